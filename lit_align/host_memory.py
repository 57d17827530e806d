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
process.

``release_mapped`` (Linux) does the same for a frozen model whose weights are its files' pages (safetensors are
mapped, not copied, when the dtype is the checkpoint's): once its forward is done, ``madvise(MADV_DONTNEED)`` takes
those pages out of the process's resident set; they stay in the page cache, which the system can reclaim without
writing anything, and the next forward maps them again from there (about 10 ms per 100 MB here). Distillation's
teacher (after its forward in each step) and a named reference (before backward) are released so:
SmolLM2-135M's teacher is 513 MiB that the student's forward and backward no longer hold. Elsewhere (macOS, Windows,
musl) nothing changes. Values never depend on any of it.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import sys
from functools import cache

import torch

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
        libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
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


MADV_DONTNEED = 4  # Linux's mman.h
PAGE = 4096
_SWAPPED, _FILE = 1 << 62, 1 << 61  # /proc/<pid>/pagemap's bits for a page (63, present: the sign bit)


def _file_mappings() -> tuple[list[int], list[int]]:
    """The starts and ends of this process's mappings of files (``/proc/self/maps``: those with an inode), sorted."""
    starts, ends = [], []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) >= 5 and fields[4] != "0":
                start, end = fields[0].split("-")
                starts.append(int(start, 16))
                ends.append(int(end, 16))
    return starts, ends


def _unwritten(start: int, end: int) -> bool:
    """Whether no page of the file mapping ``[start, end)`` was written since it was mapped: every page resident or
    swapped is the file's own (``/proc/self/pagemap``), none a private copy. False where that cannot be read."""
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(start // PAGE * 8)
            entries = torch.frombuffer(bytearray(pagemap.read((end - start) // PAGE * 8)), dtype=torch.int64)
    except OSError:
        return False
    used = (entries < 0) | (entries & _SWAPPED).ne(0)
    return not bool((used & (entries & _FILE).eq(0)).any())


def release_mapped(module: torch.nn.Module) -> int:
    """Hand the resident pages of the files ``module``'s tensors are mapped from back to the page cache
    (``madvise(MADV_DONTNEED)`` on each file mapping that holds one of its parameters or buffers): they leave the
    process's resident set, stay in the page cache (reclaimable without writing anything) and come back on the next
    read. A mapping with any page written since it was mapped (a private copy) is left alone: dropping it would undo
    the write. The bytes of mapping released (0 where there is nothing to release, or no Linux)."""
    libc = _glibc()
    if libc is None:
        return 0
    starts, ends = _file_mappings()
    chosen = set()
    for tensor in [*module.parameters(), *module.buffers()]:
        address = tensor.untyped_storage().data_ptr()
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and address < ends[i]:
            chosen.add((starts[i], ends[i]))
    released = 0
    for start, end in sorted(chosen):
        if _unwritten(start, end):
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
            released += end - start
    return released
