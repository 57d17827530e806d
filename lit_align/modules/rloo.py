"""RLOO (REINFORCE Leave-One-Out) as a LightningModule: an online recipe (``lit_align.modules.online``) with TRL
1.16's RLOO math.

``RLOOModule`` shares GRPO's machinery (rollouts, rounds, data, engines, reference, checkpoints) as a sibling on
``OnlineModule``, and differs where TRL's ``RLOOTrainer`` differs from its ``GRPOTrainer``: the KL to the reference is
a penalty on each completion's reward (``beta`` times its summed ``logps - ref``, with the policy's log-probs at
sampling time), the advantage is the reward minus the mean of the other completions of its prompt (optionally
normalized over the batch), and the loss is a PPO-clipped surrogate with one ratio per completion, averaged over
completions. The math is ``lit_align.losses.rloo``. ``docs/rloo.md`` lists every RLOOConfig field and what became of it.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_align.errors import LitAlignError
from lit_align.generation_round import GenerationRound
from lit_align.losses.grpo import nanstd
from lit_align.losses.rloo import leave_one_out_advantages, rloo_rewards, rloo_sequence_losses, sequence_kl
from lit_align.modules.online import OnlineModule
from lit_align.rollouts import ZERO_STD, Generation


class RLOOModule(OnlineModule):
    """REINFORCE Leave-One-Out, with TRL 1.16's ``RLOOTrainer`` semantics, defaults and metric names. The sampling,
    rewards, engine, tools, reference and round options are ``OnlineModule``'s.

    Args:
        num_generations: completions per prompt (TRL's RLOO default: 2).
        beta: the KL penalty's coefficient (TRL's RLOO default 0.05): each reward minus ``beta`` times the
            completion's summed ``logps - ref`` (a frozen reference, loaded when ``beta != 0``).
        epsilon: the lower clipping bound of each completion's ratio, ``1 - epsilon``.
        epsilon_high: the upper bound, ``1 + epsilon_high`` (default: ``epsilon``).
        normalize_advantages: scale the advantages to mean 0 and std 1 over the batch (every rank's completions).
        reward_clip_range: ``[min, max]`` the summed rewards are clamped to before the KL penalty (None: none).
    """

    def __init__(self, model: str = "builtin:tiny", num_generations: int = 2, beta: float = 0.05,
                 epsilon: float = 0.2, epsilon_high: float | None = None, normalize_advantages: bool = False,
                 reward_clip_range: tuple[float, float] | None = None, **kwargs):
        clip = reward_clip_range
        if clip is not None and (len(clip) != 2 or clip[0] > clip[1]):
            raise LitAlignError(f"model.reward_clip_range {list(clip)}: expected [min, max] with min <= max")
        super().__init__(model=model, num_generations=num_generations, beta=beta, **kwargs)
        self.epsilon, self.epsilon_high = epsilon, epsilon_high
        self.normalize_advantages = normalize_advantages
        self.reward_clip_range = None if clip is None else tuple(clip)

    # -- the round: the KL goes into the rewards, the baseline is the other completions' mean --------------------------
    def old_logps(self, generation: Generation, sequences: tuple) -> tuple[torch.Tensor | None, None, dict]:
        """The policy's log-probs at sampling time: the KL penalty's (``beta != 0``) and, when the policy moves before
        the round is used up, the ratio's. The engine's where they are the training forward's definition (``hf``,
        ``native``), else (``vllm``: other kernels) a forward pass, as TRL's RLOO always computes them."""
        if self.beta == 0.0 and not self.round_shape.needs_old_logps(self.trainer.accumulate_grad_batches):
            return None, None, {}
        if generation.logps is not None and self.rollouts.engine_name != "vllm":
            return generation.logps, None, {}
        return self.completion_logps(self.network, *sequences)[0], None, {}

    def advantages(self, generation: Generation, old_logps, ref_logps, loss_mask) -> torch.Tensor:
        """Leave-one-out advantages of the rewards clamped to ``reward_clip_range`` and penalized by ``beta`` times
        each completion's KL, over every rank's completions (a group stays on one rank; ``normalize_advantages`` uses
        the global batch), then this rank's rows. The rewards logged are the unpenalized ones, as TRL logs them."""
        kl = sequence_kl(old_logps, ref_logps, loss_mask) if self.beta != 0.0 else None
        penalized = rloo_rewards(generation.rewards, kl, self.beta, self.reward_clip_range)
        advantages = leave_one_out_advantages(self.gathered(penalized), self.round_shape.num_generations,
                                              self.normalize_advantages)
        return self.mine(advantages, len(penalized))

    @torch.no_grad()
    def make_round(self, batch: dict[str, Any]) -> GenerationRound:
        """The online round, plus TRL's RLOO round metrics: ``kl`` (the mean per-token ``logps - ref`` at sampling, all
        ranks' tokens) and ``frac_reward_zero_std`` of the clipped and KL-penalized rewards (the groups whose
        advantages are all zero)."""
        round = super().make_round(batch)
        strategy = self.trainer.strategy
        if self.beta != 0.0:
            mask = round.loss_mask
            totals = strategy.reduce(torch.stack([((round.old_logps - round.ref_logps) * mask).sum(),
                                                  mask.sum().float()]), reduce_op="sum")
            round.stats["kl"] = totals[0] / totals[1].clamp(min=1.0)
        if self.beta != 0.0 or self.reward_clip_range is not None:  # TRL's: of the rewards the advantages are of
            kl = sequence_kl(round.old_logps, round.ref_logps, round.loss_mask) if self.beta != 0.0 else None
            rewards = rloo_rewards(torch.tensor(round.rewards, device=self.device), kl, self.beta,
                                   self.reward_clip_range)
            spread = nanstd(self.gathered(rewards).view(-1, self.round_shape.num_generations), dim=1)
            round.stats["frac_reward_zero_std"] = (spread < ZERO_STD).float().mean()
        return round

    # -- what is computed: one ratio per completion, the loss their mean ---------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any] | None:
        step = self.next_step(batch)
        logps, entropy = self.completion_logps(self.network, step.prompt_ids, step.prompt_mask, step.completion_ids,
                                               step.completion_mask, with_entropy=True,
                                               padding_free=self.padding_free)
        losses, info = rloo_sequence_losses(logps, step.old_logps, step.advantages, step.loss_mask, self.epsilon,
                                            self.epsilon_high)
        loss = self.guard_loss(losses.mean(), losses, batch_idx, step.dataset_rows)
        if loss is None:  # skipped (on_nonfinite_loss: skip)
            return None
        # one value per completion ([n, 1]): the clip metrics are fractions of completions, as TRL's RLOO logs them
        self.log_step(loss, entropy.detach(), {k: v.unsqueeze(1) for k, v in info.items()}, step.loss_mask)
        return {"loss": loss, "step": step, "logps": logps.detach()}  # callbacks see the step's batch (outputs)
