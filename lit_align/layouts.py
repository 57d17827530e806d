"""Sequence layouts: how rows are laid out for one forward, and where each scored token lands afterwards.

A ``Layout`` is the forward's input (``input_ids [R, L]``, a 2D padding mask or a 4D ``allowed`` mask, positions),
the first label column ``start``, optionally which position predicts each label (``source``), and the map from the
forward's ``[R, L - start]`` log-probs to the caller's grid ``[N, C]`` (``index``; None: the same grid) with the
grid's ``mask`` of scored tokens. ``lit_align.logps.layout_logps`` runs any of them. Five layouts:

- ``padded``: right-padded rows (SFT rows, DPO's ``[chosen_1..B; rejected_1..B]``), scoring a masked subset;
- ``prompt_completion``: left-padded prompts, right-padded completions (GRPO), positions following the mask;
- ``packed``: the same prompts and completions packed into one row without padding, a block-causal mask keeping
  the rows apart (GRPO's ``padding_free``);
- ``shared_prompt_pairs``: each DPO pair as one row ``[prompt, chosen, rejected]``, the prompt computed once;
- ``segments``: packed SFT rows, several sequences per row with a block-causal mask.

The 4D layouts need a model that takes a custom mask (``lit_align.capabilities``); ``pairs`` picks the shared-prompt
layout only for a model that does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lit_align.capabilities import supports_shared_prompt


@dataclass
class Layout:
    name: str
    input_ids: torch.Tensor  # [R, L]
    start: int  # first label column (>= 1): logits from position start - 1 on
    mask: torch.Tensor  # [N, C] bool: the scored tokens on the caller's grid
    attention_mask: torch.Tensor | None = None  # [R, L] padding mask
    allowed: torch.Tensor | None = None  # [R, 1, L, L] bool: query q sees key k (instead of ``attention_mask``)
    position_ids: torch.Tensor | None = None  # [R, L]
    source: torch.Tensor | None = None  # [R, L - start]: the position predicting each label (None: the one before)
    index: torch.Tensor | None = None  # [N, C]: flat index into [R * (L - start)] of each grid position (None: same)
    window: int = 0  # the longest original sequence (a custom mask replaces a sliding-window mask)
    varlen: bool = False  # positions restart at each sequence: flash attention can take them instead of ``allowed``

    def to_grid(self, values: torch.Tensor) -> torch.Tensor:
        """``[R, L - start]`` per-label values on the caller's ``[N, C]`` grid."""
        return values if self.index is None else values.reshape(-1)[self.index]


def padded(input_ids: torch.Tensor, attention_mask: torch.Tensor, scored: torch.Tensor) -> Layout:
    """Rows as they are, scoring the tokens where ``scored`` is 1; the grid is ``[N, L - start]``.

    Only positions from the batch's first scored token on need logits: the LM head skips the prefix before it (the
    prompt, with real vocabularies a large saving). The first token of a row is never scored (nothing predicts it).
    """
    has = scored.any(1)
    first = scored.int().argmax(1)[has]
    start = max(int(first.min()) if first.numel() else 1, 1)
    return Layout("padded", input_ids, start, scored[:, start:].bool(), attention_mask=attention_mask,
                  window=input_ids.shape[1])


def segments(input_ids: torch.Tensor, attention_mask: torch.Tensor, scored: torch.Tensor, position_ids: torch.Tensor,
             segment_ids: torch.Tensor) -> Layout:
    """Packed rows (``lit_align.data.packing``): several sequences per row, each attending only to itself (a
    block-causal mask), positions restarting at each. A sequence's first token is never scored: what precedes it is
    another sequence. The grid is ``padded``'s."""
    first = torch.ones_like(scored, dtype=torch.bool)
    first[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    layout = padded(input_ids, attention_mask, scored.bool() & ~first)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = torch.ones(input_ids.shape[1], input_ids.shape[1], dtype=torch.bool, device=input_ids.device).tril_()
    allowed = (same & causal & (segment_ids >= 0)[:, None, :]) | torch.eye(input_ids.shape[1], dtype=torch.bool,
                                                                         device=input_ids.device)
    layout.name, layout.attention_mask, layout.varlen = "packing", None, True
    layout.allowed, layout.position_ids = allowed[:, None], position_ids
    return layout


def prompt_completion(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                      completion_mask: torch.Tensor) -> Layout:
    """Left-padded prompts followed by right-padded completions; the grid is the completions' ``[N, C]``.
    Position ids follow the attention mask, as in generation, so left padding does not shift positions."""
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    return Layout("prompt_completion", torch.cat([prompt_ids, completion_ids], 1), prompt_ids.shape[1],
                  completion_mask.bool(), attention_mask=attention_mask,
                  position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0))


def packed(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
           completion_mask: torch.Tensor) -> Layout:
    """``prompt_completion`` without padding: every prompt's real tokens, then every completion's, in one row::

        [ p_1 | p_2 | ... | p_N | c_1 | c_2 | ... | c_N ]      positions restart in each prompt and go on in its
                                                               completion; a block-causal mask keeps the rows apart

    so the layers compute real tokens only, where a padded batch computes ``N * (P + C)`` positions however short
    most rows are (completion lengths have a long tail). The mask is ``[T, T]`` for ``T`` real tokens (sdpa and
    eager attention), at batch sizes where that fits. Same grid as ``prompt_completion``.
    """
    prompt_real, completion_real = prompt_mask.bool(), completion_mask.bool()
    prompt_lengths, rows = prompt_real.sum(1), torch.arange(len(prompt_ids), device=prompt_ids.device)
    input_ids = torch.cat([prompt_ids[prompt_real], completion_ids[completion_real]])[None]
    segment = torch.cat([rows.repeat_interleave(prompt_lengths), rows.repeat_interleave(completion_real.sum(1))])
    position = torch.cat([(prompt_real.cumsum(1) - 1)[prompt_real],
                          (completion_real.cumsum(1) - 1 + prompt_lengths[:, None])[completion_real]])
    allowed = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
    # each completion token is predicted by the token before it: its row's last prompt token for the first one
    start = int(prompt_lengths.sum())
    source = torch.arange(start - 1, input_ids.shape[1] - 1, device=input_ids.device)
    first_token = (completion_real.cumsum(1) == 1) & completion_real
    source[first_token[completion_real]] = prompt_lengths.cumsum(0)[first_token.any(1)] - 1
    index = torch.zeros(completion_ids.shape, dtype=torch.long, device=completion_ids.device)
    index[completion_real] = torch.arange(int(completion_real.sum()), device=completion_ids.device)
    return Layout("padding_free", input_ids, start, completion_real, allowed=allowed[None, None], position_ids=position[None],
                  source=source[None], index=index)


def shared_prompt_pairs(batch: dict[str, torch.Tensor]) -> Layout | None:
    """DPO's ``[chosen_1..B; rejected_1..B]`` (``[2B, T]``, right-padded) as ``B`` rows ``[prompt, chosen, rejected]``.

    The rejected tokens attend to the prompt and not to the chosen ones, and take the positions they would have after
    the prompt, so every token sees exactly the context it has in ``[chosen; rejected]`` and the log-probs are the
    same up to float rounding, while the prompt goes through the network once per pair instead of twice. The grid is
    the batch's ``[2B, W]`` order (each row read twice: under its chosen mask, under its rejected one).

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
    source = torch.where(pos == chosen_end[:, None], prompt_c[:, None] - 1, pos - 1).clamp(min=0)
    first = int(prompt_c.min())
    labels = width - first
    index = (torch.arange(pairs, device=device)[:, None] * labels + torch.arange(labels, device=device)).repeat(2, 1)
    return Layout("share_prompt", input_ids[source_row, source_col], first,
                  torch.cat([chosen[:, first:], rejected[:, first:]]), allowed=allowed[:, None],
                  position_ids=source_col, source=source[:, first:], index=index, window=int(lengths.max()))


def pairs(batch: dict[str, torch.Tensor], model: torch.nn.Module, share_prompt: bool = True) -> Layout:
    """The layout ``model`` runs a batch of pairs in: ``shared_prompt_pairs`` where it can, else ``padded``."""
    if share_prompt and supports_shared_prompt(model):
        layout = shared_prompt_pairs(batch)
        window = getattr(model.config, "sliding_window", None)  # a custom mask replaces the sliding-window mask
        if layout is not None and (not window or layout.window <= window):
            return layout
    return padded(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
