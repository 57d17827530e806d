"""LightningDataModules and row formats."""

from lit_align.data.base import AlignDataModule, DataSource
from lit_align.data.completions import CompletionDataModule
from lit_align.data.preference import PreferenceDataModule, RewardDataModule
from lit_align.data.prompts import PromptDataModule
from lit_align.data.unpaired import UnpairedPreferenceDataModule

__all__ = ["AlignDataModule", "DataSource", "CompletionDataModule", "PreferenceDataModule", "PromptDataModule",
           "RewardDataModule", "UnpairedPreferenceDataModule"]
