"""lit_align.losses.distill: the generalized JSD of on-policy distillation against hand computations and TRL's own
``GKDTrainer.generalized_jsd_loss`` (float64, rule 2 of ``tests/numerics.py``); the chunked path against the plain one
(rule 3) and the tensors it makes; the top-k teacher against hand computations and, at k = V, the full one."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lit_align.losses.distill import (
    Projection, chunked_generalized_jsd, chunked_topk_generalized_jsd, generalized_jsd, token_jsd,
    topk_generalized_jsd,
)
from numerics import assert_formula, assert_rounding_close, f64, formula

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

BETAS = [0.0, 0.3, 0.5, 1.0]  # 0.3: a JSD whose mixture weights are not symmetric


def softmax(row: list[float], temperature: float = 1.0) -> list[float]:
    e = [math.exp(x / temperature) for x in row]
    return [x / sum(e) for x in e]


def kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def divergence(ps: list[float], pt: list[float], beta: float) -> float:
    """The paper's definitions, written out: forward KL, reverse KL, or the JSD with m = (1 - beta) p_s + beta p_t."""
    if beta == 0.0:
        return kl(pt, ps)
    if beta == 1.0:
        return kl(ps, pt)
    m = [(1 - beta) * a + beta * b for a, b in zip(ps, pt)]
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


# -- by hand ---------------------------------------------------------------------------------------------------------
# two positions, a vocabulary of 3
STUDENT = [[1.0, 2.0, 0.0], [0.5, -1.0, 1.5]]
TEACHER = [[0.0, 1.0, 3.0], [2.0, 0.0, -1.0]]


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_small_case_matches_the_kl_formulas(beta, temperature):
    expected = [divergence(softmax(s, temperature), softmax(t, temperature), beta) for s, t in zip(STUDENT, TEACHER)]
    per_token = token_jsd(f64([STUDENT]), f64([TEACHER]), beta, temperature)
    assert per_token.tolist() == [formula(expected)]
    assert generalized_jsd(f64([STUDENT]), f64([TEACHER]), torch.ones(1, 2), beta, temperature).item() == formula(
        sum(expected) / 2)


def test_small_case_worked_numbers():
    # at T = 1: position 0's forward KL is 1.6129389, position 1's 0.9765551; the per-token means:
    worked = {0.0: 1.2947470, 0.5: 0.2923859, 1.0: 1.4937095}
    for beta, value in worked.items():
        got = generalized_jsd(f64([STUDENT]), f64([TEACHER]), torch.ones(1, 2), beta).item()
        assert got == pytest.approx(value, abs=5e-8)


# -- against TRL -----------------------------------------------------------------------------------------------------
N, T, H, V = 3, 5, 16, 11


@pytest.fixture(scope="module")
def trl_jsd():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL warns on every import from trl.experimental
        gkd = pytest.importorskip("trl.experimental.gkd")
    return gkd.GKDTrainer.generalized_jsd_loss


def logits_and_labels(seed: int = 0):
    """float64 logits of both models and TRL's labels, -100 at padded and prompt positions."""
    g = torch.Generator().manual_seed(seed)
    student = (3 * torch.randn(N, T, V, generator=g, dtype=torch.float64)).requires_grad_()
    teacher = 3 * torch.randn(N, T, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N, T), generator=g)
    labels[0, 3:] = -100  # right padding
    labels[2, :2] = -100  # a prompt
    return student, teacher, labels


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_value_and_gradient_match_trl(trl_jsd, beta, temperature):
    student, teacher, labels = logits_and_labels()
    ours = generalized_jsd(student, teacher, labels != -100, beta, temperature)
    theirs = trl_jsd(student, teacher, labels=labels, beta=beta, temperature=temperature)
    assert_formula(ours, theirs.detach(), msg="loss")
    ours_grad, = torch.autograd.grad(ours, student)
    theirs_grad, = torch.autograd.grad(theirs, student)
    assert_formula(ours_grad, theirs_grad, msg="gradient")
    assert ours_grad[0, 3:].abs().max() == 0 and ours_grad[0, :3].abs().max() > 0  # padding gets no gradient


@pytest.mark.parametrize("beta", BETAS)
def test_reductions_match_trl(trl_jsd, beta):
    student, teacher, labels = logits_and_labels(1)
    mask = labels != -100
    assert_formula(generalized_jsd(student, teacher, mask, beta, reduction="sum"),
                   trl_jsd(student, teacher, labels=labels, beta=beta, reduction="sum").detach())
    # without labels TRL's batchmean divides by the batch size (rows), not by the tokens
    no_mask = generalized_jsd(student, teacher, None, beta)
    assert_formula(no_mask, trl_jsd(student, teacher, beta=beta).detach())
    assert_formula(no_mask, token_jsd(student, teacher, beta).sum() / N)
    per_token = generalized_jsd(student, teacher, mask, beta, reduction="none")
    assert per_token.shape == (N, T) and per_token[~mask].abs().max() == 0
    assert_formula(per_token.sum(), generalized_jsd(student, teacher, mask, beta, reduction="sum"))


def test_fully_masked_batch_is_zero_with_a_finite_gradient(trl_jsd):
    student, teacher, _ = logits_and_labels()
    loss = generalized_jsd(student, teacher, torch.zeros(N, T, dtype=torch.bool))
    assert loss.item() == 0.0 == trl_jsd(student, teacher, labels=torch.full((N, T), -100)).item()
    grad, = torch.autograd.grad(loss, student)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_no_gradient_reaches_the_teacher():
    student, teacher, labels = logits_and_labels()
    teacher.requires_grad_()
    generalized_jsd(student, teacher, labels != -100).backward()
    assert teacher.grad is None and student.grad is not None
    hidden, weight, _ = student_head(torch.float64)
    teacher_head = Projection(hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_())
    chunked_generalized_jsd(Projection(hidden, weight), teacher_head, chunk_size=4).backward()
    assert teacher_head.hidden.grad is None and teacher_head.weight.grad is None and hidden.grad is not None


@pytest.mark.parametrize("kwargs,message", [
    ({"beta": 1.5}, r"beta 1.5: expected a value in \[0, 1\]"),
    ({"beta": -0.1}, r"beta -0.1: expected a value in \[0, 1\]"),
    ({"temperature": 0.0}, "temperature 0.0: expected a value > 0"),
    ({"reduction": "mean"}, r"unknown reduction 'mean': expected one of \('batchmean', 'sum', 'none'\)"),
])
def test_bad_settings_are_refused(kwargs, message):
    student, teacher, _ = logits_and_labels()
    hidden, weight, _ = student_head(torch.float64)
    ids = teacher.topk(2).indices
    for call in (lambda: generalized_jsd(student, teacher, **kwargs),
                 lambda: chunked_generalized_jsd(Projection(hidden, weight), teacher, **kwargs),
                 lambda: topk_generalized_jsd(student, teacher.gather(-1, ids), ids, **kwargs)):
        with pytest.raises(ValueError, match=message):
            call()


# -- chunked ---------------------------------------------------------------------------------------------------------
SCALE, TEMPERATURE = 1.3, 2.0


def student_head(dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, T, H, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    return hidden, weight, b


def teacher_of(kind: str, dtype=torch.float32):
    """The teacher as logits, or as its own (wider) hidden states and head, and its logits for the plain path."""
    g = torch.Generator().manual_seed(1)
    hidden, weight, bias = (torch.randn(*shape, generator=g).to(dtype) for shape in ((N, T, 24), (V, 24), (V,)))
    logits = F.linear(hidden, weight, bias) * 0.7
    return (logits if kind == "logits" else Projection(hidden, weight, bias, 0.7)), logits


def grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])  # 4 does not divide the 12 scored positions
@pytest.mark.parametrize("teacher_kind", ["logits", "projection"])
@pytest.mark.parametrize("beta", BETAS)
def test_chunked_equals_plain_fp32(beta, teacher_kind, chunk_size):
    hidden, weight, b = student_head(bias=chunk_size != 1)
    teacher, teacher_logits = teacher_of(teacher_kind)
    mask = logits_and_labels()[2] != -100
    logits = F.linear(hidden, weight, b) * SCALE
    plain = generalized_jsd(logits, teacher_logits, mask, beta, TEMPERATURE)
    chunked = chunked_generalized_jsd(Projection(hidden, weight, b, SCALE), teacher, mask, beta, TEMPERATURE,
                                      chunk_size=chunk_size)
    assert chunked.dtype == torch.float32 and chunked.shape == ()
    # the logits (a reduction over H) and their log-softmax (over V), each in the chunk's own kernel
    assert_rounding_close(chunked, plain, scale=logits.detach().abs().max(), terms=max(H, V), msg="loss")
    for got, want, name in zip(grads(chunked, hidden, weight, b), grads(plain, hidden, weight, b),
                               ("hidden", "weight", "bias")):
        assert got.dtype == want.dtype == torch.float32
        assert_rounding_close(got, want, terms=max(V, N * T), msg=name)


@pytest.mark.parametrize("beta", BETAS)
def test_chunked_equals_plain_fp64_per_token_and_without_mask(beta):
    hidden, weight, b = student_head(torch.float64)
    teacher, teacher_logits = teacher_of("projection", torch.float64)
    logits = F.linear(hidden, weight, b) * SCALE
    for mask, reduction in ((None, "batchmean"), (None, "none"), (logits_and_labels()[2] != -100, "none")):
        plain = generalized_jsd(logits, teacher_logits, mask, beta, TEMPERATURE, reduction)
        chunked = chunked_generalized_jsd(Projection(hidden, weight, b, SCALE), teacher, mask, beta, TEMPERATURE,
                                          reduction, chunk_size=4)
        assert chunked.dtype == torch.float64 and chunked.shape == plain.shape
        assert_rounding_close(chunked, plain, scale=logits.detach().abs().max(), terms=max(H, V), dtype=torch.float64)


def test_chunked_never_lets_masked_positions_meet_the_heads():
    """Only scored positions are projected: NaN hidden states (and teacher logits) elsewhere change nothing."""
    hidden, weight, b = student_head()
    teacher, _ = teacher_of("logits")
    mask = logits_and_labels()[2] != -100
    want = chunked_generalized_jsd(Projection(hidden, weight, b), teacher, mask, chunk_size=4)
    want_grads = grads(want, hidden, weight, b)
    poisoned, poisoned_teacher = hidden.detach().clone(), teacher.clone()
    poisoned[~mask], poisoned_teacher[~mask] = math.nan, math.nan
    poisoned.requires_grad_()
    got = chunked_generalized_jsd(Projection(poisoned, weight, b), poisoned_teacher, mask, chunk_size=4)
    assert torch.equal(got, want)
    for g, w in zip(grads(got, poisoned, weight, b), want_grads):
        assert torch.equal(g, w)


def test_chunked_under_bf16_autocast_matches_plain_and_returns_fp32():
    hidden, weight, b = student_head()
    teacher, teacher_logits = teacher_of("logits")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight, b)
        plain = generalized_jsd(logits, teacher_logits, beta=0.5)
        chunked = chunked_generalized_jsd(Projection(hidden, weight, b), teacher, beta=0.5, chunk_size=4)
    assert chunked.dtype == torch.float32 and logits.dtype == torch.bfloat16
    assert_rounding_close(chunked, plain, scale=logits.detach().abs().max(), dtype=torch.bfloat16, msg="loss")
    for got, want, name in zip(grads(chunked, hidden, weight, b), grads(plain, hidden, weight, b),
                               ("hidden", "weight", "bias")):
        assert got.dtype == torch.float32  # fp32 master weights, gradients of bf16 accuracy
        assert_rounding_close(got, want, dtype=torch.bfloat16, msg=name)


class NewTensors(TorchDispatchMode):
    """The shape of every tensor an aten op makes: outputs that share no storage with its inputs (no views, no
    in-place results), forward and backward."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        self.shapes += [tuple(t.shape) for t in _tensors(out) if t.untyped_storage().data_ptr() not in inputs]
        return out

    def most_rows_of_vocabulary_width(self) -> int:
        """The most positions any new ``[..., V]`` tensor holds."""
        return max((math.prod(shape[:-1]) for shape in self.shapes if shape and shape[-1] == V), default=0)


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return _tensors(list(x.values()))
    return []


@pytest.mark.parametrize("teacher_kind", ["logits", "projection"])
def test_chunked_makes_no_tensor_of_all_positions_by_vocabulary(teacher_kind):
    """The plain path makes ``[N, T, V]`` tensors (logits, log-softmax, their gradients); the chunked one no
    vocabulary-wide tensor of more than ``chunk_size`` positions, forward or backward."""
    hidden, weight, b = student_head()
    teacher, teacher_logits = teacher_of(teacher_kind)
    with NewTensors() as plain:
        generalized_jsd(F.linear(hidden, weight, b), teacher_logits, beta=0.5).backward()
    assert plain.most_rows_of_vocabulary_width() == N * T  # what the check below would see, were it there
    with NewTensors() as chunked:
        chunked_generalized_jsd(Projection(hidden, weight, b), teacher, beta=0.5, chunk_size=4).backward()
    assert 0 < chunked.most_rows_of_vocabulary_width() <= 4


class LogitsMade(TorchDispatchMode):
    """How many vocabulary-wide products the heads make (matmuls whose output is ``[..., V]``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == V:
            self.count += 1
        return out


@pytest.mark.parametrize("beta", BETAS)
def test_chunked_makes_each_chunks_logits_once_and_again_only_for_a_weighted_sum(beta):
    """The forward computes the gradients for an even reduction (a mean: each chunk's logits made once); a weighted
    sum of the per-position values makes them again in backward, with the plain path's gradients either way."""
    hidden, weight, b = student_head()
    teacher, teacher_logits = teacher_of("projection")
    mask = logits_and_labels()[2] != -100  # 12 scored positions: 3 chunks of 4
    weights = torch.rand(N, T, generator=torch.Generator().manual_seed(3))
    for reduce, made in ((lambda x: x.sum() / mask.sum(), 2 * 3), (lambda x: (x * weights).sum(), 2 * 3 * 2)):
        with LogitsMade() as counted:
            chunked = reduce(chunked_generalized_jsd(Projection(hidden, weight, b, SCALE), teacher, mask, beta,
                                                     TEMPERATURE, "none", chunk_size=4))
            got = grads(chunked, hidden, weight, b)
        assert counted.count == made  # student and teacher, per chunk: once, or twice under the weighted sum
        logits = F.linear(hidden, weight, b) * SCALE
        plain = reduce(generalized_jsd(logits, teacher_logits, mask, beta, TEMPERATURE, "none"))
        assert_rounding_close(chunked, plain, scale=logits.detach().abs().max(), terms=max(H, V), msg="loss")
        for g, w, name in zip(got, grads(plain, hidden, weight, b), ("hidden", "weight", "bias")):
            assert_rounding_close(g, w, terms=max(V, N * T), msg=name)


def test_chunked_entropy_is_the_students_tempered_entropy_on_the_mask():
    hidden, weight, b = student_head(torch.float64)
    teacher, _ = teacher_of("projection", torch.float64)
    mask = logits_and_labels()[2] != -100
    loss, spread = chunked_generalized_jsd(Projection(hidden, weight, b, SCALE), teacher, mask, 0.5, TEMPERATURE,
                                           chunk_size=4, with_entropy=True)
    logps = F.log_softmax(F.linear(hidden, weight, b) * SCALE / TEMPERATURE, -1)
    want = -(logps.exp() * logps).sum(-1) * mask
    assert spread.shape == mask.shape and not spread.requires_grad and loss.requires_grad
    assert_rounding_close(spread, want, scale=logps.detach().abs().max(), terms=V, dtype=torch.float64)
    assert (spread[~mask] == 0).all() and (spread[mask] > 0).all()


def test_default_chunks_hold_distill_chunk_logits(monkeypatch):
    import lit_align.losses.distill as distill

    monkeypatch.setattr(distill, "DISTILL_CHUNK_LOGITS", 3 * V + 1)  # room for 3 positions of the vocabulary
    hidden, weight, b = student_head()
    teacher, _ = teacher_of("logits")
    with NewTensors() as chunked:
        chunked_generalized_jsd(Projection(hidden, weight, b), teacher).backward()
    assert chunked.most_rows_of_vocabulary_width() == 3


# -- top-k teacher ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta", BETAS)
def test_topk_with_the_whole_vocabulary_is_the_full_divergence(beta, tail):
    student, teacher, labels = logits_and_labels()
    mask = labels != -100
    top = F.log_softmax(teacher / TEMPERATURE, -1).topk(V)  # every id, in the teacher's order
    full = generalized_jsd(student, teacher, mask, beta, TEMPERATURE)
    got = topk_generalized_jsd(student, top.values, top.indices, mask, beta, TEMPERATURE, tail)
    assert_formula(got, full.detach())
    assert_formula(grads(got, student)[0], grads(full, student)[0])


STUDENT_ROW, TEACHER_ROW, TOP = [1.0, 0.0, 2.0, -1.0], [0.5, 2.0, 1.0, -2.0], [1, 2]  # the teacher's top-2 ids


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta", BETAS)
def test_topk_by_hand(beta, tail):
    ps, pt = softmax(STUDENT_ROW), softmax(TEACHER_ROW)
    if tail:  # the two top ids and one bucket with the rest of each distribution
        sparse_s = [ps[1], ps[2], ps[0] + ps[3]]
        sparse_t = [pt[1], pt[2], 1 - pt[1] - pt[2]]
    else:  # renormalised over the two top ids
        sparse_s = [ps[1] / (ps[1] + ps[2]), ps[2] / (ps[1] + ps[2])]
        sparse_t = [pt[1] / (pt[1] + pt[2]), pt[2] / (pt[1] + pt[2])]
    teacher_logps = f64([[[math.log(pt[1]), math.log(pt[2])]]])
    got = topk_generalized_jsd(f64([[STUDENT_ROW]]), teacher_logps, torch.tensor([[TOP]]), beta=beta, tail=tail,
                               reduction="none")
    assert got.tolist() == [[formula(divergence(sparse_s, sparse_t, beta))]]


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])  # 4 does not divide the 12 scored positions
@pytest.mark.parametrize("k,tail", [(3, True), (3, False), (V, True)])
@pytest.mark.parametrize("beta", BETAS)
def test_chunked_topk_equals_topk_on_the_students_logits(beta, k, tail, chunk_size):
    """Through the student's head a chunk at a time (checkpointed): ``topk_generalized_jsd``'s value and gradients
    (hidden states, weight, bias) at the masked positions, 0 elsewhere; NaN hidden states off the mask change
    nothing."""
    hidden, weight, b = student_head(torch.float64)
    _, teacher_logits = teacher_of("logits", torch.float64)
    top = F.log_softmax(teacher_logits / TEMPERATURE, -1).topk(k)
    mask = logits_and_labels()[2] != -100
    logits = F.linear(hidden, weight, b) * SCALE
    plain = topk_generalized_jsd(logits, top.values, top.indices, mask, beta, TEMPERATURE, tail, "none")
    poisoned = hidden.detach().masked_fill(~mask[..., None], math.nan).requires_grad_()
    chunked = chunked_topk_generalized_jsd(Projection(poisoned, weight, b, SCALE), top.values, top.indices, mask,
                                           beta, TEMPERATURE, tail, "none", chunk_size=chunk_size)
    assert chunked.shape == (N, T) and chunked[~mask].abs().max() == 0
    assert_rounding_close(chunked, plain, scale=logits.detach().abs().max(), terms=max(H, V), dtype=torch.float64)
    weights = torch.randn(N, T, dtype=torch.float64)  # an upstream gradient that differs per position
    got = grads((chunked * weights).sum(), poisoned, weight, b)
    want = grads((plain * weights).sum(), hidden, weight, b)
    assert got[0][~mask].abs().max() == 0
    for g, w, name in zip(got, want, ("hidden", "weight", "bias")):
        assert_rounding_close(g, w, terms=max(V, N * T), dtype=torch.float64, msg=name)


def test_topk_tail_keeps_a_floor_when_the_teacher_top_k_holds_all_its_mass():
    """A teacher whose top-1 log-prob rounds to 0 leaves no mass for the tail: it gets the dtype's eps instead of a
    zero that would make the reverse KL infinite."""
    ps, eps = softmax(STUDENT_ROW), torch.finfo(torch.float64).eps
    got = topk_generalized_jsd(f64([[STUDENT_ROW]]), f64([[[0.0]]]), torch.tensor([[[2]]]), beta=1.0,
                               reduction="none")
    rest = 1 - ps[2]
    assert got.tolist() == [[formula(ps[2] * math.log(ps[2]) + rest * math.log(rest / eps))]]
