"""Host memory of CPU training under glibc: freed heap kept out of a step's peak RSS (``model.mmap_activations``).

glibc serves allocations from its heap and keeps what is freed there for the next ones. A training forward allocates,
layer after layer, activations kept for backward between temporaries freed at once; later requests split the freed
blocks and small long-lived objects settle between them, so the heap fills with holes the next tensors do not fit,
and grows: on SmolLM2-135M a GRPO step's peak RSS carried 0.6-0.9 GB of freed heap
(``bench/memory_phases.py --recipe grpo``).

``mapped_forward`` changes two things for a training step's forward (from the step's start to its backward; GRPO's
sampling too, at a round's first step):

- glibc's mmap threshold: a request of at least ``M_MMAP_THRESHOLD`` that the heap's free blocks cannot hold gets a
  mapping of its own instead of a larger heap, returned to the system when freed. During the forward it is
  ``FORWARD_THRESHOLD`` (1 MiB): the forward fills the heap's free blocks and maps the rest, so the heap does not
  grow with the activations. From backward on it is ``HEAP_THRESHOLD``, where glibc's own adaptive threshold ends
  (the trim threshold at twice that, as glibc sets it there).
- at the start and at the end of the forward ``malloc_trim`` hands the pages of the heap's free blocks back to the
  system (the blocks stay; a page comes back when it is written again): what the previous step's backward and
  optimizer step freed is not resident under the forward's activations.

The price is page faults, one per 4 KiB page mapped or handed back and then written: on that model about 0.35M more
a step, some 5% of a training step's CPU time. Setting the threshold turns glibc's adaptation off for the rest of the
process. Elsewhere (macOS, Windows, musl) nothing changes. Values never depend on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
FORWARD_THRESHOLD = 1 << 20  # the forward's tensors of 1 MiB and more get mappings of their own
HEAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems: its adaptive threshold's ceiling


@cache
def _glibc():
    """The C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_forward_mapped = False  # whether the thresholds are the forward's (process-wide, as glibc's settings are)


def mapped_forward(active: bool) -> bool:
    """Start (``active``) or end the forward's own mappings: glibc's ``M_MMAP_THRESHOLD`` at ``FORWARD_THRESHOLD``,
    else ``HEAP_THRESHOLD`` (its ``M_TRIM_THRESHOLD`` at twice that, either way); at the start and at the end of a
    forward, first the pages of the heap's free blocks back to the system (``malloc_trim``). Whether glibc is there
    to take them."""
    global _forward_mapped
    libc = _glibc()
    if libc is None:
        return False
    if _forward_mapped != active:
        libc.malloc_trim(0)
    _forward_mapped = active
    libc.mallopt(M_MMAP_THRESHOLD, FORWARD_THRESHOLD if active else HEAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, 2 * HEAP_THRESHOLD)
    return True
