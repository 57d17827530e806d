"""LightningDataModules and row formats."""

from lit_align.data.base import AlignDataModule
from lit_align.data.completions import CompletionDataModule
from lit_align.data.preference import PreferenceDataModule
from lit_align.data.prompts import PromptDataModule

__all__ = ["AlignDataModule", "CompletionDataModule", "PreferenceDataModule", "PromptDataModule"]
