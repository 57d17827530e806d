"""LightningModules: what each recipe computes in ``training_step``."""

from lit_align.modules.base import AlignModule
from lit_align.modules.cpo import CPOModule
from lit_align.modules.distill import DistillationModule
from lit_align.modules.dpo import DPOModule
from lit_align.modules.grpo import GRPOModule
from lit_align.modules.kto import KTOModule
from lit_align.modules.orpo import ORPOModule
from lit_align.modules.reward import RewardModule
from lit_align.modules.rloo import RLOOModule
from lit_align.modules.sft import SFTModule

__all__ = ["AlignModule", "CPOModule", "DistillationModule", "DPOModule", "GRPOModule", "KTOModule", "ORPOModule",
           "RewardModule", "RLOOModule", "SFTModule"]
