"""Precomputed reference log-probs: one no-grad pass of the reference before training, cached on disk.

The pass runs in ``DPOModule.configure_model``: after the DataModule has tokenized its rows and before a checkpoint
is restored into the policy, so the reference it sees is the initial one. Each row of the train and validation data
gets ``ref_chosen_logps`` / ``ref_rejected_logps`` columns (``collate_pairs`` puts them in the batch, and the step
then runs no reference), and the reference is freed before training starts.

The cache is ``$LIT_ALIGN_CACHE/ref_logps/<key>.pt`` (``[rows, 2]`` float32). The key hashes everything the numbers
depend on: the rows' token ids in order (a content hash, not ``datasets``' ``_fingerprint``, which turns random when a
map function cannot be hashed, so it covers the tokenizer, chat template and prompt handling), ``max_length`` (the
batch truncates), the reference's files (``config.json`` and weights, hashed by content; a hub model's from its local
snapshot), its ``dtype`` and attention implementation, the trainer's precision and the sequence layout
(``share_prompt``). A later run with the same key loads the file and runs no reference at all.

Under DDP every rank computes its share of the rows (``rank::world_size``), the shares are all-gathered, and rank 0
writes the file; whether the cache holds the key is rank 0's decision, broadcast to the others.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow.compute as pc
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lit_align.errors import LitAlignError
from lit_align.models import cache_dir, resolve

TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def rows_fingerprint(dataset) -> str:
    """SHA-256 of the token ids of every row, in dataset order (lengths included, so rows cannot run together)."""
    table = dataset.with_format("arrow")[:]
    h = hashlib.sha256()
    for name in TOKEN_COLUMNS:
        column = table.column(name).combine_chunks()
        h.update(name.encode())
        h.update(np.asarray(pc.list_value_length(column), dtype=np.int64).tobytes())
        h.update(np.asarray(column.flatten(), dtype=np.int64).tobytes())
    return h.hexdigest()


def model_files_hash(name: str) -> str:
    """SHA-256 of a model's ``config.json`` and weight files: a local directory's, or a hub model's local snapshot."""
    path = Path(resolve(name)).expanduser()
    if not path.is_dir():
        from transformers.utils import cached_file

        config = cached_file(name, "config.json")
        if config is None:
            raise LitAlignError(f"precompute_ref_log_probs: cannot find the files of model {name!r} to key the cache")
        path = Path(config).parent
    files = sorted(p for p in path.iterdir() if p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES))
    h = hashlib.sha256()
    for file in files:
        h.update(file.name.encode())
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def cache_key(dataset, **settings) -> str:
    """The cache key of ``dataset``'s reference log-probs under ``settings`` (plain JSON values)."""
    blob = json.dumps({"rows": rows_fingerprint(dataset), **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cache_path(key: str) -> Path:
    return cache_dir() / "ref_logps" / f"{key}.pt"


def compute(dataset, collate, batch_size: int, pair_logps: Callable, device: torch.device, strategy) -> torch.Tensor:
    """``[rows, 2]`` reference log-probs (chosen, rejected), this rank's rows computed, all ranks' gathered."""
    rank, world = strategy.global_rank, strategy.world_size
    shard = dataset.select(range(rank, len(dataset), world)) if world > 1 else dataset
    loader = DataLoader(shard, batch_size=batch_size, shuffle=False, collate_fn=collate)
    values = []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items() if k not in REF_COLUMNS}
        with torch.no_grad():
            chosen, rejected = pair_logps(batch)
        values.append(torch.stack([chosen, rejected], 1).float())
    values = torch.cat(values) if values else torch.zeros(0, 2, device=device)
    if world == 1:
        return values.cpu()
    per_rank = math.ceil(len(dataset) / world)
    padded = torch.zeros(per_rank, 2, device=device)
    padded[: len(values)] = values
    gathered = strategy.all_gather(padded)  # [world, per_rank, 2]; row r + world * k is gathered[r, k]
    return gathered.permute(1, 0, 2).reshape(-1, 2)[: len(dataset)].cpu()


def attach(dataset, values: torch.Tensor):
    """``dataset`` with the ``ref_chosen_logps`` / ``ref_rejected_logps`` columns added."""
    for i, name in enumerate(REF_COLUMNS):
        dataset = dataset.add_column(name, values[:, i].tolist())
    return dataset


def precompute(datasets: dict, collate, pair_logps: Callable, load_reference: Callable, settings: dict, strategy,
               device: torch.device) -> dict:
    """Reference log-prob columns for each of ``datasets`` (``{split: (Dataset, batch size)}``), from the cache or
    from one pass.

    ``load_reference()`` is a context manager giving the reference, entered only on a cache miss and left (the
    reference freed) right after the pass. ``pair_logps(model, batch)`` returns ``(chosen, rejected)`` summed
    log-probs. Returns ``{split: Dataset}``.
    """
    out, missing = {}, {}
    for split, (dataset, batch_size) in datasets.items():
        path = cache_path(cache_key(dataset, **settings))
        hit = strategy.broadcast(path.exists(), src=0)
        if hit:
            values = torch.load(path, map_location="cpu", weights_only=True)
            if values.shape != (len(dataset), 2):
                raise LitAlignError(f"reference log-prob cache {path} holds {tuple(values.shape)}, expected "
                                    f"({len(dataset)}, 2): delete it")
            rank_zero_info(f"lit_align: reference log-probs for {split} ({len(dataset)} rows) read from {path}")
            out[split] = attach(dataset, values)
        else:
            missing[split] = (dataset, batch_size, path)
    if not missing:
        return out
    with load_reference() as model:
        for split, (dataset, batch_size, path) in missing.items():
            rank_zero_info(f"lit_align: computing reference log-probs for {split} ({len(dataset)} rows, "
                           f"batch size {batch_size})")
            values = compute(dataset, collate, batch_size, lambda batch: pair_logps(model, batch), device, strategy)
            if strategy.global_rank == 0:
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
                torch.save(values, partial)
                os.replace(partial, path)  # atomic: a reader sees the whole file or none
            out[split] = attach(dataset, values)
    return out
