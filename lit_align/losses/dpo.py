"""TRL's DPO loss family as pure tensor functions, and its settings (``DPOLoss``), validated in one place.

Every loss is per pair (``[B]``): the module takes the mean over pairs, which is TRL's mean over the batch. A list of
loss types is a weighted sum of their per-pair losses (MPO-style mixes). The pieces that need per-token log-probs
(LD-DPO's ``ld_alpha``, the ``sft`` term, WPO weights) are computed here from ``[2B, T]`` token log-probs and masks,
rows ordered ``[chosen_1..B; rejected_1..B]``; the losses themselves see only per-sequence numbers and those results.

Names: ``u`` is a log-ratio ``pi - ref`` (summed log-probs), a *score* is ``u`` passed through the f-divergence
transform (``u`` itself for ``reverse_kl``, i.e. plain DPO), ``delta`` is ``score_chosen - score_rejected``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lit_align.errors import LitAlignError
from lit_align.losses.settings import check_choice, check_positive

DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# The f-DPO reparameterization only cancels log Z(x) in the chosen - rejected difference, so only the losses built on
# that difference have an f-divergence form (TRL rejects the others).
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


def f_divergence_scores(logratios: torch.Tensor, f_divergence_type: str = "reverse_kl",
                        alpha: float = 0.5) -> torch.Tensor:
    """``f'(t)`` at ``t = pi / ref = exp(logratios)`` for the f-DPO regularizers: ``[B] -> [B]``.

    ``reverse_kl``: ``log t`` (DPO); ``forward_kl``: ``1 - 1/t``; ``js_divergence``: ``log(2t / (t + 1))``;
    ``alpha_divergence``: ``(t^(alpha - 1) - 1) / (alpha - 1)``, ``log t`` at ``alpha = 1``, with the exponent clamped
    (at 80, or 11 for fp16 inputs) so ``t^(alpha - 1)`` stays finite, as TRL does.
    """
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:
            return logratios
        upcast = ((alpha - 1.0) * logratios).to(torch.promote_types(logratios.dtype, torch.float32))
        exponent = upcast.clamp(max=11.0 if logratios.dtype == torch.float16 else 80.0)
        return (torch.exp(exponent) - 1.0).to(logratios.dtype) / (alpha - 1.0)
    raise ValueError(f"unknown f_divergence_type {f_divergence_type!r}: expected one of {F_DIVERGENCE_TYPES}")


def _smoothed_sigmoid(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-logsigmoid(z)``, with a fraction ``label_smoothing`` of the labels flipped (cDPO-style)."""
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def _per_token_loss(loss_type: str, chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                    chosen_lengths: torch.Tensor | None, rejected_lengths: torch.Tensor | None,
                    beta: float) -> torch.Tensor:
    """``ipo`` and ``sigmoid_norm``: the losses on scores averaged per completion token, which need the lengths."""
    if chosen_lengths is None or rejected_lengths is None:
        raise ValueError(f"dpo_loss(loss_type={loss_type!r}) needs chosen_lengths and rejected_lengths")
    mean_delta = chosen_scores / chosen_lengths.clamp(min=1) - rejected_scores / rejected_lengths.clamp(min=1)
    if loss_type == "ipo":
        return (mean_delta - 1 / (2 * beta)) ** 2
    return -F.logsigmoid(beta * mean_delta)


def _one_loss(
    loss_type: str,
    u_chosen: torch.Tensor,
    u_rejected: torch.Tensor,
    delta: torch.Tensor,
    beta: float,
    *,
    policy_margin: torch.Tensor | None = None,
    ref_margin: torch.Tensor | None = None,
    chosen_scores: torch.Tensor | None = None,
    rejected_scores: torch.Tensor | None = None,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
    sft_nll: torch.Tensor | None = None,
) -> torch.Tensor:
    """One loss of the family, per pair ``[B]``; ``dpo_loss`` computes the arguments and documents the formulas."""
    z = beta * delta
    if loss_type == "sigmoid":
        return -F.logsigmoid(z)
    if loss_type == "hinge":  # SLiC
        return torch.relu(1 - z)
    if loss_type in ("ipo", "sigmoid_norm"):
        return _per_token_loss(loss_type, chosen_scores, rejected_scores, chosen_lengths, rejected_lengths, beta)
    if loss_type == "exo_pair":  # KL(softmax over {chosen, rejected} || [1 - eps, eps])
        eps = label_smoothing
        return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
    if loss_type == "robust":  # unbiased under a preference-flip rate eps
        eps = label_smoothing
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if loss_type == "nca_pair":
        return (-F.logsigmoid(beta * u_chosen)
                - 0.5 * F.logsigmoid(-beta * u_chosen) - 0.5 * F.logsigmoid(-beta * u_rejected))
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * u_chosen) - F.logsigmoid(-beta * u_rejected)
    if loss_type == "sppo_hard":  # P(chosen wins) = 1, P(rejected wins) = 0
        return (u_chosen - 0.5 / beta) ** 2 + (u_rejected + 0.5 / beta) ** 2
    if loss_type == "aot":  # sorted across the batch: per-position, not per-pair
        sorted_delta = policy_margin.sort(dim=0).values - ref_margin.sort(dim=0).values
        return _smoothed_sigmoid(beta * sorted_delta, label_smoothing)
    if loss_type == "aot_unpaired":
        sorted_delta = u_chosen.sort(dim=0).values - u_rejected.sort(dim=0).values
        return _smoothed_sigmoid(beta * sorted_delta, label_smoothing)
    if loss_type == "apo_zero":  # raise chosen, lower rejected
        return 1 - torch.sigmoid(beta * u_chosen) + torch.sigmoid(beta * u_rejected)
    if loss_type == "apo_down":  # lower both, rejected more
        return torch.sigmoid(beta * u_chosen) + 1 - torch.sigmoid(beta * (u_chosen - u_rejected))
    if loss_type == "discopop":  # logistic/exponential blend, mixed by sigmoid(z / tau)
        mix = torch.sigmoid(z / discopop_tau)
        return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
    if loss_type == "sft":
        if sft_nll is None:
            raise ValueError("dpo_loss(loss_type='sft') needs sft_nll")
        return sft_nll.expand(u_chosen.shape[0])
    raise ValueError(f"unknown DPO loss_type {loss_type!r}: expected one of {DPO_LOSS_TYPES}")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    sft_nll: torch.Tensor | None = None,
    pair_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO-family losses and implicit rewards: ``[B] x 4 -> (losses, chosen_rewards, rejected_rewards)``.

    With ``u_c = pi_c - ref_c``, ``u_r = pi_r - ref_r``, ``s = f_divergence_scores(u)``, ``z = beta (s_c - s_r)``:

    - ``sigmoid`` (DPO): ``-logsigmoid(z)``; ``hinge`` (SLiC): ``relu(1 - z)``;
    - ``ipo``: ``(s_c / len_c - s_r / len_r - 1 / (2 beta))^2`` (per-token averages, as TRL; needs the lengths);
      ``sigmoid_norm``: ``-logsigmoid(beta (s_c / len_c - s_r / len_r))``;
    - ``exo_pair``: ``q (logsigmoid(z) - log(1 - eps)) + (1 - q) (logsigmoid(-z) - log eps)``, ``q = sigmoid(z)``,
      ``eps = label_smoothing``;
    - ``robust``: ``((1 - eps) (-logsigmoid(z)) - eps (-logsigmoid(-z))) / (1 - 2 eps)``;
    - ``nca_pair``: ``-logsigmoid(beta u_c) - (logsigmoid(-beta u_c) + logsigmoid(-beta u_r)) / 2``;
    - ``bco_pair``: ``-logsigmoid(beta u_c) - logsigmoid(-beta u_r)``;
    - ``sppo_hard``: ``(u_c - 1 / (2 beta))^2 + (u_r + 1 / (2 beta))^2``;
    - ``aot``: smoothed sigmoid loss of ``beta (sort(pi_c - pi_r) - sort(ref_c - ref_r))`` over the batch;
      ``aot_unpaired``: of ``beta (sort(u_c) - sort(u_r))`` (the smoothing is ``label_smoothing``);
    - ``apo_zero``: ``1 - sigmoid(beta u_c) + sigmoid(beta u_r)``;
      ``apo_down``: ``sigmoid(beta u_c) + 1 - sigmoid(beta (u_c - u_r))``;
    - ``discopop``: ``-logsigmoid(z) (1 - m) + exp(-z) m``, ``m = sigmoid(z / discopop_tau)``;
    - ``sft``: ``sft_nll`` (the batch's NLL per chosen token, see ``sft_nll``) for every pair.

    A list of loss types sums them per pair, each times its ``loss_weights`` entry (default 1). ``pair_weights``
    (e.g. WPO's, see ``wpo_weights``) multiply every pair's loss. The rewards are ``beta * u``, detached, whatever the
    loss: TRL's ``rewards/chosen`` and ``rewards/rejected``. Take ``losses.mean()`` for the batch loss.
    """
    loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    _check_combination(loss_types, loss_weights, f_divergence_type)
    weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    u_chosen = policy_chosen_logps - ref_chosen_logps
    u_rejected = policy_rejected_logps - ref_rejected_logps
    chosen_scores = f_divergence_scores(u_chosen, f_divergence_type, f_alpha_divergence_coef)
    rejected_scores = f_divergence_scores(u_rejected, f_divergence_type, f_alpha_divergence_coef)
    losses = 0.0
    for name, weight in zip(loss_types, weights):
        losses = losses + weight * _one_loss(
            name, u_chosen, u_rejected, chosen_scores - rejected_scores, beta,
            policy_margin=policy_chosen_logps - policy_rejected_logps, ref_margin=ref_chosen_logps - ref_rejected_logps,
            chosen_scores=chosen_scores, rejected_scores=rejected_scores, chosen_lengths=chosen_lengths,
            rejected_lengths=rejected_lengths, label_smoothing=label_smoothing, discopop_tau=discopop_tau,
            sft_nll=sft_nll,
        )
    if pair_weights is not None:
        losses = losses * pair_weights
    return losses, beta * u_chosen.detach(), beta * u_rejected.detach()


def _check_combination(loss_types: list[str], loss_weights, f_divergence_type: str) -> None:
    if loss_weights is not None and len(loss_weights) != len(loss_types):
        raise LitAlignError(f"model.loss_weights {loss_weights}: expected one weight per loss_type {loss_types}")
    if f_divergence_type != "reverse_kl" and not set(loss_types) <= set(F_DIVERGENCE_LOSS_TYPES):
        raise LitAlignError(f"model.f_divergence_type {f_divergence_type!r} with loss_type {loss_types}: expected "
                            f"'reverse_kl', or only loss types from {F_DIVERGENCE_LOSS_TYPES}")


@dataclass(frozen=True)
class DPOLoss:
    """The DPO loss settings under TRL's names (documented on ``DPOModule``), checked once, here.

    ``loss(pi_c, pi_r, ref_c, ref_r, **per_batch)`` is ``dpo_loss`` with these settings.
    """

    loss_type: str | Sequence[str] = "sigmoid"
    loss_weights: Sequence[float] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    ld_alpha: float | None = None
    use_weighting: bool = False

    def __post_init__(self) -> None:
        types = self.loss_types
        unknown = [name for name in types if name not in DPO_LOSS_TYPES]
        if not types or unknown:
            given = repr(unknown[0]) if unknown else "[]"
            raise LitAlignError(f"model.loss_type {given}: expected one or a list of {DPO_LOSS_TYPES}")
        check_choice("f_divergence_type", self.f_divergence_type, F_DIVERGENCE_TYPES)
        _check_combination(types, None if self.loss_weights is None else list(self.loss_weights),
                           self.f_divergence_type)
        smoothing = self.label_smoothing
        if "robust" in types and not 0 <= smoothing < 0.5:
            raise LitAlignError(f"model.label_smoothing {smoothing}: expected a value in [0, 0.5) for 'robust'")
        if "exo_pair" in types and not 0 < smoothing < 1:
            raise LitAlignError(f"model.label_smoothing {smoothing}: expected a value in (0, 1) for 'exo_pair' "
                                "(the EXO paper suggests 1e-3)")
        if not 0 <= smoothing <= 1:
            raise LitAlignError(f"model.label_smoothing {smoothing}: expected a value in [0, 1]")
        if self.ld_alpha is not None and not 0 <= self.ld_alpha <= 1:
            raise LitAlignError(f"model.ld_alpha {self.ld_alpha}: expected None or a value in [0, 1]")
        if self.use_weighting and {"aot", "aot_unpaired"} & set(types):
            raise LitAlignError("model.use_weighting: not available with loss_type 'aot' or 'aot_unpaired' "
                                "(they sort the batch, so per-pair weights would not match their pairs)")
        check_positive("discopop_tau", self.discopop_tau)

    @property
    def loss_types(self) -> list[str]:
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)

    def __call__(self, policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, **per_batch):
        """``dpo_loss`` with these settings; ``per_batch``: lengths, ``sft_nll``, ``pair_weights``."""
        return dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
                        beta=self.beta, loss_type=self.loss_types,
                        loss_weights=None if self.loss_weights is None else list(self.loss_weights),
                        label_smoothing=self.label_smoothing, f_divergence_type=self.f_divergence_type,
                        f_alpha_divergence_coef=self.f_alpha_divergence_coef, discopop_tau=self.discopop_tau,
                        **per_batch)


# -- per-token pieces: rows [chosen_1..B; rejected_1..B], token log-probs 0 where the mask is 0 ----------------------
def sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, ld_alpha: float | None = None) -> torch.Tensor:
    """Summed completion log-probs ``[2B, T] -> [2B]``, LD-DPO style: within each pair, the tokens past the shorter
    completion's length (the "verbose" tail of the longer one) count ``ld_alpha`` times. None: the plain sum."""
    mask = mask.bool()
    if ld_alpha is None:
        return (token_logps * mask).sum(1)
    position = mask.long().cumsum(1)  # 1-based index among the completion's tokens
    chosen_len, rejected_len = mask.sum(1).chunk(2)
    shared = torch.minimum(chosen_len, rejected_len).repeat(2)[:, None]
    weight = torch.where(position <= shared, 1.0, ld_alpha)
    return (token_logps * weight * mask).sum(1)


def sft_nll(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The ``sft`` term: minus the mean log-prob over all chosen completion tokens of the batch (a scalar)."""
    chosen_logps, chosen_mask = token_logps.chunk(2)[0], mask.chunk(2)[0].bool()
    return -chosen_logps[chosen_mask].mean()


def wpo_weights(token_logps: torch.Tensor, log_sum_sq_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """WPO pair weights ``[2B, T] -> [B]`` (no gradient): for each completion,
    ``exp(mean over its tokens of (log p(token) - log sum_v p(v)^2))``, the length-normalized probability of the
    sequence relative to the policy's own sampling; the pair's weight is chosen's times rejected's."""
    with torch.no_grad():
        mask = mask.bool()
        aligned = ((token_logps - log_sum_sq_probs) * mask).sum(1) / mask.sum(1).clamp(min=1)
        chosen, rejected = torch.exp(aligned).chunk(2)
        return chosen * rejected
