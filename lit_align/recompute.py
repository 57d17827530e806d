"""Activation checkpointing of the policy's layers: ``model.gradient_checkpointing`` false, true or ``selective``.

``true`` is transformers' own: each decoder layer keeps only its input and runs its forward again in backward (about
a third more step time). ``selective`` keeps what the expensive ops computed and recomputes only the cheap ones:
each layer runs under torch's selective checkpoint policy (``torch.utils.checkpoint``'s
``create_selective_checkpoint_contexts``, the op-level policy torchtitan calls "selective"), which caches the
outputs of matmuls and attention kernels in the forward; in backward the layer's forward runs again with those
outputs taken from the cache, so only the elementwise ops run twice (RMSNorm, the rotary embedding, SiLU(gate) * up,
GQA's repeated keys and values, the residual adds). No matmul is recomputed and every value and gradient is bitwise
the one without checkpointing (``tests/test_recompute.py``); what backward keeps drops by about half: on
SmolLM2-135M (Llama layers, hidden 576, MLP 1536) from ~12.5k to ~6.3k floats per token and layer.

Without checkpointing, ``lean_mlps`` still recomputes one thing, always: a SwiGLU MLP's ``silu(gate) * up`` (two
elementwise ops) in backward instead of keeping it and ``silu(gate)`` (autograd keeps ``gate``, ``silu(gate)``,
``up`` and the product): 3k fewer floats per token and layer there (~12.5k to ~9.4k), the same values and gradients
bit for bit (``_SwiGLUDown``'s backward runs autograd's own operations on the same tensors). ``lean_norms`` does the
same for the RMSNorms inside the layers: a norm keeps its input and ``r = rsqrt(mean(x^2) + eps)``, and the
projections after it keep how to make its output rather than the output (a ``saved_tensors_hooks`` pair around each
layer's forward): backward makes each norm output again, once (one elementwise op), and nothing else of the layer
is recomputed. With the attention keeping the model's own grouped keys and values (``lit_align.attention``), a
SmolLM2-135M layer keeps ~5.8k floats per token, less than ``selective``'s ~6.3k, without its per-op dispatch:
distillation's micro-step on that model 6.0 s against 6.3-6.7 s (``docs/distill.md``).
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lit_align.errors import LitAlignError

_aten = torch.ops.aten
# the ops whose outputs ``selective`` keeps: matmuls (a linear layer is ``mm`` / ``addmm`` underneath) and attention
SAVED_OPS = frozenset(
    getattr(_aten, name).default
    for name in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention")
    if hasattr(_aten, name)
)
MODES = (False, True, "selective")


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in SAVED_OPS or "flash_attn" in str(op):  # the flash-attn package's kernels are attention too
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def check_mode(mode) -> None:
    """Refuse a ``model.gradient_checkpointing`` that is none of ``MODES``, in one line."""
    if not any(mode is m or (isinstance(m, str) and mode == m) for m in MODES):
        raise LitAlignError(f"model.gradient_checkpointing {mode!r}: expected false, true or 'selective'")


def enable_checkpointing(model: torch.nn.Module, mode: bool | str) -> None:
    """Turn on ``model``'s (a transformers ``PreTrainedModel``) gradient checkpointing as ``mode`` says."""
    if mode is False:
        return
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _keep_matmuls)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x's name; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_checkpointing(model: torch.nn.Module) -> None:
    """Turn ``model``'s gradient checkpointing off (under either of transformers' names)."""
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    disable()


# the MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (``lean_mlps``)
SWIGLU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


class _SwiGLUDown(torch.autograd.Function):
    """``F.linear(silu(gate) * up, weight)`` keeping only ``gate`` and ``up`` for backward, where the product is
    computed again. Backward runs what autograd runs for the unfused ops (``mm`` for the linear on the flattened rows,
    ``silu_backward``), in the same order: bitwise the same gradients."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, weight)
        return F.linear(F.silu(gate).mul_(up), weight)  # in place: one [tokens, intermediate] temporary fewer

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        act = F.silu(gate)
        rows, grad_weight = grad.reshape(-1, grad.shape[-1]), None
        if ctx.needs_input_grad[2]:
            product = act * up
            grad_weight = product.reshape(-1, product.shape[-1]).t().mm(rows).t()
            del product
        grad_product = rows.mm(weight).view(gate.shape)
        # in place where the operand is done with: two [tokens, intermediate] temporaries fewer, the same products
        grad_up = act.mul_(grad_product)
        return torch.ops.aten.silu_backward(grad_product.mul_(up), gate), grad_up, grad_weight


def _is_silu(act) -> bool:
    """Whether ``act`` is torch's or transformers' SiLU module, with its own forward (no kernel put in its place)."""
    from transformers.activations import SiLUActivation

    return type(act) in (torch.nn.SiLU, SiLUActivation) and act.forward.__func__ is type(act).forward


def _lean_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    down = mlp.down_proj
    if (torch.is_grad_enabled() and type(down) is torch.nn.Linear and down.bias is None  # not under LoRA
            and gate.dtype == up.dtype == down.weight.dtype and not torch.is_autocast_enabled(x.device.type)):
        return _SwiGLUDown.apply(gate, up, down.weight)
    if not torch.is_grad_enabled() and gate.dtype == up.dtype and not torch.is_autocast_enabled(x.device.type):
        return down(F.silu(gate).mul_(up))  # the same product, without gradient: in place
    return down(mlp.act_fn(gate) * up)


def lean_mlps(model: torch.nn.Module) -> int:
    """Give ``model``'s SwiGLU MLPs (``SWIGLU_MLPS`` with a SiLU) a forward that keeps two ``[tokens, intermediate]``
    tensors fewer for backward, the same values and gradients (bit for bit on CPU, tested); how many. Without
    gradient the product is made in place (one temporary fewer). It steps aside where it does not apply: a
    LoRA-wrapped or biased ``down_proj``, mixed dtypes or autocast."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in SWIGLU_MLPS and _is_silu(getattr(module, "act_fn", None)):
            module.forward = partial(_lean_mlp_forward, module)
            count += 1
    return count


# the RMSNorm classes whose forward is Llama's: ``weight * (x * rsqrt(mean(x^2) + eps))``, computed in fp32
LLAMA_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def _normed(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight * (x * r)`` as the plain forward computes it (products commute bit for bit), one temporary."""
    return (x * r).mul_(weight)


class _RMSNorm(torch.autograd.Function):
    """``weight * (x * r)``, ``r = rsqrt(mean(x^2) + eps)`` given (made without gradient by the caller), keeping ``x``,
    ``r`` and ``weight`` for backward, where autograd would keep ``x * r`` besides ``x``. The gradient w.r.t. ``x``
    includes its path through ``r``: ``r * (g w - x r * mean(g w * x r))``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, r, weight)
        return _normed(x, r, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, r, weight = ctx.saved_tensors
        normed = x * r
        grad_weight = (grad * normed).sum(tuple(range(grad.dim() - 1))) if ctx.needs_input_grad[2] else None
        grad_normed = grad * weight
        return r * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True)), None, grad_weight


class _NormOutput:
    """A lean norm's output in a layer's forward, by what makes it: the ops of the layer that keep it for backward
    keep this instead (``_Kept``), and it is made again once, at the first of them to need it."""

    __slots__ = ("x", "r", "weight", "alive", "again")

    def __init__(self, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, output: torch.Tensor):
        self.x, self.r, self.weight, self.again = x, r, weight, None
        self.alive = weakref.ref(output)  # while the output lives, no other tensor has its storage

    def value(self) -> torch.Tensor:
        if self.again is None:
            self.again = _normed(self.x, self.r, self.weight)  # the forward's operations: the same values
        return self.again


class _Kept(NamedTuple):
    """What a layer keeps for backward instead of a view of a lean norm's output: the norm output and the view."""

    output: _NormOutput
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


_layer_norms: dict[int, _NormOutput] | None = None  # the running lean layer's norm outputs by storage address


def _pack(tensor: torch.Tensor):
    output = _layer_norms.get(tensor.untyped_storage().data_ptr()) if _layer_norms else None
    if output is None or output.alive() is None:
        return tensor
    return _Kept(output, tensor.size(), tensor.stride(), tensor.storage_offset())


def _unpack(kept):
    if isinstance(kept, _Kept):
        return kept.output.value().as_strided(kept.size, kept.stride, kept.offset)
    return kept


NORM_ROWS_BYTES = 1 << 19  # rows of an RMSNorm's input squared at a time: temporaries under 1 MiB, reused


def _inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(x^2) + eps)`` over the last dimension, the plain forward's operations row by row (the same
    values): ``NORM_ROWS_BYTES`` of rows squared at a time, not one temporary of the input's size (a fresh mapping
    under ``mmap_activations``, page faults and all)."""
    rows = x.reshape(-1, x.shape[-1])
    step = max(1, NORM_ROWS_BYTES // (x.shape[-1] * x.element_size()))
    squares = torch.cat([part.pow(2).mean(-1, keepdim=True) for part in rows.split(step)])
    return torch.rsqrt(squares.add_(eps)).view(*x.shape[:-1], 1)


def _lean_norm_forward(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = norm.weight
    if not (x.dtype == weight.dtype == torch.float32 and x.is_contiguous()):
        return type(norm).forward(norm, x)
    with torch.no_grad():
        r = _inverse_rms(x, norm.variance_epsilon)
    if not torch.is_grad_enabled():
        return _normed(x, r, weight)  # without gradient: the same values, one temporary
    output = _RMSNorm.apply(x, r, weight)
    if _layer_norms is not None and output.is_contiguous():
        _layer_norms[output.untyped_storage().data_ptr()] = _NormOutput(x.detach(), r, weight, output)
    return output


def _lean_layer_forward(forward, *args, **kwargs):
    global _layer_norms
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    outer, _layer_norms = _layer_norms, {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            return forward(*args, **kwargs)
    finally:
        _layer_norms = outer


def lean_norms(model: torch.nn.Module) -> int:
    """Give ``model``'s Llama-like RMSNorms (``LLAMA_NORMS``) a forward that keeps its input and ``r`` for backward,
    not ``x * r``, and have the decoder layers around them keep no norm output either: an op that keeps one (the
    q/k/v projections keep the input norm's, gate/up the post-attention norm's) keeps how to make it, and backward
    makes it again, once per norm (one elementwise op). Values are the plain forward's bit for bit, gradients equal
    up to float rounding; per norm 2 x hidden fewer floats kept a token (``x * r`` and the output), 4 x hidden a
    Llama layer. Without gradient (a frozen teacher, sampling's prefill) the same values with one temporary, not three;
    outside fp32 the plain forward; how many norms it leaned."""
    count = 0
    for layer in model.modules():
        norms = [m for m in layer.children() if type(m).__name__ in LLAMA_NORMS]
        norms += [m for child in layer.children() for m in child.children() if type(m).__name__ in LLAMA_NORMS]
        if not norms or not type(layer).__name__.endswith("DecoderLayer"):
            continue
        for norm in norms:
            norm.forward = partial(_lean_norm_forward, norm)
        layer.forward = partial(_lean_layer_forward, layer.forward)
        count += len(norms)
    return count
