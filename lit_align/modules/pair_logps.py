"""Log-probs of preference pairs, in one of two layouts; what ``DPOModule`` and the precompute pass run.

The batch is TRL's ``[chosen_1..B; rejected_1..B]`` (right-padded, ``completion_mask``): ``completion_logps`` runs it
as is. ``shared_prompt_layout`` repacks it as ``B`` rows ``[prompt, chosen, rejected]``: the rejected tokens attend to
the prompt and not to the chosen ones, and take the positions they would have after the prompt, so every token sees
exactly the context it has in ``[chosen; rejected]`` and the log-probs are the same up to float rounding, while the
prompt goes through the network once per pair instead of twice (``shared_prompt_logps``). Both go through
``lit_align.logps.next_token_logps`` (plain or chunked LM head).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lit_align.logps import attention_mask_4d, forward_parameters, next_token_logps


class CompletionLogps(NamedTuple):
    """Per-token results of one forward, rows ``[chosen_1..B; rejected_1..B]`` (``[2B, T]``, any ``T``)."""

    tokens: torch.Tensor  # log-prob of each completion token (fp32, 0 where ``mask`` is 0)
    mask: torch.Tensor  # bool: which positions are this row's completion tokens, in order
    stats: dict[str, torch.Tensor]  # the asked ``lit_align.logps`` statistics per token (no gradient), ``argmax``
    #                                 turned into ``is_top1`` (the label is the most likely token)


def _per_token_stats(values: dict[str, torch.Tensor], labels: torch.Tensor) -> dict[str, torch.Tensor]:
    if "argmax" in values:
        values = {**values, "is_top1": values["argmax"] == labels}
        del values["argmax"]
    return values


def completion_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], stats: tuple[str, ...] = (),
                     chunk_size: int | None = None) -> CompletionLogps:
    """One forward over a right-padded batch: per-token completion log-probs (see ``CompletionLogps``).

    Only positions that predict a completion token need logits: the LM head skips the prompt prefix shared by the
    batch (a large saving with real vocabularies), and with ``chunk_size`` it runs a chunk at a time
    (``lit_align.logps``).
    """
    input_ids, completion_mask = batch["input_ids"], batch["completion_mask"]
    has_completion = completion_mask.any(1)
    first = completion_mask.int().argmax(1)[has_completion]
    start = max(int(first.min()) if first.numel() else 1, 1)  # first completion position; logits from start - 1
    tokens, values = next_token_logps(model, input_ids, start, chunk_size, stats=stats,
                                      attention_mask=batch["attention_mask"])
    mask = completion_mask[:, start:].bool()
    return CompletionLogps(tokens.masked_fill(~mask, 0), mask, _per_token_stats(values, input_ids[:, start:]))


# Architectures whose forward honours a custom 4D attention mask and explicit ``position_ids`` with their usual meaning
# (rotary positions; no ALiBi or other bias derived from a 2D mask). Others run the plain ``[chosen; rejected]`` batch.
SHARED_PROMPT_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "phi3", "olmo",
    "olmo2", "granite", "smollm3", "cohere", "starcoder2", "glm", "helium",
})


def supports_shared_prompt(model: torch.nn.Module) -> bool:
    """Whether ``model`` can run pairs as ``[prompt, chosen, rejected]`` rows (see ``shared_prompt_logps``)."""
    config = getattr(model, "config", None)
    forward = getattr(model, "forward", None)
    return (
        config is not None and forward is not None
        and getattr(config, "model_type", None) in SHARED_PROMPT_MODEL_TYPES
        and getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
        and not getattr(config, "output_router_logits", False)  # the MoE aux loss reads a 2D mask
        and "position_ids" in forward_parameters(model)
    )


def shared_prompt_layout(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Repack ``[chosen_1..B; rejected_1..B]`` (``[2B, T]``) as ``B`` rows ``[prompt, chosen, rejected]``.

    Returns ``input_ids``, ``position_ids`` (the rejected tokens continue from the prompt, as in their own sequence),
    ``allowed`` (``[B, 1, L, L]`` bool: causal, minus rejected -> chosen; a padding query sees only itself),
    ``chosen`` / ``rejected`` (``[B, L]``: which tokens are scored) and ``source`` (``[B, L]``: the position whose
    logits predict each token: the previous one, but the prompt's last for the first rejected token).
    None when the batch is not of that form: not right-padded, a pair whose two prompts differ, an empty prompt, or a
    completion that is not one contiguous run through the end of its sequence.
    """
    input_ids, attention = batch["input_ids"], batch["attention_mask"].bool()
    completion = batch["completion_mask"].bool()
    n, width = input_ids.shape
    if n % 2:
        return None
    pairs, device = n // 2, input_ids.device
    columns = torch.arange(width, device=device)
    lengths = attention.sum(1)
    prompt = torch.where(completion.any(1), completion.int().argmax(1), lengths)
    completion_lengths = completion.sum(1)
    prompt_c, prompt_r = prompt[:pairs], prompt[pairs:]
    if not (
        torch.equal(attention, columns < lengths[:, None])  # right padding
        and torch.equal(prompt + completion_lengths, lengths)  # one completion run, to the end
        and torch.equal(prompt_c, prompt_r)
        and bool((prompt_c > 0).all())
        and bool(((input_ids[:pairs] == input_ids[pairs:]) | (columns >= prompt_c[:, None])).all())
    ):
        return None
    chosen_end = prompt_c + completion_lengths[:pairs]
    row_lengths = chosen_end + completion_lengths[pairs:]
    width = int(row_lengths.max())
    pos = torch.arange(width, device=device)[None]  # [1, L]
    in_first = pos < chosen_end[:, None]  # prompt or chosen
    valid = pos < row_lengths[:, None]
    rows = torch.arange(pairs, device=device)[:, None]
    source_row = torch.where(in_first, rows, rows + pairs)
    source_col = torch.where(in_first, pos, pos - completion_lengths[:pairs, None])
    source_col = torch.where(valid, source_col, 0)
    chosen = in_first & (pos >= prompt_c[:, None])
    rejected = valid & ~in_first
    causal = pos[0, None, :] <= pos[0, :, None]  # [L(query), L(key)]
    allowed = causal & valid[:, None, :] & ~(rejected[:, :, None] & chosen[:, None, :])
    allowed |= torch.eye(width, dtype=torch.bool, device=device)  # padding queries: themselves (no empty softmax)
    source = torch.where(pos == chosen_end[:, None], prompt_c[:, None] - 1, pos - 1)
    return {
        "input_ids": input_ids[source_row, source_col],
        "position_ids": source_col,
        "allowed": allowed[:, None],
        "chosen": chosen,
        "rejected": rejected,
        "source": source.clamp(min=0),
        "first": int(prompt_c.min()),
        "window": int(lengths.max()),
    }


def shared_prompt_logps(model: torch.nn.Module, layout: dict[str, torch.Tensor], stats: tuple[str, ...] = (),
                        chunk_size: int | None = None) -> CompletionLogps:
    """``completion_logps`` over the rows of ``shared_prompt_layout``, ordered ``[chosen_1..B; rejected_1..B]`` like
    the batch it was made from (each pair's row appears twice, once under its chosen mask, once under its rejected)."""
    input_ids, first = layout["input_ids"], layout["first"]
    tokens, values = next_token_logps(model, input_ids, first, chunk_size, stats=stats,
                                      source=layout["source"][:, first:],
                                      attention_mask=attention_mask_4d(model, layout["allowed"]),
                                      position_ids=layout["position_ids"])
    masks = torch.cat([layout["chosen"][:, first:], layout["rejected"][:, first:]])
    values = _per_token_stats(values, input_ids[:, first:])
    return CompletionLogps(tokens.repeat(2, 1).masked_fill(~masks, 0), masks,
                           {name: v.repeat(2, 1) for name, v in values.items()})


def logps_of(model: torch.nn.Module, batch: dict[str, torch.Tensor], layout: dict[str, torch.Tensor] | None,
             stats: tuple[str, ...] = (), chunk_size: int | None = None) -> CompletionLogps:
    """Per-token log-probs (and ``stats``) of a batch: the shared-prompt rows where ``model`` takes them, else the
    plain ``[chosen; rejected]`` batch."""
    if _use_shared_prompt(model, layout):
        return shared_prompt_logps(model, layout, stats, chunk_size)
    return completion_logps(model, batch, stats, chunk_size)


def _use_shared_prompt(model: torch.nn.Module, layout: dict[str, torch.Tensor] | None) -> bool:
    if layout is None or not supports_shared_prompt(model):
        return False
    window = getattr(model.config, "sliding_window", None)  # a custom mask replaces the sliding-window mask
    return not window or layout["window"] <= window


def pair_layout(batch: dict[str, torch.Tensor], model: torch.nn.Module, share_prompt: bool):
    """``shared_prompt_layout(batch)`` when ``share_prompt`` is on and ``model`` supports it, else None."""
    return shared_prompt_layout(batch) if share_prompt and supports_shared_prompt(model) else None
