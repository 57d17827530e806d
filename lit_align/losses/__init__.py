"""Pure tensor math of the losses: no Lightning, tensors in and tensors out, so tests and users call them directly.

``lit_align.losses.distill``: on-policy distillation's generalized JSD (``generalized_jsd``), chunked through the
student's LM head (``chunked_generalized_jsd``, ``Projection``) or against a teacher's top-k (``topk_generalized_jsd``).
``lit_align.losses.dpo``: TRL's DPO family (``dpo_loss``, its settings ``DPOLoss``, LD-DPO sums, WPO weights).
``lit_align.losses.grpo``: group advantages (and GDPO's), TRL's eight GRPO loss types, their masks and reductions.
``lit_align.losses.grpo_loss``: the GRPO loss settings (``GRPOLoss``, checked once) and the entropy coefficient's
controller (``EntropyControl``).
``lit_align.losses.kto``: TRL's KTO losses (``kto_loss``, ``KTOLoss``) and the KL estimate.
``lit_align.losses.preference_free``: CPO, SimPO and AlphaPO (``cpo_loss``, ``CPOLoss``) and ORPO (``odds_ratio_loss``).
``lit_align.losses.reward``: the reward model's Bradley-Terry loss (``reward_loss``) and TRL's statistics of it.
``lit_align.losses.settings``: the checks the settings above share (one of a list, a value > 0), worded alike.
Token log-probs, which all but the reward model's take as input, come from ``lit_align.logps``.
"""

from lit_align.losses.distill import (
    DISTILL_REDUCTIONS,
    Projection,
    chunked_generalized_jsd,
    generalized_jsd,
    topk_generalized_jsd,
)
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
from lit_align.losses.kto import KTO_LOSS_TYPES, KTOLoss, kl_estimate, kto_loss
from lit_align.losses.preference_free import CPO_LOSS_TYPES, CPOLoss, cpo_loss, odds_ratio_loss
from lit_align.losses.reward import reward_loss, reward_metrics

__all__ = [
    "CPO_LOSS_TYPES", "CPOLoss", "DISTILL_REDUCTIONS", "DPO_LOSS_TYPES", "DPOLoss", "EntropyControl", "GRPOLoss",
    "GRPO_LOSS_TYPES", "KTO_LOSS_TYPES", "KTOLoss", "Projection", "SCALE_REWARDS", "aggregate_grpo_loss",
    "chunked_generalized_jsd", "cpo_loss", "decoupled_advantages", "dpo_loss", "generalized_jsd", "group_advantages",
    "grpo_token_losses", "high_entropy_mask", "kl_estimate", "kto_loss", "nanstd", "odds_ratio_loss",
    "off_policy_mask", "reward_loss", "reward_metrics", "sequence_logps", "sft_nll", "topk_generalized_jsd",
    "vespo_gamma_weights", "wpo_weights",
]
