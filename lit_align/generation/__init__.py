"""Sampling completions from a causal LM, behind one small interface.

An engine is a ``Engine``: built from ``SamplingConfig``'s keywords (max_new_tokens, temperature, top_p, top_k,
return_logps; its own after them), its ``generate(model, prompt_ids, prompt_mask, num_samples, eos_token_ids,
pad_token_id)`` takes left-padded prompts and returns a ``Rollout``: completion ids (right-padded after EOS), the mask
of real completion tokens (EOS included), which rows ran out of tokens before EOS, and, when the engine has them, the
per-token log-probs of the sampled tokens under the temperature-scaled distribution (what GRPO's old-policy
log-probs are, so the trainer can skip a forward pass). Rows are ``num_samples`` consecutive samples per prompt.

``AutoEngine`` (``auto``, the default) runs ``native`` wherever it decodes the model on CPU, else ``hf``.
``HFEngine`` (``hf``) wraps transformers' ``generate`` and is the reference engine. ``NativeEngine`` (``native``)
runs its own decode loop (one prefill per prompt shared by its samples, a preallocated KV cache, sampling on
tensors) and returns the same thing. ``VLLMEngine`` (``vllm``) runs a vLLM engine colocated in the training process
(imported only when chosen; its own environment), or samples from a vLLM server started apart (``vllm_server``).
Another engine plugs in as a module here and an entry in ``ENGINES``.
"""

from __future__ import annotations

from lit_align.errors import LitAlignError
from lit_align.generation.base import Rollout, Engine, SamplingConfig, completion_mask_from_eos
from lit_align.generation.auto import AutoEngine
from lit_align.generation.hf import HFEngine
from lit_align.generation.native import NativeEngine, filter_logits, sample_next
from lit_align.generation.vllm import VLLMOptions, VLLMEngine

ENGINES: dict[str, type[Engine]] = {"auto": AutoEngine, "hf": HFEngine, "native": NativeEngine, "vllm": VLLMEngine}


def make_engine(engine: str, **settings) -> Engine:
    """The ``engine`` (a key of ``ENGINES``), built with ``settings`` (``SamplingConfig``'s and its own)."""
    if engine not in ENGINES:
        raise LitAlignError(f"model.engine {engine!r}: expected one of {sorted(ENGINES)}")
    return ENGINES[engine](**settings)


__all__ = [
    "AutoEngine", "ENGINES", "HFEngine", "NativeEngine", "Rollout", "Engine", "SamplingConfig",
    "completion_mask_from_eos", "VLLMOptions", "VLLMEngine", "filter_logits", "make_engine", "sample_next",
]
