"""RLOO (REINFORCE Leave-One-Out) as a LightningModule: GRPO's round, data and engines, TRL 1.16's RLOO math.

``RLOOModule`` is a ``GRPOModule`` (one generation round per ``round_pos == 0``, the same ``RoundShape``,
``PromptDataModule``, rewards, engines, checkpoints) that differs where TRL's ``RLOOTrainer`` differs from its
``GRPOTrainer``: the KL to the reference is a penalty on each completion's reward (``beta`` times its summed
``logps - ref``, with the policy's log-probs at sampling time), the advantage is the reward minus the mean of the
other completions of its prompt (optionally normalized over the batch), and the loss is a PPO-clipped surrogate with
one ratio per completion, averaged over completions. The math is ``lit_align.losses.rloo``.

GRPO's loss options that RLOOConfig does not have (``loss_type``, ``scale_rewards``, the GSPO / SAPO / VESPO / entropy
/ GDPO / off-policy settings, the ``vllm_importance_sampling_*`` correction) are not RLOO's options: fixed in
``__init__``, they are neither on the command line nor among a run's hyper-parameters. The README lists every
RLOOConfig field and what became of it.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_align.errors import LitAlignError
from lit_align.generation_round import GenerationRound
from lit_align.losses.grpo import nanstd
from lit_align.losses.rloo import leave_one_out_advantages, rloo_rewards, rloo_sequence_losses, sequence_kl
from lit_align.modules.grpo import GRPOModule

# GRPO's options that are not RLOO's (RLOOConfig has none of them): ``__init__`` fixes them
_NOT_RLOO = (
    "loss_type", "delta", "importance_sampling_level", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
    "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "scale_rewards", "multi_objective_aggregation",
    "top_entropy_quantile", "off_policy_mask_threshold", "use_bias_correction_kl", "entropy_coef",
    "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max", "tools", "max_tool_calling_iterations", "environment_factory", "rollout_func",
)


class RLOOModule(GRPOModule):
    """REINFORCE Leave-One-Out, with TRL 1.16's ``RLOOTrainer`` semantics, defaults and metric names.

    Args:
        num_generations: completions per prompt (TRL's RLOO default: 2; linked from ``data:`` as for GRPO).
        beta: the KL penalty's coefficient (TRL's RLOO default 0.05): each reward minus ``beta`` times the
            completion's summed ``logps - ref`` (a frozen reference, loaded when ``beta > 0``).
        normalize_advantages: scale the advantages to mean 0 and std 1 over the batch (every rank's completions).
        reward_clip_range: ``[min, max]`` the summed rewards are clamped to before the KL penalty (None: none).
        epsilon / epsilon_high: the clipping band of each completion's ratio, ``[1 - epsilon, 1 + epsilon_high]``.

    The other options are ``GRPOModule``'s (sampling, engines, rewards, round shape, ``mask_truncated_completions``,
    ``sync_ref_model`` and its two settings).
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
        **kwargs,
    ):
        clip = reward_clip_range
        if clip is not None and (len(clip) != 2 or clip[0] > clip[1]):
            raise LitAlignError(f"model.reward_clip_range {list(clip)}: expected [min, max] with min <= max")
        # every one of _NOT_RLOO by name: the command line (jsonargparse) then leaves them out
        super().__init__(
            model=model, reward_funcs=reward_funcs, reward_weights=reward_weights, num_generations=num_generations,
            beta=beta, ref_model=ref_model, epsilon=epsilon, epsilon_high=epsilon_high, loss_type="bnpo", delta=None,
            importance_sampling_level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
            vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, scale_rewards="none",
            multi_objective_aggregation="sum_then_normalize", top_entropy_quantile=1.0, off_policy_mask_threshold=None,
            use_bias_correction_kl=False, entropy_coef=0.0, use_adaptive_entropy=False, entropy_coef_min=0.0,
            entropy_coef_max=1.0, entropy_coef_delta=0.005, entropy_target=0.2,
            vllm_importance_sampling_correction=False, vllm_importance_sampling_mode="sequence_mask",
            vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=None, tools=None,
            max_tool_calling_iterations=None, environment_factory=None, rollout_func=None, **kwargs)
        for name in _NOT_RLOO:
            self.hparams.pop(name, None)
        self.normalize_advantages = normalize_advantages
        self.reward_clip_range = None if clip is None else tuple(clip)

    # -- the round: the KL goes into the rewards, the baseline is the other completions' mean --------------------------
    def old_logps(self, rollout, sequences: tuple) -> tuple[torch.Tensor | None, None, dict]:
        """The policy's log-probs at sampling time: the KL penalty's (``beta > 0``) and, when the policy moves before
        the round is used up, the ratio's. The engine's where they are the training forward's definition (``hf``,
        ``native``), else (``vllm``: other kernels) a forward pass, as TRL's RLOO always computes them."""
        if self.loss_fn.beta == 0.0 and not self.round_shape.needs_old_logps(self.trainer.accumulate_grad_batches):
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
        beta = self.loss_fn.beta
        kl = sequence_kl(old_logps, ref_logps, mask) if beta != 0.0 else None
        penalized = rloo_rewards(rewards, kl, beta, self.reward_clip_range)
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
        if self.loss_fn.beta != 0.0:
            mask = round.loss_mask
            totals = strategy.reduce(torch.stack([((round.old_logps - round.ref_logps) * mask).sum(),
                                                  mask.sum().float()]), reduce_op="sum")
            round.stats["kl"] = totals[0] / totals[1].clamp(min=1.0)
        for name, values in round.reward_funcs.items():
            every = strategy.all_gather(torch.tensor(values, device=self.device)).reshape(1, -1)
            round.stats[f"rewards/{name}/std"] = nanstd(every, dim=1).view(())
        return round

    # -- what is computed: one ratio per completion, the loss their mean ---------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any] | None:
        if batch["round_pos"] == 0 or self.round is None:
            self.round = self.generate_round(batch)
        step = self.round.step_batch(batch["round_pos"])
        logps, entropy = self.completion_logps(self.network, step.prompt_ids, step.prompt_mask, step.completion_ids,
                                               step.completion_mask, with_entropy=True,
                                               padding_free=self.padding_free)
        settings = self.loss_fn
        losses, info = rloo_sequence_losses(logps, step.old_logps, step.advantages, step.loss_mask,
                                            settings.epsilon, settings.epsilon_high)
        loss = self.guard_loss(losses.mean(), losses, batch_idx, step.dataset_rows)
        if loss is None:  # skipped (on_nonfinite_loss: skip)
            return None
        # one value per completion ([n, 1]): the clip metrics are fractions of completions, as TRL's RLOO logs them
        self.log_step(loss, loss, entropy.detach(), {k: v.unsqueeze(1) for k, v in info.items()}, step.loss_mask)
        return {"loss": loss, "step": step, "logps": logps.detach()}  # callbacks see the step's batch (outputs)
