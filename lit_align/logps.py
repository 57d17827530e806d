"""Next-token log-probs of a causal LM, plain or chunked: the one place every recipe gets its log-probs from.

Plain: the model's forward returns ``[N, T, V]`` logits and ``token_logps`` gathers the labels. For backward,
autograd keeps those logits (and, in half precision, their fp32 copy): at a 128k vocabulary that is the largest tensor
of the step by far. Chunked (``chunk_size``): the decoder runs to hidden states ``[N, T, H]`` and
``chunked_token_logps`` applies the LM head ``chunk_size`` positions and one vocabulary block at a time (a tile that
stays in cache while an online logsumexp reads it), in fp32, keeping only the per-token log-probs; backward recomputes
the tiles. Same values and gradients (to float rounding), peak memory of one tile instead of ``[N, T, V]``
(``bench/logps_memory.py``), and fewer passes over memory than the full logits' ``logsumexp`` and ``softmax``.

Precision: whatever the model's dtype or autocast, the logsumexp, the log-probs and the statistics are fp32 (fp64 for
an fp64 model, so that tests can check formulas free of fp32 rounding).

Not chunked (falls back to the plain path, same results): models whose head is not a plain ``nn.Linear`` after
``get_decoder()``, models with final-logit soft-capping (Gemma 2/3), and heads that are sharded outside their own
forward: DeepSpeed ZeRO-3 partitions, and a model wrapped whole as one FSDP unit (the frozen reference under
``configs/strategy/fsdp.yaml``; its forward runs without gradient, so no logits are kept for backward anyway). The
policy under FSDP is chunked: its head lives in the root unit, whole during ``training_step``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lit_align.attention import skips_hidden, sparse_mask
from lit_align.capabilities import attention_implementation, is_fsdp_unit, takes_custom_mask, takes_logits_to_keep
from lit_align.errors import LitAlignError

STATS = ("entropy", "argmax", "mean_logit", "log_sum_sq_probs")
DEFAULT_CHUNK_ROWS = 512  # positions per chunk where no chunk size is set
BLOCK_LOGITS = 2**21  # logits per [rows, vocabulary block] tile: 8 MB in fp32, in the last-level cache
KEEP_LOGITS_BYTES = 2**28  # with ``keep_logits``, backward reuses the forward's logits when they take at most this


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype log-probs are computed in: fp32 for half precision and fp32 inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def fp32_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` over the vocabulary in (at least) fp32: ``[N, T, V] -> [N, T]`` (half precision upcast one
    sequence at a time, so no fp32 copy of the whole batch's logits is made)."""
    if logits.dtype in (torch.float32, torch.float64):
        return torch.logsumexp(logits, dim=-1)
    return torch.stack([torch.logsumexp(row.float(), dim=-1) for row in logits])


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under ``logits``: ``[N, T, V], [N, T] -> [N, T]`` (fp32; fp64 for fp64 logits).

    Gathers the label logit and subtracts a logsumexp, so no ``[N, T, V]`` log-softmax is ever held beside the
    logits. Labels must be valid ids everywhere (mask afterwards; use any id, e.g. 0, at padded positions).
    """
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(compute_dtype(logits.dtype))
    return picked - fp32_logsumexp(logits)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


class _Head:
    """The LM head cut into vocabulary blocks: ``tiles(h)`` yields ``(start, weight block, logits)``, each logits tile
    ``[rows, block]``: ``scale * (h @ weight[start:start + block].T + bias)`` in the compute dtype, the matmul in
    ``dtype``."""

    def __init__(self, weight, bias, scale: float, dtype: torch.dtype, block: int):
        self.weight, self.bias = weight.to(dtype), None if bias is None else bias.to(dtype)  # cast once
        self.scale, self.acc, self.block = scale, compute_dtype(dtype), block

    def tiles(self, h: torch.Tensor):
        for v in range(0, self.weight.shape[0], self.block):
            w = self.weight[v : v + self.block]
            logits = F.linear(h, w, None if self.bias is None else self.bias[v : v + self.block]).to(self.acc)
            yield v, w, logits if self.scale == 1.0 else logits.mul_(self.scale)

    def logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole vocabulary's logits ``[rows, V]`` (a head of one block), written into ``out`` where given and
        the matmul runs in the compute dtype (else a new tensor): ``F.linear``'s own product, the same values."""
        if out is None or self.weight.dtype != self.acc:
            return next(self.tiles(h))[2]
        if self.bias is None:
            torch.mm(h, self.weight.T, out=out)
        else:
            torch.addmm(self.bias, h, self.weight.T, out=out)
        return out if self.scale == 1.0 else out.mul_(self.scale)

    def log_softmax_tiles(self, h: torch.Tensor, lse: torch.Tensor, kept=None):
        """``tiles(h)`` as log-probs, given the rows' log-sum-exp ``lse``: recomputed, or (``kept``: forward's
        ``(logits - running max, running max)`` tiles, in order) shifted in place, with no matmul."""
        if kept is None:
            for v, w, x in self.tiles(h):
                yield v, w, x.sub_(lse[:, None])
        else:
            for v in range(0, self.weight.shape[0], self.block):
                x, top = next(kept)
                yield v, self.weight[v : v + self.block], x.add_((top - lse)[:, None])


class _ChunkedTokenLogps(torch.autograd.Function):
    """``[M, H], [V, H], [V] | None, [M] -> [M]`` log-probs, plus ``[M]`` stats (``chunked_token_logps``), without
    gradient but for the entropy under ``entropy_grad``.

    Each chunk of ``chunk_size`` positions meets the head one vocabulary block at a time (``_Head``): the tile stays in
    cache while an online logsumexp (running max, rescaled sums) and the stats read it. Backward turns each tile into
    ``softmax`` with the saved logsumexp in one pass: the forward's tiles where ``keep`` (a matmul saved, their memory
    held), else recomputed."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size: int, block_size: int, scale: float, dtype: torch.dtype,
                stats: tuple, keep: bool, entropy_grad: bool = False):
        head = _Head(weight, bias, scale, dtype, block_size)
        acc, vocab = head.acc, weight.shape[0]
        lse = hidden.new_empty(labels.shape, dtype=acc)
        logps = torch.empty_like(lse)
        out = {name: torch.empty_like(lse, dtype=torch.long if name == "argmax" else acc) for name in stats}
        kept = []  # with ``keep``: each tile as (its logits minus its running max, that max), in place later
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, labels.numel(), chunk_size):
                rows, label = slice(s, s + chunk_size), labels[s : s + chunk_size]
                zero = lse.new_zeros(len(label))
                # running max, sum of exp(x - max), sum of exp(x - max) * (x - max), of exp(2 (x - max)), of x
                top, total, moment, square, plain = zero - torch.inf, zero, zero, zero, zero
                picked, argmax = zero, label
                for v, _, x in head.tiles(hidden[rows].to(dtype)):
                    inside = (label >= v) & (label < v + x.shape[1])
                    picked = torch.where(inside, x.gather(1, (label - v).clamp(0, x.shape[1] - 1)[:, None])[:, 0],
                                         picked)
                    if "mean_logit" in out:
                        plain = plain + x.sum(-1)
                    tile_top, tile_arg = x.max(-1)
                    if "argmax" in out:
                        argmax = torch.where(tile_top > top, tile_arg + v, argmax)
                    new_top = torch.maximum(top, tile_top)
                    shift = torch.where(total > 0, top - new_top, 0)
                    rescale = shift.exp()
                    x.sub_(new_top[:, None])
                    e = x.exp() if keep or "entropy" in out or "log_sum_sq_probs" in out else x.exp_()
                    if keep:
                        kept.append((x, new_top))
                    if "entropy" in out:
                        moment = rescale * (moment + total * shift) + torch.linalg.vecdot(e, x)
                    if "log_sum_sq_probs" in out:
                        square = rescale * rescale * square + torch.linalg.vecdot(e, e)
                    total, top = rescale * total + e.sum(-1), new_top
                log_total = total.log()
                lse[rows] = top + log_total
                logps[rows] = picked - lse[rows]
                if "entropy" in out:  # -sum p log p, p = e / total
                    out["entropy"][rows] = log_total - moment / total
                if "argmax" in out:
                    out["argmax"][rows] = argmax
                if "mean_logit" in out:
                    out["mean_logit"][rows] = plain / vocab
                if "log_sum_sq_probs" in out:
                    out["log_sum_sq_probs"][rows] = square.log() - 2 * log_total
        entropy = out["entropy"] if entropy_grad else None
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.chunk_size, ctx.block_size, ctx.scale, ctx.dtype = chunk_size, block_size, scale, dtype
        ctx.kept = iter(kept) if keep else None
        ctx.entropy_at = list(stats).index("entropy") if entropy_grad else None
        ctx.mark_non_differentiable(*[v for name, v in out.items() if not (entropy_grad and name == "entropy")])
        return (logps, *out.values())

    @staticmethod
    def backward(ctx, grad_logps, *grad_stats):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        chunk, dtype = ctx.chunk_size, ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        head = _Head(weight, bias, ctx.scale, dtype, ctx.block_size)
        acc = head.acc
        # d loss / d logits = coef * (softmax - onehot(label)), coef = -scale * d loss / d logp: the softmax part
        # tile by tile, the one-hot part once at the end
        coef = grad_logps.to(acc) * -ctx.scale
        grad_entropy = None if ctx.entropy_at is None else grad_stats[ctx.entropy_at]
        if grad_entropy is not None:  # d H / d logit_v = -p_v (log p_v + H), times the scale
            coef_entropy = grad_entropy.to(acc) * -ctx.scale
        grad_h = torch.empty_like(hidden, dtype=acc) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        kept, ctx.kept = ctx.kept, None  # the kept tiles serve one backward (a second one recomputes)

        def softmax_tiles(h, rows):  # (start, weight block, softmax tile) of each vocabulary block
            for v, w, logp in head.log_softmax_tiles(h, lse[rows], kept):
                if grad_entropy is None:
                    yield v, w, logp.exp_()
                else:  # the entropy's part folded in: the tile is then d loss / d logits, ``coef`` included
                    probs = logp.exp()
                    yield v, w, probs.mul_(logp.add_(entropy[rows, None]).mul_(coef_entropy[rows, None])
                                           .add_(coef[rows, None]))

        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, labels.numel(), chunk):
                rows = slice(s, s + chunk)
                h = hidden[rows].to(dtype)
                # without the entropy's gradient the tiles are softmax alone and ``coef`` scales rows afterwards
                row_scale = coef[rows] if grad_entropy is None else torch.ones_like(coef[rows])
                scaled_h = (h.to(acc) * row_scale[:, None]).to(dtype)
                part_h = torch.zeros(h.shape, dtype=acc, device=h.device) if need_h else None
                for v, w, probs in softmax_tiles(h, rows):
                    if need_b:
                        grad_b[v : v + len(w)] += probs.T @ row_scale
                    probs = probs.to(dtype)
                    if need_h:
                        _accumulate(part_h, probs, w)
                    if need_w:
                        _accumulate(grad_w[v : v + len(w)], probs.T, scaled_h)
                if need_h:
                    grad_h[rows] = part_h.mul_(row_scale[:, None])
        if need_h:
            grad_h.sub_(head.weight[labels].to(acc) * coef[:, None])
            grad_h = grad_h.to(hidden.dtype)
        if need_w:
            grad_w.index_add_(0, labels, hidden.to(acc) * -coef[:, None])
            grad_w = grad_w.to(weight.dtype)
        if need_b:
            grad_b = grad_b.index_add_(0, labels, -coef).to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def _accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b``, ``out`` in the compute dtype, ``a`` and ``b`` in the matmul's."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)  # no temporary
    else:
        out += (a @ b).to(out.dtype)


def chunked_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    scale: float = 1.0,
    stats: tuple[str, ...] = (),
    block_size: int | None = None,
    keep_logits: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs of ``labels`` under ``scale * (hidden @ weight.T + bias)``: ``[..., H], [V, H], [...] -> [...]`` fp32.

    Equals ``token_logps(lm_head(hidden) * scale, labels)`` in values and gradients (w.r.t. ``hidden``, ``weight``,
    ``bias``), without ever holding the ``[..., V]`` logits: ``chunk_size`` positions meet the head one vocabulary
    block of ``block_size`` tokens at a time (default: tiles of ``BLOCK_LOGITS``), and backward recomputes the tiles.
    ``keep_logits``: backward reuses the forward's logits instead of recomputing them (a third of the head's matmuls
    saved) when they take at most ``KEEP_LOGITS_BYTES``. The matmul runs in the autocast dtype if autocast is on, else
    in ``hidden``'s dtype; everything after it in fp32.
    ``stats`` (no gradient, fp32, of the scaled logits): ``entropy``, ``argmax`` (ids), ``mean_logit`` (mean over the
    vocabulary), ``log_sum_sq_probs`` (``log sum_v p(v)^2``, WPO's normalizer); with ``entropy_grad`` the entropy has
    its gradient (``-p (log p + H)`` per logit, tile by tile in backward, as the log-probs'). Labels must be valid ids
    everywhere.
    """
    unknown = set(stats) - set(STATS)
    if unknown:
        raise ValueError(f"unknown stats {sorted(unknown)}: expected some of {STATS}")
    dtype = _autocast_dtype(hidden.device) or hidden.dtype
    shape = labels.shape
    trained = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    keep = (keep_logits and trained
            and labels.numel() * weight.shape[0] * compute_dtype(dtype).itemsize <= KEEP_LOGITS_BYTES)
    logps, *values = _ChunkedTokenLogps.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1),
                                              int(chunk_size), int(block_size or max(BLOCK_LOGITS // chunk_size, 128)),
                                              float(scale), dtype, tuple(stats), keep,
                                              entropy_grad and "entropy" in stats)
    return logps.view(shape), {name: v.view(shape) for name, v in zip(stats, values)}


def plain_token_stats(logits: torch.Tensor, stats: tuple[str, ...],
                      entropy_grad: bool = False) -> dict[str, torch.Tensor]:
    """The ``stats`` of ``chunked_token_logps`` from full (already scaled) logits, without gradient, but for the
    entropy with ``entropy_grad`` (an entropy bonus trains on it)."""
    out = {}
    if entropy_grad and "entropy" in stats:
        full = logits.to(compute_dtype(logits.dtype))
        out["entropy"] = torch.logsumexp(full, -1) - (full.softmax(-1) * full).sum(-1)
        stats = tuple(name for name in stats if name != "entropy")
    with torch.no_grad():
        logits = logits.detach()
        if "entropy" in stats:
            full = logits.to(compute_dtype(logits.dtype))
            out["entropy"] = torch.logsumexp(full, -1) - (full.softmax(-1) * full).sum(-1)
        if "argmax" in stats:
            out["argmax"] = logits.argmax(-1)
        if "mean_logit" in stats:
            out["mean_logit"] = logits.to(compute_dtype(logits.dtype)).mean(-1)
        if "log_sum_sq_probs" in stats:
            out["log_sum_sq_probs"] = fp32_logsumexp(2 * logits) - 2 * fp32_logsumexp(logits)
    return out


def chunkable_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear, float] | None:
    """``(decoder, lm_head, logit scale)`` when ``model``'s logits are ``scale * lm_head(decoder(...)[0])``, else None.

    The scale covers ``logit_scale`` (Cohere) and ``logits_scaling`` (Granite); soft-capped logits (Gemma 2/3) and
    DeepSpeed ZeRO-3 partitioned heads are not chunkable.
    """
    config = getattr(model, "config", None)
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if config is None or get_decoder is None or get_head is None:
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text_config, "final_logit_softcapping", None):
        return None
    head = get_head()
    # a sharded head is only whole inside its FSDP unit's or ZeRO-3 module's forward: an FSDP-wrapped model (the
    # reference under lit_align.strategies.DecoderLayers), a flat 1-D shard, a ZeRO-3 partition (ds_id)
    if type(head) is not torch.nn.Linear or head.weight.dim() != 2 or hasattr(head.weight, "ds_id") or is_fsdp_unit(model):
        return None
    decoder = get_decoder()
    if decoder is None or decoder is model:
        return None
    scale = float(getattr(text_config, "logit_scale", None) or 1.0)
    scale /= float(getattr(text_config, "logits_scaling", None) or 1.0)
    return decoder, head, scale


def attention_mask_4d(model: torch.nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """A 4D mask (``allowed[n, 0, q, k]``: query ``q`` sees key ``k``; ``[N, 1, Q, K]``) as ``model``'s attention
    takes it: bool for sdpa (on CPU a ``lit_align.attention.SparseMask``, whose attention skips what it hides),
    additive for eager (which adds the mask to the scores)."""
    if skips_hidden(model, allowed.device):
        config = model.config.get_text_config()
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
        return sparse_mask(allowed, heads // kv_heads if kv_heads else 1)
    if model.config._attn_implementation == "sdpa":
        return allowed
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


class _Scored(NamedTuple):
    """The tokens a forward scores (``labels``: ``[N, L - start]``, or ``[1, S]`` with ``targets``) and where the
    outputs that predict them are (``source``: None, the position before each)."""

    labels: torch.Tensor
    rows: torch.Tensor
    source: torch.Tensor | None
    start: int

    @classmethod
    def of(cls, input_ids: torch.Tensor, start: int, source: torch.Tensor | None,
           targets: torch.Tensor | None) -> _Scored:
        """``next_token_logps``' arguments as the tokens they score."""
        start = max(int(start), 1)
        if targets is None:
            labels = input_ids[:, start:]
            return cls(labels, torch.arange(labels.shape[0], device=labels.device)[:, None], source, start)
        width = input_ids.shape[1]
        return cls(input_ids.reshape(-1)[targets][None], (source // width)[None], (source % width)[None].contiguous(),
                   start)

    def predicting(self, outputs: torch.Tensor) -> torch.Tensor:
        """Of a forward's per-position outputs ``[R, L, ...]``: those of the positions that predict the labels."""
        return outputs[:, self.start - 1 : -1] if self.source is None else outputs[self.rows, self.source]

    def logits(self, model: torch.nn.Module, input_ids: torch.Tensor, forward_kwargs: dict) -> torch.Tensor:
        """``model``'s logits at the predicting positions, its LM head on those positions only where the model takes
        ``logits_to_keep``."""
        if not takes_logits_to_keep(model):
            return self.predicting(model(input_ids=input_ids, **forward_kwargs).logits)
        if self.source is None:  # the logits of the last L - start + 1 positions
            return model(input_ids=input_ids, **forward_kwargs, logits_to_keep=self.labels.shape[1] + 1).logits[:, :-1]
        keep = torch.unique(self.source)  # the logits of the positions in ``source`` only
        logits = model(input_ids=input_ids, **forward_kwargs, logits_to_keep=keep).logits
        return logits[self.rows, torch.searchsorted(keep, self.source.contiguous())]


def next_token_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    start: int,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    stats: tuple[str, ...] = (),
    source: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
    entropy_grad: bool = False,
    **forward_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs ``[N, L - start]`` (fp32) of ``input_ids[:, start:]``, each given the tokens before it.

    Logits divided by ``temperature``. With ``chunk_size`` (and a chunkable model, see ``chunkable_head``) the head
    runs chunk by chunk (``chunked_token_logps``); otherwise the model's forward computes the logits of the last
    ``L - start + 1`` positions only (``logits_to_keep``). ``stats``: as in ``chunked_token_logps``, on the same
    tempered logits. ``source`` (``[N, L - start]``): the position whose output predicts each label, when it is not
    the one just before it (DPO's shared-prompt rows, packed rows). ``targets`` (``[S]``, flat positions into
    ``[N * L]``): score these tokens only, ``source`` then flat too; log-probs ``[1, S]``. ``entropy_grad``: the
    ``entropy`` stat keeps its gradient (GRPO's entropy bonus trains on it). ``forward_kwargs``
    (``attention_mask``, ``position_ids``, ...) go to the model.
    """
    scored = _Scored.of(input_ids, start, source, targets)
    labels = scored.labels
    forward_kwargs = {"use_cache": False, **forward_kwargs}
    # chunked, or rows laid out by lit_align (``source``): the head on the predicting positions only, through
    # ``chunked_token_logps``, at a 152k vocabulary several times faster than autograd through the model's full
    # logits (bench/profile_steps.py); unchunked, ``DEFAULT_CHUNK_ROWS`` positions at a time, the logits kept for
    # backward where they are small (``KEEP_LOGITS_BYTES``), an explicit ``chunk_size`` never keeping them
    parts = chunkable_head(model) if chunk_size or source is not None else None
    if parts is not None:
        decoder, head, scale = parts
        hidden = scored.predicting(decoder(input_ids=input_ids, **forward_kwargs)[0])
        fp32 = getattr(head, "fp32_matmul", False)  # ``lit_align.models.cast_lm_head_to_fp32``
        with torch.autocast(hidden.device.type, enabled=False) if fp32 else nullcontext():
            return chunked_token_logps(hidden.float() if fp32 else hidden, head.weight, labels, head.bias,
                                       chunk_size or DEFAULT_CHUNK_ROWS, scale / temperature, stats,
                                       keep_logits=chunk_size is None, entropy_grad=entropy_grad)
    logits = scored.logits(model, input_ids, forward_kwargs)
    if temperature != 1.0:
        logits = logits / temperature
    return token_logps(logits, labels), plain_token_stats(logits, stats, entropy_grad)


class TokenLogps(NamedTuple):
    """Per-token results of one forward over a ``Layout``, on the layout's output grid ``[N, C]``."""

    tokens: torch.Tensor  # log-prob of each scored token (fp32, fp64 for fp64 models; 0 where ``mask`` is 0)
    mask: torch.Tensor  # bool: which grid positions are scored tokens
    labels: torch.Tensor  # the token ids scored (arbitrary where ``mask`` is 0)
    stats: dict[str, torch.Tensor]  # the asked ``STATS`` per token, without gradient (but ``entropy_grad``'s)


def layout_logps(model: torch.nn.Module, layout, stats: tuple[str, ...] = (), chunk_size: int | None = None,
                 temperature: float = 1.0, entropy_grad: bool = False) -> TokenLogps:
    """The log-probs (and ``stats``) of a ``lit_align.layouts.Layout``'s scored tokens: one forward of ``model``.

    Every recipe's log-probs come from here: SFT's rows, DPO's pairs (plain or shared-prompt), GRPO's completions
    (padded or packed); the layout says how the rows are laid out and where each token lands in the caller's grid.
    """
    tokens, values = next_token_logps(model, layout.input_ids, layout.start, chunk_size, temperature, stats=stats,
                                      source=layout.source, targets=layout.targets, entropy_grad=entropy_grad,
                                      **layout_forward_kwargs(model, layout))
    labels = layout.to_grid(layout.labels())
    return TokenLogps(layout.to_grid(tokens).masked_fill(~layout.mask, 0), layout.mask, labels,
                      {name: layout.to_grid(v) for name, v in values.items()})


def layout_forward_kwargs(model: torch.nn.Module, layout) -> dict:
    """What a forward of ``model`` over ``layout`` takes besides the ids: its attention mask (2D, or the 4D mask as
    the model's attention takes it) and its position ids."""
    kwargs = {}
    if (layout.varlen and len(layout.input_ids) == 1
            and (attention_implementation(model) or "").startswith("flash_attention")):
        pass  # one packed row: transformers' flash attention reads its sequences from the restarting position_ids
    elif layout.allowed is not None:
        if not takes_custom_mask(model):
            raise LitAlignError(f"{layout.name} needs sdpa or eager attention; the model uses "
                                f"{model.config._attn_implementation!r}")
        kwargs["attention_mask"] = attention_mask_4d(model, layout.allowed)
    elif layout.attention_mask is not None:
        kwargs["attention_mask"] = layout.attention_mask
    if layout.position_ids is not None:
        kwargs["position_ids"] = layout.position_ids
    return kwargs


class Projection(NamedTuple):
    """Logits given as the hidden states that make them: ``scale * (hidden @ weight.T + bias)``."""

    hidden: torch.Tensor  # [..., H]: the model's final hidden states at the positions that predict the tokens
    weight: torch.Tensor  # [V, H]: the LM head's weight
    bias: torch.Tensor | None = None  # [V]
    scale: float = 1.0  # the model's own logit scale (the third value of ``chunkable_head``)

    def logits(self) -> torch.Tensor:
        """The logits themselves, ``[..., V]`` (what a loss that cannot take the projection reads)."""
        return F.linear(self.hidden, self.weight, self.bias) * self.scale


def layout_outputs(model: torch.nn.Module, layout) -> Projection | torch.Tensor:
    """``model``'s outputs at a ``lit_align.layouts.Layout``'s scored tokens, ``[S, ...]`` in its grid's order (row by
    row over ``layout.mask``): a ``Projection`` (the final hidden states ``[S, H]`` and the LM head that makes their
    logits) where the head is chunkable (``chunkable_head``), else the logits ``[S, V]``. One forward, no logits where
    it can: what a loss over whole next-token distributions reads (distillation's divergence, chunked through the
    head: ``lit_align.losses.distill.chunked_generalized_jsd``)."""
    scored = _Scored.of(layout.input_ids, layout.start, layout.source, layout.targets)
    kwargs = {"use_cache": False, **layout_forward_kwargs(model, layout)}
    parts = chunkable_head(model)
    if parts is None:
        return layout.to_grid(scored.logits(model, layout.input_ids, kwargs))[layout.mask]
    decoder, head, scale = parts
    hidden = layout.to_grid(scored.predicting(decoder(input_ids=layout.input_ids, **kwargs)[0]))[layout.mask]
    fp32 = getattr(head, "fp32_matmul", False)  # ``lit_align.models.cast_lm_head_to_fp32``
    return Projection(hidden.float() if fp32 else hidden, head.weight, head.bias, scale)
