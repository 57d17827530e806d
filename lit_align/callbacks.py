"""When things happen: Lightning Callbacks only (what is computed lives in the modules)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lit_align.errors import LitAlignError
from lit_align.strategies import full_policy_state_dict


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
        if not self.enabled:
            return
        target = Path(self.path) if self.path else run_dir(trainer) / self.dirname  # every rank: log_dir broadcasts
        if target.exists() and not (target / "config.json").exists():
            raise LitAlignError(f"export path {target} exists and is not a Hugging Face model directory; "
                                "refusing to replace it (choose another export.path)")
        state_dict = full_policy_state_dict(trainer, pl_module.policy)  # every rank: gathers sharded weights
        if not trainer.is_global_zero:
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        pl_module.export(staging, state_dict=state_dict)
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


class CompletionsLogger(L.Callback):
    """Every ``every_n_steps`` optimizer steps, write the latest generation round's prompts, completions and rewards.

    Rows go to ``<run dir>/completions.csv`` (columns: step, prompt, completion, reward), and to the logger's table
    when it has one (``WandbLogger.log_table``). Works with any module exposing a ``round`` buffer with a ``log``
    entry (GRPOModule).

    Args:
        every_n_steps: cadence in optimizer steps.
        max_rows: rows written per round at most.
    """

    def __init__(self, every_n_steps: int = 10, max_rows: int = 16):
        self.every_n_steps, self.max_rows = every_n_steps, max_rows
        self._last_step: int | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        buffer = getattr(pl_module, "round", None)
        step = trainer.global_step  # optimizer steps done; 0 until the first one (gradient accumulation)
        if not trainer.is_global_zero or buffer is None or step == 0 or step % self.every_n_steps:
            return
        if self._last_step == trainer.global_step:  # several batches per step under gradient accumulation
            return
        self._last_step = trainer.global_step
        log = buffer["log"]
        rows = list(zip(log["prompts"], log["completions"], log["rewards"]))[: self.max_rows]
        path = run_dir(trainer) / "completions.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["step", "prompt", "completion", "reward"])
            writer.writerows([trainer.global_step, str(p), c, r] for p, c, r in rows)
        for logger in trainer.loggers:
            if hasattr(logger, "log_table"):
                logger.log_table(key="completions", columns=["step", "prompt", "completion", "reward"],
                                 data=[[trainer.global_step, str(p), c, r] for p, c, r in rows])
