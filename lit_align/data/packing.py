"""Packing SFT rows: several sequences in one row, without attention between them (TRL's ``packing``).

A packed row holds whole sequences back to back and lists their lengths (``seq_lengths``); its batch carries
``position_ids`` that restart at every sequence and ``segment_ids`` that tell them apart, and the forward masks
attention block-causally (``lit_align.layouts.segments``). Every token then sees exactly the context it has alone, so
the loss over the same sequences is the one an unpacked batch gives (to float rounding), and no position is padding.

- ``bfd`` (best-fit decreasing, TRL's default): sequences (each cut to ``max_length``) go, longest first, into the
  row whose free space fits them most tightly; a sequence is never split.
- ``wrapped``: all sequences, whole (nothing is cut before packing, as in TRL), back to back, cut every ``max_length``
  tokens; a sequence cut at a row's end goes on at the next row's start (positions restart there), as classic
  language-model packing does.

Making each batch one row instead (``model.padding_free``) is the module's layout choice: ``lit_align.layouts.sft``.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

import torch

PACKING_STRATEGIES = ("bfd", "wrapped")
KEYS = ("input_ids", "completion_mask", "assistant_mask")


class _FreeSpace:
    """Open bins by free space: ``pop_at_least(n)`` takes a bin with the least free space >= ``n`` (best fit). Free
    spaces are integers up to the capacity, so the sorted list of those in use stays short."""

    def __init__(self):
        self.spaces: list[int] = []  # sorted, each with at least one bin
        self.bins: dict[int, list[int]] = {}

    def push(self, space: int, bin_id: int) -> None:
        if not self.bins.get(space):
            bisect.insort(self.spaces, space)
        self.bins.setdefault(space, []).append(bin_id)

    def pop_at_least(self, need: int) -> tuple[int, int] | None:
        """``(space, bin)`` with the smallest free space >= ``need``, removed; None if no bin has room."""
        j = bisect.bisect_left(self.spaces, need)
        if j == len(self.spaces):
            return None
        space = self.spaces[j]
        bin_id = self.bins[space].pop()
        if not self.bins[space]:
            del self.spaces[j]
        return space, bin_id


def present_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The ``KEYS`` every row has in full (``assistant_mask`` is empty on rows that are not chats)."""
    return [k for k in KEYS if all(len(r.get(k) or []) == len(r["input_ids"]) for r in rows)]


def bfd_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity`` by best-fit decreasing."""
    free = _FreeSpace()
    bins: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        found = free.pop_at_least(lengths[index])
        if found is None:
            space, bin_id = capacity, len(bins)
            bins.append([])
        else:
            space, bin_id = found
        bins[bin_id].append(index)
        if space - lengths[index] > 0:
            free.push(space - lengths[index], bin_id)
    return bins


def pack(rows: list[dict[str, list[int]]], max_length: int, strategy: str = "bfd") -> list[dict[str, list[int]]]:
    """Packed rows (``KEYS`` concatenated, plus ``seq_lengths``) from tokenized SFT rows."""
    keys = present_keys(rows)
    index = [r.get("row", i) for i, r in enumerate(rows)]  # each packed row lists the dataset rows in it (``rows``)
    if strategy == "bfd":
        rows = [{k: r[k][:max_length] for k in keys} for r in rows]
        return [{**{k: [t for i in b for t in rows[i][k]] for k in keys},
                 "seq_lengths": [len(rows[i]["input_ids"]) for i in b], "rows": [index[i] for i in b]}
                for b in bfd_bins([len(r["input_ids"]) for r in rows], max_length)]
    flat = {k: [t for r in rows for t in r[k]] for k in keys}
    ends = list(itertools.accumulate(len(r["input_ids"]) for r in rows))
    out = []
    for start in range(0, len(flat["input_ids"]), max_length):
        stop = min(start + max_length, len(flat["input_ids"]))
        cuts = [start, *(e for e in ends if start < e < stop), stop]
        first = bisect.bisect_right(ends, start)  # the sequence the row starts in
        out.append({**{k: v[start:stop] for k, v in flat.items()},
                    "seq_lengths": [b - a for a, b in zip(cuts, cuts[1:])],
                    "rows": index[first : first + len(cuts) - 1]})
    return out


def collate_packed(rows: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """A batch of packed rows (``seq_lengths``): right-padded ``input_ids``, ``attention_mask``, the masks,
    ``position_ids`` (0 at each sequence's start) and ``segment_ids`` (which sequence of the row; -1 on padding)."""
    keys = present_keys(rows)
    width = max(len(r["input_ids"]) for r in rows)
    batch = {k: torch.zeros(len(rows), width, dtype=torch.long) for k in keys}
    batch["input_ids"].fill_(pad_token_id)
    batch["attention_mask"] = torch.zeros(len(rows), width, dtype=torch.long)
    batch["position_ids"] = torch.zeros(len(rows), width, dtype=torch.long)
    batch["segment_ids"] = torch.full((len(rows), width), -1, dtype=torch.long)
    for n, row in enumerate(rows):
        length = len(row["input_ids"])
        for k in keys:
            batch[k][n, :length] = torch.tensor(row[k])
        batch["attention_mask"][n, :length] = 1
        batch["position_ids"][n, :length] = torch.cat([torch.arange(s) for s in row["seq_lengths"]])
        batch["segment_ids"][n, :length] = torch.repeat_interleave(torch.arange(len(row["seq_lengths"])),
                                                                   torch.tensor(row["seq_lengths"]))
    if "rows" in rows[0]:
        batch["dataset_rows"] = torch.tensor([i for row in rows for i in row["rows"]])
    return batch
