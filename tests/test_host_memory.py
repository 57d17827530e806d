"""lit_align.host_memory and ``model.mmap_activations``: under glibc a training step's forward maps the large tensors
its free heap cannot hold instead of growing the heap, backward grows the heap again; the losses stay the same.
Each check runs in a fresh interpreter, whose heap holds little free memory."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from helpers import cli_env, fit, mapped_resident_kib
from lit_align import host_memory
from lit_align.data import PreferenceDataModule
from lit_align.modules import DPOModule


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return None
    return libc


libc = _glibc()
pytestmark = pytest.mark.skipif(libc is None, reason="glibc's mallinfo2 shows where memory comes from")


def new_tensor_mapped() -> bool:
    """Whether a new tensor larger than all the heap's free memory (so that only a larger heap or a mapping of its
    own can hold it) gets its own mapping."""
    libc.malloc_trim(0)  # the free top of the heap (an earlier probe's) back to the system
    info = libc.mallinfo2()
    size = info.fordblks + (2 << 20)
    assert size < host_memory.HEAP_THRESHOLD, "the heap holds too much free memory to tell"
    tensor = torch.empty(size // 4)
    mapped = libc.mallinfo2().hblkhd - info.hblkhd >= size
    del tensor
    return mapped


def in_fresh_process(call: str):
    """``call`` (an expression over this module, ``t``) evaluated in a new interpreter, whose heap holds little free
    memory (this one's, after other tests, may hold too much for ``new_tensor_mapped`` to tell)."""
    code = f"import json, test_host_memory as t; print('RESULT', json.dumps({call}))"
    proc = subprocess.run([sys.executable, "-c", code], env=cli_env(OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ")[-1])


def probes() -> list:
    """Whether a new large tensor is mapped in a forward's setting, and after it."""
    host_memory.mapped_forward(True)
    forward = new_tensor_mapped()
    host_memory.mapped_forward(False)
    return [forward, new_tensor_mapped()]


def test_the_forward_maps_large_tensors_and_the_heap_takes_them_back_after():
    assert host_memory.mapped_forward(False)  # glibc is there
    assert in_fresh_process("t.probes()") == [True, False]


class WhereTensorsGo(L.Callback):
    """In each training forward (a hook on the policy's decoder) and after each backward: whether a new large tensor
    is mapped (``new_tensor_mapped``)."""

    def __init__(self):
        self.forward, self.after_backward, self.losses = [], [], []

    def on_train_start(self, trainer, pl_module):
        def hook(module, args, output):
            if torch.is_grad_enabled():  # the training forward
                self.forward.append(new_tensor_mapped())

        pl_module.network.get_decoder().register_forward_hook(hook)

    def on_after_backward(self, trainer, pl_module):
        self.after_backward.append(new_tensor_mapped())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def dpo_run(mmap_activations: bool) -> dict:
    """Three steps of DPO on the tiny model: where a new large tensor goes in each forward and after each backward,
    and the losses."""
    record = WhereTensorsGo()
    module = DPOModule(model="builtin:tiny", learning_rate=1e-3, padding_free=True, mmap_activations=mmap_activations)
    data = PreferenceDataModule(path="builtin:sort", batch_size=4, max_length=32, val_split=None, shuffle=False)
    fit(module, data, max_steps=3, callbacks=[record])
    return {"forward": record.forward, "after_backward": record.after_backward, "losses": record.losses}


def test_mmap_activations_maps_the_forward_only_and_keeps_the_losses():
    on, off = in_fresh_process("t.dpo_run(True)"), in_fresh_process("t.dpo_run(False)")
    assert on["forward"] == [True] * 3 and on["after_backward"] == [False] * 3
    assert off["forward"] == [False] * 3  # glibc's own threshold: the heap grows instead
    assert on["losses"] == off["losses"] and len(set(off["losses"])) == 3


def test_a_forward_hands_the_free_heap_back_at_its_start_and_its_end(monkeypatch):
    """``malloc_trim`` when a forward starts (what the previous backward and optimizer step freed is not resident
    under its activations) and when it ends; not again for a forward already started or ended."""
    calls = []

    class Libc:
        def malloc_trim(self, pad):
            calls.append("trim")

        def mallopt(self, option, value):
            calls.append((option, value))

    monkeypatch.setattr(host_memory, "_glibc", Libc)
    monkeypatch.setattr(host_memory, "_forward_mapped", False)
    for active in (True, True, False, False):
        host_memory.mapped_forward(active)
    forward, heap = host_memory.FORWARD_THRESHOLD, host_memory.HEAP_THRESHOLD
    settings = {threshold: [(host_memory.M_MMAP_THRESHOLD, threshold), (host_memory.M_TRIM_THRESHOLD, 2 * heap)]
                for threshold in (forward, heap)}
    assert calls == ["trim", *settings[forward], *settings[forward], "trim", *settings[heap], *settings[heap]]


# -- a frozen model's file pages out of the resident set between its forwards (release_mapped) ----------------------
@pytest.fixture
def mapped_model(tiny_path):
    """The built-in tiny model loaded from its safetensors file, which its weights are mapped from."""
    from lit_align.models import load_model
    model = load_model(str(tiny_path))
    return model, (Path(tiny_path) / "model.safetensors").resolve()


def test_release_mapped_hands_a_models_file_pages_back_and_they_read_back_the_same(mapped_model):
    model, weights = mapped_model
    tokens = torch.arange(40).view(2, 20)
    with torch.no_grad():
        before = model(tokens).logits
    assert mapped_resident_kib(model) > 0.9 * weights.stat().st_size / 1024  # every weight read once
    assert host_memory.release_mapped(model) >= weights.stat().st_size
    assert mapped_resident_kib(model) == 0
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, before)  # read back from the page cache
    assert mapped_resident_kib(model) > 0.9 * weights.stat().st_size / 1024


def test_release_mapped_leaves_a_written_mapping_alone(mapped_model):
    model, weights = mapped_model
    weight = model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        weight.mul_(2.0)  # a private copy of those pages: the mapping no longer holds only the file's own
    written = weight.clone()
    assert host_memory.release_mapped(model) == 0
    assert torch.equal(weight, written) and mapped_resident_kib(model) > 0


def test_release_mapped_releases_nothing_of_tensors_in_memory():
    model = torch.nn.Linear(256, 256)
    weight = model.weight.detach().clone()
    assert host_memory.release_mapped(model) == 0
    assert torch.equal(model.weight, weight)
