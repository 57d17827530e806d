"""Test helpers importable from tests (``from helpers import ...``) and, with ``PYTHONPATH=tests``, from a CLI run
(``--trainer.callbacks+=helpers.RecordBatches``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning as L
import torch


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """A CSVLogger ``metrics.csv`` as a list of rows, empty cells dropped, numbers parsed."""
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def metric_at(rows: list[dict[str, float]], name: str, step: int) -> float:
    """The value of ``name`` logged at ``step`` (exactly one such row)."""
    values = [r[name] for r in rows if name in r and int(r["step"]) == step]
    assert len(values) == 1, f"{name} at step {step}: {values}"
    return values[0]


class RecordBatches(L.Callback):
    """Write every training batch this rank sees to ``<out_dir>/rank<R>.json``: ``[{step, input_ids}]``.

    Args:
        out_dir: where the per-rank files go.
    """

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.seen: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append({"step": trainer.global_step, "input_ids": batch["input_ids"].tolist(),
                          "completion_mask": batch["completion_mask"].tolist()})

    def on_train_end(self, trainer, pl_module) -> None:
        out = Path(self.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
            "world_size": trainer.world_size, "batches": self.seen,
        }))


def left_padded(tokenizer, prompts):
    """Left-padded ``(prompt_ids, prompt_mask)`` of several prompt strings, as PromptDataModule collates them."""
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    return (torch.tensor([[pad] * (width - len(i)) + i for i in ids]),
            torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids]))
