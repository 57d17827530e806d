"""Pure tensor math of the losses: no Lightning, tensors in and tensors out, so tests and users call them directly.

``lit_align.losses.dpo``: TRL's DPO family (``dpo_loss``, its settings ``DPOLoss``, LD-DPO sums, WPO weights).
``lit_align.losses.grpo``: group advantages, the clipped surrogate, TRL's GRPO loss aggregations.
``lit_align.losses.reward``: the reward model's Bradley-Terry loss (``reward_loss``) and TRL's statistics of it.
Token log-probs, which the DPO and GRPO losses take as input, come from ``lit_align.logps``.
"""

from lit_align.losses.dpo import DPO_LOSS_TYPES, DPOLoss, dpo_loss, sequence_logps, sft_nll, wpo_weights
from lit_align.losses.grpo import (
    GRPO_LOSS_TYPES,
    SCALE_REWARDS,
    aggregate_grpo_loss,
    group_advantages,
    grpo_token_losses,
    nanstd,
)
from lit_align.losses.reward import reward_loss, reward_metrics

__all__ = [
    "DPO_LOSS_TYPES", "DPOLoss", "GRPO_LOSS_TYPES", "SCALE_REWARDS", "aggregate_grpo_loss", "dpo_loss",
    "group_advantages", "grpo_token_losses", "nanstd", "reward_loss", "reward_metrics", "sequence_logps", "sft_nll",
    "wpo_weights",
]
