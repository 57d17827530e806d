"""GRPO as a LightningModule: an online recipe (``lit_align.modules.online``) with group-relative advantages and
TRL's GRPO losses.

``OnlineModule`` samples a round of ``num_generations`` completions per prompt once and feeds its steps; GRPO adds
its loss settings (``lit_align.losses.grpo_loss.GRPOLoss``), the group-relative ``advantages`` and each step's
``training_step``; with vLLM's sampling corrected for, it reads the old log-probs from the training forward
(``old_logps``). The math is in ``lit_align.losses.grpo``.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_align.errors import LitAlignError
from lit_align.generation import VLLMOptions
from lit_align.losses.grpo import decoupled_advantages, group_advantages, importance_sampling_ratio, masked_total
from lit_align.losses.grpo_loss import EntropyControl, GRPOLoss
from lit_align.modules.online import CHECKPOINT_KEY, OnlineModule
from lit_align.rollouts import Generation


class GRPOModule(OnlineModule):
    """Group Relative Policy Optimization, with TRL's loss types and metric names. The sampling, rewards, engine,
    tools, reference and round options are ``OnlineModule``'s.

    Args:
        loss_type: ``dapo`` (TRL's default), ``grpo``, ``bnpo``, ``dr_grpo``, ``cispo``, ``sapo``, ``luspo`` or
            ``vespo`` (formulas: ``lit_align.losses.grpo.grpo_token_losses`` and ``aggregate_grpo_loss``).
        beta: KL coefficient to a frozen reference in the loss (k3 estimator); 0 (TRL's default) loads no
            reference (``OnlineModule``'s ``ref_model`` and ``sync_ref_model`` choose it).
        epsilon: lower clipping bound of the ratio (``1 - epsilon``).
        epsilon_high: upper bound (``1 + epsilon_high``; default: ``epsilon``; DAPO uses 0.28); for ``cispo`` the
            cap of the detached weight itself (ScaleRL recommends 5.0).
        delta: two-sided clipping (INTELLECT-2): the unclipped ratio is capped at ``delta`` too (None: off;
            above ``1 + epsilon_high`` is recommended).
        importance_sampling_level: ``token`` (a ratio per token) or ``sequence`` (GSPO: the exp of the completion's
            mean log-ratio, one per completion).
        sapo_temperature_pos: ``sapo``'s gate temperature for tokens with a positive advantage.
        sapo_temperature_neg: ``sapo``'s gate temperature for the others.
        vespo_k_pos: ``vespo``'s power k for a non-negative advantage (how hard ratios below 1 are down-weighted).
        vespo_lambda_pos: ``vespo``'s decay lambda for a non-negative advantage (ratios above 1).
        vespo_k_neg: k for a negative advantage.
        vespo_lambda_neg: lambda for a negative advantage.
        scale_rewards: ``group`` (divide by the group's std), ``batch`` or ``none``.
        multi_objective_aggregation: ``sum_then_normalize`` (sum the weighted rewards, then ``scale_rewards``) or
            ``normalize_then_sum`` (GDPO: normalize each reward function within its group, sum with the weights,
            normalize the sum over the batch; ``lit_align.losses.grpo.decoupled_advantages``).
        top_entropy_quantile: train only on the tokens whose entropy is in this top fraction (over every rank's loss
            tokens; 1.0: all, the paper uses 0.2).
        off_policy_mask_threshold: drop the completions with a negative advantage whose mean KL from the sampling
            policy (its log-probs: vLLM's, else the old policy's) exceeds this (DeepSeek-V3.2; None: off).
        use_bias_correction_kl: multiply the KL term by the importance ratio (its gradient then is the unbiased
            reverse-KL one, even on-policy where the ratio is 1).
        entropy_coef: subtract this times the mean entropy of the loss tokens from the loss (an exploration bonus,
            trained through the entropy's gradient; 0: off).
        use_adaptive_entropy: adapt ``entropy_coef`` every optimizer step (Skywork-OR1): up by ``entropy_coef_delta``
            when the last step's entropy was at most ``entropy_target`` (the bonus then applies), down otherwise.
        entropy_coef_min: lower bound of the adaptive coefficient.
        entropy_coef_max: upper bound of the adaptive coefficient.
        entropy_coef_delta: the adaptive coefficient's step.
        entropy_target: the mean token entropy (nats) below which the adaptive bonus applies.
        vllm_importance_sampling_correction: weigh each token's loss by the ratio of the training forward's
            probability to vLLM's (TRL's; ``lit_align.losses.grpo.importance_sampling_ratio``); the old log-probs are
            then the training forward's. Needs vLLM's log-probs: top_k 0 and top_p 1.0.
        vllm_importance_sampling_mode: ``sequence_mask`` (TRL's default), ``sequence_truncate``, ``token_truncate``
            or ``token_mask``.
        vllm_importance_sampling_clip_min: lower bound of the ratio (None: none).
        vllm_importance_sampling_clip_max: upper bound of the ratio (TRL's cap; None: none).
    """

    def __init__(
        self,
        model: str = "builtin:tiny",
        loss_type: str = "dapo",
        beta: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        scale_rewards: str = "group",
        multi_objective_aggregation: str = "sum_then_normalize",
        top_entropy_quantile: float = 1.0,
        off_policy_mask_threshold: float | None = None,
        use_bias_correction_kl: bool = True,
        entropy_coef: float = 0.0,
        use_adaptive_entropy: bool = False,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
        entropy_coef_delta: float = 0.005,
        entropy_target: float = 0.2,
        vllm_importance_sampling_correction: bool = True,
        vllm_importance_sampling_mode: str = "sequence_mask",
        vllm_importance_sampling_clip_min: float | None = None,
        vllm_importance_sampling_clip_max: float | None = 3.0,
        **kwargs,
    ):
        super().__init__(model=model, beta=beta, **kwargs)
        self.loss_fn = GRPOLoss(**{name: self.hparams[name] for name in GRPOLoss.__dataclass_fields__})
        self.entropy_control = EntropyControl.from_loss(self.loss_fn)
        self.entropy_window: torch.Tensor | None = None  # adaptive: (entropy sum, tokens) of this accumulation window

    def sampling_correction(self, vllm: VLLMOptions) -> tuple[str, float | None, float | None] | None:
        """TRL's ``vllm_importance_sampling_*``: the loss weighs each token by the training forward's probability over
        vLLM's."""
        correction = vllm.importance_sampling(self.sampling)
        if self.hparams.loss_type == "vespo" and correction is not None and not correction[0].startswith("token"):
            raise LitAlignError(f"model.vllm_importance_sampling_mode {correction[0]!r}: loss_type 'vespo' folds "
                                "vLLM's importance weights into its per-sequence weight token by token: expected "
                                "'token_truncate' or 'token_mask'")
        return correction

    # -- the round: the old log-probs, the advantages ------------------------------------------------------------------
    def old_logps(self, generation: Generation, sequences: tuple) -> tuple[torch.Tensor | None, Any, dict]:
        """With vLLM's sampling corrected for (TRL), the old log-probs are the training forward's and the importance
        weights compare them with vLLM's, over the sampled tokens only (not tool turns); else ``OnlineModule``'s."""
        if self.importance_sampling is None:
            return super().old_logps(generation, sequences)
        old_logps = self.completion_logps(self.network, *sequences)[0]
        mask = generation.sampled_mask
        is_ratio = importance_sampling_ratio(old_logps, generation.logps, mask, *self.importance_sampling)
        return old_logps, is_ratio, self.sampling_stats(old_logps, generation.logps, mask, is_ratio)

    def kept_sampling_logps(self, generation: Generation, is_ratio: torch.Tensor | None) -> torch.Tensor | None:
        """vLLM's log-probs, for the off-policy mask, when the sampling is corrected for."""
        if is_ratio is not None and self.loss_fn.off_policy_mask_threshold is not None:
            return generation.logps
        return None

    def sampling_stats(self, train_logps, sampling_logps, mask, is_ratio) -> dict[str, torch.Tensor]:
        """TRL's ``sampling/*`` metrics: how far vLLM's log-probs are from the training forward's, and the importance
        weights (over real tokens; per completion for the sequence modes); rank-averaged means, every rank's
        extremes."""
        real = mask.bool()
        gap = (train_logps - sampling_logps).abs()[real]
        weights = is_ratio[real] if is_ratio.shape == mask.shape else is_ratio.flatten()
        strategy = self.trainer.strategy
        means = strategy.reduce(torch.stack([gap.mean(), weights.mean()]), reduce_op="mean")
        extremes = strategy.all_gather(torch.stack([gap.max(), weights.max(), -weights.min()])).reshape(-1, 3).amax(0)
        return {"sampling/sampling_logp_difference/mean": means[0],
                "sampling/sampling_logp_difference/max": extremes[0],
                "sampling/importance_sampling_ratio/min": -extremes[2],
                "sampling/importance_sampling_ratio/mean": means[1],
                "sampling/importance_sampling_ratio/max": extremes[1]}

    def advantages(self, generation: Generation, old_logps, ref_logps, loss_mask) -> torch.Tensor:
        """As TRL: advantages over every rank's rewards (the same per group: a group stays on one rank;
        ``scale_rewards: batch`` divides by the global batch's std), then this rank's rows. GRPO's KL is in the
        loss, not here."""
        group = self.round_shape.num_generations
        if self.loss_fn.multi_objective_aggregation == "normalize_then_sum":
            advantages = decoupled_advantages(self.gathered(generation.per_func), self.reward_weights, group)
        else:
            advantages = group_advantages(self.gathered(generation.rewards), group, self.loss_fn.scale_rewards)
        return self.mine(advantages, len(generation.rewards))

    # -- what is computed -------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any] | None:
        step = self.next_step(batch)
        mask, settings = step.loss_mask, self.loss_fn
        logps, entropy = self.completion_logps(self.network, step.prompt_ids, step.prompt_mask, step.completion_ids,
                                               step.completion_mask, with_entropy=True,
                                               padding_free=self.padding_free, entropy_grad=settings.entropy_bonus)
        out = settings(logps, step.old_logps, step.advantages, mask, ref_logps=step.ref_logps, entropy=entropy,
                       entropy_pool=self.entropy_pool(entropy, mask) if settings.top_entropy_quantile < 1 else None,
                       sampling_logps=step.sampling_logps, is_ratio=step.is_ratio,
                       max_completion_length=self.max_completion_length, num_tokens=self.round.num_tokens,
                       entropy_coef=self.entropy_control.applied())
        if settings.use_adaptive_entropy:  # this accumulation window's entropy, for the coefficient's update
            window = torch.stack([(entropy.detach() * out.trained).sum(), out.trained.sum()])
            self.entropy_window = window if self.entropy_window is None else self.entropy_window + window
        loss = self.guard_loss(out.loss, (out.token_losses * mask).sum(1), batch_idx, step.dataset_rows)
        if loss is None:  # skipped (on_nonfinite_loss: skip)
            return None
        self.log_step(loss, entropy.detach(), out.info, mask, self.loss_stats(out, mask))
        return {"loss": loss, "step": step, "logps": logps.detach()}  # callbacks see the step's batch (outputs)

    def loss_stats(self, out, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The loss types' own metrics under TRL's names, and the policy term alone under an entropy bonus."""
        info, mask = out.info, mask.to(out.token_losses.dtype)
        names = {"cispo_clipped": "cispo_clip_ratio", "phi_seq": "vespo/phi_seq_mean", "kl": "kl"}
        stats = {metric: masked_total(info[key], mask) for key, metric in names.items() if key in info}
        if self.loss_fn.entropy_bonus:
            stats["policy_loss"] = out.policy_loss
        return stats

    def entropy_pool(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Every rank's loss tokens' entropies (``top_entropy_quantile``'s threshold is their quantile, as TRL's)."""
        mine = entropy.detach()[mask.bool()].float()
        sizes = self.trainer.strategy.all_gather(torch.tensor(len(mine), device=self.device)).reshape(-1)
        padded = torch.full((int(sizes.max()),), -1.0, device=self.device)  # entropies are >= 0: -1 marks padding
        padded[: len(mine)] = mine
        gathered = self.trainer.strategy.all_gather(padded).reshape(-1)
        return gathered[gathered >= 0]

    def on_before_optimizer_step(self, optimizer) -> None:
        """After an accumulation window: the adaptive entropy coefficient of the next step, from this window's mean
        entropy over every rank's trained tokens (TRL updates it at the same boundary)."""
        super().on_before_optimizer_step(optimizer)
        if self.entropy_window is not None:
            totals = self.trainer.strategy.reduce(self.entropy_window, reduce_op="sum")
            self.entropy_control.step(float(totals[0] / totals[1].clamp(min=1.0)))
            self.entropy_window = None
        if self.loss_fn.entropy_bonus:  # the coefficient the next step applies (TRL logs it here too)
            self.log("train/entropy_coef", float(self.entropy_control.coef))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[CHECKPOINT_KEY]["entropy_control"] = self.entropy_control.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get(CHECKPOINT_KEY, {})
        if "entropy_control" in state:
            self.entropy_control.load_state_dict(state["entropy_control"])
