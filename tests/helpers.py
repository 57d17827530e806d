"""Test helpers importable from tests (``from helpers import ...``) and, with ``PYTHONPATH=tests``, from a CLI run
(``--trainer.callbacks+=helpers.RecordBatches``)."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import time
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


class SigtermAt(L.Callback):
    """Send this process a real SIGTERM during the training step at ``step`` (Lightning's handler takes it from there).

    Args:
        step: the global step whose batch receives the signal.
    """

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class HangInCheckpointWrite(L.Callback):
    """From step ``step`` on, every ``torch.save`` writes half a checkpoint's bytes, touches ``marker`` and hangs: a
    process killed then dies in the middle of a checkpoint write.

    Args:
        step: the first global step whose checkpoint write hangs.
        marker: file created once the write is half done.
    """

    def __init__(self, step: int, marker: str):
        self.step, self.marker = step, marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        real_save = torch.save

        def hanging_save(obj, f, *args, **kwargs):
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            if isinstance(f, (str, Path)):
                f = open(f, "wb")  # noqa: SIM115 - never closed: the process is killed
            f.write(data[: len(data) // 2])
            f.flush()
            Path(self.marker).touch()
            time.sleep(600)

        torch.save = hanging_save


def write_sort_rows(path: Path, n: int, kind: str) -> str:
    """``n`` sort-task rows as JSONL at ``path``: ``kind`` ``prompts`` (prompt, answer) or ``pairs`` (prompt, chosen,
    rejected); digit strings of 3-5 characters, distinct and in no order."""
    digits = [f"{(i * 7919) % 100000:05d}"[: 3 + i % 3] for i in range(n)]
    if kind == "prompts":
        rows = [{"prompt": f"sort {d}:", "answer": "".join(sorted(d))} for d in digits]
    else:
        rows = [{"prompt": f"sort {d}:", "chosen": " " + "".join(sorted(d)), "rejected": " " + d[::-1] + "0"}
                for d in digits]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
