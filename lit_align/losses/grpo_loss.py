"""GRPO's loss settings under TRL's names, checked once (``GRPOLoss``), and the adaptive entropy coefficient's
controller (``EntropyControl``).

The formulas are in ``lit_align.losses.grpo``; ``GRPOModule`` builds one ``GRPOLoss`` from its flat options (TRL's
``GRPOConfig`` names) and calls it for each step's loss (``GRPOLoss.__call__``: TRL's ``_compute_loss``, term for
term). Refused, as TRL refuses them: unknown names. Warned about, as TRL warns: ``luspo`` without sequence-level weights, ``vespo`` with them, and sequence-level
weights under the token-summing reductions (``bnpo``, ``dr_grpo``, ``dapo``, ``cispo``). Refused beyond TRL, where a
value could only fail later or mean nothing: non-positive SAPO temperatures (they divide), a
``top_entropy_quantile`` outside [0, 1], adaptive bounds in the wrong order, negative thresholds and steps.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lit_align.errors import LitAlignError
from lit_align.losses.grpo import (
    GRPO_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS, MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS, aggregate_grpo_loss,
    grpo_token_losses, high_entropy_mask, masked_mean, off_policy_mask,
)
from lit_align.losses.settings import check_choice


@dataclass(frozen=True)
class GRPOLoss:
    """The GRPO loss settings (documented on ``GRPOModule``), with TRL's defaults."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    scale_rewards: str = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = True
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2

    def __post_init__(self) -> None:
        for name, value, allowed in (("loss_type", self.loss_type, GRPO_LOSS_TYPES),
                                     ("importance_sampling_level", self.importance_sampling_level,
                                      IMPORTANCE_SAMPLING_LEVELS),
                                     ("scale_rewards", self.scale_rewards, SCALE_REWARDS),
                                     ("multi_objective_aggregation", self.multi_objective_aggregation,
                                      MULTI_OBJECTIVE_AGGREGATIONS)):
            check_choice(name, value, allowed)
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, name) > 0:
                raise LitAlignError(f"model.{name} must be > 0 (SAPO's gate divides by it), got {getattr(self, name)}")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise LitAlignError(f"model.top_entropy_quantile must be in [0, 1] (the fraction of highest-entropy "
                                f"tokens trained on), got {self.top_entropy_quantile}")
        for name in ("off_policy_mask_threshold", "delta"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise LitAlignError(f"model.{name} must be >= 0 or null, got {getattr(self, name)}")
        if self.use_adaptive_entropy:
            if self.entropy_coef_min > self.entropy_coef_max:
                raise LitAlignError(f"model.entropy_coef_min ({self.entropy_coef_min}) must be <= "
                                    f"model.entropy_coef_max ({self.entropy_coef_max})")
            if self.entropy_coef_delta < 0:
                raise LitAlignError(f"model.entropy_coef_delta must be >= 0, got {self.entropy_coef_delta}")
        level, loss = self.importance_sampling_level, self.loss_type
        if loss == "luspo" and level != "sequence":
            warnings.warn("lit_align: loss_type 'luspo' is meant with importance_sampling_level 'sequence' (the "
                          "paper's setup)", stacklevel=3)
        if loss == "vespo" and level != "token":
            warnings.warn("lit_align: VESPO computes sequence-level weights itself; importance_sampling_level should "
                          "be 'token' (the default)", stacklevel=3)
        if level == "sequence" and loss in ("bnpo", "dr_grpo", "dapo", "cispo"):
            warnings.warn(f"lit_align: with importance_sampling_level 'sequence', {loss!r} sums per-token terms, "
                          "weighting each sequence by its length; GSPO's setup is loss_type 'grpo'", stacklevel=3)

    @property
    def entropy_bonus(self) -> bool:
        """Whether the loss subtracts ``entropy_coef`` times the mean entropy (adaptive: always, as TRL)."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    def __call__(self, logps, old_logps, advantages, mask, *, max_completion_length: int, num_tokens: float,
                 ref_logps=None, entropy=None, entropy_pool=None, sampling_logps=None, is_ratio=None,
                 entropy_coef: float = 0.0) -> StepLoss:
        """One step's loss, as TRL's ``GRPOTrainer._compute_loss``: the masks (``top_entropy_quantile`` over
        ``entropy``, its threshold from ``entropy_pool``: every rank's loss tokens' entropies; the off-policy mask
        against ``sampling_logps``, default the old log-probs), the per-token losses, their reduction, minus
        ``entropy_coef`` times the mean ``entropy`` over the trained tokens when the bonus is on."""
        mask = mask.to(logps.dtype)
        entropy_mask, token_weights = None, None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = high_entropy_mask(entropy.detach(), mask, self.top_entropy_quantile, entropy_pool)
            token_weights = entropy_mask = entropy_mask.to(logps.dtype)
        if self.off_policy_mask_threshold is not None:
            old = logps.detach() if old_logps is None else old_logps
            opsm = off_policy_mask(advantages, logps, old if sampling_logps is None else sampling_logps, mask,
                                   self.off_policy_mask_threshold)
            token_weights = opsm if token_weights is None else token_weights * opsm
        token_losses, info = grpo_token_losses(
            logps, old_logps, advantages, self.epsilon, self.epsilon_high, ref_logps, self.beta,
            loss_type=self.loss_type, mask=mask, importance_sampling_level=self.importance_sampling_level,
            delta=self.delta, sapo_temperatures=(self.sapo_temperature_pos, self.sapo_temperature_neg),
            vespo_params=(self.vespo_k_pos, self.vespo_lambda_pos, self.vespo_k_neg, self.vespo_lambda_neg),
            token_weights=token_weights, is_ratio=is_ratio, use_bias_correction_kl=self.use_bias_correction_kl)
        loss = aggregate_grpo_loss(token_losses, mask, self.loss_type, max_completion_length, num_tokens)
        policy_loss = loss.detach()
        trained = mask if entropy_mask is None else mask * entropy_mask  # the entropy bonus's tokens (TRL's)
        if self.entropy_bonus:  # a mean over the tokens, whatever the policy term's reduction
            loss = loss - entropy_coef * masked_mean(entropy, trained)
        return StepLoss(loss, policy_loss, token_losses, info, trained)


class StepLoss(NamedTuple):
    """``GRPOLoss``'s answer for one step."""

    loss: torch.Tensor  # what backward runs on
    policy_loss: torch.Tensor  # the policy term alone (TRL's ``policy_loss`` metric under an entropy bonus)
    token_losses: torch.Tensor  # [N, C] or [N, 1], before the reduction
    info: dict[str, torch.Tensor]  # grpo_token_losses' diagnostics
    trained: torch.Tensor  # [N, C] the tokens the entropy bonus averages over (the loss mask, high-entropy only)


@dataclass
class EntropyControl:
    """The entropy bonus's coefficient across steps (TRL's ``entropy_coef`` and, adaptive, Skywork-OR1's controller).

    Static: ``coef`` throughout. Adaptive: every optimizer step applies ``coef`` only if the last step's entropy
    (every rank's tokens of its accumulation window) was at most ``target``; after the step, ``coef`` moves by
    ``delta`` towards more bonus (entropy at most ``target``) or less, within ``[coef_min, coef_max]``. The first
    step applies none (no entropy measured yet).
    """

    coef: float
    adaptive: bool = False
    coef_min: float = 0.0
    coef_max: float = 1.0
    delta: float = 0.005
    target: float = 0.2
    last_entropy: float = math.inf

    @classmethod
    def from_loss(cls, loss: GRPOLoss) -> EntropyControl:
        return cls(loss.entropy_coef, loss.use_adaptive_entropy, loss.entropy_coef_min, loss.entropy_coef_max,
                   loss.entropy_coef_delta, loss.entropy_target)

    def applied(self) -> float:
        """The coefficient this step's micro-batches apply."""
        if self.adaptive and not self.last_entropy <= self.target:
            return 0.0
        return self.coef

    def step(self, entropy: float) -> None:
        """After an optimizer step whose tokens' mean entropy was ``entropy``: the next step's coefficient."""
        if not self.adaptive:
            return
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = state["coef"], state["last_entropy"]
