"""DPO as a LightningModule: what is computed lives in ``training_step``; the math lives in ``lit_align.losses.dpo``.

One step: a single forward of the policy over the batch's pairs (the model gets no labels and returns logits), the
reference's log-probs of the same pairs (``lit_align.reference``: a frozen model, the adapters switched off, or
precomputed), per-token completion log-probs summed per sequence (or LD-DPO-weighted), and ``loss_type``'s loss
averaged over pairs: by default ``-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``, or any of TRL's family.
Metrics carry TRL's names and meanings.

The batch is TRL's ``[chosen_1..B; rejected_1..B]``; by default each pair runs as one sequence
``[prompt, chosen, rejected]`` instead (``share_prompt``, ``lit_align.layouts.shared_prompt_pairs``): same log-probs,
the prompt through the network once per pair instead of twice. With ``padding_free`` those rows are packed
without padding (``lit_align.layouts.packed_rows``): rows vary from tens to hundreds of tokens, and a padded batch
pays every row the longest one's length; on CPU under sdpa the step's pairs go in one row (``packing_width``).
"""

from __future__ import annotations

from functools import partial

import torch

from lit_align.data.preference import PreferenceDataModule
from lit_align.losses.dpo import DPOLoss, sequence_logps, sft_nll, wpo_weights
from lit_align.modules.pairs import METRICS, PairModule, pair_statistics
from lit_align.reference import PrecomputedReference, build_reference


class DPOModule(PairModule):
    """Direct Preference Optimization against a reference model.

    The reference (docs/dpo.md, "Reference model"): a frozen copy of the initial policy (default), ``ref_model``, the
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
        precompute_ref_log_probs: run the reference once over the train and validation rows before training (no
            reference in memory while training) and cache the log-probs under ``$LIT_ALIGN_CACHE/ref_logps``; a
            later run on the same rows, reference and settings reads them back (``lit_align.reference``).
        precompute_ref_batch_size: pairs per batch in that pass (default: the data's ``batch_size`` /
            ``val_batch_size``); it needs no activations for backward, so it can be several times larger.
        sync_ref_model: TR-DPO: every ``ref_model_sync_steps`` optimizer steps,
            ``ref <- ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * ref`` (adds
            ``lit_align.reference.RefModelSync``). Not with ``precompute_ref_log_probs`` or ``peft_config``.
        ref_model_mixup_alpha: the policy's weight in that mix (TRL's default 0.6).
        ref_model_sync_steps: the sync cadence in optimizer steps (TRL's default 512).
    """

    metrics = METRICS + ("entropy", "mean_token_accuracy")
    resume_may_change = ("precompute_ref_batch_size",)  # the pass's batch size, not its numbers

    def __init__(self, model: str = "builtin:tiny", ref_model: str | None = None, beta: float = 0.1,
                 loss_type: str | list[str] = "sigmoid", loss_weights: list[float] | None = None,
                 label_smoothing: float = 0.0, f_divergence_type: str = "reverse_kl",
                 f_alpha_divergence_coef: float = 0.5, ld_alpha: float | None = None, use_weighting: bool = False,
                 discopop_tau: float = 0.05, share_prompt: bool = True, padding_free: bool | None = None,
                 precompute_ref_log_probs: bool = False,
                 precompute_ref_batch_size: int | None = None, sync_ref_model: bool = False,
                 ref_model_mixup_alpha: float = 0.6, ref_model_sync_steps: int = 512, **kwargs):
        super().__init__(model=model, share_prompt=share_prompt, padding_free=padding_free, **kwargs)
        self.loss_fn = DPOLoss(loss_type=loss_type, loss_weights=loss_weights, beta=beta,
                               label_smoothing=label_smoothing, f_divergence_type=f_divergence_type,
                               f_alpha_divergence_coef=f_alpha_divergence_coef, discopop_tau=discopop_tau,
                               ld_alpha=ld_alpha, use_weighting=use_weighting)
        self.reference, self.ref_sync = build_reference(
            ref_model, self.lora_config is not None, precompute=precompute_ref_log_probs,
            precompute_batch_size=precompute_ref_batch_size, sync_ref_model=sync_ref_model,
            ref_model_mixup_alpha=ref_model_mixup_alpha, ref_model_sync_steps=ref_model_sync_steps)

    def setup(self, stage: str) -> None:
        """A precomputed reference's pass, before the policy is loaded or a checkpoint restored: the DataModule's rows
        (Lightning sets it up first; ``AlignModule.setup`` connects it) get their log-probs, handed model -> data."""
        super().setup(stage)
        datamodule = self.trainer.datamodule
        if isinstance(self.reference, PrecomputedReference) and isinstance(datamodule, PreferenceDataModule):
            datamodule.add_reference_logps(partial(self.reference.annotate, self))

    # -- log-probs: ``pair_token_logps``, the same function for the policy, the reference and the precompute pass ------
    def pair_logps(self, network: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed (LD-DPO-weighted) completion log-probs ``[2B]``: what the reference contributes to the loss."""
        out = self.pair_token_logps(network, batch)
        return sequence_logps(out.tokens, out.mask, self.loss_fn.ld_alpha)

    def reference_settings(self) -> dict:
        """What else precomputed reference log-probs depend on (their cache key)."""
        return {"share_prompt": self.share_prompt, "padding_free": self.padding_free, "ld_alpha": self.loss_fn.ld_alpha}

    # -- what is computed -------------------------------------------------------------------------------------------
    def pair_outputs(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per-pair losses and statistics ``[B]`` for one batch of ``[chosen; rejected]`` sequences, and the weights
        of the token-level ones (``logits/*`` and ``entropy`` average over completion tokens, ``mean_token_accuracy``
        over chosen tokens, as TRL does)."""
        use_weighting = self.loss_fn.use_weighting
        stats = ("mean_logit", "entropy", "argmax") + (("log_sum_sq_probs",) if use_weighting else ())
        policy = self.pair_token_logps(self.network, batch, stats)
        logps = sequence_logps(policy.tokens, policy.mask, self.loss_fn.ld_alpha)
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = self.reference.logps(batch, lambda net: self.pair_logps(net, batch)).chunk(2)
        lengths = batch["completion_mask"].sum(1)
        chosen_lengths, rejected_lengths = lengths.chunk(2)
        pair_weights = None
        if use_weighting:
            pair_weights = wpo_weights(policy.tokens, policy.stats["log_sum_sq_probs"], policy.mask)
        losses, chosen_rewards, rejected_rewards = self.loss_fn(
            chosen, rejected, ref_chosen, ref_rejected, chosen_lengths=chosen_lengths,
            rejected_lengths=rejected_lengths, pair_weights=pair_weights,
            sft_nll=sft_nll(policy.tokens, policy.mask) if "sft" in self.loss_fn.loss_types else None,
        )
        with torch.no_grad():
            mask = policy.mask
            token_logits = (policy.stats["mean_logit"] * mask).sum(1) / lengths.clamp(min=1)
            entropy = (policy.stats["entropy"] * mask).sum(1).view(2, -1).sum(0)  # per pair, chosen + rejected
            top1 = ((policy.stats["argmax"] == policy.labels) & mask).sum(1).chunk(2)[0]  # the chosen tokens
        return {
            "loss": losses,
            **pair_statistics(chosen_rewards, rejected_rewards, logps, token_logits),
            "entropy": entropy / (chosen_lengths + rejected_lengths).clamp(min=1),
            "mean_token_accuracy": top1 / chosen_lengths.clamp(min=1),
        }, {"logits/chosen": chosen_lengths, "logits/rejected": rejected_lengths,
            "entropy": chosen_lengths + rejected_lengths, "mean_token_accuracy": chosen_lengths}
