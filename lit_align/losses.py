"""Pure tensor math of alignment: token log-probs and the preference losses.

No Lightning here: every function takes tensors and returns tensors, so tests and users can call them directly.
Shapes: ``B`` pairs, ``N`` sequences, ``T`` positions, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under ``logits``: ``[N, T, V], [N, T] -> [N, T]`` (fp32).

    Gathers the label logit and subtracts a logsumexp, so no ``[N, T, V]`` log-softmax is ever held beside the
    logits. Half-precision logits are upcast one sequence at a time (the logsumexp needs fp32 to be accurate).
    Labels must be valid ids everywhere (mask afterwards; use any id, e.g. 0, at padded positions).
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return (picked - torch.logsumexp(logits, dim=-1)).float()
    rows = []
    for row_logits, row_labels in zip(logits, labels):
        row_logits = row_logits.float()
        picked = row_logits.gather(-1, row_labels.unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of the masked labels of each sequence: ``[N, T, V], [N, T], [N, T] -> [N]``.

    ``logits[:, t]`` must already predict ``labels[:, t]`` (the caller shifts: ``logits[:, :-1]`` predicts
    ``input_ids[:, 1:]``). Positions where ``mask`` is 0 contribute nothing, whatever their label.
    """
    mask = mask.bool()
    logps = token_logps(logits, labels.masked_fill(~mask, 0))
    return (logps * mask).sum(-1)


DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses and the implicit rewards: ``[B] x 4 -> (losses [B], chosen_rewards [B], rejected_rewards [B])``.

    ``sigmoid`` (the DPO paper): ``-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``.
    ``hinge`` (SLiC): ``relu(1 - beta * delta)``. ``ipo``: ``(delta_c / len_c - delta_r / len_r - 1 / (2 beta))^2``,
    with log-ratios averaged per completion token as TRL does (needs ``chosen_lengths`` / ``rejected_lengths``).

    The rewards are ``beta * (pi - ref)``, detached: what TRL logs as ``rewards/chosen`` and ``rewards/rejected``.
    Take ``losses.mean()`` for the batch loss.
    """
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("dpo_loss(loss_type='ipo') needs chosen_lengths and rejected_lengths")
        ipo_delta = chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(min=1)
        losses = (ipo_delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}: expected one of {DPO_LOSS_TYPES}")
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
