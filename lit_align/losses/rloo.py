"""RLOO's pure tensor math (REINFORCE Leave-One-Out, Ahmadian et al. 2024), as TRL 1.16's ``RLOOTrainer`` computes it.

Shapes: ``N`` completions (``num_generations`` consecutive ones per prompt), ``C`` completion positions.

Where it differs from GRPO (``lit_align.losses.grpo``): the KL to the reference is a *reward* penalty, the summed
first-order log ratio of each completion (``logps - ref``, which may be negative per token), not a k3 term in the
loss; the baseline of a completion is the mean reward of the *other* completions of its prompt, not the group's
mean, and there is no division by the group's std (``normalize_advantages`` scales by the whole batch's instead);
the importance ratio is one per completion (its summed log-probs), and the loss is the mean over completions.
"""

from __future__ import annotations

import torch

from lit_align.losses.grpo import nanstd


def sequence_kl(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N, C] -> [N]``: each completion's summed first-order log ratio ``sum((logps - ref) * mask)``."""
    return ((logps - ref_logps) * mask).sum(-1)


def rloo_rewards(rewards: torch.Tensor, kl: torch.Tensor | None = None, beta: float = 0.0,
                 reward_clip_range: tuple[float, float] | None = None) -> torch.Tensor:
    """The rewards RLOO's advantages see: ``[N] -> [N]``, clamped to ``reward_clip_range`` first, then minus ``beta``
    times each completion's ``kl`` (``sequence_kl``). NaN (an unscorable completion) stays NaN."""
    if reward_clip_range:
        rewards = rewards.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    if beta != 0.0:
        if kl is None:
            raise ValueError("rloo_rewards: beta != 0 needs kl")
        rewards = rewards - beta * kl
    return rewards


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int,
                             normalize: bool = False) -> torch.Tensor:
    """``[N] -> [N]``: each reward minus the mean of the other scorable rewards of its prompt.

    NaN rewards (no reward function applied) are left out of their siblings' baselines and get advantage 0, as does
    a completion with no scorable sibling. ``normalize``: then ``(A - mean(A)) / (std(A) + 1e-4)`` over the whole
    batch's scorable completions (unbiased std, as TRL).
    """
    grouped = rewards.view(-1, num_generations)
    scorable = (~grouped.isnan()).sum(1, keepdim=True)
    baselines = (grouped.nansum(1, keepdim=True) - grouped) / (scorable - 1)
    advantages = (grouped - baselines).view(-1)
    if normalize:
        flat = advantages.view(1, -1)
        advantages = (advantages - advantages.nanmean()) / (nanstd(flat, dim=1).view(()) + 1e-4)
    return advantages.nan_to_num(0.0)


def rloo_sequence_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-completion clipped surrogate: ``[N, C] -> [N]`` (the step loss is its mean), and per-completion diagnostics.

    ``ratio = exp(sum(logps * mask) - sum(old_logps * mask))`` per completion (``old_logps`` None: on-policy, ratio 1
    with gradient); loss ``= -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)``. Diagnostics
    ``low_clipped`` and ``high_clipped`` as TRL counts them (ratio outside the band where clipping binds).
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    seq_logps = (logps * mask).sum(-1)
    old = seq_logps.detach() if old_logps is None else (old_logps * mask).sum(-1)
    ratio = torch.exp(seq_logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    losses = -torch.min(ratio * advantages, clipped * advantages)
    info = {
        "low_clipped": ((ratio < 1 - epsilon) & (advantages < 0)).to(ratio.dtype),
        "high_clipped": ((ratio > 1 + epsilon_high) & (advantages > 0)).to(ratio.dtype),
    }
    return losses, info
