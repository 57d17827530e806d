"""The default engine: ``native`` wherever it decodes the model on CPU, else ``hf``."""

from __future__ import annotations

import torch

from lit_align.generation.base import Rollout
from lit_align.generation.hf import HFEngine
from lit_align.generation.native import NativeEngine, native_decodes


class AutoEngine:
    """``NativeEngine`` for the models it decodes on CPU (``native_decodes``: full-attention layers, ``sdpa`` or
    ``eager`` attention), ``HFEngine`` for the others, on accelerators (native has not been measured on one yet:
    ``bench/gpu_strategies.py``) and whenever ``generation_kwargs`` are given (they are ``generate``'s). The two
    sample the same distribution; native is faster (``bench/generate_vs_hf.py``). Same arguments as ``HFEngine``;
    ``chosen`` names the engine the last ``generate`` ran."""

    def __init__(self, **settings):
        self.hf = HFEngine(**settings)
        self.native = None if settings.get("generation_kwargs") else NativeEngine(**settings)
        self.config, self.chosen = self.hf.config, None

    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int,
                 eos_token_ids: list[int], pad_token_id: int) -> Rollout:
        native = self.native is not None and prompt_ids.device.type == "cpu" and native_decodes(model)
        self.chosen = "native" if native else "hf"
        engine = self.native if native else self.hf
        return engine.generate(model, prompt_ids, prompt_mask, num_samples, eos_token_ids, pad_token_id)


__all__ = ["AutoEngine"]
