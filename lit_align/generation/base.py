"""What every engine shares: the ``Rollout`` it returns, the ``Engine`` interface, the ``SamplingConfig`` it is built
from, and the completion mask every engine derives from EOS."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from lit_align.errors import LitAlignError


@dataclass
class Rollout:
    completion_ids: torch.Tensor  # [N, C]
    completion_mask: torch.Tensor  # [N, C], 1 on tokens up to and including the first EOS
    truncated: torch.Tensor  # [N] bool: no EOS within max_new_tokens
    logps: torch.Tensor | None = None  # [N, C] sampling log-probs (temperature applied), or None


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample, whatever the engine.

    Args:
        max_new_tokens: completion length cap (TRL's ``max_completion_length``).
        temperature: sampling temperature; 0 means greedy.
        top_p: nucleus sampling mass (1.0: off).
        top_k: keep the k most likely tokens (0: off, TRL's default).
        return_logps: also return the sampling log-probs (temperature-scaled, unfiltered distribution).
        min_p: keep only tokens at least ``min_p`` times as likely as the most likely one (None: off).
        repetition_penalty: transformers' and vLLM's: the logits of tokens in the prompt or already generated are
            divided by it where positive, multiplied where negative (1.0: off; > 1 discourages repeats). It applies
            to greedy sampling too.
        generation_kwargs: more keywords for the engine's own generation call (transformers' ``generate`` for
            ``hf``, vLLM's ``SamplingParams`` for ``vllm``), overriding the ones above; an engine that has none
            refuses them.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    return_logps: bool = True
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict | None = None

    def __post_init__(self):
        t, p, k, n = self.temperature, self.top_p, self.top_k, self.max_new_tokens
        if t < 0 or not 0 < p <= 1 or k < 0 or n < 1:
            raise LitAlignError(f"engine: need temperature >= 0, 0 < top_p <= 1, top_k >= 0, max_new_tokens >= 1; "
                                f"got {t}, {p}, {k}, {n}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise LitAlignError(f"model.min_p must be in [0, 1] or null, got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise LitAlignError(f"model.repetition_penalty must be > 0 (1.0: off), got {self.repetition_penalty}")
        if self.generation_kwargs is not None and not isinstance(self.generation_kwargs, dict):
            raise LitAlignError(f"model.generation_kwargs must be a mapping of keywords, got "
                                f"{type(self.generation_kwargs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@runtime_checkable
class Engine(Protocol):
    """An engine: ``num_samples`` completions per left-padded prompt, as a ``Rollout`` whose rows are each prompt's
    samples in a row; the model is left in the training mode it came in."""

    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int,
                 eos_token_ids: list[int], pad_token_id: int) -> Rollout: ...


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask [N, C], truncated [N])``: keep tokens up to and including the first EOS; no EOS means truncated."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    length = completion_ids.shape[1]
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], length, dtype=torch.long))
    positions = torch.arange(length, device=completion_ids.device).expand_as(completion_ids)
    return (positions <= first.unsqueeze(1)).long(), ~is_eos.any(1)
