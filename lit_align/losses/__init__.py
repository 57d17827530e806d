"""Pure tensor math of the losses: no Lightning, tensors in and tensors out, so tests and users call them directly.

``lit_align.losses.dpo``: TRL's DPO family (``dpo_loss``, its settings ``DPOLoss``, LD-DPO sums, WPO weights).
``lit_align.losses.grpo``: group advantages (and GDPO's), TRL's eight GRPO loss types, their masks and reductions.
``lit_align.losses.grpo_loss``: the GRPO loss settings (``GRPOLoss``, checked once) and the entropy coefficient's
controller (``EntropyControl``).
Token log-probs, which both take as input, come from ``lit_align.logps``.
"""

from lit_align.losses.dpo import DPO_LOSS_TYPES, DPOLoss, dpo_loss, sequence_logps, sft_nll, wpo_weights
from lit_align.losses.grpo import (
    GRPO_LOSS_TYPES,
    SCALE_REWARDS,
    aggregate_grpo_loss,
    decoupled_advantages,
    group_advantages,
    grpo_token_losses,
    high_entropy_mask,
    nanstd,
    off_policy_mask,
    vespo_gamma_weights,
)
from lit_align.losses.grpo_loss import EntropyControl, GRPOLoss

__all__ = [
    "DPO_LOSS_TYPES", "DPOLoss", "EntropyControl", "GRPOLoss", "GRPO_LOSS_TYPES", "SCALE_REWARDS",
    "aggregate_grpo_loss", "decoupled_advantages", "dpo_loss", "group_advantages", "grpo_token_losses",
    "high_entropy_mask", "nanstd", "off_policy_mask", "sequence_logps", "sft_nll", "vespo_gamma_weights",
    "wpo_weights",
]
