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
"""

from __future__ import annotations

from functools import partial

import torch
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
