"""When things happen: Lightning Callbacks only (what is computed lives in the modules)."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_info


def run_dir(trainer: L.Trainer) -> Path:
    """The run's directory: the logger's version directory, or ``default_root_dir`` without a logger."""
    return Path(trainer.log_dir or trainer.default_root_dir)


class HFExport(L.Callback):
    """At the end of fit, write the policy and tokenizer as a Hugging Face model directory.

    The directory is ``<run dir>/<dirname>`` (e.g. ``runs/dpo/version_0/hf_model``) unless ``path`` is given. It is
    written beside its final place and renamed in, so an interrupted export never leaves a half-written model where a
    complete one stood.

    Args:
        dirname: directory name inside the run directory.
        path: an explicit output directory instead (overwritten if it exists).
        enabled: set false to skip the export.
    """

    def __init__(self, dirname: str = "hf_model", path: str | None = None, enabled: bool = True):
        self.dirname, self.path, self.enabled = dirname, path, enabled
        self.exported_to: Path | None = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled or not trainer.is_global_zero:
            return
        target = Path(self.path) if self.path else run_dir(trainer) / self.dirname
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        pl_module.export(staging)
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            staging.rename(target)
            shutil.rmtree(old)
        else:
            staging.rename(target)
        self.exported_to = target
        rank_zero_info(f"lit_align: exported the Hugging Face model to {target}")
