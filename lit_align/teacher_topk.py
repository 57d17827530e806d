"""Distillation's teacher top-k cache (``model.teacher_topk_cache: k``): the teacher's top-k next-token log-probs at
every token of the dataset's completions, computed once per dataset and kept on disk.

A round that trains on the dataset's ``completion`` column (``lmbda < 1`` without ``seq_kd``) meets the same
completions every epoch, and the teacher's distributions on them never change. With the cache, the module's
``setup`` hands ``TeacherTopK.annotate`` to the data (``PromptDataModule.add_teacher_topk``), as DPO's precomputed
reference does: every training row gets its completion's ``[tokens, k]`` top-k ids and log-probs (columns
``teacher_topk_ids`` / ``teacher_topk_logps``, flattened), from the cache or from one no-grad pass of the teacher; a
dataset round then carries them (``round_topk``), and its loss is ``topk_generalized_jsd`` against them, no teacher
forward. The student's own samples (on-policy rounds) and validation still run the teacher.

The values: the teacher's log-softmax at ``model.temperature`` (the loss's), in fp32, its k largest entries per
position, over each row's whole completion (a round cuts them to ``max_completion_length``, as it cuts the
completion: the teacher is causal, a prefix's values are the whole's). The cache is
``$LIT_ALIGN_CACHE/teacher_topk/<key>.pt`` (``{"ids": [T, k] int32, "logps": [T, k] float32, "lengths": [rows]}``,
rows in dataset order), verified as the reference cache is (``lit_align.reference.verified_cache``: the SHA-256 of
its bytes beside it; a file that does not verify is reported and computed again). The key hashes the rows' prompt
and completion token ids, the teacher's files (``Teacher.identity``) and ``from_pretrained`` arguments, ``dtype``,
attention implementation, the trainer's precision, the sequence layout (``padding_free``), ``temperature`` and k.
Under DDP every rank runs the teacher over its share of the rows (``rank::world_size``), the shares are gathered,
rank 0 writes the file; whether the cache holds the key is rank 0's decision, broadcast.

Left out, and why: several teachers (``teacher_model`` a mapping; refused with the option), and the validation rows
(validation scores the student's own completions).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.utils.rnn import pad_sequence

from lit_align.data.prompts import TOPK_COLUMNS
from lit_align.errors import LitAlignError
from lit_align.logps import Projection, compute_dtype
from lit_align.reference import cache_key, cache_path, verified_cache, write_cache
from lit_align.rollouts import repeat_each

TOPK_CHUNK_LOGITS = 2**24  # logits per chunk of positions in the pass (positions x vocabulary)


class TopK(NamedTuple):
    """A teacher known by its top-k: ids and log-probs ``[..., k]``, the same positions in both."""

    ids: torch.Tensor
    logps: torch.Tensor


class TeacherTopK:
    """The teacher's top-k on the dataset's completions, for the rounds that train on them.

    Args:
        k: log-probs kept per position (at most the vocabulary's size, which gives the full divergence).
    """

    def __init__(self, k: int):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise LitAlignError(f"model.teacher_topk_cache must be a number of log-probs per token >= 1 or null, "
                                f"got {k!r}")
        self.k = k
        self.computed: list[str] = []  # the splits this process ran the teacher over (the others: from the cache)

    def annotate(self, module, rows, split: str, batch_size: int):
        """``rows`` with their completion's top-k columns: from the cache, or from one pass of the teacher.

        ``module`` (a ``DistillationModule``, which hands this to its data from ``setup``) supplies the teacher
        (loaded here, once: the run keeps it for on-policy rounds and validation) and how its outputs are laid out
        (``outputs``, the function training uses); ``batch_size`` (rows per forward) is the data's.
        """
        if TOPK_COLUMNS[0] in rows.column_names:  # an earlier pass's
            return rows
        if "completion_ids" not in rows.column_names:
            raise LitAlignError("model.teacher_topk_cache caches the teacher on the dataset's completions, but the "
                                f"{split} rows have no 'completion' column; give each row its 'completion' or drop "
                                "model.teacher_topk_cache")
        trainer, strategy, teacher = module.trainer, module.trainer.strategy, module.teacher
        teacher.setup(module)  # loads it and reads its files' identity (once)
        vocab = teacher.model.config.get_text_config().vocab_size
        if self.k > vocab:
            raise LitAlignError(f"model.teacher_topk_cache is {self.k}, more than the teacher's vocabulary "
                                f"({vocab} tokens); at most {vocab} (which keeps the whole distribution)")
        hp = module.hparams
        path = cache_path(cache_key(rows, ("prompt_ids", "completion_ids"), teacher=teacher.identity,
                                    teacher_init_kwargs=teacher.init_kwargs, dtype=hp.dtype,
                                    attn_implementation=hp.attn_implementation, precision=str(trainer.precision),
                                    padding_free=module.padding_free, temperature=module.temperature, k=self.k),
                          "teacher_topk")
        lengths = [len(ids) for ids in rows["completion_ids"]]
        check = cache_check(lengths, self.k)
        verified = verified_cache(path, check, "teacher top-k log-prob") if trainer.is_global_zero else None
        if strategy.broadcast(verified, src=0):
            values = torch.load(path, map_location="cpu", weights_only=True)
            rank_zero_info(f"lit_align: the teacher's top-{self.k} log-probs for {split} ({len(rows)} rows) read "
                           f"from {path}")
            return attach_topk(rows, values)
        rank_zero_info(f"lit_align: computing the teacher's top-{self.k} log-probs for {split} ({len(rows)} rows, "
                       f"batch size {batch_size})")
        device = strategy.root_device
        teacher.model.to(device)

        def topk(sequences: tuple) -> TopK:
            with torch.no_grad(), trainer.precision_plugin.train_step_context():  # autocast as in training_step
                return topk_logps(module.outputs(teacher.model, sequences), self.k, module.temperature)

        values = compute_topk(rows, lengths, topk, batch_size, device, strategy)
        self.computed.append(split)
        if strategy.global_rank == 0:
            write_cache(path, values, "teacher top-k log-prob")
        return attach_topk(rows, values)


def topk_logps(outputs: Projection | torch.Tensor, k: int, temperature: float) -> TopK:
    """``[S, k]``: the k largest log-probs of the tempered distribution at each of ``layout_outputs``' ``[S, ...]``
    positions and their ids, through the head a chunk of positions at a time (in fp32, fp64 for fp64)."""
    vocab = outputs.weight.shape[0] if isinstance(outputs, Projection) else outputs.shape[-1]
    chunk = max(1, TOPK_CHUNK_LOGITS // vocab)
    ids, logps = [], []
    for s in range(0, len(outputs.hidden if isinstance(outputs, Projection) else outputs), chunk):
        if isinstance(outputs, Projection):
            logits = outputs._replace(hidden=outputs.hidden[s : s + chunk]).logits()
        else:
            logits = outputs[s : s + chunk]
        top = logits.to(compute_dtype(logits.dtype)).div(temperature).log_softmax(-1).topk(k)
        ids.append(top.indices)
        logps.append(top.values)
    return TopK(torch.cat(ids), torch.cat(logps))


def compute_topk(rows, lengths: list[int], topk, batch_size: int, device: torch.device,
                 strategy) -> dict[str, torch.Tensor]:
    """The cache's values for ``rows`` (``lengths``: their completions' tokens), in dataset order: this rank's rows
    (``rank::world_size``) run through ``topk(sequences)`` ``batch_size`` at a time (padded with id 0, which the
    masks leave out), every rank's gathered."""
    rank, world = strategy.global_rank, strategy.world_size
    mine = list(range(rank, len(rows), world))
    parts = []
    for start in range(0, len(mine), batch_size):
        batch = rows.select(mine[start : start + batch_size])
        prompts = [torch.tensor(ids, dtype=torch.long) for ids in batch["prompt_ids"]]
        completions = [torch.tensor(ids, dtype=torch.long) for ids in batch["completion_ids"]]
        prompt_ids = pad_sequence([p.flip(0) for p in prompts], batch_first=True).flip(1)
        prompt_mask = pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True).flip(1)
        completion_ids = pad_sequence(completions, batch_first=True)
        completion_mask = pad_sequence([torch.ones_like(c) for c in completions], batch_first=True)
        sequences = tuple(t.to(device) for t in (prompt_ids, prompt_mask, completion_ids, completion_mask))
        parts.append(topk(sequences))  # the completion tokens row by row: this batch's rows' values, flat
    k = parts[0].ids.shape[1] if parts else 0
    ids = torch.cat([p.ids for p in parts]).to(torch.int32) if parts else torch.zeros(0, k, dtype=torch.int32)
    logps = torch.cat([p.logps for p in parts]).float() if parts else torch.zeros(0, k)
    if world > 1:
        ids, logps = gather_rows(ids.to(device), logps.to(device), lengths, strategy)
    return {"ids": ids.cpu(), "logps": logps.cpu(), "lengths": torch.tensor(lengths, dtype=torch.long)}


def gather_rows(ids: torch.Tensor, logps: torch.Tensor, lengths: list[int], strategy):
    """Every rank's ``[T_rank, k]`` values (its rows ``rank::world_size``, flat), all-gathered and put back in
    dataset order."""
    world = strategy.world_size
    totals = [sum(lengths[r::world]) for r in range(world)]
    width = max(totals)
    k = ids.shape[1]
    padded = [torch.cat([t, t.new_zeros(width - len(t), k)]) for t in (ids, logps.float())]
    gathered = [strategy.all_gather(t) for t in padded]  # [world, width, k] each
    per_rank = [[g[r, : totals[r]].split(lengths[r::world]) for r in range(world)] for g in gathered]
    order = [(row % world, row // world) for row in range(len(lengths))]
    return tuple(torch.cat([parts[r][i] for r, i in order]) if order else g[0, :0]
                 for parts, g in zip(per_rank, gathered))


def cache_check(lengths: list[int], k: int):
    """``verified_cache``'s check: the file holds the top-k of these rows' completions (``lengths`` tokens each)."""
    total = sum(lengths)

    def check(values: Any) -> str | None:
        if not isinstance(values, dict) or set(values) != {"ids", "logps", "lengths"}:
            return "it is not a teacher top-k cache (expected ids, logps and lengths)"
        if values["lengths"].tolist() != lengths:
            return f"its rows' completion lengths are not the {len(lengths)} rows' of the dataset"
        for name in ("ids", "logps"):
            if tuple(values[name].shape) != (total, k):
                return f"its {name} hold {tuple(values[name].shape)}, expected ({total}, {k})"
        return None

    return check


def attach_topk(rows, values: dict[str, torch.Tensor]):
    """``rows`` with the ``teacher_topk_ids`` / ``teacher_topk_logps`` columns: each row's ``[tokens, k]`` values,
    flattened (Arrow lists built from the flat arrays, no Python lists)."""
    k = values["ids"].shape[1]
    offsets = pa.array(np.concatenate([[0], np.cumsum(values["lengths"].numpy())]) * k, type=pa.int64())
    for name, key in zip(TOPK_COLUMNS, ("ids", "logps")):
        flat = pa.array(values[key].reshape(-1).numpy())
        rows = rows.add_column(name, pa.LargeListArray.from_arrays(offsets, flat))
    return rows


def round_topk(batch: dict[str, Any], num: int, limit: int, k: int, device: torch.device) -> TopK:
    """``[N, C, k]``: the cached top-k of a round of the dataset's completions (each prompt's ``num`` times, cut to
    ``limit`` tokens, right-padded with id 0 and log-prob 0, which the loss never reads), as
    ``DistillationModule.dataset_generation`` lays out the completions."""
    if TOPK_COLUMNS[0] not in batch:
        raise LitAlignError("model.teacher_topk_cache: a batch came without the teacher's top-k log-probs (rows set "
                            "up after the cache was attached?)")
    ids, logps = ([torch.as_tensor(row, dtype=dtype).view(-1, k)[:limit] for row in repeat_each(batch[name], num)]
                  for name, dtype in zip(TOPK_COLUMNS, (torch.long, torch.float32)))
    return TopK(pad_sequence(ids, batch_first=True).to(device), pad_sequence(logps, batch_first=True).to(device))
