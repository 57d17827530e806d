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


def digit_fraction(completions, **_):
    """A reward that spreads random completions (fraction of digits), so advantages and gradients are non-zero."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


class ReplayRollouts(L.Callback):
    """Record what GRPO's sampler returns on this rank (``record_dir``), or replay recorded rounds (``replay_dir``).

    Replaying, each round's completions and rewards come from the recording of whichever rank sampled that prompt in
    that round, in the order of this run's prompts: a one-process run then trains on exactly the completions a DDP
    run sampled, so their losses can be compared (sampling itself depends on each rank's random stream).

    Args:
        record_dir: write ``<record_dir>/rank<R>.pt`` at the end of training.
        replay_dir: read every ``rank*.pt`` there and replay it instead of sampling.
    """

    def __init__(self, record_dir: str | None = None, replay_dir: str | None = None):
        self.record_dir, self.replay_dir = record_dir, replay_dir
        self.rounds: list[dict] = []

    def setup(self, trainer, pl_module, stage) -> None:
        real = pl_module.sample
        if self.replay_dir is not None:
            recorded = [torch.load(p) for p in sorted(Path(self.replay_dir).glob("rank*.pt"))]
            by_round = [{} for _ in recorded[0]]
            for rank in recorded:
                for k, rnd in enumerate(rank):
                    for i, prompt in enumerate(rnd["prompts"]):
                        by_round[k].setdefault(json.dumps(prompt), []).append({key: rnd[key][i] for key in rnd})

        def sample(sampler, batch, num_samples):
            if sampler is not pl_module.sampler:  # validation: greedy, unchanged
                return real(sampler, batch, num_samples)
            if self.replay_dir is None:
                rollout, prompts, completions, per_func = real(sampler, batch, num_samples)
                self.rounds.append({"prompts": prompts, "completions": completions, "per_func": per_func,
                                    "ids": [row[m.bool()] for row, m in zip(rollout.completion_ids,
                                                                            rollout.completion_mask)],
                                    "truncated": rollout.truncated})
                return rollout, prompts, completions, per_func
            from lit_align.generation import Rollout

            k = len(self.rounds)
            self.rounds.append(None)
            rows = [r for p in batch["prompts"] for r in by_round[k][json.dumps(p)]]
            width = max(len(r["ids"]) for r in rows)
            pad = pl_module.tokenizer.pad_token_id
            ids = torch.stack([torch.cat([r["ids"], r["ids"].new_full((width - len(r["ids"]),), pad)]) for r in rows])
            mask = torch.stack([torch.arange(width) < len(r["ids"]) for r in rows]).long()
            rollout = Rollout(ids, mask, torch.stack([r["truncated"] for r in rows]))
            return (rollout, [r["prompts"] for r in rows], [r["completions"] for r in rows],
                    torch.stack([r["per_func"] for r in rows]))

        pl_module.sample = sample

    def on_train_end(self, trainer, pl_module) -> None:
        if self.record_dir is not None:
            Path(self.record_dir).mkdir(parents=True, exist_ok=True)
            torch.save(self.rounds, Path(self.record_dir) / f"rank{trainer.global_rank}.pt")
