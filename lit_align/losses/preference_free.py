"""Preference losses without a reference model: TRL's CPO (with SimPO and AlphaPO) and ORPO, as pure tensor functions.

Both compare the policy's own log-probs of the chosen and rejected completions, ``pi_c`` and ``pi_r`` (``[B]``), and
add a negative log-likelihood term on the chosen rows (``nll``, computed by the caller from per-token log-probs):

- CPO (https://huggingface.co/papers/2401.08417): ``cpo_loss`` on ``pi_c - pi_r``, plus ``cpo_alpha * nll`` (the
  chosen completions' tokens). SimPO (https://huggingface.co/papers/2405.14734) is ``loss_type: simpo`` on
  per-token averaged log-probs with a target margin ``simpo_gamma``, usually with ``cpo_alpha: 0``.
- ORPO (https://huggingface.co/papers/2403.07691): ``nll - beta * mean(logsigmoid(log_odds))``, the log-probs
  averaged per token, ``log_odds = log(p_c / (1 - p_c)) - log(p_r / (1 - p_r))``; ``nll`` over the chosen rows'
  whole sequences, prompt included (TRL's choice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lit_align.errors import LitAlignError
from lit_align.losses.settings import check_choice, check_positive

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")
AVERAGED_LOSS_TYPES = ("ipo", "simpo")  # their log-probs are per-token averages, the others' sums


def alphapo_rewards(logps: torch.Tensor, alpha: float) -> torch.Tensor:
    """AlphaPO's reward shape (https://huggingface.co/papers/2501.03884): ``(1 - p^-alpha) / alpha``, ``p = exp(logps)``;
    ``logps`` itself at ``alpha = 0``."""
    if alpha == 0.0:
        return logps
    return (1 - torch.exp(-alpha * logps)) / alpha


def cpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair CPO-family losses and rewards: ``[B] x 2 -> (losses, chosen_rewards, rejected_rewards)``.

    With ``r = alphapo_rewards(logps, alpha)`` (the log-probs themselves at ``alpha = 0``) and ``d = r_c - r_r``:

    - ``sigmoid`` (CPO, Eq. 3): ``-(1 - eps) logsigmoid(beta d) - eps logsigmoid(-beta d)``, ``eps = label_smoothing``;
    - ``simpo``: the same on ``d - simpo_gamma / beta``;
    - ``hinge``: ``relu(1 - beta d)``; ``ipo``: ``(d - 1 / (2 beta))^2``.

    ``ipo`` and ``simpo`` expect per-token averaged log-probs, the others summed ones (``AVERAGED_LOSS_TYPES``; the
    module passes the right ones). The rewards are ``beta * r``, detached. The NLL term is the caller's.
    """
    chosen = alphapo_rewards(policy_chosen_logps, alpha)
    rejected = alphapo_rewards(policy_rejected_logps, alpha)
    d = chosen - rejected
    if loss_type == "simpo":
        d = d - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * d) - label_smoothing * F.logsigmoid(-beta * d)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * d)
    elif loss_type == "ipo":
        losses = (d - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown CPO loss_type {loss_type!r}: expected one of {CPO_LOSS_TYPES[:-1]}")
    return losses, beta * chosen.detach(), beta * rejected.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation on either side of ``-log 2``."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def odds_ratio_loss(
    policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor, beta: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO's odds-ratio term per pair, on per-token averaged log-probs: ``[B] x 2 -> (ratio_losses, chosen_rewards,
    rejected_rewards, log_odds)``.

    ``log_odds = (pi_c - pi_r) - (log(1 - exp(pi_c)) - log(1 - exp(pi_r)))``; ``ratio_losses = -beta *
    logsigmoid(log_odds)``, so that ORPO's loss is ``nll + ratio_losses.mean()`` (TRL writes ``nll - mean(beta *
    logsigmoid(...))``). Rewards ``beta * pi``, detached. TRL's metrics ``log_odds_ratio`` and ``log_odds_chosen`` are
    the batch means of ``logsigmoid(log_odds)`` and ``log_odds``. Computed in at least fp32, as TRL does.
    """
    dtype = torch.promote_types(policy_chosen_logps.dtype, torch.float32)
    chosen, rejected = policy_chosen_logps.to(dtype), policy_rejected_logps.to(dtype)
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return -beta * F.logsigmoid(log_odds), beta * chosen.detach(), beta * rejected.detach(), log_odds


@dataclass(frozen=True)
class CPOLoss:
    """The CPO settings under TRL's names (documented on ``CPOModule``), checked once, here. ``loss_type: alphapo``
    is TRL's shorthand for ``simpo`` with ``cpo_alpha: 0`` (and ``alpha`` as given); ``loss_type`` and ``cpo_alpha``
    here are what it stands for."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5
    alpha: float = 0.0

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, CPO_LOSS_TYPES)
        if self.loss_type == "alphapo":
            object.__setattr__(self, "loss_type", "simpo")
            object.__setattr__(self, "cpo_alpha", 0.0)
        check_positive("beta", self.beta)
        if not 0 <= self.label_smoothing < 0.5:
            raise LitAlignError(f"model.label_smoothing {self.label_smoothing}: expected a value in [0, 0.5)")
        if self.cpo_alpha < 0:
            raise LitAlignError(f"model.cpo_alpha {self.cpo_alpha}: expected a value >= 0")

    @property
    def averaged(self) -> bool:
        """Whether the loss reads per-token averaged log-probs (``ipo``, ``simpo``) rather than sums."""
        return self.loss_type in AVERAGED_LOSS_TYPES

    def __call__(self, policy_chosen_logps, policy_rejected_logps):
        return cpo_loss(policy_chosen_logps, policy_rejected_logps, beta=self.beta, loss_type=self.loss_type,
                        label_smoothing=self.label_smoothing, simpo_gamma=self.simpo_gamma, alpha=self.alpha)
