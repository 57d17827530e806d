"""What the recipes on preference pairs share (DPO, CPO, ORPO): ``PairModule``, which lays a batch of
``[chosen; rejected]`` sequences out for the network and logs each recipe's per-pair outputs under TRL's names, and
``pair_statistics``, the rewards / log-probs / logits metrics each of them reports alike.

The recipes are siblings on this module; none imports another.
"""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric

from lit_align import layouts
from lit_align.logps import TokenLogps, layout_logps
from lit_align.modules.base import AlignModule

# what every pair recipe logs: its loss and ``pair_statistics``' names; each recipe adds its own after these
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected")


def pair_statistics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, logps: torch.Tensor,
                    token_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-pair metrics every pair recipe logs: rewards, their accuracy and margin, the log-probs the loss read
    and the mean logit of each completion's tokens (``[2B]`` inputs, ``[B]`` outputs)."""
    chosen, rejected = logps.detach().chunk(2)
    return {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": chosen,
        "logps/rejected": rejected,
        "logits/chosen": token_logits.chunk(2)[0],
        "logits/rejected": token_logits.chunk(2)[1],
    }


def _sum_and_weight(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``[sum, weight]`` of per-pair ``values``: their sum and count, or weighted by ``weights`` (tokens)."""
    if weights is None:
        return torch.stack([values.sum(), torch.tensor(float(values.numel()), device=values.device)])
    return torch.stack([(values * weights).sum(), weights.sum().float()])


class PairModule(AlignModule):
    """What the recipes on preference pairs share (DPO, CPO, ORPO): batches of ``[chosen; rejected]`` sequences laid
    out for the network (``share_prompt``, ``padding_free``), per-pair outputs from ``pair_outputs``, and logging
    them under TRL's names (``metrics``).

    Args:
        share_prompt: run each pair as one sequence ``[prompt, chosen, rejected]`` so the prompt is computed once,
            not twice (same log-probs up to float rounding). Used where the architecture supports it (Llama, Mistral,
            Qwen, Gemma, Phi-3, ... with ``sdpa`` or ``eager`` attention); elsewhere the plain batch runs.
        padding_free: pack each batch's rows (``share_prompt``'s, or the plain ones) without padding, several per
            row, each attending only to itself; the LM head runs on completion tokens only. Same log-probs up to
            float rounding (TRL's ``padding_free``, which TRL 1.16 turns off with a warning). Needs what
            ``share_prompt`` needs, else an error. None (the default): on where it is exact and cheaper
            (``lit_align.layouts.packs_by_default``: such a model under sdpa on CPU), off elsewhere.
    """

    # what ``pair_outputs`` returns and each step logs, in TRL's names: a recipe extends ``METRICS`` with its own
    metrics: tuple[str, ...] = METRICS

    def __init__(self, model: str = "builtin:tiny", share_prompt: bool = True, padding_free: bool | None = None,
                 **kwargs):
        super().__init__(model=model, **kwargs)
        self.share_prompt, self.padding_free = share_prompt, padding_free
        self.val_metrics = torch.nn.ModuleDict({name.replace("/", "_"): MeanMetric() for name in self.metrics})

    def pair_token_logps(self, network: torch.nn.Module, batch: dict[str, torch.Tensor],
                         stats: tuple[str, ...] = ()) -> TokenLogps:
        """Per-token completion log-probs ``[2B, T]`` of the batch's pairs, in the layout ``network`` runs best."""
        return layout_logps(network, layouts.pairs(batch, network, self.share_prompt, self.padding_free), stats,
                            self.logps_chunk_size)

    def pair_outputs(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per-pair losses and statistics ``[B]`` named as ``metrics``, and the weights of those averaged over
        tokens rather than pairs."""
        raise NotImplementedError

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out, weights = self.pair_outputs(batch)
        loss = self.guard_loss(out["loss"].mean(), out["loss"], batch_idx, batch.get("dataset_rows"))
        if loss is None:  # skipped (on_nonfinite_loss: skip)
            return None
        # one all-reduce of each metric's sum and weight (pairs, or tokens for the token means) over every rank's
        # pairs, as TRL gathers them before dividing, and of the token count
        sums = [_sum_and_weight(out[name].detach().float(), weights.get(name)) for name in self.metrics]
        sums.append(torch.stack([batch["attention_mask"].sum().float(), torch.ones((), device=self.device)]))
        sums = self.trainer.strategy.reduce(torch.stack(sums), reduce_op="sum")
        self.log_mean(dict(zip(self.metrics, sums[:-1, 0] / sums[:-1, 1].clamp(min=1))), prog_bar=("loss",))
        self.num_tokens += float(sums[-1, 0])
        self.log("train/num_tokens", self.num_tokens)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out, weights = self.pair_outputs(batch)
        for name in self.metrics:
            metric = self.val_metrics[name.replace("/", "_")]
            metric.update(out[name].float(), weights.get(name, 1.0))
            self.log(f"val/{name}", metric, prog_bar=name == "rewards/accuracies")

    test_step = validation_step
