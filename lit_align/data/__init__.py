"""LightningDataModules and row formats."""

from lit_align.data.base import AlignDataModule
from lit_align.data.preference import PreferenceDataModule

__all__ = ["AlignDataModule", "PreferenceDataModule"]
