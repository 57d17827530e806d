"""DPO as a LightningModule: what is computed lives in ``training_step``; the math lives in ``lit_align.losses``.

One step: a single forward of the policy over the batch's pairs (the model gets no labels and returns logits), a
no-grad forward of the frozen reference over the same pairs, per-token completion log-probs summed per sequence (or
LD-DPO-weighted), and ``loss_type``'s loss averaged over pairs: by default ``-logsigmoid(beta * ((pi_c - ref_c) -
(pi_r - ref_r)))``, or any of TRL's family (``lit_align.dpo_losses``). Metrics carry TRL's names and meanings.

The batch is TRL's ``[chosen_1..B; rejected_1..B]``; by default each pair runs as one sequence
``[prompt, chosen, rejected]`` instead (``share_prompt``, ``lit_align.modules.pair_logps``): same log-probs, the prompt
through the network once per pair instead of twice.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torchmetrics import MeanMetric

from lit_align.callbacks import RefModelSync
from lit_align.errors import LitAlignError
from lit_align.dpo_losses import (
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSS_TYPES,
    F_DIVERGENCE_TYPES,
    dpo_loss,
    ld_sequence_logps,
    sft_nll,
    wpo_weights,
)
from lit_align.modules import reference
from lit_align.modules.base import AlignModule, frozen
from lit_align.modules.pair_logps import logps_of, pair_layout

METRICS = (
    "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
    "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy",
)


def check_loss_options(loss_types: list[str], loss_weights: list[float] | None, label_smoothing: float,
                       f_divergence_type: str, ld_alpha: float | None, use_weighting: bool,
                       discopop_tau: float) -> None:
    """Raise ``LitAlignError`` for a loss setting TRL would reject or that has no meaning."""
    unknown = [name for name in loss_types if name not in DPO_LOSS_TYPES]
    if not loss_types or unknown:
        given = repr(unknown[0]) if unknown else "[]"
        raise LitAlignError(f"model.loss_type {given}: expected one or a list of {DPO_LOSS_TYPES}")
    if loss_weights is not None and len(loss_weights) != len(loss_types):
        raise LitAlignError(f"model.loss_weights {loss_weights}: expected one weight per loss_type {loss_types}")
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise LitAlignError(f"model.f_divergence_type {f_divergence_type!r}: expected one of {F_DIVERGENCE_TYPES}")
    if f_divergence_type != "reverse_kl" and not set(loss_types) <= set(F_DIVERGENCE_LOSS_TYPES):
        raise LitAlignError(f"model.f_divergence_type {f_divergence_type!r} with loss_type {loss_types}: expected "
                            f"'reverse_kl', or only loss types from {F_DIVERGENCE_LOSS_TYPES}")
    if "robust" in loss_types and not 0 <= label_smoothing < 0.5:
        raise LitAlignError(f"model.label_smoothing {label_smoothing}: expected a value in [0, 0.5) for 'robust'")
    if "exo_pair" in loss_types and not 0 < label_smoothing < 1:
        raise LitAlignError(f"model.label_smoothing {label_smoothing}: expected a value in (0, 1) for 'exo_pair' "
                            "(the EXO paper suggests 1e-3)")
    if not 0 <= label_smoothing <= 1:
        raise LitAlignError(f"model.label_smoothing {label_smoothing}: expected a value in [0, 1]")
    if ld_alpha is not None and not 0 <= ld_alpha <= 1:
        raise LitAlignError(f"model.ld_alpha {ld_alpha}: expected None or a value in [0, 1]")
    if use_weighting and {"aot", "aot_unpaired"} & set(loss_types):
        raise LitAlignError("model.use_weighting: not available with loss_type 'aot' or 'aot_unpaired' "
                            "(they sort the batch, so per-pair weights would not match their pairs)")
    if not discopop_tau > 0:
        raise LitAlignError(f"model.discopop_tau {discopop_tau}: expected a value > 0")


def _mean(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return values.mean()
    return (values * weights).sum() / weights.sum().clamp(min=1)


class DPOModule(AlignModule):
    """Direct Preference Optimization against a reference model.

    The reference (README, "Reference model"): a frozen copy of the initial policy (default), ``ref_model``, the
    policy with its LoRA adapters disabled (``peft_config``), or no model at all during training
    (``precompute_ref_log_probs``); ``sync_ref_model`` mixes the policy into it as training goes (TR-DPO).

    Args:
        ref_model: the reference: a model name/path, or None for a frozen copy of the policy at step 0 (TRL's default).
        beta: the DPO temperature (TRL's default 0.1); higher keeps the policy closer to the reference (IPO's tau).
        loss_type: one of TRL's loss types, or a list of them summed with ``loss_weights``: ``sigmoid`` (DPO),
            ``hinge``, ``ipo``, ``exo_pair``, ``nca_pair``, ``robust``, ``bco_pair``, ``sppo_hard``, ``aot``,
            ``aot_unpaired``, ``apo_zero``, ``apo_down``, ``discopop``, ``sft``, ``sigmoid_norm``.
        loss_weights: one weight per entry of ``loss_type`` (default: 1.0 each), e.g. ``[0.8, 0.2, 1.0]`` for MPO.
        label_smoothing: for ``robust`` the probability that a label is flipped, in [0, 0.5); for ``exo_pair`` its
            epsilon, > 0 (the paper suggests 1e-3); for ``aot`` / ``aot_unpaired`` the smoothing of their sigmoid loss.
        f_divergence_type: the f-DPO regularizer: ``reverse_kl`` (DPO), ``forward_kl``, ``js_divergence``,
            ``alpha_divergence``; non-default only with ``sigmoid``, ``sigmoid_norm``, ``hinge``, ``ipo``,
            ``exo_pair``, ``robust``, ``discopop``, ``sft``.
        f_alpha_divergence_coef: alpha of ``alpha_divergence``.
        ld_alpha: LD-DPO: completion tokens past the shorter completion of the pair count this much (in [0, 1]) in
            the summed log-probs of policy and reference (``precompute_ref_log_probs`` applies it; ``ref_*_logps``
            columns of your own data must be weighted alike); None: all count fully (plain DPO).
        use_weighting: WPO: weight each pair's loss by the policy's length-normalized probability of both
            completions (not with ``aot`` / ``aot_unpaired``, which do not keep pairs together).
        discopop_tau: the temperature of ``discopop``'s logistic/exponential blend (TRL's default 0.05).
        share_prompt: run each pair as one sequence ``[prompt, chosen, rejected]`` so the prompt is computed once,
            not twice (same log-probs up to float rounding). Used where the architecture supports it (Llama, Mistral,
            Qwen, Gemma, Phi-3, ... with ``sdpa`` or ``eager`` attention); elsewhere the plain batch runs.
        precompute_ref_log_probs: run the reference once over the train and validation rows before training (no
            reference in memory while training) and cache the log-probs under ``$LIT_ALIGN_CACHE/ref_logps``; a
            later run on the same rows, reference and settings reads them back (``lit_align.modules.reference``).
        precompute_ref_batch_size: pairs per batch in that pass (default: the data's ``batch_size`` /
            ``val_batch_size``); it needs no activations for backward, so it can be several times larger.
        sync_ref_model: TR-DPO: every ``ref_model_sync_steps`` optimizer steps,
            ``ref <- ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * ref`` (adds
            ``lit_align.callbacks.RefModelSync``). Not with ``precompute_ref_log_probs`` or ``peft_config``.
        ref_model_mixup_alpha: the policy's weight in that mix (TRL's default 0.6).
        ref_model_sync_steps: the sync cadence in optimizer steps (TRL's default 512).
    """

    def __init__(self, model: str = "builtin:tiny", ref_model: str | None = None, beta: float = 0.1,
                 loss_type: str | list[str] = "sigmoid", loss_weights: list[float] | None = None,
                 label_smoothing: float = 0.0, f_divergence_type: str = "reverse_kl",
                 f_alpha_divergence_coef: float = 0.5, ld_alpha: float | None = None, use_weighting: bool = False,
                 discopop_tau: float = 0.05, share_prompt: bool = True, precompute_ref_log_probs: bool = False,
                 precompute_ref_batch_size: int | None = None, sync_ref_model: bool = False,
                 ref_model_mixup_alpha: float = 0.6, ref_model_sync_steps: int = 512, **kwargs):
        super().__init__(model=model, **kwargs)
        self.loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
        check_loss_options(self.loss_types, loss_weights, label_smoothing, f_divergence_type, ld_alpha,
                           use_weighting, discopop_tau)
        if precompute_ref_batch_size is not None and precompute_ref_batch_size < 1:
            raise LitAlignError(
                f"model.precompute_ref_batch_size must be >= 1 or null, got {precompute_ref_batch_size}")
        if sync_ref_model and (precompute_ref_log_probs or self.lora_config is not None):
            raise LitAlignError("model.sync_ref_model needs a reference model in memory: it cannot be combined with "
                                "precompute_ref_log_probs or peft_config")
        if ref_model is not None and self.lora_config is not None:
            raise LitAlignError("model.ref_model: with peft_config the reference is the policy with its adapters "
                                "disabled; leave ref_model null")
        self.ref_model_name, self.beta = ref_model, beta
        self.loss_options = {
            "loss_type": self.loss_types, "loss_weights": loss_weights, "label_smoothing": label_smoothing,
            "f_divergence_type": f_divergence_type, "f_alpha_divergence_coef": f_alpha_divergence_coef,
            "discopop_tau": discopop_tau,
        }
        self.ld_alpha, self.use_weighting = ld_alpha, use_weighting
        self.share_prompt = share_prompt
        self.precompute_ref_log_probs = precompute_ref_log_probs
        self.precompute_ref_batch_size = precompute_ref_batch_size
        self.ref_sync = RefModelSync(ref_model_sync_steps, ref_model_mixup_alpha) if sync_ref_model else None
        self.val_metrics = torch.nn.ModuleDict({name.replace("/", "_"): MeanMetric() for name in METRICS})

    def configure_model(self) -> None:
        initial = self.policy is None  # this hook runs before a checkpoint is restored: a new policy is the initial one
        if initial:
            super().configure_model()
            if not self.precompute_ref_log_probs:
                self.ref_model = self.load_reference(self.ref_model_name)
        if self.precompute_ref_log_probs:  # again when the DataModule set up new rows (e.g. validate, then fit)
            self.precompute_reference(initial_policy=initial)

    def configure_callbacks(self):
        return [self.ref_sync] if self.ref_sync is not None else []

    # -- precomputed reference log-probs (lit_align.modules.reference) ----------------------------------------------
    def precompute_reference(self, initial_policy: bool) -> None:
        """Give the DataModule's train/validation rows that lack them ``ref_chosen_logps`` / ``ref_rejected_logps``."""
        trainer = self._trainer
        dm = trainer.datamodule if trainer is not None else None
        if dm is None or not hasattr(dm, "train_data") or not hasattr(dm, "collate"):
            raise LitAlignError("model.precompute_ref_log_probs needs the trainer to run with a PreferenceDataModule "
                                "(trainer.fit(model, datamodule=...))")
        todo = {}
        for split, rows, batch_size in (("train", dm.train_data, dm.batch_size),
                                        ("val", dm.val_data, dm.val_batch_size)):
            if rows is not None and reference.REF_COLUMNS[0] not in rows.column_names:
                todo[split] = (rows, self.precompute_ref_batch_size or batch_size)
        if not todo:
            return
        hp = self.hparams
        # one rank reads the weight files to hash them (every rank reading a large model's files is slow)
        name = self.ref_model_name or self.model_name
        reference_hash = trainer.strategy.broadcast(reference.model_files_hash(name) if trainer.is_global_zero else None)
        settings = {
            "reference": reference_hash, "dtype": hp.dtype,
            "attn_implementation": hp.attn_implementation, "precision": str(trainer.precision),
            "max_length": dm.max_length, "share_prompt": self.share_prompt, "ld_alpha": self.ld_alpha,
        }
        device = trainer.strategy.root_device

        def pair_logps(model, batch):
            layout = pair_layout(batch, model, self.share_prompt)
            with trainer.precision_plugin.train_step_context():  # autocast as in training_step
                out = logps_of(model, batch, layout, chunk_size=self.logps_chunk_size)
                return ld_sequence_logps(out.tokens, out.mask, self.ld_alpha).chunk(2)

        @contextmanager
        def load_reference():
            if self.ref_model_name is not None or not initial_policy:
                yield frozen(self.load(self.ref_model_name or self.model_name)).to(device)
                return
            was_training = self.policy.training  # the policy as loaded is the initial model: no copy needed
            self.policy.to(device).eval()
            try:
                with self.policy.disable_adapter() if self.lora_config is not None else nullcontext():
                    yield self.network
            finally:
                self.policy.train(was_training)

        done = reference.precompute(todo, dm.collate, pair_logps, load_reference, settings, trainer.strategy, device)
        dm.train_data = done.get("train", dm.train_data)
        dm.val_data = done.get("val", dm.val_data)

    # -- what is computed -------------------------------------------------------------------------------------------
    def pair_outputs(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per-pair losses and statistics ``[B]`` for one batch of ``[chosen; rejected]`` sequences, and the weights
        of the token-level ones (``logits/*`` and ``entropy`` average over completion tokens, ``mean_token_accuracy``
        over chosen tokens, as TRL does)."""
        layout = pair_layout(batch, self.network, self.share_prompt)
        stats = ("mean_logit", "entropy", "argmax") + (("log_sum_sq_probs",) if self.use_weighting else ())
        policy = logps_of(self.network, batch, layout, stats, self.logps_chunk_size)
        chosen, rejected = ld_sequence_logps(policy.tokens, policy.mask, self.ld_alpha).chunk(2)
        if "ref_chosen_logps" in batch:  # precomputed reference log-probs (precompute_ref_log_probs, or the data's)
            ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        elif self.precompute_ref_log_probs:
            raise LitAlignError("precompute_ref_log_probs: a batch came without ref_chosen_logps (rows set up after "
                                "the precompute pass?)")
        else:
            with torch.no_grad(), self.reference_model() as ref_model:  # the frozen copy, or the adapters switched off
                ref = logps_of(ref_model, batch, layout, chunk_size=self.logps_chunk_size)
                ref_chosen, ref_rejected = ld_sequence_logps(ref.tokens, ref.mask, self.ld_alpha).chunk(2)
        lengths = batch["completion_mask"].sum(1)
        pair_weights = None
        if self.use_weighting:
            pair_weights = wpo_weights(policy.tokens, policy.stats["log_sum_sq_probs"], policy.mask)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            chosen, rejected, ref_chosen, ref_rejected, beta=self.beta, **self.loss_options,
            chosen_lengths=lengths.chunk(2)[0], rejected_lengths=lengths.chunk(2)[1],
            sft_nll=sft_nll(policy.tokens, policy.mask) if "sft" in self.loss_types else None,
            pair_weights=pair_weights,
        )
        with torch.no_grad():
            mask = policy.mask
            token_logits = (policy.stats["mean_logit"] * mask).sum(1) / lengths.clamp(min=1)
            entropy = (policy.stats["entropy"] * mask).sum(1).view(2, -1).sum(0)  # per pair, chosen + rejected
            top1 = (policy.stats["is_top1"] & mask).sum(1).chunk(2)[0]  # the chosen completion's tokens
        chosen_lengths, rejected_lengths = lengths.chunk(2)
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
            "entropy": entropy / (chosen_lengths + rejected_lengths).clamp(min=1),
            "mean_token_accuracy": top1 / chosen_lengths.clamp(min=1),
        }, {"logits/chosen": chosen_lengths, "logits/rejected": rejected_lengths,
            "entropy": chosen_lengths + rejected_lengths, "mean_token_accuracy": chosen_lengths}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out, weights = self.pair_outputs(batch)
        loss = self.guard_loss(out["loss"].mean(), out["loss"], batch_idx, batch.get("rows"))
        if loss is None:  # skipped (on_nonfinite_loss: skip)
            return None
        # one all-reduce for every metric (mean over ranks of per-rank means) and the token count (a sum)
        stats = [_mean(out[name].detach().float(), weights.get(name)) for name in METRICS]
        stats.append(batch["attention_mask"].sum().float())
        stats = self.trainer.strategy.reduce(torch.stack(stats), reduce_op="mean")
        for name, value in zip(METRICS, stats):
            self.log(f"train/{name}", value, prog_bar=name == "loss")
        self.num_tokens += float(stats[-1]) * self.trainer.world_size
        self.log("train/num_tokens", self.num_tokens)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out, weights = self.pair_outputs(batch)
        for name in METRICS:
            metric = self.val_metrics[name.replace("/", "_")]
            metric.update(out[name].float(), weights.get(name, 1.0))
            self.log(f"val/{name}", metric, prog_bar=name == "rewards/accuracies")

    test_step = validation_step
