"""GRPO's pure tensor math: group-relative advantages, the clipped per-token surrogate, TRL's loss aggregations.

Shapes: ``N`` completions (``num_generations`` consecutive ones per prompt), ``C`` completion positions.
"""

from __future__ import annotations

import math

import torch

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """Group-relative advantages: ``[N] -> [N]``, rows ordered as ``num_generations`` consecutive samples per prompt.

    ``reward - mean(group)``, divided by ``std(group) + 1e-4`` (``group``), by the whole batch's std (``batch``), or
    not at all (``none``, Dr. GRPO). Std is the unbiased one, as in TRL. NaN rewards (no reward function applied)
    are left out of the statistics and get advantage 0.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}: expected one of {SCALE_REWARDS}")
    grouped = rewards.view(-1, num_generations)
    advantages = grouped - grouped.nanmean(1, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (nanstd(grouped, dim=1) + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (nanstd(rewards.view(1, -1), dim=1) + 1e-4)
    return advantages.view(-1).nan_to_num(0.0)


def nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased std over ``dim`` ignoring NaN (0 where fewer than two values), keeping ``dim``."""
    count = (~x.isnan()).sum(dim, keepdim=True)
    var = ((x - x.nanmean(dim, keepdim=True)) ** 2).nansum(dim, keepdim=True) / (count - 1).clamp(min=1)
    return var.sqrt()


def grpo_token_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate (+ ``beta`` * k3 KL): ``[N, C] -> [N, C]``, and per-token diagnostics.

    ``ratio = exp(logps - old_logps)`` (``old_logps`` None: the samples are on-policy, ratio 1 with gradient);
    loss ``= -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * kl`` with
    ``kl = exp(ref - logps) - (ref - logps) - 1``. Diagnostics: ``kl``, ``low_clipped``, ``high_clipped`` as TRL
    counts them (ratio outside the band on the side where clipping binds).
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    adv = advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    losses = -torch.min(ratio * adv, clipped * adv)
    info = {
        "low_clipped": ((ratio < 1 - epsilon) & (adv < 0)).to(ratio.dtype),
        "high_clipped": ((ratio > 1 + epsilon_high) & (adv > 0)).to(ratio.dtype),
    }
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("grpo_token_losses: beta != 0 needs ref_logps")
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        losses = losses + beta * kl
        info["kl"] = kl.detach()
    return losses, info


def aggregate_grpo_loss(
    token_losses: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    num_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce ``[N, C]`` token losses to the step loss, per TRL's ``loss_type``:

    - ``grpo``: mean over sequences of each sequence's token mean (length-biased);
    - ``bnpo``: token mean over this batch;
    - ``dr_grpo``: token sum / (N * ``max_completion_length``);
    - ``dapo``: token sum / ``num_tokens``, the active tokens per step averaged over the whole generation round
      (all steps, all ranks), so every token of the round weighs the same.
    """
    mask = mask.to(token_losses.dtype)
    total = (token_losses * mask).sum()
    if loss_type == "grpo":
        return ((token_losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("aggregate_grpo_loss(loss_type='dr_grpo') needs max_completion_length")
        return total / (token_losses.shape[0] * max_completion_length)
    if loss_type == "dapo":
        if num_tokens is None:
            raise ValueError("aggregate_grpo_loss(loss_type='dapo') needs num_tokens")
        return total / max(num_tokens, 1.0)
    raise ValueError(f"unknown GRPO loss_type {loss_type!r}: expected one of {GRPO_LOSS_TYPES}")


def importance_sampling_ratio(train_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                              mode: str = "sequence_mask", clip_min: float | None = None,
                              clip_max: float | None = 3.0) -> torch.Tensor:
    """TRL's correction for sampling with another engine (vLLM) than the training forward: the weight of each token's
    loss, ``[N, C]`` (``token_*``) or ``[N, 1]`` (``sequence_*``, one per completion).

    The ratio is ``exp(train - sampling)`` per token over the ``mask``'s tokens, or ``exp(sum over the completion)``
    per sequence; ``*_truncate`` clamps it to ``[clip_min, clip_max]`` (truncated importance sampling), ``*_mask``
    sets it to 0 outside that range. None bounds are open.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r}: expected one of {IMPORTANCE_SAMPLING_MODES}")
    diff = ((train_logps - sampling_logps) * mask).nan_to_num(0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return ratio.clamp(min=low, max=high)
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
