"""On-policy distillation's pure tensor math: TRL 1.16's generalized Jensen-Shannon divergence between the student's
and the teacher's next-token distributions, from full logits, chunked through the student's LM head, or against a
teacher's top-k log-probs.

``beta`` picks the divergence (TRL's ``DistillationConfig.beta``): 0 the forward KL(teacher || student), 1 the reverse
KL(student || teacher), in between the generalized JSD ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with the
mixture ``m = (1 - beta) p_s + beta p_t`` (0 and 1 are the KLs themselves, not the JSD's limits). Both models' logits
are divided by ``temperature`` first. The teacher is a constant: no gradient reaches it.

Three ways in, one formula (``divergence_terms``), one set of reductions (``reduce_divergence``):

- ``generalized_jsd``: both models' full logits (TRL's ``GKDTrainer.generalized_jsd_loss``, ``mask`` in place of its
  ``labels != -100``).
- ``chunked_generalized_jsd``: the student as final hidden states and LM head (``Projection``), the teacher as logits
  or as a ``Projection`` too. The heads run ``chunk_size`` positions at a time and the forward computes the gradients
  while a chunk's logits exist, so the student's ``[positions, V]`` logits and their softmax never exist whole and
  are made once (TRL's ``DistillationTrainer`` computes the loss in chunks, always, and makes them again in
  backward).
- ``topk_generalized_jsd``: the teacher as its top-k log-probs and their ids (a cached or served teacher);
  ``chunked_topk_generalized_jsd`` the same with the student as a ``Projection``, a chunk of positions at a time
  (activation checkpointing: backward makes each chunk's logits again).

Left out, and why: TRL's ``mean`` reduction (a mean over vocabulary entries too, which no trainer uses); tiling the
vocabulary inside a chunk (TRL tiles 32k entries at a time; here a chunk meets the whole vocabulary, so chunks are
sized by ``DISTILL_CHUNK_LOGITS``); final-logit soft-capping (as in ``lit_align.logps``, soft-capped heads are not
chunked).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lit_align.logps import Projection, _accumulate, _autocast_dtype, _Head, compute_dtype

DISTILL_REDUCTIONS = ("batchmean", "sum", "none")
DISTILL_CHUNK_LOGITS = 2**23  # logits per chunk (positions x vocabulary): 32 MB per fp32 buffer; 55 rows at 152k


def check_divergence(beta: float, temperature: float, reduction: str) -> None:
    """Refuse a ``beta`` outside [0, 1], a ``temperature`` that is not > 0, or an unknown ``reduction``."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta {beta}: expected a value in [0, 1] (0 forward KL, 1 reverse KL, between them the JSD)")
    if not temperature > 0:
        raise ValueError(f"temperature {temperature}: expected a value > 0")
    if reduction not in DISTILL_REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}: expected one of {DISTILL_REDUCTIONS}")


def divergence_terms(student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """Each vocabulary entry's share of the divergence: ``[..., V], [..., V] -> [..., V]``; its sum over the last
    dimension is the per-token divergence. Log-probs must be finite (``0 * -inf`` is NaN, as in TRL's ``F.kl_div``)."""
    if beta == 0.0:
        return _kl_terms(teacher_logps, student_logps)
    if beta == 1.0:
        return _kl_terms(student_logps, teacher_logps)
    mixture = _mixture_logps(student_logps, teacher_logps, beta)
    return beta * _kl_terms(teacher_logps, mixture) + (1 - beta) * _kl_terms(student_logps, mixture)


def _kl_terms(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``p (log p - log q)``, entry by entry: KL(p || q) once summed."""
    return log_p.exp() * (log_p - log_q)


def _mixture_logps(student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """``log((1 - beta) p_s + beta p_t)``."""
    return torch.logaddexp(student_logps + math.log1p(-beta), teacher_logps + math.log(beta))


def divergence_and_grad(student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float,
                        entropy: bool = False, out: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The per-token divergence ``[...]`` (``divergence_terms`` summed), its gradient w.r.t. the student's (tempered)
    logits ``[..., V]`` (written into ``out`` where given), the teacher fixed, and with ``entropy`` the student's
    entropy ``[...]``, in shared passes over the vocabulary (one ``exp`` of the student's log-probs serves all three).
    ``student_logps`` is overwritten.

    The softmax turns ``g = d D / d log p_s`` into ``p_s (g - sum p_s g)``: ``p_s - p_t`` for the forward KL,
    ``p_s (log p_s - log p_t - KL)`` for the reverse KL, ``(1 - beta) p_s (log p_s - log m - KL(p_s || m))`` for the
    JSD (the terms through the mixture ``m`` cancel).
    """
    probs = torch.exp(student_logps, out=out)
    spread = -_dot(probs, student_logps) if entropy else None
    if beta == 0.0:
        teacher = teacher_logps.exp()
        return _dot(teacher, teacher_logps - student_logps), probs.sub_(teacher), spread
    if beta == 1.0:
        gap = student_logps.sub_(teacher_logps)
        value = kl = _dot(probs, gap)
    else:
        mixture = _mixture_logps(student_logps, teacher_logps, beta)
        gap = student_logps.sub_(mixture)
        kl = _dot(probs, gap)
        value = beta * _dot(teacher_logps.exp(), teacher_logps.sub(mixture)) + (1 - beta) * kl
    return value, probs.mul_(gap.sub_(kl[..., None])).mul_(1.0 if beta == 1.0 else 1 - beta), spread


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` as one dot product per row: no ``[..., V]`` temporary (a batched ``bmm`` of ``[1, V] @
    [V, 1]`` products runs 4x slower on CPU)."""
    rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    if not len(rows_a):
        return a.new_zeros(a.shape[:-1])
    return torch.stack([torch.dot(x, y) for x, y in zip(rows_a, rows_b)]).reshape(a.shape[:-1])


def reduce_divergence(per_token: torch.Tensor, mask: torch.Tensor | None = None,
                      reduction: str = "batchmean") -> torch.Tensor:
    """TRL's reductions of per-token divergences ``[N, T]`` (any ``[N, ...]``), positions where ``mask`` is 0 left out.

    ``batchmean``: with a mask, the sum over its positions divided by their number (at least 1): a per-token mean, the
    normalisation of every TRL trainer; without one, the sum divided by ``N`` (per row: ``F.kl_div``'s batchmean, what
    TRL's ``generalized_jsd_loss`` does without ``labels``). ``sum``: the sum (TRL's ``num_items_in_batch``
    normalisation is this sum divided by that count). ``none``: the per-token values, 0 where masked out.
    """
    if mask is not None:
        per_token = per_token.masked_fill(~mask.bool(), 0.0)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    return total / (mask.sum().clamp(min=1) if mask is not None else max(per_token.shape[0], 1))


def token_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5,
              temperature: float = 1.0) -> torch.Tensor:
    """Per-token divergence ``[..., V], [..., V] -> [...]``, in fp32 (fp64 for fp64 student logits)."""
    dtype = compute_dtype(student_logits.dtype)
    student = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)
    return divergence_terms(student, teacher, beta).sum(-1)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """TRL's generalized JSD loss from both models' logits ``[N, T, V]``: the value of
    ``GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta, temperature)`` with ``mask = labels != -100``,
    and its gradient w.r.t. ``student_logits`` (none reaches the teacher). ``mask`` ``[N, T]``: the scored positions;
    ``reduction``: see ``reduce_divergence``."""
    check_divergence(beta, temperature, reduction)
    return reduce_divergence(token_jsd(student_logits, teacher_logits, beta, temperature), mask, reduction)


def _teacher_logits(teacher: Projection | torch.Tensor, rows: torch.Tensor, temperature: float,
                    dtype: torch.dtype) -> Callable[[slice], torch.Tensor]:
    """``logits(s)``: the teacher's tempered logits ``[len(rows[s]), V]`` (in ``dtype``) at the flat positions
    ``rows[s]``, from its logits or through its head, one chunk at a time."""
    if isinstance(teacher, Projection):
        hidden = teacher.hidden.detach().reshape(-1, teacher.hidden.shape[-1])
        matmul = _autocast_dtype(hidden.device) or hidden.dtype
        bias = None if teacher.bias is None else teacher.bias.detach()
        head = _Head(teacher.weight.detach(), bias, teacher.scale / temperature, matmul, teacher.weight.shape[0])
        return lambda s, out=None: head.logits(hidden[rows[s]].to(matmul), out).to(dtype)
    logits = teacher.detach().reshape(-1, teacher.shape[-1])
    return lambda s, out=None: logits[rows[s]].to(dtype) / temperature


def _chunk_logps(head: _Head, hidden: torch.Tensor, teacher: Callable, rows: slice, work: tuple | None):
    """The student's and the teacher's log-probs ``[rows, V]`` at one chunk of positions; with ``work``
    (``_workspace``) written into its second and third buffers, the logits made in its first."""
    if work is None:
        return head.logits(hidden).log_softmax(-1), teacher(rows).log_softmax(-1)
    logits, student, teacher_logps = (buffer[: len(hidden)] for buffer in work)
    torch.log_softmax(head.logits(hidden, logits), -1, out=student)
    return student, torch.log_softmax(teacher(rows, logits), -1, out=teacher_logps)


def _workspace(hidden: torch.Tensor, head: _Head, chunk: int) -> tuple | None:
    """Three ``[chunk, V]`` buffers for a chunk's vocabulary-wide tensors, which every chunk reuses (new ones each
    chunk would be fresh memory each time: a page fault per 4 KiB, under ``mmap_activations`` a mapping each); None
    where the matmul's dtype is not the compute dtype (bf16 under autocast: its logits are cast anyway)."""
    if head.weight.dtype != head.acc:
        return None
    return tuple(hidden.new_empty(min(chunk, len(hidden)), head.weight.shape[0], dtype=head.acc) for _ in range(3))


class _ChunkedJSD(torch.autograd.Function):
    """``[M, H], [V, H], [V] | None -> [M], [M]``: per-position divergence and (``entropy``) the student's entropy
    (else ``[0]``), the student's logits made ``chunk`` positions at a time (``teacher(rows)`` gives the teacher's).

    With ``grads`` the forward also computes the gradients for an upstream gradient of one at every position, while
    each chunk's logits exist (``divergence_and_grad``): backward only scales them when its upstream gradient is one
    value everywhere (a sum or mean over the positions, what the losses take); another one (a weighted sum) makes the
    logits again, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher, scale: float, beta: float, chunk: int, dtype: torch.dtype,
                grads: bool, entropy: bool):
        head = _Head(weight, bias, scale, dtype, weight.shape[0])
        out = hidden.new_empty(hidden.shape[0], dtype=head.acc)
        spread = hidden.new_empty(hidden.shape[0] if entropy else 0, dtype=head.acc)
        needs = [grads and n for n in ctx.needs_input_grad[:3]]
        buffers = _grad_buffers(hidden, weight, head.acc, *needs)
        work = _workspace(hidden, head, chunk)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, len(hidden), chunk):
                rows = slice(s, s + chunk)
                h = hidden[rows].to(dtype)
                logps = _chunk_logps(head, h, teacher, rows, work)
                value, coef, chunk_spread = divergence_and_grad(*logps, beta, entropy, _first(work, len(h)))
                out[rows] = value
                if entropy:
                    spread[rows] = chunk_spread
                if grads:
                    _add_grads(buffers, coef.mul_(scale), h, head, rows, dtype)
        ctx.save_for_backward(hidden, weight, bias)
        ctx.teacher, ctx.scale, ctx.beta, ctx.chunk, ctx.dtype = teacher, scale, beta, chunk, dtype
        ctx.buffers = buffers if grads else None
        ctx.mark_non_differentiable(spread)
        return out, spread

    @staticmethod
    def backward(ctx, grad_out, _):
        hidden, weight, bias = ctx.saved_tensors
        buffers, ctx.buffers = ctx.buffers, None
        upstream = grad_out.to(compute_dtype(ctx.dtype))
        if buffers is None or (len(upstream) and not bool((upstream == upstream[0]).all())):
            grad_h, grad_w, grad_b = _recomputed_grads(ctx, hidden, weight, bias, upstream)
        else:  # the forward's gradients, at an upstream gradient of one: scaled (per position for the hidden states)
            grad_h, grad_w, grad_b = buffers
            one = upstream[0] if len(upstream) else 0.0
            grad_h = None if grad_h is None else grad_h.mul_(upstream[:, None])
            grad_w, grad_b = (None if g is None else g.mul_(one) for g in (grad_w, grad_b))
        grads = [None if g is None else g.to(t.dtype) for g, t in ((grad_h, hidden), (grad_w, weight), (grad_b, bias))]
        return (*grads, None, None, None, None, None, None, None)


def _first(work: tuple | None, rows: int) -> torch.Tensor | None:
    """The workspace's first buffer at ``rows`` rows (free once both log-probs are made), or None."""
    return None if work is None else work[0][:rows]


def _grad_buffers(hidden, weight, acc: torch.dtype, need_h: bool, need_w: bool, need_b: bool) -> tuple:
    """Gradients of the hidden states (filled chunk by chunk), the head's weight and its bias (zeros, summed into),
    in ``acc``; None where not needed."""
    return (torch.empty_like(hidden, dtype=acc) if need_h else None,
            torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None,
            torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None)


def _add_grads(buffers: tuple, coef: torch.Tensor, h: torch.Tensor, head: _Head, rows: slice, dtype) -> None:
    """One chunk's share of the gradients from ``coef``, the loss's gradient w.r.t. its logits ``[rows, V]``."""
    grad_h, grad_w, grad_b = buffers
    if grad_b is not None:
        grad_b += coef.sum(0)
    coef = coef.to(dtype)
    if grad_h is not None:
        grad_h[rows] = coef @ head.weight
    if grad_w is not None:
        _accumulate(grad_w, coef.T, h)


def _recomputed_grads(ctx, hidden, weight, bias, upstream: torch.Tensor) -> tuple:
    """The gradients for any upstream gradient: each chunk's logits made again."""
    head = _Head(weight, bias, ctx.scale, ctx.dtype, weight.shape[0])
    buffers = _grad_buffers(hidden, weight, head.acc, *ctx.needs_input_grad[:3])
    work = _workspace(hidden, head, ctx.chunk)
    with torch.autocast(hidden.device.type, enabled=False):
        for s in range(0, len(hidden), ctx.chunk):
            rows = slice(s, s + ctx.chunk)
            h = hidden[rows].to(ctx.dtype)
            logps = _chunk_logps(head, h, ctx.teacher, rows, work)
            _, coef, _ = divergence_and_grad(*logps, ctx.beta, out=_first(work, len(h)))
            _add_grads(buffers, coef.mul_(upstream[rows, None].to(head.acc) * ctx.scale), h, head, rows, ctx.dtype)
    return buffers


def chunked_generalized_jsd(
    student: Projection,
    teacher: Projection | torch.Tensor,
    mask: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``generalized_jsd`` with the student given as hidden states and LM head, ``chunk_size`` positions at a time.

    ``student.hidden`` ``[N, T, H]`` (any ``[..., H]``); ``teacher``: its logits ``[N, T, V]`` or a ``Projection``
    (its own hidden size; the vocabulary must be the student's); ``mask`` ``[N, T]``: only these positions meet the
    heads. Values and gradients (w.r.t. the student's hidden states, weight and bias) are those of
    ``generalized_jsd(scale * (hidden @ weight.T + bias), teacher logits, ...)`` up to rounding, and no
    vocabulary-wide tensor it makes holds more than ``chunk_size`` positions (default: ``DISTILL_CHUNK_LOGITS // V``).
    The student's matmul runs in the autocast dtype if autocast is on, else in ``hidden``'s; the divergence in fp32
    (fp64 for fp64). Each chunk's logits are made once when the loss reduces the positions evenly (``batchmean``,
    ``sum``, or ``none`` summed or averaged by the caller): the forward computes the gradients too. ``with_entropy``:
    also return the student's tempered entropy ``[N, T]`` (0 where ``mask`` is 0; no gradient) from the same pass.
    """
    check_divergence(beta, temperature, reduction)
    shape, vocab = student.hidden.shape[:-1], student.weight.shape[0]
    scored = torch.ones(shape, dtype=torch.bool, device=student.hidden.device) if mask is None else mask.bool()
    rows = scored.reshape(-1).nonzero().squeeze(1)  # flat indices of the scored positions
    matmul = _autocast_dtype(student.hidden.device) or student.hidden.dtype
    dtype = compute_dtype(matmul)
    hidden = student.hidden.reshape(-1, student.hidden.shape[-1])[rows]
    teacher_logits = _teacher_logits(teacher, rows, temperature, dtype)
    chunk = int(chunk_size or max(1, DISTILL_CHUNK_LOGITS // vocab))
    inputs = (hidden, student.weight, student.bias)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    values, spread = _ChunkedJSD.apply(*inputs, teacher_logits, student.scale / temperature, float(beta), chunk,
                                       matmul, grads, with_entropy)
    per_token = values.new_zeros(scored.numel()).index_put((rows,), values).view(shape)
    divergence = reduce_divergence(per_token, mask, reduction)
    if not with_entropy:
        return divergence
    return divergence, spread.new_zeros(scored.numel()).index_put((rows,), spread).view(shape)


def topk_generalized_jsd(
    student_logits: torch.Tensor,
    teacher_topk_logps: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    tail: bool = True,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """The divergence against a teacher known by its top-k log-probs ``[N, T, K]`` and their ids ``[N, T, K]`` (valid
    ids everywhere, masked positions included), the student by its logits ``[N, T, V]``.

    The teacher's log-probs are used as given: those of its distribution at ``temperature`` (what a server returns when
    asked at that temperature); the student's logits are divided by ``temperature`` here. Both distributions are cut
    to the teacher's top-k ids, the approximation of TRL's ``ServerDistillationTrainer`` (which allows it for
    ``beta > 0`` only with k = 1; here any k):
    ``tail`` (TRL's ``loss_add_tail``): a (k+1)-th entry holds each distribution's rest, the student's exact mass on
    the other ids and the teacher's ``1 - sum(top-k probs)`` (at least the dtype's eps, the resolution of that
    difference); at k = V there is no rest and no tail entry. Else both are renormalised over the k ids.
    Either way, k = V gives ``generalized_jsd``'s value.
    """
    check_divergence(beta, temperature, reduction)
    dtype = compute_dtype(student_logits.dtype)
    student = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    teacher = teacher_topk_logps.detach().to(dtype)
    on_top = student.gather(-1, teacher_topk_ids)
    if tail and teacher_topk_ids.shape[-1] < student.shape[-1]:
        student_rest = torch.logsumexp(student.scatter(-1, teacher_topk_ids, -math.inf), -1, keepdim=True)
        teacher_mass = -torch.expm1(torch.logsumexp(teacher, -1, keepdim=True))  # 1 - sum of the top-k probs
        teacher_rest = teacher_mass.clamp(min=torch.finfo(dtype).eps).log()
        student, teacher = torch.cat([on_top, student_rest], -1), torch.cat([teacher, teacher_rest], -1)
    else:
        student = on_top - torch.logsumexp(on_top, -1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, -1, keepdim=True)
    return reduce_divergence(divergence_terms(student, teacher, beta).sum(-1), mask, reduction)


def chunked_topk_generalized_jsd(
    student: Projection,
    teacher_topk_logps: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    tail: bool = True,
    reduction: str = "batchmean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``topk_generalized_jsd`` with the student given as hidden states and LM head (``student.hidden`` ``[N, T, H]``,
    any ``[..., H]``), ``chunk_size`` positions at a time: each chunk's logits are made in the forward and made again
    in the backward (activation checkpointing), so the student's ``[positions, V]`` logits never exist whole. Only
    the ``mask`` positions meet the head. Values and gradients are ``topk_generalized_jsd``'s of
    ``student.logits()`` (default chunk: ``DISTILL_CHUNK_LOGITS // V`` positions)."""
    check_divergence(beta, temperature, reduction)
    shape = student.hidden.shape[:-1]
    scored = torch.ones(shape, dtype=torch.bool, device=student.hidden.device) if mask is None else mask.bool()
    hidden = student.hidden[scored]
    logps, ids = teacher_topk_logps[scored], teacher_topk_ids[scored]

    def divergence(h: torch.Tensor, logps: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = student._replace(hidden=h).logits()
        return topk_generalized_jsd(logits, logps, ids, beta=beta, temperature=temperature, tail=tail,
                                    reduction="none")

    chunk = int(chunk_size or max(1, DISTILL_CHUNK_LOGITS // student.weight.shape[0]))
    parts = [checkpoint(divergence, hidden[s : s + chunk], logps[s : s + chunk], ids[s : s + chunk],
                        use_reentrant=False) for s in range(0, len(hidden), chunk)]
    values = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
    per_token = values.new_zeros(shape).masked_scatter(scored, values)
    return reduce_divergence(per_token, mask, reduction)
