"""RLOO (REINFORCE Leave-One-Out) as a LightningModule: GRPO's round, data and engines, TRL 1.16's RLOO math.

``RLOOModule`` is a ``GRPOModule`` (one generation round per ``round_pos == 0``, the same ``RoundShape``,
``PromptDataModule``, rewards, engines, checkpoints) that differs where TRL's ``RLOOTrainer`` differs from its
``GRPOTrainer``: the KL to the reference is a penalty on each completion's reward (``beta`` times its summed
``logps - ref``, with the policy's log-probs at sampling time), the advantage is the reward minus the mean of the
other completions of its prompt (optionally normalized over the batch), and the loss is a PPO-clipped surrogate with
one ratio per completion, averaged over completions. The math is ``lit_align.losses.rloo``.

GRPO options RLOO does not have (``loss_type``, ``scale_rewards``, the ``vllm_importance_sampling_*`` correction)
are not RLOO's options either; the README lists every RLOOConfig field and what became of it.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_align.callbacks import RefModelSync
from lit_align.errors import LitAlignError
from lit_align.generation_round import GenerationRound
from lit_align.losses.grpo import nanstd
from lit_align.losses.rloo import leave_one_out_advantages, rloo_rewards, rloo_sequence_losses, sequence_kl
from lit_align.modules.grpo import GRPOModule

# GRPO's options that are not RLOO's: fixed in ``__init__``, and not among an RLOO run's hyper-parameters
_NOT_RLOO = ("loss_type", "scale_rewards", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")


class RLOOModule(GRPOModule):
    """REINFORCE Leave-One-Out, with TRL 1.16's ``RLOOTrainer`` semantics, defaults and metric names.

    Args:
        num_generations: completions per prompt (TRL's RLOO default: 2; linked from ``data:`` as for GRPO).
        beta: the KL penalty's coefficient (TRL's RLOO default 0.05): each reward minus ``beta`` times the
            completion's summed ``logps - ref`` (a frozen reference, loaded when ``beta > 0``).
        normalize_advantages: scale the advantages to mean 0 and std 1 over the batch (every rank's completions).
        reward_clip_range: ``[min, max]`` the summed rewards are clamped to before the KL penalty (None: none).
        epsilon / epsilon_high: the clipping band of each completion's ratio, ``[1 - epsilon, 1 + epsilon_high]``.
        sync_ref_model: every ``ref_model_sync_steps`` optimizer steps, ``ref <- ref_model_mixup_alpha * policy +
            (1 - ref_model_mixup_alpha) * ref`` (TRL's; ``lit_align.callbacks.RefModelSync``); needs ``beta > 0``
            and full fine-tuning.
        ref_model_mixup_alpha: the policy's weight in that mix (TRL's default 0.6).
        ref_model_sync_steps: optimizer steps between two mixes (TRL's default 512).

    The other options are ``GRPOModule``'s (sampling, engines, rewards, round shape, ``mask_truncated_completions``).
    """

    def __init__(
        self,
        model: str = "builtin:tiny",
        reward_funcs: list[str | dict] | None = None,
        reward_weights: list[float] | None = None,
        num_generations: int = 2,
        beta: float = 0.05,
        ref_model: str | None = None,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        normalize_advantages: bool = False,
        reward_clip_range: tuple[float, float] | None = None,
        sync_ref_model: bool = False,
        ref_model_mixup_alpha: float = 0.6,
        ref_model_sync_steps: int = 512,
        **kwargs,
    ):
        clip = reward_clip_range
        if clip is not None and (len(clip) != 2 or clip[0] > clip[1]):
            raise LitAlignError(f"model.reward_clip_range {list(clip)}: expected [min, max] with min <= max")
        super().__init__(model=model, reward_funcs=reward_funcs, reward_weights=reward_weights,
                         num_generations=num_generations, beta=beta, ref_model=ref_model, epsilon=epsilon,
                         epsilon_high=epsilon_high, loss_type="bnpo", scale_rewards="none",
                         vllm_importance_sampling_correction=False, vllm_importance_sampling_mode="sequence_mask",
                         vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=None, **kwargs)
        for name in _NOT_RLOO:
            self.hparams.pop(name, None)
        self.normalize_advantages = normalize_advantages
        self.reward_clip_range = None if reward_clip_range is None else tuple(reward_clip_range)
        if sync_ref_model and (beta == 0.0 or self.lora_config is not None):
            raise LitAlignError("model.sync_ref_model needs a reference model in memory: beta > 0 (with beta 0 there "
                                "is none) and no peft_config (the reference is then the adapters-off policy)")
        self.ref_sync = RefModelSync(ref_model_sync_steps, ref_model_mixup_alpha) if sync_ref_model else None

    def configure_callbacks(self):
        return [self.ref_sync] if self.ref_sync is not None else []

    # -- the round: the KL goes into the rewards, the baseline is the other completions' mean --------------------------
    def old_logps(self, rollout, sequences: tuple) -> tuple[torch.Tensor | None, None, dict]:
        """The policy's log-probs at sampling time: the KL penalty's (``beta > 0``) and, when the policy moves before
        the round is used up, the ratio's. The engine's where they are the training forward's definition (``hf``,
        ``native``), else (``vllm``: other kernels) a forward pass, as TRL's RLOO always computes them."""
        if self.beta == 0.0 and not self.round_shape.needs_old_logps(self.trainer.accumulate_grad_batches):
            return None, None, {}
        if rollout.logps is not None and self.hparams.engine != "vllm":
            return rollout.logps, None, {}
        return self.completion_logps(self.network, *sequences)[0], None, {}

    def advantages(self, per_func: torch.Tensor, old_logps: torch.Tensor | None = None,
                   ref_logps: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rewards [N], advantages [N], every rank's rewards)``: leave-one-out advantages of the rewards clamped to
        ``reward_clip_range`` and penalized by ``beta`` times each completion's KL, over every rank's completions
        (a group stays on one rank; ``normalize_advantages`` uses the global batch), then this rank's rows. The
        rewards returned (and logged) are the unpenalized ones, as TRL logs them."""
        weighted = per_func * self.reward_weights
        rewards = torch.where(per_func.isnan().all(1), torch.nan, weighted.nansum(1))
        kl = sequence_kl(old_logps, ref_logps, mask) if self.beta != 0.0 else None
        penalized = rloo_rewards(rewards, kl, self.beta, self.reward_clip_range)
        gather = self.trainer.strategy.all_gather
        all_rewards, all_penalized = gather(rewards).reshape(-1), gather(penalized).reshape(-1)
        rank = self.trainer.global_rank
        mine = slice(rank * len(rewards), (rank + 1) * len(rewards))
        advantages = leave_one_out_advantages(all_penalized, self.round_shape.num_generations,
                                              self.normalize_advantages)
        return rewards, advantages[mine], all_rewards

    @torch.no_grad()
    def generate_round(self, batch: dict[str, Any]) -> GenerationRound:
        """GRPO's round, plus TRL's RLOO round metrics: ``kl`` (the mean per-token ``logps - ref`` at sampling, all
        ranks' tokens) and ``rewards/<fn>/std``."""
        round = super().generate_round(batch)
        strategy = self.trainer.strategy
        if self.beta != 0.0:
            mask = round.loss_mask
            totals = strategy.reduce(torch.stack([((round.old_logps - round.ref_logps) * mask).sum(),
                                                  mask.sum().float()]), reduce_op="sum")
            round.stats["kl"] = totals[0] / totals[1].clamp(min=1.0)
        for name, values in round.reward_funcs.items():
            every = strategy.all_gather(torch.tensor(values, device=self.device)).reshape(1, -1)
            round.stats[f"rewards/{name}/std"] = nanstd(every, dim=1).view(())
        return round

    # -- what is computed: one ratio per completion, the loss their mean --------------------------------------------
    def policy_loss(self, step, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """TRL's RLOO loss: the PPO-clipped surrogate of each completion's summed log-ratio, averaged over the
        step's completions; the clip metrics are fractions of completions."""
        losses, info = rloo_sequence_losses(logps, step.old_logps, step.advantages, step.loss_mask, self.epsilon,
                                            self.epsilon_high)
        stats = {
            "clip_ratio/low_mean": info["low_clipped"].mean(),
            "clip_ratio/high_mean": info["high_clipped"].mean(),
            "clip_ratio/region_mean": (info["low_clipped"] + info["high_clipped"]).mean(),
        }
        return losses.mean(), losses, stats
