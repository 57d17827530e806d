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

TILE = 128  # queries per tile: small enough to follow a mask's blocks, large enough for the kernel's efficiency

_KERNELS = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


@dataclass(frozen=True)
class Tile:
    row: int
    start: int  # queries start .. stop - 1
    stop: int
    keys: slice | torch.Tensor  # the keys any of them sees: a range, or their columns
    mask: torch.Tensor | None  # [1, 1, stop - start, keys] additive (0 / -inf) float32; None: all of ``keys``
    causal: bool = False  # the tile's mask is causal from its first key (``keys`` as long as the tile)


def plan(allowed: torch.Tensor, tile: int = TILE) -> list[Tile]:
    """The tiles of a bool ``allowed [R, 1, Q, K]`` mask (query ``q`` sees key ``k``); every query sees some key."""
    allowed = allowed.cpu()
    tiles = []
    for row in range(allowed.shape[0]):
        for start in range(0, allowed.shape[2], tile):
            stop = min(start + tile, allowed.shape[2])
            block = allowed[row, 0, start:stop]
            columns = block.any(0).nonzero().flatten()
            first, last = int(columns[0]), int(columns[-1]) + 1
            keys = slice(first, last) if last - first == len(columns) else columns
            block = block[:, keys]
            if bool(block.all()):
                tiles.append(Tile(row, start, stop, keys, None))
            elif (isinstance(keys, slice) and block.shape[0] == block.shape[1]
                  and torch.equal(block, torch.ones_like(block).tril_())):
                tiles.append(Tile(row, start, stop, keys, None, causal=True))
            else:
                tiles.append(Tile(row, start, stop, keys, additive(block)))
    return tiles


def additive(block: torch.Tensor) -> torch.Tensor:
    return torch.zeros(block.shape, dtype=torch.float32).masked_fill_(~block, float("-inf"))[None, None]


def _keys(x: torch.Tensor, tile: Tile) -> torch.Tensor:
    row = x[tile.row:tile.row + 1]
    return row[:, :, tile.keys] if isinstance(tile.keys, slice) else row.index_select(2, tile.keys)


class SparseAttention(torch.autograd.Function):
    """``softmax(q k^T * scale + mask) v`` tile by tile (``plan``), in torch's CPU flash-attention kernels, which
    take grouped keys and values as they are (GQA: fewer key/value heads than query heads; none repeated, nor kept
    repeated for backward). The output is laid out ``[R, Q, H, D]`` in memory (a ``[R, H, Q, D]`` view of it), the
    layout attention's callers transpose it to: that transpose copies nothing, and the output projection keeps the
    storage this keeps for backward."""

    @staticmethod
    def forward(ctx, query, key, value, tiles, scale):
        rows, heads, queries, dim = query.shape
        out = query.new_empty(rows, queries, heads, dim).transpose(1, 2)
        logsumexp = query.new_empty(query.shape[:3], dtype=torch.float32)
        for tile in tiles:
            mask = None if tile.mask is None else tile.mask.to(query.dtype)
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query[tile.row:tile.row + 1, :, tile.start:tile.stop], _keys(key, tile), _keys(value, tile), 0.0,
                tile.causal, attn_mask=mask, scale=scale)
            out[tile.row:tile.row + 1, :, tile.start:tile.stop] = o
            logsumexp[tile.row:tile.row + 1, :, tile.start:tile.stop] = lse
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.tiles, ctx.scale = tiles, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, logsumexp = ctx.saved_tensors
        grad_query, grad_key, grad_value = torch.empty_like(query), torch.zeros_like(key), torch.zeros_like(value)
        for tile in ctx.tiles:
            queries = (slice(tile.row, tile.row + 1), slice(None), slice(tile.start, tile.stop))
            mask = None if tile.mask is None else tile.mask.to(query.dtype)
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad[queries], query[queries], _keys(key, tile), _keys(value, tile), out[queries],
                logsumexp[queries], 0.0, tile.causal, attn_mask=mask, scale=ctx.scale)
            grad_query[queries] = gq
            if isinstance(tile.keys, slice):
                grad_key[tile.row:tile.row + 1, :, tile.keys] += gk
                grad_value[tile.row:tile.row + 1, :, tile.keys] += gv
            else:
                grad_key[tile.row:tile.row + 1].index_add_(2, tile.keys, gk)
                grad_value[tile.row:tile.row + 1].index_add_(2, tile.keys, gv)
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
