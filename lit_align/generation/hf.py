"""The reference engine: transformers' ``generate`` (batched, KV cache)."""

from __future__ import annotations

import torch

from lit_align.errors import LitAlignError
from lit_align.generation.base import Rollout, SamplingConfig, completion_mask_from_eos

# generate's keywords that decide the rollout's shape and contents: lit_align's own
ROLLOUT_KEYWORDS = {"input_ids", "attention_mask", "max_new_tokens", "num_return_sequences", "eos_token_id",
                    "pad_token_id", "return_dict_in_generate", "output_logits", "use_cache"}


class HFEngine:
    """Sample with ``model.generate``.

    Args: ``SamplingConfig``'s (``return_logps``: from the raw logits generate already computed, so neither
        penalized nor filtered; ``generation_kwargs``: more ``generate`` keywords, overriding lit_align's, except
        those that shape the rollout, which are refused).
    """

    def __init__(self, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 return_logps: bool = True, min_p: float | None = None, repetition_penalty: float = 1.0,
                 generation_kwargs: dict | None = None):
        self.config = SamplingConfig(max_new_tokens, temperature, top_p, top_k, return_logps, min_p,
                                     repetition_penalty, generation_kwargs)
        fixed = sorted(set(generation_kwargs or {}) & ROLLOUT_KEYWORDS)
        if fixed:
            raise LitAlignError(f"model.generation_kwargs {fixed}: engine 'hf' sets these itself (they shape the "
                                f"rollout); set max_completion_length / num_generations instead")

    @torch.no_grad()
    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int,
                 eos_token_ids: list[int], pad_token_id: int) -> Rollout:
        config, greedy = self.config, self.config.greedy
        if greedy and num_samples > 1:  # generate() refuses num_return_sequences > 1 without sampling
            prompt_ids = prompt_ids.repeat_interleave(num_samples, 0)
            prompt_mask = prompt_mask.repeat_interleave(num_samples, 0)
            num_samples = 1
        was_training = model.training
        model.eval()
        try:
            sampling = {"do_sample": not greedy, "temperature": None if greedy else config.temperature,
                        "top_p": None if greedy else config.top_p, "top_k": None if greedy else config.top_k,
                        "min_p": None if greedy else config.min_p, "repetition_penalty": config.repetition_penalty,
                        **(config.generation_kwargs or {})}  # TRL: generation_kwargs override the others
            out = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                max_new_tokens=config.max_new_tokens,
                num_return_sequences=num_samples,
                eos_token_id=eos_token_ids,
                pad_token_id=pad_token_id,
                use_cache=True,
                return_dict_in_generate=True,
                output_logits=config.return_logps and not greedy,
                **sampling,
            )
        finally:
            model.train(was_training)
        completion_ids = out.sequences[:, prompt_ids.shape[1] :]
        mask, truncated = completion_mask_from_eos(completion_ids, eos_token_ids)
        completion_ids = completion_ids.masked_fill(mask == 0, pad_token_id)
        logps = None
        if config.return_logps and not greedy:
            logits = torch.stack(out.logits, dim=1).float() / config.temperature  # [N, C, V]
            logps = (logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)) * mask
        return Rollout(completion_ids, mask, truncated, logps)
