"""DPO as a LightningModule: what is computed lives in ``training_step``; the math lives in ``lit_align.losses``.

One step: a single forward of the policy over ``[chosen; rejected]`` (the model gets no labels and returns logits),
a no-grad forward of the frozen reference over the same batch, summed completion log-probs, and
``-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` averaged over pairs. Metrics carry TRL's names and meanings.
"""

from __future__ import annotations

import copy
import inspect
from collections import OrderedDict

import torch
from torchmetrics import MeanMetric

from lit_align.errors import LitAlignError
from lit_align.losses import DPO_LOSS_TYPES, dpo_loss, sequence_logps
from lit_align.modules.base import AlignModule, frozen

METRICS = (
    "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
    "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected",
)


def completion_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over a right-padded batch: ``(summed completion log-probs [N], mean logit per sequence [N])``.

    Only positions that predict a completion token need logits: with ``logits_to_keep`` the LM head skips the
    prompt prefix shared by the batch (a large saving with real vocabularies).
    """
    input_ids, completion_mask = batch["input_ids"], batch["completion_mask"]
    has_completion = completion_mask.any(1)
    first = completion_mask.int().argmax(1)[has_completion]
    start = max(int(first.min()) if first.numel() else 1, 1)  # first completion position; logits from start - 1
    kwargs = {"input_ids": input_ids, "attention_mask": batch["attention_mask"], "use_cache": False}
    if _takes_logits_to_keep(model):
        logits = model(**kwargs, logits_to_keep=input_ids.shape[1] - start + 1).logits[:, :-1]
    else:
        logits = model(**kwargs).logits[:, start - 1 : -1]
    labels, mask = input_ids[:, start:], completion_mask[:, start:]
    logps = sequence_logps(logits, labels, mask)
    with torch.no_grad():
        mean_logits = (logits.mean(-1).float() * mask).sum(-1)
    return logps, mean_logits


def _mean(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return values.mean()
    return (values * weights).sum() / weights.sum().clamp(min=1)


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    forward = getattr(model, "forward", None)
    return forward is not None and "logits_to_keep" in inspect.signature(forward).parameters


class DPOModule(AlignModule):
    """Direct Preference Optimization against a frozen reference model.

    Args:
        ref_model: the reference: a model name/path, or None for a frozen copy of the policy at step 0 (TRL's default).
        beta: the DPO temperature (TRL's default 0.1); higher keeps the policy closer to the reference.
        loss_type: ``sigmoid`` (DPO), ``hinge`` or ``ipo``.
    """

    def __init__(self, model: str = "builtin:tiny", ref_model: str | None = None, beta: float = 0.1,
                 loss_type: str = "sigmoid", **kwargs):
        super().__init__(model=model, **kwargs)
        if loss_type not in DPO_LOSS_TYPES:
            raise LitAlignError(f"model.loss_type {loss_type!r}: expected one of {DPO_LOSS_TYPES}")
        self.ref_model_name, self.beta, self.loss_type = ref_model, beta, loss_type
        self.ref_model: torch.nn.Module | None = None
        self.val_metrics = torch.nn.ModuleDict({name.replace("/", "_"): MeanMetric() for name in METRICS})

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        super().configure_model()
        if self.ref_model_name is None:
            ref = copy.deepcopy(self.policy)
            if self.hparams.gradient_checkpointing:
                ref.gradient_checkpointing_disable()
        else:
            ref = self.load(self.ref_model_name)
        self.ref_model = frozen(ref)

    # -- the reference is frozen, in eval mode, and never part of a checkpoint ----------------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        if self.ref_model is not None:
            self.ref_model.eval()
        return self

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        state = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        skip = prefix + "ref_model."
        return OrderedDict((k, v) for k, v in state.items() if not k.startswith(skip))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self.ref_model is not None:  # refill the reference from itself: checkpoints do not carry it
            state_dict = {**state_dict, **{f"ref_model.{k}": v for k, v in self.ref_model.state_dict().items()}}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # -- what is computed -------------------------------------------------------------------------------------------
    def pair_outputs(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per-pair losses and statistics ``[B]`` for one batch of ``[chosen; rejected]`` sequences, and the weights
        of the token-level ones (``logits/*`` average over completion tokens, as TRL does)."""
        logps, mean_logits = completion_logps(self.policy, batch)
        if "ref_chosen_logps" in batch:  # precomputed reference log-probs
            ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        else:
            with torch.no_grad():
                ref_chosen, ref_rejected = completion_logps(self.ref_model, batch)[0].chunk(2)
        chosen, rejected = logps.chunk(2)
        lengths = batch["completion_mask"].sum(1)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            chosen, rejected, ref_chosen, ref_rejected, beta=self.beta, loss_type=self.loss_type,
            chosen_lengths=lengths.chunk(2)[0], rejected_lengths=lengths.chunk(2)[1],
        )
        token_logits = mean_logits / lengths.clamp(min=1)
        return {
            "loss": losses,
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
            "rewards/margins": chosen_rewards - rejected_rewards,
            "logps/chosen": chosen.detach(),
            "logps/rejected": rejected.detach(),
            "logits/chosen": token_logits.chunk(2)[0],
            "logits/rejected": token_logits.chunk(2)[1],
        }, {"logits/chosen": lengths.chunk(2)[0], "logits/rejected": lengths.chunk(2)[1]}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out, weights = self.pair_outputs(batch)
        loss = out["loss"].mean()
        # one all-reduce for every metric (mean over ranks of per-rank means)
        stats = torch.stack([_mean(out[name].detach().float(), weights.get(name)) for name in METRICS])
        stats = self.trainer.strategy.reduce(stats, reduce_op="mean")
        for name, value in zip(METRICS, stats):
            self.log(f"train/{name}", value, prog_bar=name == "loss")
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out, weights = self.pair_outputs(batch)
        for name in METRICS:
            metric = self.val_metrics[name.replace("/", "_")]
            metric.update(out[name].float(), weights.get(name, 1.0))
            self.log(f"val/{name}", metric, prog_bar=name == "rewards/accuracies")

    test_step = validation_step
