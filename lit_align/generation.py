"""Sampling completions from a causal LM, behind one small interface.

A sampler takes left-padded prompts and returns a ``Rollout``: completion ids (right-padded after EOS), the mask of
real completion tokens (EOS included), which rows ran out of tokens before EOS, and, when the engine has them, the
per-token log-probs of the sampled tokens under the temperature-scaled distribution (what GRPO's old-policy
log-probs are, so the trainer can skip a forward pass). Rows are ``num_samples`` consecutive samples per prompt.

``HFSampler`` wraps transformers' ``generate`` (batched, KV cache) and is the reference engine. Faster engines plug in
by implementing ``generate`` with the same signature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rollout:
    completion_ids: torch.Tensor  # [N, C]
    completion_mask: torch.Tensor  # [N, C], 1 on tokens up to and including the first EOS
    truncated: torch.Tensor  # [N] bool: no EOS within max_new_tokens
    logps: torch.Tensor | None = None  # [N, C] sampling log-probs (temperature applied), or None


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask [N, C], truncated [N])``: keep tokens up to and including the first EOS; no EOS means truncated."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    length = completion_ids.shape[1]
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], length, dtype=torch.long))
    positions = torch.arange(length, device=completion_ids.device).expand_as(completion_ids)
    return (positions <= first.unsqueeze(1)).long(), ~is_eos.any(1)


class HFSampler:
    """Sample with ``model.generate``.

    Args:
        max_new_tokens: completion length cap (TRL's ``max_completion_length``).
        temperature: sampling temperature; 0 means greedy.
        top_p: nucleus sampling mass (1.0: off).
        top_k: keep the k most likely tokens (0: off, TRL's default).
        return_logps: also return the sampling log-probs (from the raw logits generate already computed).
    """

    def __init__(self, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 return_logps: bool = True):
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.return_logps = return_logps

    @torch.no_grad()
    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int,
                 eos_token_ids: list[int], pad_token_id: int) -> Rollout:
        greedy = self.temperature == 0
        if greedy and num_samples > 1:  # generate() refuses num_return_sequences > 1 without sampling
            prompt_ids = prompt_ids.repeat_interleave(num_samples, 0)
            prompt_mask = prompt_mask.repeat_interleave(num_samples, 0)
            num_samples = 1
        was_training = model.training
        model.eval()
        try:
            out = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                max_new_tokens=self.max_new_tokens,
                do_sample=not greedy,
                temperature=None if greedy else self.temperature,
                top_p=None if greedy else self.top_p,
                top_k=None if greedy else self.top_k,
                num_return_sequences=num_samples,
                eos_token_id=eos_token_ids,
                pad_token_id=pad_token_id,
                use_cache=True,
                return_dict_in_generate=True,
                output_logits=self.return_logps and not greedy,
            )
        finally:
            model.train(was_training)
        completion_ids = out.sequences[:, prompt_ids.shape[1] :]
        mask, truncated = completion_mask_from_eos(completion_ids, eos_token_ids)
        completion_ids = completion_ids.masked_fill(mask == 0, pad_token_id)
        logps = None
        if self.return_logps and not greedy:
            logits = torch.stack(out.logits, dim=1).float() / self.temperature  # [N, C, V]
            logps = (logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)) * mask
        return Rollout(completion_ids, mask, truncated, logps)
