"""A preallocated KV cache for ``NativeEngine``: one prefill per prompt shared by its samples, one slot per step."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from transformers.cache_utils import Cache, DynamicLayer


@dataclass
class PackedWrite:
    """Where a packed prefill's tokens go (``SlotCache.packed``): token ``tokens[i]`` of the packed row into cache
    row ``rows[i]``, column ``columns[i]``; the update fills ``width`` columns from the cache's current length."""

    rows: torch.Tensor
    columns: torch.Tensor
    tokens: torch.Tensor
    width: int


class SlotLayer(DynamicLayer):
    """One layer's keys and values for ``rows`` rows (``B * G``), in buffers allocated once: ``[rows, H, capacity, D]``.

    A prefill update runs on fewer rows than the cache holds (the prompts' shared prefix once, then the ``B`` prompts)
    and is written once into each of its rows' copies (a broadcast copy: the prompt's cache is shared, not recomputed);
    it attends to the slots filled so far as those rows see them. A packed prefill (``SlotCache.packed``: the
    prompts' tokens side by side in one row, no padding) scatters each token into its rows' copies instead, zeros in
    the padding columns, and attends to the first row's filled slots followed by the packed tokens. Each decode step
    then writes its position in place, and attention reads the filled prefix as a view: no concatenation, no
    attention over empty slots.
    """

    def __init__(self, rows: int, capacity: int, cache: SlotCache | None = None):
        super().__init__()
        self.rows, self.capacity, self.length, self.cache = rows, capacity, 0, cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows = self.rows
        self.device = key_states.device
        self.keys = key_states.new_empty((rows, key_states.shape[1], self.capacity, key_states.shape[3]))
        self.values = value_states.new_empty((rows, value_states.shape[1], self.capacity, value_states.shape[3]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.cache is not None and self.cache.packed_write is not None:
            return self._packed_update(key_states, value_states, self.cache.packed_write)
        start = self.length
        end = start + key_states.shape[-2]
        self.length = end
        batch = key_states.shape[0]
        if batch < self.rows:  # a prefill: each of the batch's rows copied into its rows // batch rows
            self.keys[:, :, start:end].unflatten(0, (batch, -1)).copy_(key_states.unsqueeze(1))
            self.values[:, :, start:end].unflatten(0, (batch, -1)).copy_(value_states.unsqueeze(1))
            if start == 0:
                return key_states, value_states
            every = self.rows // batch  # the batch's rows: the first of each one's copies
            return self.keys[::every, :, :end], self.values[::every, :, :end]
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _packed_update(self, key_states: torch.Tensor, value_states: torch.Tensor, write: PackedWrite):
        start = self.length
        self.length = start + write.width
        for buffer, states in ((self.keys, key_states), (self.values, value_states)):
            buffer[:, :, start:self.length].zero_()  # padding: never attended to, but finite (0 x garbage is NaN)
            buffer[write.rows, :, write.columns] = states[0].transpose(0, 1)[write.tokens]
        if start == 0:
            return key_states, value_states
        return (torch.cat([self.keys[:1, :, :start], key_states], 2),
                torch.cat([self.values[:1, :, :start], value_states], 2))

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.capacity


class SlotCache(Cache):
    """A transformers ``Cache`` of ``SlotLayer`` (created lazily, one per attention layer)."""

    def __init__(self, rows: int, capacity: int):
        self.packed_write: PackedWrite | None = None
        super().__init__(layer_class_to_replicate=partial(SlotLayer, rows, capacity, self))

    @contextmanager
    def packed(self, write: PackedWrite):
        """The updates inside (one forward) are a packed prefill's, written as ``write`` says."""
        self.packed_write = write
        try:
            yield
        finally:
            self.packed_write = None

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the cache rows ``rows`` (indices), in that order: the rows still decoding."""
        for layer in self.layers:
            layer.keys, layer.values, layer.rows = layer.keys[rows], layer.values[rows], len(rows)
