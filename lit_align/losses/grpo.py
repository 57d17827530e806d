"""GRPO's pure tensor math: group-relative advantages (and GDPO's), the per-token policy terms of TRL 1.16's eight
loss types with their masks (high-entropy tokens, off-policy sequences) and KL, TRL's loss reductions, and the
sampling engine's importance weights. Their settings, checked once, are ``lit_align.losses.grpo_loss.GRPOLoss``.

Shapes: ``N`` completions (``num_generations`` consecutive ones per prompt), ``C`` completion positions.
"""

from __future__ import annotations

import math

import torch

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
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


def decoupled_advantages(per_func: torch.Tensor, weights: torch.Tensor, num_generations: int) -> torch.Tensor:
    """GDPO's advantages (TRL's ``multi_objective_aggregation: normalize_then_sum``): ``[N, F] -> [N]``.

    Each reward function's column is normalized within each group first (``(r - mean) / (std + 1e-4)``), the
    normalized columns are summed with ``weights``, and that sum is normalized over the whole batch; ``scale_rewards``
    plays no part. NaN values (a function that returned None) are left out; rows where every function did get 0.
    """
    grouped = per_func.view(-1, num_generations, per_func.shape[1])
    normalized = (grouped - grouped.nanmean(1, keepdim=True)) / (nanstd(grouped, dim=1) + 1e-4)
    summed = (normalized.view_as(per_func) * weights).nansum(1)
    summed = torch.where(per_func.isnan().all(1), torch.nan, summed)
    advantages = (summed - summed.nanmean()) / (nanstd(summed.view(1, -1), dim=1).view(()) + 1e-4)
    return advantages.nan_to_num(0.0)


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
    *,
    loss_type: str = "grpo",
    mask: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
    vespo_params: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
    token_weights: torch.Tensor | None = None,
    is_ratio: torch.Tensor | None = None,
    use_bias_correction_kl: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss (+ ``beta`` * k3 KL) of TRL's ``loss_type``: ``[N, C] -> [N, C]`` (``[N, 1]`` where
    nothing is per token), and per-token diagnostics.

    The importance weight ``w = exp(logps - old_logps)`` per token, or per sequence (``importance_sampling_level:
    sequence``, GSPO: the exp of the completion's mean log-ratio over ``mask``); ``old_logps`` None: on-policy,
    ``w = 1`` with gradient. Policy terms, ``A`` the advantage:

    - ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: ``-min(w' A, clip(w, 1 - epsilon, 1 + epsilon_high) A)``,
      ``w' = min(w, delta)`` with ``delta`` (two-sided clipping, INTELLECT-2), else ``w``;
    - ``cispo``: ``-sg(min(w, epsilon_high)) A logps`` (the weight clipped and detached, MiniMax-M1);
    - ``sapo``: ``-sigmoid(tau (w - 1)) 4 / tau A``, ``tau`` the first of ``sapo_temperatures`` where ``A > 0``, the
      second elsewhere (a soft gate instead of the clip);
    - ``vespo``: ``-phi A logps``, ``phi = vespo_gamma_weights(...)`` per sequence (no gradient), with
      ``vespo_params = (k_pos, lambda_pos, k_neg, lambda_neg)``; ``is_ratio`` (token-level sampling-engine weights)
      enters ``phi`` instead of multiplying the loss.

    The policy term is multiplied by ``token_weights`` (the off-policy and high-entropy masks) and, but for ``vespo``,
    by ``is_ratio`` (the sampling engine's importance weights); the KL ``exp(ref - logps) - (ref - logps) - 1`` is added
    after, times ``w`` with ``use_bias_correction_kl`` (DeepSeek-V3.2's unbiased KL gradient). Diagnostics: ``kl``;
    ``low_clipped``/``high_clipped`` (clip family, as TRL counts them: ``w'`` outside the band on the side where
    clipping binds), ``cispo_clipped`` (``w > epsilon_high`` with ``A > 0``), ``phi_seq`` (``vespo``).
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"unknown GRPO loss_type {loss_type!r}: expected one of {GRPO_LOSS_TYPES}")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = torch.ones_like(logps) if mask is None else mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    ratio = torch.exp(importance_log_weights(log_ratio, mask, importance_sampling_level))
    losses, info = _policy_term(loss_type, logps, log_ratio, ratio, advantages.unsqueeze(1), mask,
                                epsilon=epsilon, epsilon_high=epsilon_high, delta=delta,
                                sapo_temperatures=sapo_temperatures, vespo_params=vespo_params, is_ratio=is_ratio)
    if token_weights is not None:
        losses = losses * token_weights
    if is_ratio is not None and loss_type != "vespo":
        losses = losses * is_ratio
    if beta != 0.0:
        kl = _k3_kl(logps, ref_logps, ratio if use_bias_correction_kl else None)
        losses = losses + beta * kl
        info["kl"] = kl.detach()
    return losses, info


def importance_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``log w`` at ``importance_sampling_level``: the tokens' log-ratios ``[N, C]`` (``token``), or each
    completion's mean log-ratio over ``mask`` ``[N, 1]`` (``sequence``, GSPO)."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"unknown importance_sampling_level {level!r}: expected one of {IMPORTANCE_SAMPLING_LEVELS}")


def _policy_term(loss_type: str, logps: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor,
                 adv: torch.Tensor, mask: torch.Tensor, *, epsilon: float, epsilon_high: float, delta: float | None,
                 sapo_temperatures: tuple[float, float], vespo_params: tuple[float, float, float, float],
                 is_ratio: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss_type``'s policy term per token, ``ratio`` the importance weight ``w`` and ``adv`` the advantages
    ``[N, 1]`` (the formulas: ``grpo_token_losses``), and its diagnostics."""
    info: dict[str, torch.Tensor] = {}
    if loss_type == "cispo":
        losses = -torch.clamp(ratio, max=epsilon_high).detach() * adv * logps
        info["cispo_clipped"] = ((ratio > epsilon_high) & (adv > 0)).to(logps.dtype)
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, adv.new_tensor(sapo_temperatures[0]), adv.new_tensor(sapo_temperatures[1]))
        losses = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    elif loss_type == "vespo":
        phi = vespo_gamma_weights(adv, log_ratio.detach(), mask, is_ratio, *vespo_params)
        losses = -phi * adv * logps
        info["phi_seq"] = phi
    else:
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
        unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
        losses = -torch.min(unclipped * adv, clipped * adv)
        # counted on the delta-capped ratio, as TRL counts them
        info["low_clipped"] = ((unclipped < 1 - epsilon) & (adv < 0)).to(logps.dtype)
        info["high_clipped"] = ((unclipped > 1 + epsilon_high) & (adv > 0)).to(logps.dtype)
    return losses, info


def _k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor | None, ratio: torch.Tensor | None) -> torch.Tensor:
    """The per-token KL estimate ``exp(ref - logps) - (ref - logps) - 1`` (k3), times ``ratio`` where given
    (``use_bias_correction_kl``)."""
    if ref_logps is None:
        raise ValueError("grpo_token_losses: beta != 0 needs ref_logps")
    diff = ref_logps - logps
    kl = torch.exp(diff) - diff - 1
    return kl if ratio is None else kl * ratio


def vespo_gamma_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                        is_ratio: torch.Tensor | None = None, k_pos: float = 2.0, lambda_pos: float = 3.0,
                        k_neg: float = 3.0, lambda_neg: float = 2.0) -> torch.Tensor:
    """VESPO's per-sequence weight ``phi(w) = exp(lambda) w^k exp(-lambda w)`` (1 at ``w = 1``): ``[N, 1]``, no
    gradient.

    ``w`` is the sequence's importance ratio ``exp(sum over mask of log_ratio)`` (token log-ratios clamped to
    [-20, 20]), times the sampling engine's token weights ``is_ratio`` (their logs summed, clamped to
    [log 1e-8, 20]), ``log w`` clamped to [log 1e-8, 20]; ``(k, lambda)`` are the ``_pos`` pair where ``A >= 0``,
    else the ``_neg`` pair (lambda at least 1e-4). Non-finite weights become 0. ``advantages``: ``[N, 1]``.
    """
    with torch.no_grad():
        low = math.log(1e-8)
        seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
        if is_ratio is not None:
            seq = seq + torch.log(is_ratio).clamp(low, 20.0).sum(-1, keepdim=True)
        log_w = seq.clamp(low, 20.0)
        nonneg = advantages >= 0
        k = torch.where(nonneg, log_w.new_tensor(k_pos), log_w.new_tensor(k_neg))
        lam = torch.where(nonneg, log_w.new_tensor(lambda_pos), log_w.new_tensor(lambda_neg)).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float,
                      pool: torch.Tensor | None = None) -> torch.Tensor:
    """TRL's ``top_entropy_quantile`` (Beyond the 80/20 Rule): ``[N, C]`` bool, true on the ``mask``'s tokens whose
    entropy is at least the ``1 - quantile`` quantile of ``pool`` (default: the entropies under ``mask``; the module
    passes every rank's). Quantile 0 keeps the highest-entropy token(s) only, 1 every token."""
    values = (entropy[mask.bool()] if pool is None else pool).float()  # TRL's threshold is an fp32 quantile
    if values.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(values, 1 - quantile)
    return ((entropy * mask) >= threshold) & mask.bool()


def off_policy_mask(advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's ``off_policy_mask_threshold``): ``[N, 1]``, 0 for the
    completions with a negative advantage whose mean ``sampling_logps - logps`` (a KL estimate from the sampling policy
    over ``mask``, NaN counted as 0) exceeds ``threshold``, 1 for the others."""
    kl = (sampling_logps - logps.detach()).nan_to_num(0.0)
    mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    return ((advantages.unsqueeze(1) >= 0) | (mean_kl <= threshold)).to(logps.dtype)


def sequence_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each completion's mean of ``values`` over ``mask`` (``[N, 1]`` values: as they are), NaN where it has none
    (TRL's ``clip_ratio/low_min`` and ``high_max`` are their extremes)."""
    if values.shape[-1] == 1:
        return values.squeeze(-1)
    return (values * mask).sum(-1) / mask.sum(-1)


def masked_total(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[sum, count]`` of ``values`` over ``mask``'s tokens (``[N, 1]`` values: over the rows, as TRL's metrics take
    them): ``masked_mean``'s parts, which a metric over every rank sums before dividing (TRL's global masked mean)."""
    dtype = torch.promote_types(values.dtype, torch.float32)  # at least fp32: counts exact past 256
    if values.shape[-1] == 1 and mask.shape[-1] != 1:
        return torch.stack([values.sum().to(dtype), torch.tensor(float(values.shape[0]), dtype=dtype,
                                                                 device=values.device)])
    return torch.stack([(values * mask).sum().to(dtype), mask.sum().to(dtype)])


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask``'s tokens (``masked_total``); the entropy bonus is ``entropy_coef`` times this
    of the entropies."""
    total, count = masked_total(values, mask)
    return total / count.clamp(min=1.0)


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
    - ``dapo`` (and ``cispo``, ``vespo``): token sum / ``num_tokens``, the active tokens per step averaged over the
      whole generation round (all steps, all ranks), so every token of the round weighs the same;
    - ``luspo``: mean over sequences of each sequence's token sum (each sequence weighs its length).

    ``sapo`` reduces as ``grpo``. ``token_losses`` may be ``[N, 1]`` (sequence-level terms): the mask broadcasts it.
    """
    mask = mask.to(token_losses.dtype)
    total = (token_losses * mask).sum()
    if loss_type == "luspo":
        return (token_losses * mask).sum(-1).mean()
    if loss_type in ("grpo", "sapo"):
        return ((token_losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("aggregate_grpo_loss(loss_type='dr_grpo') needs max_completion_length")
        return total / (mask.shape[0] * max_completion_length)
    if loss_type in ("dapo", "cispo", "vespo"):
        if num_tokens is None:
            raise ValueError(f"aggregate_grpo_loss(loss_type={loss_type!r}) needs num_tokens")
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
