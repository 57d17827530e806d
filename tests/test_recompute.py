"""lit_align.recompute: ``gradient_checkpointing: selective`` gives bitwise the values and gradients of no
checkpointing, runs no matmul twice (transformers' full checkpointing does) and recomputes the elementwise ops; a
DPO run with it logs the same losses; a mode that is none of false / true / selective is refused in one line.
``lean_mlps``: bitwise the values and gradients, two fewer ``[tokens, intermediate]`` tensors kept a layer, and the
plain forward wherever it does not apply (LoRA, autocast, no gradient). ``lean_norms``: the values bit for bit, the
gradients up to rounding, four fewer ``[tokens, hidden]`` tensors kept a layer; the plain forward without gradient
or outside fp32."""

from __future__ import annotations

import collections
import copy

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from generation.tiny_models import ARCHITECTURES
from helpers import fit
from numerics import assert_rounding_close
from lit_align.data import PreferenceDataModule
from lit_align.errors import LitAlignError
from lit_align.modules import DPOModule
from lit_align import recompute
from lit_align.recompute import enable_checkpointing, lean_mlps, lean_norms


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
    # the first step's loss bit for bit; then the parameters differ by the lean norms' gradient rounding (no
    # checkpointing leans the norms, lean_norms; selective is bitwise the plain layers)
    assert losses["selective"][0] == losses[False][0] and len(set(losses[False])) == 3
    assert losses["selective"] == pytest.approx(losses[False], rel=1e-5)


@pytest.mark.parametrize("mode", ["full", "yes", 1.0])
def test_unknown_mode_is_refused(mode):
    with pytest.raises(LitAlignError) as info:
        DPOModule(gradient_checkpointing=mode)
    assert str(info.value) == f"model.gradient_checkpointing {mode!r}: expected false, true or 'selective'"


def saved_bytes_and_gradients(model, ids) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """The bytes autograd keeps for backward (each storage once, parameters left out), the loss and the gradients."""
    model.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return sum(kept.values()), loss.detach(), grads


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_mlps_are_bitwise_plain_and_keep_two_tensors_less(arch, tokenizer):
    plain = ARCHITECTURES[arch](tokenizer, "sdpa")
    lean = copy.deepcopy(plain)
    layers, width = plain.config.num_hidden_layers, plain.config.intermediate_size
    assert lean_mlps(lean) == layers
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    (plain_bytes, plain_loss, plain_grads), (lean_bytes, lean_loss, lean_grads) = (
        saved_bytes_and_gradients(m, ids) for m in (plain, lean))
    assert torch.equal(lean_loss, plain_loss)
    assert plain_grads.keys() == lean_grads.keys()
    assert all(torch.equal(lean_grads[n], g) for n, g in plain_grads.items())
    assert plain_bytes - lean_bytes == layers * 2 * ids.numel() * width * 4  # silu(gate) and the product, fp32


def leaned_beside_plain(tokenizer, lean) -> tuple[torch.Tensor, torch.nn.Module, torch.nn.Module]:
    """Token ids, a tiny Llama and a copy ``lean`` leaned, after checking that without gradient both give the same
    logits bit for bit."""
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = ARCHITECTURES["llama"](tokenizer, "sdpa")
    leaned = copy.deepcopy(plain)
    lean(leaned)
    with torch.no_grad():
        assert torch.equal(leaned(input_ids=ids).logits, plain(input_ids=ids).logits)
    return ids, plain, leaned


def test_lean_mlps_step_aside_for_lora_autocast_and_inference(tokenizer):
    from peft import LoraConfig, get_peft_model

    ids, plain, lean = leaned_beside_plain(tokenizer, lean_mlps)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(lean(input_ids=ids).logits, plain(input_ids=ids).logits)
    config = LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False)
    adapted = {}
    for name, model in (("plain", plain), ("lean", lean)):
        torch.manual_seed(0)  # the same adapter weights
        adapted[name] = saved_bytes_and_gradients(get_peft_model(model, copy.deepcopy(config)), ids)[1:]
    assert torch.equal(adapted["lean"][0], adapted["plain"][0])
    assert {n for n in adapted["lean"][1] if "lora_" in n} and all(
        torch.equal(adapted["lean"][1][n], g) for n, g in adapted["plain"][1].items())


@pytest.mark.parametrize("mode", [False, "selective"])
def test_a_module_leans_its_mlps_and_norms_without_checkpointing(mode, tiny_path):
    module = DPOModule(model="builtin:tiny", gradient_checkpointing=mode)
    module.configure_model()
    for kind in ("LlamaMLP", "LlamaRMSNorm", "LlamaDecoderLayer"):
        forwards = {type(m.forward).__name__ for m in module.policy.model.layers.modules() if type(m).__name__ == kind}
        assert forwards == ({"partial"} if mode is False else {"method"}), kind
    assert type(module.policy.model.norm.forward).__name__ == "method"  # the final norm: outside the layers


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_norms_keep_no_norm_output_and_give_the_plain_values(arch, tokenizer, monkeypatch):
    """A leaned layer keeps each RMSNorm's input and ``r`` only: neither ``x * r`` nor the norm's output (which the
    projections after it keep, as how to make it again), 4 x hidden floats fewer per token and layer; the loss is
    the plain one bit for bit, the gradients equal up to float rounding."""
    plain = ARCHITECTURES[arch](tokenizer, "sdpa")
    lean = copy.deepcopy(plain)
    layers, hidden = plain.config.num_hidden_layers, plain.config.hidden_size
    assert lean_norms(lean) == 2 * layers
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    plain_bytes, plain_loss, plain_grads = saved_bytes_and_gradients(plain, ids)
    params = {p.untyped_storage().data_ptr() for p in lean.parameters()}
    inside, pack = {}, recompute._pack  # a lean layer keeps what its own hooks let through

    def counting(tensor):
        packed = pack(tensor)
        if isinstance(packed, torch.Tensor) and packed.untyped_storage().data_ptr() not in params:
            inside[packed.untyped_storage().data_ptr()] = packed.untyped_storage().nbytes()
        return packed

    monkeypatch.setattr(recompute, "_pack", counting)
    outside, lean_loss, lean_grads = saved_bytes_and_gradients(lean, ids)
    assert torch.equal(lean_loss, plain_loss)
    assert plain_grads.keys() == lean_grads.keys()
    for name, grad in plain_grads.items():
        assert_rounding_close(lean_grads[name], grad, scale=grad.abs().max() * 8, terms=hidden, msg=name)
    assert plain_bytes - (outside + sum(inside.values())) == layers * ids.numel() * 4 * hidden * 4


def test_lean_norms_step_aside_outside_fp32_and_give_the_plain_values_without_gradient(tokenizer, monkeypatch):
    ids, plain, lean = leaned_beside_plain(tokenizer, lean_norms)
    norm = lean.model.layers[0].input_layernorm
    x = torch.randn(3, plain.config.hidden_size, dtype=torch.float64, requires_grad=True)
    assert norm(x).grad_fn.name() == type(norm)(x.shape[-1]).double()(x).grad_fn.name() == "MulBackward0"
    assert norm(x.float()).grad_fn.name() == "_RMSNormBackward"
    # r from a few rows at a time (no temporary of the input's size): the plain forward's values bit for bit
    monkeypatch.setattr(recompute, "NORM_ROWS_BYTES", 3 * plain.config.hidden_size * 4)
    x = torch.randn(2, 11, plain.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(norm(x), plain.model.layers[0].input_layernorm(x))
    assert torch.equal(recompute._inverse_rms(x, 1e-6), torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
