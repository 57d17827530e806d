"""TRL's reward-model loss (``RewardTrainer.compute_loss``) as a pure tensor function.

A reward model maps a whole sequence (prompt + completion) to one number. Trained on preference pairs with the
Bradley-Terry model, ``P(chosen > rejected) = sigmoid(r_c - r_r)``, its loss per pair is

    -logsigmoid(r_c - r_r - margin) + center_rewards_coefficient * (r_c + r_r)^2

``margin`` (a dataset column, 0 without one) asks for a gap of at least that much (Llama 2's margin loss); the
centering term (Eisenstein et al. 2023, eq. 2) pulls the rewards towards mean zero. TRL takes the mean over pairs
of each term, which is the mean over pairs of this per-pair loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                center_rewards_coefficient: float | None = None) -> torch.Tensor:
    """Per-pair losses ``[B]`` from the rewards of the chosen and rejected sequences (``[B]`` each); the training
    loss is their mean. ``margin``: ``[B]`` or None; ``center_rewards_coefficient``: None (TRL's default) or a
    weight (TRL recommends 0.01)."""
    delta = chosen - rejected
    if margin is not None:
        delta = delta - margin.to(delta.dtype)
    losses = -F.logsigmoid(delta)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


def reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's reward-model statistics of one batch (detached): ``accuracy`` (pairs whose chosen reward is higher),
    ``margin`` (mean ``r_c - r_r``), ``min_reward`` / ``mean_reward`` / ``max_reward`` over every sequence."""
    chosen, rejected = chosen.detach(), rejected.detach()
    rewards = torch.cat([chosen, rejected])
    return {"accuracy": (chosen > rejected).to(chosen.dtype).mean(), "margin": (chosen - rejected).mean(),
            "min_reward": rewards.min(), "mean_reward": rewards.mean(), "max_reward": rewards.max()}
