"""TRL's KTO losses as pure tensor functions, and their settings (``KTOLoss``), checked in one place.

KTO (https://huggingface.co/papers/2402.01306) learns from unpaired rows, each a completion labelled desirable or
undesirable. With ``u = pi - ref`` the summed completion log-ratio of a row and ``z0`` the batch's KL estimate:

- ``kto``: desirable ``1 - sigmoid(beta (u - z0))``, undesirable ``1 - sigmoid(beta (z0 - u))`` (Eq. 7);
- ``apo_zero_unpaired``: desirable ``1 - sigmoid(beta u)``, undesirable ``sigmoid(beta u)`` (APO-zero, unpaired; no
  KL estimate).

Each row's loss is multiplied by ``desirable_weight`` or ``undesirable_weight``; the batch loss is the mean over rows.
``z0`` is ``kl_estimate``: the mean over the batch of ``pi - ref`` on *mismatched* pairs (each prompt with another
row's completion), clamped at 0 and without gradient, as TRL computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lit_align.losses.settings import check_choice, check_positive

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kl_estimate(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point ``z0``: ``mean(pi - ref)`` over the mismatched pairs ``[B] -> []``, detached. Clamp it at
    0 (``.clamp(min=0)``) after averaging over ranks, as TRL does; ``kto_loss`` takes the result."""
    return (policy_kl_logps - ref_kl_logps).mean().detach()


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    labels: torch.Tensor,
    kl: torch.Tensor | float = 0.0,
    beta: float = 0.1,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KTO losses and implicit rewards: ``[B] x 2, labels [B] bool -> (losses [B], rewards [B])``.

    ``labels`` is True for a desirable row; ``kl`` is ``z0`` (``kl_estimate``, clamped; ignored by
    ``apo_zero_unpaired``). The losses are already weighted by ``desirable_weight`` / ``undesirable_weight``; their
    mean is TRL's loss (TRL lists the desirable rows' losses first, which does not change the mean). The rewards are
    ``beta * u``, detached: TRL's ``rewards/chosen`` over the desirable rows, ``rewards/rejected`` over the others.
    """
    labels = labels.bool()
    u = policy_logps - ref_logps
    if loss_type == "kto":
        desirable = 1 - torch.sigmoid(beta * (u - kl))
        undesirable = 1 - torch.sigmoid(beta * (kl - u))
    elif loss_type == "apo_zero_unpaired":
        desirable = 1 - torch.sigmoid(beta * u)
        undesirable = torch.sigmoid(beta * u)
    else:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}: expected one of {KTO_LOSS_TYPES}")
    losses = torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)
    return losses, beta * u.detach()


@dataclass(frozen=True)
class KTOLoss:
    """The KTO loss settings under TRL's names (documented on ``KTOModule``), checked once, here.

    ``loss(pi, ref, labels, kl)`` is ``kto_loss`` with these settings.
    """

    loss_type: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, KTO_LOSS_TYPES)
        for name in ("beta", "desirable_weight", "undesirable_weight"):
            check_positive(name, getattr(self, name))

    @property
    def uses_kl(self) -> bool:
        """Whether the loss needs the KL estimate (and so the mismatched pairs): all but ``apo_zero_unpaired``."""
        return self.loss_type != "apo_zero_unpaired"

    def __call__(self, policy_logps, ref_logps, labels, kl=0.0):
        return kto_loss(policy_logps, ref_logps, labels, kl, beta=self.beta, loss_type=self.loss_type,
                        desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight)
