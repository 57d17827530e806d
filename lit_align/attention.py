"""Attention under a sparse 4D mask that computes only what the mask lets through (CPU).

torch's CPU attention kernels skip hidden blocks only under ``is_causal``: given an explicit mask, they score every
query against every key of the row. The packed layouts' masks (``lit_align.layouts``: several sequences per row,
each seeing only itself; a pair's rejected tokens not seeing its chosen ones; GRPO's completions seeing their prompt
and themselves) hide most of a row: 75% of the real model's packed DPO rows, more of GRPO's.

``sparse_mask(allowed)`` is that bool mask as a ``SparseMask``: the same tensor, plus ``tiles``, for each row's run of
``TILE`` queries the keys they see (a range, or the columns when they are not one run) and the tile's mask on those
keys (None when it lets everything through, ``is_causal`` when it is a causal square). transformers' ``sdpa``
attention hands the mask to ``F.scaled_dot_product_attention`` as it is; given a ``SparseMask``, that call runs
``sparse_attention``: each tile against its keys only, in torch's CPU flash-attention kernels, forward and backward
(``SparseAttention``), the same values as the full call up to float rounding. Any other use of the mask, and any call
it does not cover (another device, dropout, fp64), is the plain tensor's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward as transformers_sdpa

TILE = 256  # most queries per tile: a longer run of them is split evenly
MIN_RUN = 32  # a shorter run of queries joins its neighbour's tile (padding queries each see only themselves)

_KERNELS = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


@dataclass(frozen=True)
class Part:
    """Keys a tile's queries see, for one kernel call."""

    keys: slice | torch.Tensor  # a range of keys, or their columns
    mask: torch.Tensor | None = None  # [1, 1, queries, keys] additive (0 / -inf) float32; None: all of ``keys``
    causal: bool = False  # causal from the tile's first query (``keys`` start there, as many as the queries)


@dataclass(frozen=True)
class Tile:
    row: int
    start: int  # queries start .. stop - 1
    stop: int
    parts: tuple[Part, ...]  # the keys they see; several parts' results are merged by their log-sum-exp


def plan(allowed: torch.Tensor, tile: int = TILE) -> list[Tile]:
    """The tiles of a bool ``allowed [R, 1, Q, K]`` mask (query ``q`` sees key ``k``); every query sees some key.

    A row's queries are cut where one does not see the query before it (a new sequence, a pair's rejected tokens, a
    completion after another), so that a tile's queries see the same earlier keys and, causally, each other: its
    keys are then unmasked runs and one causal square, each a kernel call without a mask. Other tiles get their
    keys' range (or columns) and an additive mask."""
    allowed = allowed.cpu()
    tiles = []
    for row in range(allowed.shape[0]):
        mask = allowed[row, 0]
        for start, stop in _query_ranges(mask, tile):
            tiles.append(Tile(row, start, stop, _parts(mask[start:stop], start)))
    return tiles


def _query_ranges(mask: torch.Tensor, tile: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of a ``[Q, K]`` mask's queries: runs that see their predecessor (short ones merged
    with a neighbour up to ``tile`` queries), each split evenly into at most ``tile``."""
    length = mask.shape[0]
    cuts = (~mask.diagonal(-1)).nonzero().flatten().add(1).tolist() if mask.shape[0] == mask.shape[1] else []
    runs = []
    for start, stop in zip([0] + cuts, cuts + [length]):
        if runs and min(stop - start, runs[-1][1] - runs[-1][0]) < MIN_RUN and stop - runs[-1][0] <= tile:
            runs[-1] = (runs[-1][0], stop)
        else:
            runs.append((start, stop))
    ranges = []
    for start, stop in runs:
        size = -(-(stop - start) // -(-(stop - start) // tile))  # the run in equal tiles of at most ``tile``
        ranges += [(a, min(a + size, stop)) for a in range(start, stop, size)]
    return ranges


def _parts(block: torch.Tensor, start: int) -> tuple[Part, ...]:
    """The parts of a tile's ``[queries, K]`` mask, its queries ``start ..``: unmasked runs of the earlier keys and a
    causal square where every query sees the same earlier keys and the tile causally, else one masked part."""
    stop = start + block.shape[0]
    own = block[:, start:stop]
    if (own.shape[0] == own.shape[1] and not block[:, stop:].any() and torch.equal(own, torch.ones_like(own).tril_())
            and bool((block[:, :start] == block[:1, :start]).all())):
        return (*(Part(keys) for keys in _runs(block[0, :start].nonzero().flatten())),
                Part(slice(start, stop), causal=True))
    columns = block.any(0).nonzero().flatten()
    runs = _runs(columns)
    keys = runs[0] if len(runs) == 1 else columns
    block = block[:, keys]
    return (Part(keys) if bool(block.all()) else Part(keys, additive(block)),)


def _runs(columns: torch.Tensor) -> list[slice]:
    """Sorted column indices as slices of consecutive ones."""
    if not len(columns):
        return []
    edges = [0, *((columns[1:] != columns[:-1] + 1).nonzero().flatten() + 1).tolist(), len(columns)]
    return [slice(int(columns[a]), int(columns[b - 1]) + 1) for a, b in zip(edges, edges[1:])]


def additive(block: torch.Tensor) -> torch.Tensor:
    return torch.zeros(block.shape, dtype=torch.float32).masked_fill_(~block, float("-inf"))[None, None]


def _keys(x: torch.Tensor, row: int, part: Part) -> torch.Tensor:
    x = x[row:row + 1]
    return x[:, :, part.keys] if isinstance(part.keys, slice) else x.index_select(2, part.keys)


def _mask(part: Part, dtype: torch.dtype) -> torch.Tensor | None:
    return None if part.mask is None else part.mask.to(dtype)


def _merged(results: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention output and log-sum-exp from those of disjoint key sets: each output weighted by its share of
    the softmax's total, ``exp(lse_part - lse)``."""
    if len(results) == 1:
        return results[0]
    lses = torch.stack([lse for _, lse in results])
    lse = torch.logsumexp(lses, 0)
    weights = (lses - lse).exp_().unsqueeze(-1)
    out = sum(w * o.float() for w, (o, _) in zip(weights, results))
    return out.to(results[0][0].dtype), lse


class SparseAttention(torch.autograd.Function):
    """``softmax(q k^T * scale + mask) v`` tile by tile (``plan``), in torch's CPU flash-attention kernels, which
    take grouped keys and values as they are (GQA: fewer key/value heads than query heads; none repeated, nor kept
    repeated for backward). A tile of several parts merges their outputs in forward; in backward each part's call
    gets the merged output and log-sum-exp, which makes its keys' share of every gradient exactly. The output is laid
    out ``[R, Q, H, D]`` in memory (a ``[R, H, Q, D]`` view of it), the layout attention's callers transpose it to:
    that transpose copies nothing, and the output projection keeps the storage this keeps for backward."""

    @staticmethod
    def forward(ctx, query, key, value, tiles, scale):
        rows, heads, queries, dim = query.shape
        out = query.new_empty(rows, queries, heads, dim).transpose(1, 2)
        logsumexp = query.new_empty(query.shape[:3], dtype=torch.float32)
        for tile in tiles:
            at = (slice(tile.row, tile.row + 1), slice(None), slice(tile.start, tile.stop))
            out[at], logsumexp[at] = _merged([torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query[at], _keys(key, tile.row, part), _keys(value, tile.row, part), 0.0, part.causal,
                attn_mask=_mask(part, query.dtype), scale=scale)
                for part in tile.parts])
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.tiles, ctx.scale = tiles, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, logsumexp = ctx.saved_tensors
        grad_query, grad_key, grad_value = torch.empty_like(query), torch.zeros_like(key), torch.zeros_like(value)
        for tile in ctx.tiles:
            at = (slice(tile.row, tile.row + 1), slice(None), slice(tile.start, tile.stop))
            grad_tile = None
            for part in tile.parts:
                gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    grad[at], query[at], _keys(key, tile.row, part), _keys(value, tile.row, part), out[at],
                    logsumexp[at], 0.0, part.causal, attn_mask=_mask(part, query.dtype), scale=ctx.scale)
                grad_tile = gq if grad_tile is None else grad_tile.add_(gq)
                if isinstance(part.keys, slice):
                    grad_key[tile.row:tile.row + 1, :, part.keys] += gk
                    grad_value[tile.row:tile.row + 1, :, part.keys] += gv
                else:
                    grad_key[tile.row:tile.row + 1].index_add_(2, part.keys, gk)
                    grad_value[tile.row:tile.row + 1].index_add_(2, part.keys, gv)
            grad_query[at] = grad_tile
        return grad_query, grad_key, grad_value, None, None


def sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tiles: list[Tile],
                     scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention(query, key, value, attn_mask=<the mask of tiles>, scale=scale)`` computing
    only the tiles' keys: ``query [R, H, Q, D]``, ``key``/``value [R, H_kv, K, D]`` (``H_kv < H`` with
    ``enable_gqa``, each key head serving ``H // H_kv`` query heads)."""
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"key has {key.shape[1]} heads and query {query.shape[1]}: pass enable_gqa=True")
    return SparseAttention.apply(query, key, value, tiles, query.shape[-1] ** -0.5 if scale is None else scale)


class SparseMask(torch.Tensor):
    """A bool ``[R, 1, Q, K]`` attention mask with its ``tiles``: ``F.scaled_dot_product_attention`` given it computes
    only what it lets through (``sparse_attention``), where it can; everything else sees the plain tensor.

    transformers' ``sdpa`` attention meets it first (``sdpa_attention_forward``, registered under that name) and hands
    a grouped model's keys and values over as the model's own heads. A caller that repeated them to every query head
    itself (as many heads as the query, with ``kv_groups`` > 1, the query heads per key/value head of the model the
    mask is made for) has every ``kv_groups``-th head taken back, so that backward keeps those and not the copies."""

    tiles: list[Tile]
    kv_groups: int = 1

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor | None:
        """``sparse_attention`` under this mask where it covers the call (CPU, fp32/bf16/fp16, no dropout, not
        causal, this mask's shape; under autocast in its dtype), else None."""
        if torch.is_autocast_enabled("cpu"):  # what autocast would give the kernel: its lower precision
            query, key, value = (x.to(torch.get_autocast_dtype("cpu")) for x in (query, key, value))
        if not (_KERNELS and query.device.type == "cpu"
                and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and query.dtype == key.dtype == value.dtype and not dropout_p and not is_causal
                and (query.shape[0], query.shape[2], key.shape[2]) == tuple(self.shape[i] for i in (0, 2, 3))):
            return None
        groups = self.kv_groups
        if groups > 1 and key.shape[1] == query.shape[1] and query.shape[1] % groups == 0:
            key, value, enable_gqa = key[:, ::groups].contiguous(), value[:, ::groups].contiguous(), True
        return sparse_attention(query, key, value, self.tiles, scale, enable_gqa)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
                            args), **kwargs)
            mask = call.pop("attn_mask", None)
            if isinstance(mask, SparseMask):
                with torch._C.DisableTorchFunctionSubclass():
                    out = mask.attend(**call)
                if out is not None:
                    return out
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                           **kwargs):
    """transformers' ``sdpa`` attention function, taking a ``SparseMask`` before it repeats a grouped model's keys
    and values to every query head (under a mask it does, to reach torch's kernels): ``sparse_attention`` computes
    the groups as they are. Every other call is transformers' own function's."""
    if (isinstance(attention_mask, SparseMask) and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions")):
        with torch._C.DisableTorchFunctionSubclass():
            out = attention_mask.attend(query, key, value, dropout, scale=scaling,
                                        enable_gqa=key.shape[1] != query.shape[1])
        if out is not None:
            return out.transpose(1, 2), None  # [R, Q, H, D], contiguous: as transformers' returns it
    return transformers_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             is_causal=is_causal, **kwargs)


def sparse_mask(allowed: torch.Tensor, kv_groups: int = 1) -> SparseMask:
    """``allowed`` (bool ``[R, 1, Q, K]``, every query seeing some key) as a ``SparseMask`` for a model with
    ``kv_groups`` query heads per key/value head."""
    AttentionInterface.register("sdpa", sdpa_attention_forward)
    mask = allowed.as_subclass(SparseMask)
    mask.tiles, mask.kv_groups = plan(allowed), kv_groups
    return mask


def skips_hidden(model: torch.nn.Module, device: torch.device | str) -> bool:
    """Whether ``model``'s attention on ``device`` computes only what a 4D mask lets through: sdpa on CPU, given a
    ``SparseMask`` (``lit_align.logps.attention_mask_4d``); its cost then follows the mask, not the row's square."""
    return _KERNELS and model.config._attn_implementation == "sdpa" and torch.device(device).type == "cpu"
