"""Sequence layouts: how rows are laid out for one forward, and where each scored token lands afterwards.

A ``Layout`` is the forward's input (``input_ids [R, L]``, a 2D padding mask or a 4D ``allowed`` mask, positions),
the first label column ``start``, optionally which position predicts each label (``source``), and the map from the
forward's ``[R, L - start]`` log-probs to the caller's grid ``[N, C]`` (``index``; None: the same grid) with the
grid's ``mask`` of scored tokens. ``lit_align.logps.layout_logps`` runs any of them. Seven layouts, and each recipe's
choice among them (``sft``, ``pairs``, ``completions``):

- ``padded``: right-padded rows (SFT rows, DPO's ``[chosen_1..B; rejected_1..B]``), scoring a masked subset;
- ``prompt_completion``: left-padded prompts, right-padded completions (GRPO), positions following the mask;
- ``right_aligned``: the same rows as ``[prompt, completion, padding]``, for ``packed_rows`` (GRPO's ``padding_free``);
- ``shared_prompt_pairs``: each DPO pair as one row ``[prompt, chosen, rejected]``, the prompt computed once;
- ``shared_prompt_completions``: GRPO's completions as one row per prompt ``[prompt, completion, completion, ...]``;
- ``segments``: packed SFT rows, several sequences per row with a block-causal mask; ``one_row`` makes a batch's
  rows (padded or packed) one such row (SFT's ``padding_free``);
- ``packed_rows``: a right-padded layout (DPO's two pair layouts, GRPO's two) without padding (their
  ``padding_free``), its rows packed into as few rows as hold them, the LM head on the scored tokens only
  (``targets``).

``padding_free`` means the same for every recipe: the step's sequences packed without padding, each attending only to
itself, the same log-probs up to float rounding. SFT makes the batch one row (TRL's way; under flash attention the
restarting positions mark the sequences, no mask); DPO and GRPO pack rows (``packed_rows``, the LM head on the
scored tokens only): one row where the attention computes only what the mask lets through (``packing_width``: sdpa
on CPU), else rows as wide as the longest, each prompt once where they can (a pair's prompt, the prompt of a step's
completions). The 4D layouts need a model that takes a custom mask (``lit_align.capabilities``); ``pairs`` picks the
shared-prompt layout only for a model that does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lit_align.attention import skips_hidden
from lit_align.capabilities import supports_shared_prompt
from lit_align.data.packing import bfd_bins
from lit_align.errors import LitAlignError


PACKED_WIDTH = 8192  # widest packed row where attention skips what the mask hides: its [W, W] bool mask is 64 MiB
MIN_SHARED_PREFIX = 16  # fewest first prompt tokens in common that a step's completions run once for all prompts


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
    # [S]: flat positions into [R * L] of the only tokens scored (``start`` unused); ``source`` then holds their
    # predictors' flat positions ([S]), the log-probs come out [1, S] and ``index`` points into those
    targets: torch.Tensor | None = None

    def labels(self) -> torch.Tensor:
        """The token ids the forward scores: ``[R, L - start]``, or ``[1, S]`` with ``targets``."""
        return self.input_ids[:, self.start:] if self.targets is None else self.input_ids.reshape(-1)[self.targets][None]

    def to_grid(self, values: torch.Tensor) -> torch.Tensor:
        """The forward's per-label values (``labels``' shape, and any trailing dimensions: hidden states) on the
        caller's ``[N, C]`` grid."""
        return values if self.index is None else values.flatten(0, 1)[self.index]


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


def one_row(input_ids: torch.Tensor, attention_mask: torch.Tensor, scored: torch.Tensor,
            position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None) -> Layout:
    """Right-padded rows (``padded``'s, or packed ones with their ``position_ids`` and ``segment_ids``) as one row of
    their sequences back to back, no padding: ``segments`` of a single row. The grid is that row's."""
    real = attention_mask.bool()
    rows = torch.arange(len(input_ids), device=input_ids.device)[:, None].expand_as(input_ids)
    if position_ids is None:  # one sequence per row, from position 0
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    if segment_ids is None:
        segment_ids = torch.zeros_like(input_ids)
    segment = rows * (int(segment_ids.max()) + 1) + segment_ids  # one id per sequence of the whole batch
    return segments(input_ids[real][None], attention_mask[real][None], scored[real][None],
                    position_ids[real][None], segment[real][None])


def sft(batch: dict[str, torch.Tensor], scored: torch.Tensor, padding_free: bool = False) -> Layout:
    """The layout an SFT batch runs in: its rows as they come (``padded``, or ``segments`` for packed rows), or with
    ``padding_free`` all of them as one row (``one_row``), scoring the tokens where ``scored`` is 1."""
    packed = "segment_ids" in batch
    if padding_free:
        return one_row(batch["input_ids"], batch["attention_mask"], scored, batch.get("position_ids"),
                       batch.get("segment_ids"))
    if packed:
        return segments(batch["input_ids"], batch["attention_mask"], scored, batch["position_ids"],
                        batch["segment_ids"])
    return padded(batch["input_ids"], batch["attention_mask"], scored)


def prompt_completion(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                      completion_mask: torch.Tensor) -> Layout:
    """Left-padded prompts followed by right-padded completions; the grid is the completions' ``[N, C]``.
    Position ids follow the attention mask, as in generation, so left padding does not shift positions."""
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    return Layout("prompt_completion", torch.cat([prompt_ids, completion_ids], 1), prompt_ids.shape[1],
                  completion_mask.bool(), attention_mask=attention_mask,
                  position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0))


def right_aligned(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor) -> Layout:
    """``prompt_completion``'s rows with their padding moved to the end, ``[prompt | completion | padding]``,
    positions from 0: the same values, in the right-padded form ``packed_rows`` packs (GRPO's ``padding_free``).
    The grid is the completions' ``[N, C]``."""
    real = torch.cat([prompt_mask, completion_mask], 1).bool()
    lengths, prompt_lengths = real.sum(1), prompt_mask.bool().sum(1)
    width = int(lengths.max())
    order = torch.sort((~real).int(), dim=1, stable=True).indices[:, :width]  # each row's real tokens first, in order
    input_ids = torch.cat([prompt_ids, completion_ids], 1).gather(1, order)
    columns = torch.arange(width, device=input_ids.device)
    attention_mask = (columns < lengths[:, None]).long()
    # completion token j of row i is label column P_i + j - 1 (labels start at column 1)
    label_columns = prompt_lengths[:, None] + torch.arange(completion_ids.shape[1], device=input_ids.device) - 1
    rows = torch.arange(len(input_ids), device=input_ids.device)[:, None]
    index = rows * (width - 1) + label_columns.clamp(0, max(width - 2, 0))
    return Layout("right_aligned", input_ids.masked_fill(attention_mask == 0, 0), 1, completion_mask.bool(),
                  attention_mask=attention_mask, index=index, window=width)


def _prompts_then_completions(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> bool:
    """Whether every prompt is left-padded and not empty, and every completion one run from its first column: the
    rows ``shared_prompt_completions`` can lay out."""
    prompt, completion = prompt_mask.bool(), completion_mask.bool()
    prompt_columns = torch.arange(prompt.shape[1], device=prompt.device)
    completion_columns = torch.arange(completion.shape[1], device=completion.device)
    return (torch.equal(prompt, prompt_columns >= prompt.shape[1] - prompt.sum(1)[:, None])
            and torch.equal(completion, completion_columns < completion.sum(1)[:, None])
            and bool((prompt.sum(1) > 0).all()))


def shared_prefix(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """How many first real tokens every left-padded prompt has in common (a chat template's system prompt and
    header), leaving each prompt at least one token of its own (its last logits come from its own forward)."""
    lengths = prompt_mask.sum(1)
    shortest = int(lengths.min())
    if len(prompt_ids) < 2 or shortest < 2:
        return 0
    columns = prompt_ids.shape[1] - lengths[:, None] + torch.arange(shortest - 1, device=prompt_ids.device)
    heads = prompt_ids.gather(1, columns)  # each prompt's first real tokens
    differs = (heads != heads[:1]).any(0)
    return int(differs.int().argmax()) if differs.any() else shortest - 1


def shared_prompt_completions(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                              completion_mask: torch.Tensor, prefix_width: int | None = None) -> Layout | None:
    """GRPO's completions as one row per distinct prompt, ``[prompt, completion_a, completion_b, ..., padding]``.

    Each completion's tokens attend to the prompt and to their own completion only, at the positions they would have
    right after the prompt, so every token sees exactly the context it has in ``right_aligned``'s rows and the
    log-probs are the same up to float rounding, while a prompt goes through the network once per step instead of
    once per completion of it (a step of 8 completions of 4 prompts: about half its prompt tokens). The grid is the
    completions' ``[N, C]``.

    With ``prefix_width``, the first tokens every distinct prompt has in common (``shared_prefix``: a chat template's
    system prompt and header, a tool list), when there are at least ``MIN_SHARED_PREFIX`` of them, run once too: all
    in one row ``[prefix, prompt_a's rest, its completions, prompt_b's rest, ...]`` (if it is at most
    ``prefix_width`` wide), each prompt's rest attending to the prefix and to itself (``shared_prefix_completions``).

    None when no prompt repeats and no prefix is shared, or the rows are not of that form: a prompt that is not
    left-padded, or a completion that is not one run from its first column.
    """
    if not _prompts_then_completions(prompt_mask, completion_mask):
        return None
    device = prompt_ids.device
    n, width = prompt_ids.shape
    prompt_lengths, completion_lengths = prompt_mask.bool().sum(1), completion_mask.bool().sum(1)
    keys = prompt_ids.masked_fill(~prompt_mask.bool(), -1)  # pad ids may differ between equal prompts
    _, group = torch.unique(keys, dim=0, return_inverse=True)
    groups = int(group.max()) + 1
    order = torch.arange(n, device=device)
    first_rows = torch.full((groups,), n, device=device).scatter_reduce_(0, group, order, "amin")
    member, by_first = first_rows.sort()  # each group's first row; groups numbered in that order
    group = torch.empty_like(by_first).scatter_(0, by_first, torch.arange(groups, device=device))[group]
    group_prompt = prompt_lengths[member]
    spans = group_prompt + torch.zeros_like(group_prompt).index_add_(0, group, completion_lengths)
    shared = shared_prefix(prompt_ids[member], prompt_mask[member]) if prefix_width else 0
    if shared < MIN_SHARED_PREFIX or int(spans.sum()) - (groups - 1) * shared > prefix_width:
        shared = 0
    if groups == n and not shared:
        return None
    own = group_prompt - shared  # each prompt's tokens after the shared prefix
    if shared:  # one row: the prefix, then each group's prompt rest and completions
        rows, row_of = 1, torch.zeros(groups, dtype=torch.long, device=device)
        base = shared + (spans - shared).cumsum(0) - (spans - shared)  # each group's first column
        row_lengths = (shared + (spans - shared).sum()).reshape(1)
    else:  # a row per group
        rows, row_of, base, row_lengths = groups, torch.arange(groups, device=device), torch.zeros_like(spans), spans
    # each completion's first column in its row: after its prompt and the group's earlier completions
    earlier = (group[:, None] == group[None, :]) & (order[None, :] < order[:, None])  # [i, j]: j before i, same row
    offset = base[group] + own[group] + (earlier * completion_lengths[None, :]).sum(1)
    length = int(row_lengths.max())
    pos = torch.arange(length, device=device)
    input_ids = torch.zeros(rows, length, dtype=prompt_ids.dtype, device=device)
    position_ids = torch.zeros(rows, length, dtype=torch.long, device=device)
    team = torch.full((rows, length), -2, dtype=torch.long, device=device)  # each column's group, -1 the prefix
    segment = torch.full((rows, length), -2, dtype=torch.long, device=device)  # -1 a prompt's, i completion i
    first = width - group_prompt  # each group's first prompt column in ``prompt_ids``
    if shared:
        input_ids[0, :shared] = prompt_ids[member[0], first[0]:first[0] + shared]
        position_ids[0, :shared], team[0, :shared], segment[0, :shared] = pos[:shared], -1, -1
    g, k = (torch.arange(int(own.max()), device=device) < own[:, None]).nonzero(as_tuple=True)
    at = (row_of[g], base[g] + k)
    input_ids[at] = prompt_ids[member[g], first[g] + shared + k]
    position_ids[at], team[at], segment[at] = shared + k, g, -1
    token_rows, token_cols = completion_mask.bool().nonzero(as_tuple=True)
    at = (row_of[group[token_rows]], offset[token_rows] + token_cols)
    input_ids[at] = completion_ids[token_rows, token_cols]
    position_ids[at], team[at], segment[at] = prompt_lengths[token_rows] + token_cols, group[token_rows], token_rows
    valid = pos < row_lengths[:, None]
    causal = pos[None, :] <= pos[:, None]  # [L(query), L(key)]
    key_team, key_segment = team[:, None, :], segment[:, None, :]
    sees = (key_team == -1) | ((key_team == team[:, :, None])
                               & ((key_segment == -1) | (key_segment == segment[:, :, None])))
    allowed = (causal & sees & valid[:, None, :]) | torch.eye(length, dtype=torch.bool, device=device)
    # label column c (c >= 1) is predicted by column c - 1, but a completion's first token by its prompt's last one
    source = (pos[1:] - 1).repeat(rows, 1)
    scored = completion_lengths > 0
    source[row_of[group[scored]], offset[scored] - 1] = (base + own - 1)[group[scored]]
    completion_columns = offset[:, None] + torch.arange(completion_ids.shape[1], device=device)
    index = row_of[group][:, None] * (length - 1) + (completion_columns - 1).clamp(0, length - 2)
    return Layout("shared_prefix_completions" if shared else "shared_prompt_completions", input_ids, 1,
                  completion_mask.bool(), attention_mask=valid.long(), allowed=allowed[:, None],
                  position_ids=position_ids, source=source, index=index,
                  window=int((prompt_lengths + completion_lengths).max()))


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
                  torch.cat([chosen[:, first:], rejected[:, first:]]), attention_mask=valid.long(),
                  allowed=allowed[:, None], position_ids=source_col, source=source[:, first:], index=index,
                  window=int(lengths.max()))


def packed_bins(lengths: list[int], width: int | None = None) -> list[list[int]]:
    """``lengths``' indices in bins (``lit_align.data.packing.bfd_bins``) at most ``width`` wide (None, or less than
    the longest: the longest), with the fewest padding positions (bins x the fullest bin) of a few capacities tried:
    the total split evenly over as few bins as hold it (or one or two more), and a little more."""
    longest, total = max(lengths), sum(lengths)
    width = max(longest, width or 0)
    fewest = -(-total // width)
    capacities = dict.fromkeys(min(width, max(longest, int(total / rows * slack) + 1))
                               for rows in range(fewest, min(max(fewest, total // longest), fewest + 2) + 1)
                               for slack in (1.0, 1.03, 1.1, 1.25))
    best, best_cost = [], None
    for capacity in capacities:
        bins = bfd_bins(lengths, capacity)
        cost = len(bins) * max(sum(lengths[i] for i in b) for b in bins)
        if best_cost is None or cost < best_cost:
            best, best_cost = bins, cost
        if cost == total:
            break
    return best


def packs_by_default(model: torch.nn.Module, device: torch.device | str) -> bool:
    """``padding_free``'s default (None): on where packing is exact and cheaper than padding, for a model that takes
    a custom mask (``supports_shared_prompt``), has no sliding window, and whose attention computes only what the
    mask lets through (``skips_hidden``: sdpa on CPU). Elsewhere (flash or a GPU's sdpa) a packed row's 4D mask costs
    the square of its width, so padded rows stay the default there."""
    return (supports_shared_prompt(model) and not getattr(model.config, "sliding_window", None)
            and skips_hidden(model, device))


def resolve_padding_free(padding_free: bool | None, model: torch.nn.Module | None, device) -> bool:
    """``padding_free`` as given, or its default for ``model`` on ``device`` (``packs_by_default``) when None."""
    if padding_free is None:
        return model is not None and packs_by_default(model, device)
    return padding_free


def packing_width(model: torch.nn.Module, device: torch.device | str) -> int | None:
    """How wide ``packed_rows`` makes rows for ``model`` on ``device``: up to ``PACKED_WIDTH`` where its attention
    computes only what the mask lets through (``lit_align.attention.skips_hidden``), else as wide as the longest row
    (None): a plain 4D-masked attention's cost is square in the row's width."""
    return PACKED_WIDTH if skips_hidden(model, device) else None


def packed_rows(layout: Layout, width: int | None = None) -> Layout:
    """``layout``'s right-padded rows (``padded``, ``shared_prompt_pairs``, ``right_aligned``) without padding::

        [ pair_3 row | pair_1 row ]        each row whole, best-fit decreasing into rows at most ``width`` wide
        [ pair_2 row | pair_4 row | pad ]  (``packed_bins``); each sees only itself, as before

    Every token keeps its positions and what it attends to (``layout``'s 4D mask, or causal, within its own row), so
    the log-probs are ``layout``'s up to float rounding, while the layers compute few padding positions where a padded
    batch pays every row the longest one's length, and the LM head runs on the scored tokens only (``targets``), not
    on the prompts. ``width`` None: rows as wide as the longest one, for attention whose cost is square in the row's
    width (``packing_width``). The grid is ``layout``'s.
    """
    device = layout.input_ids.device
    n, width_in = layout.input_ids.shape
    lengths = layout.attention_mask.sum(1)
    bins = packed_bins(lengths.tolist(), width)
    capacity = max(int(lengths[b].sum()) for b in bins)
    row_bin, row_offset = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long)
    for b, members in enumerate(bins):
        row_bin[members] = b
        row_offset[members] = (lengths[members].cumsum(0) - lengths[members]).cpu()
    row_bin, row_offset = row_bin.to(device), row_offset.to(device)
    columns = torch.arange(width_in, device=device)
    rows, cols = (columns < lengths[:, None]).nonzero(as_tuple=True)
    new_row, new_col = row_bin[rows], row_offset[rows] + cols
    shape = (len(bins), capacity)
    input_ids = layout.input_ids.new_zeros(shape).index_put_((new_row, new_col), layout.input_ids[rows, cols])
    positions = layout.position_ids if layout.position_ids is not None else columns.expand(n, width_in)
    position_ids = positions.new_zeros(shape).index_put_((new_row, new_col), positions[rows, cols])
    owner = torch.full(shape, -1, dtype=torch.long, device=device).index_put_((new_row, new_col), rows)
    column = torch.zeros(shape, dtype=torch.long, device=device).index_put_((new_row, new_col), cols)
    if layout.allowed is not None:  # query q sees key k where the original row let it
        inner = layout.allowed[owner.clamp(min=0)[:, :, None], 0, column[:, :, None], column[:, None, :]]
    else:
        inner = column[:, None, :] <= column[:, :, None]
    allowed = inner & (owner[:, :, None] == owner[:, None, :]) & (owner >= 0)[:, None, :]
    allowed |= torch.eye(capacity, dtype=torch.bool, device=device)  # padding queries: themselves (no empty softmax)
    # where each original (row, column) went, flat in [rows * capacity]; then the grid's scored tokens and predictors
    flat = torch.zeros(n, width_in, dtype=torch.long, device=device).index_put_((rows, cols),
                                                                          new_row * capacity + new_col)
    labels = width_in - layout.start
    grid = layout.index if layout.index is not None else torch.arange(n * labels, device=device).view(n, labels)
    grid_row, grid_col = grid // labels, grid % labels + layout.start
    predictor = (columns - 1).clamp(min=0).repeat(n, 1)
    if layout.source is not None:
        predictor[:, layout.start:] = layout.source
    scored = layout.mask
    targets = flat[grid_row, grid_col][scored]
    source = flat[grid_row, predictor[grid_row, grid_col]][scored]
    index = torch.zeros_like(grid)
    index[scored] = torch.arange(len(targets), device=device)
    return Layout(f"{layout.name}+padding_free", input_ids, 1, scored, allowed=allowed[:, None],
                  position_ids=position_ids, source=source, index=index, window=layout.window, targets=targets)


def pairs(batch: dict[str, torch.Tensor], model: torch.nn.Module, share_prompt: bool = True,
          padding_free: bool | None = None) -> Layout:
    """The layout ``model`` runs a batch of pairs in: ``shared_prompt_pairs`` where it can, else ``padded``; with
    ``padding_free`` (None: ``packs_by_default``), that layout packed (``packed_rows``)."""
    layout = None
    padding_free = resolve_padding_free(padding_free, model, batch["input_ids"].device)
    custom_mask = supports_shared_prompt(model)
    if padding_free and not custom_mask:
        raise LitAlignError(f"padding_free needs a model that takes a custom attention mask and position ids (sdpa "
                            f"or eager attention, a Llama-like architecture); this one is "
                            f"{getattr(model.config, 'model_type', '?')!r} with "
                            f"{getattr(model.config, '_attn_implementation', '?')!r} attention")
    if share_prompt and custom_mask:
        layout = shared_prompt_pairs(batch)
    if layout is None:
        layout = padded(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    if padding_free:
        layout = packed_rows(layout, packing_width(model, batch["input_ids"].device))
    window = getattr(model.config, "sliding_window", None)  # a custom mask replaces the sliding-window mask
    if layout.allowed is not None and window and layout.window > window:
        return padded(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    return layout


def completions(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                completion_mask: torch.Tensor, padding_free: bool | None = False,
                model: torch.nn.Module | None = None) -> Layout:
    """The layout GRPO's completions run in: after their left-padded prompts (``prompt_completion``), or with
    ``padding_free`` packed without padding (``packed_rows``, as wide as ``packing_width`` lets ``model``; None: rows
    as wide as the longest): one row per prompt, its completions after it, where a prompt repeats, and with a
    ``packing_width`` the prompts' common start once where they have one (``shared_prompt_completions``), else
    ``[prompt, completion]`` rows (``right_aligned``). ``padding_free`` None: ``packs_by_default``."""
    if resolve_padding_free(padding_free, model, prompt_ids.device):
        width = None if model is None else packing_width(model, prompt_ids.device)
        layout = shared_prompt_completions(prompt_ids, prompt_mask, completion_ids, completion_mask, width)
        if layout is None:
            layout = right_aligned(prompt_ids, prompt_mask, completion_ids, completion_mask)
        return packed_rows(layout, width)
    return prompt_completion(prompt_ids, prompt_mask, completion_ids, completion_mask)
