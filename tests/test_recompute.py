"""lit_align.recompute: ``gradient_checkpointing: selective`` gives bitwise the values and gradients of no
checkpointing, runs no matmul twice (transformers' full checkpointing does) and recomputes the elementwise ops; a
DPO run with it logs the same losses; a mode that is none of false / true / selective is refused in one line."""

from __future__ import annotations

import collections

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from generation.tiny_models import ARCHITECTURES
from helpers import fit
from lit_align.data import PreferenceDataModule
from lit_align.errors import LitAlignError
from lit_align.modules import DPOModule
from lit_align.recompute import enable_checkpointing


class OpCounts(TorchDispatchMode):
    """How often each aten op runs (an op the selective policy answers from its cache never reaches this mode)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_op_counts(model, ids, mask) -> tuple[torch.Tensor, dict[str, torch.Tensor], collections.Counter]:
    """The loss, the gradients and how often each aten op ran in backward, for one forward over ``ids``."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    loss = out.float().logsumexp(-1).mean()
    with OpCounts() as ops:
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, ops.counts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: GQA and biased projections (addmm)
def test_selective_is_bitwise_plain_and_recomputes_no_matmul(arch, tokenizer):
    model = ARCHITECTURES[arch](tokenizer, "sdpa")
    ids = torch.randint(3, 40, (1, 24), generator=torch.Generator().manual_seed(0))
    # two packed sequences (8 and 16 tokens), each attending to itself only: DPO's padding_free layout
    mask = torch.ones(24, 24, dtype=torch.bool).tril()
    mask[8:, :8] = False
    mask = mask[None, None]

    runs = {}
    for mode in (False, "selective", True):
        if mode is not False:
            model.gradient_checkpointing_disable()
            enable_checkpointing(model, mode)
        runs[mode] = backward_op_counts(model, ids, mask)
    plain, selective, full = runs[False], runs["selective"], runs[True]
    assert torch.equal(selective[0], plain[0])
    assert all(torch.equal(selective[1][n], g) for n, g in plain[1].items())
    matmuls = lambda counts: counts["mm"] + counts["addmm"]  # noqa: E731
    assert matmuls(selective[2]) == matmuls(plain[2]) > 0
    assert matmuls(full[2]) > matmuls(plain[2])  # transformers' checkpointing runs each layer's matmuls again
    layers = model.config.num_hidden_layers
    assert plain[2]["silu"] == 0 and selective[2]["silu"] == layers  # SiLU (elementwise) recomputed, once a layer


def test_dpo_with_selective_checkpointing_logs_the_same_losses(tiny_path):
    class Losses(L.Callback):
        def __init__(self):
            self.values = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.values.append(outputs["loss"].item())

    losses = {}
    for mode in (False, "selective"):
        record = Losses()
        module = DPOModule(model="builtin:tiny", learning_rate=1e-3, padding_free=True, gradient_checkpointing=mode)
        data = PreferenceDataModule(path="builtin:sort", batch_size=4, max_length=32, val_split=None, shuffle=False)
        fit(module, data, max_steps=3, callbacks=[record])
        losses[mode] = record.values
    assert losses["selective"] == losses[False] and len(set(losses[False])) == 3


@pytest.mark.parametrize("mode", ["full", "yes", 1.0])
def test_unknown_mode_is_refused(mode):
    with pytest.raises(LitAlignError) as info:
        DPOModule(gradient_checkpointing=mode)
    assert str(info.value) == f"model.gradient_checkpointing {mode!r}: expected false, true or 'selective'"
