"""lit_align.logps: the chunked log-prob path equals the plain one, in values, gradients and statistics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_align.logps import chunkable_head, chunked_token_logps, next_token_logps, plain_token_stats
from lit_align.logps import token_logps
from numerics import assert_rounding_close

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

N, T, H, V = 3, 7, 16, 50


def inputs(dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, T, H, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (N, T), generator=g)
    grad_out = torch.randn(N, T, generator=g)  # a non-uniform upstream gradient
    return hidden, weight, b, labels, grad_out


def grads(logps, grad_out, *tensors):
    return torch.autograd.grad((logps * grad_out).sum(), [t for t in tensors if t is not None])


def assert_grads_close(got_grads, want_grads, dtype=torch.float32, grad_dtype=None):
    """Each gradient: reductions over the vocabulary (hidden) or the positions (weight, bias), in another order; in
    half precision, one rounding of an fp32 accumulation (``terms=1``)."""
    for got, want, name in zip(got_grads, want_grads, ("hidden", "weight", "bias")):
        assert got.dtype == want.dtype == (grad_dtype or dtype), name
        terms = max(V, N * T) if dtype == torch.float32 else 1
        assert_rounding_close(got, want, terms=terms, dtype=dtype, msg=name)


@pytest.mark.parametrize("chunk_size,block_size", [(1, None), (5, None), (21, None), (1000, None), (5, 7), (21, 1),
                                                   (4, 49)])  # 21 = N*T; 5 does not divide it; blocks of V=50
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_equals_plain_fp32(chunk_size, block_size, bias):
    hidden, weight, b, labels, grad_out = inputs(bias=bias)
    scale = 1 / 0.7  # a temperature
    logits = F.linear(hidden, weight, b) * scale
    plain = token_logps(logits, labels)
    chunked, _ = chunked_token_logps(hidden, weight, labels, b, chunk_size=chunk_size, scale=scale,
                                     block_size=block_size)
    assert chunked.dtype == torch.float32 and chunked.shape == (N, T)
    # the logits (a reduction over H) and their logsumexp (over V), each in the chunk's own kernel
    assert_rounding_close(chunked, plain, scale=logits.abs().max(), terms=max(H, V))
    assert_grads_close(grads(chunked, grad_out, hidden, weight, b), grads(plain, grad_out, hidden, weight, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_give_the_recomputed_gradients_without_the_backward_matmul(dtype, monkeypatch):
    """``keep_logits``: backward reuses the forward's tiles (the head's matmul runs in forward only), with the
    gradients of the recomputing backward; a second backward (``retain_graph``) recomputes; over the byte budget, or
    without gradient, nothing is kept."""
    import lit_align.logps as logps_module

    hidden, weight, b, labels, grad_out = inputs(dtype)
    calls = []
    tiles = logps_module._Head.tiles
    monkeypatch.setattr(logps_module._Head, "tiles", lambda self, h: calls.append(len(h)) or tiles(self, h))
    want = grads(chunked_token_logps(hidden, weight, labels, b, chunk_size=5, block_size=7, scale=1.3)[0], grad_out,
                 hidden, weight, b)
    assert len(calls) == 2 * 5  # 5 chunks of 21 positions, forward and backward
    calls.clear()
    logps, _ = chunked_token_logps(hidden, weight, labels, b, chunk_size=5, block_size=7, scale=1.3, keep_logits=True)
    first = torch.autograd.grad((logps * grad_out).sum(), [hidden, weight, b], retain_graph=True)
    assert len(calls) == 5  # the forward's only
    for got, expected, name in zip(first, want, ("hidden", "weight", "bias")):
        assert_rounding_close(got, expected, terms=1, dtype=dtype, msg=name)  # the same tiles, the same order
    again = torch.autograd.grad((logps * grad_out).sum(), [hidden, weight, b])
    assert len(calls) == 2 * 5
    for got, expected in zip(again, want):
        assert torch.equal(got, expected)
    calls.clear()
    monkeypatch.setattr(logps_module, "KEEP_LOGITS_BYTES", N * T * V * 4 - 1)
    logps, _ = chunked_token_logps(hidden, weight, labels, b, chunk_size=5, keep_logits=True)
    grads(logps, grad_out, hidden, weight, b)
    assert len(calls) == 2 * 5


@pytest.mark.parametrize("block_size", [None, 8])
def test_chunked_equals_plain_bf16(block_size):
    hidden, weight, b, labels, grad_out = inputs(torch.bfloat16)
    plain = token_logps(F.linear(hidden, weight, b), labels)  # bf16 logits, upcast inside
    chunked, _ = chunked_token_logps(hidden, weight, labels, b, chunk_size=4, block_size=block_size)
    assert chunked.dtype == plain.dtype == torch.float32
    # the same bf16 logits (bf16 matmul rounding, possibly another kernel per chunk), then fp32 math
    logits = F.linear(hidden, weight, b).float()
    assert_rounding_close(chunked, plain, scale=logits.abs().max(), dtype=torch.bfloat16)
    assert_grads_close(grads(chunked, grad_out, hidden, weight, b), grads(plain, grad_out, hidden, weight, b),
                       dtype=torch.bfloat16)


def test_chunked_under_autocast_matches_plain_and_returns_fp32():
    hidden, weight, b, labels, grad_out = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = token_logps(F.linear(hidden, weight, b), labels)
        chunked, _ = chunked_token_logps(hidden, weight, labels, b, chunk_size=8, block_size=16)
    assert chunked.dtype == torch.float32
    logits = F.linear(hidden, weight, b)
    assert_rounding_close(chunked, plain, scale=logits.abs().max(), dtype=torch.bfloat16)
    # fp32 master weights get fp32 gradients, of bf16 accuracy
    assert_grads_close(grads(chunked, grad_out, hidden, weight, b), grads(plain, grad_out, hidden, weight, b),
                       dtype=torch.bfloat16, grad_dtype=torch.float32)


@pytest.mark.parametrize("block_size", [None, 1, 6])
def test_chunked_stats_equal_plain_stats(block_size):
    """Every statistic, also when the vocabulary is cut into blocks (the online logsumexp rescales its sums as the
    running maximum moves), with the maximum tied across blocks (argmax: the first)."""
    hidden, weight, b, labels, _ = inputs()
    with torch.no_grad():  # tokens 3 and 40 (other blocks) share one exact logit: the largest at half the positions
        weight[3], weight[40] = 0, 0
        b[3] = b[40] = F.linear(hidden, weight, b).amax(-1).median() + 1e-3
    names = ("entropy", "argmax", "mean_logit", "log_sum_sq_probs")
    _, chunked = chunked_token_logps(hidden, weight, labels, b, chunk_size=4, scale=2.0, stats=names,
                                     block_size=block_size)
    logits = F.linear(hidden, weight, b) * 2.0
    plain = plain_token_stats(logits, names)
    assert torch.equal(chunked["argmax"], plain["argmax"])
    for name in ("entropy", "mean_logit", "log_sum_sq_probs"):
        assert not chunked[name].requires_grad
        assert_rounding_close(chunked[name], plain[name], scale=logits.abs().max(), terms=max(H, V), msg=name)
    with pytest.raises(ValueError, match="unknown stats"):
        chunked_token_logps(hidden, weight, labels, stats=("perplexity",))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_next_token_logps_chunked_equals_plain_on_a_model(tiny_path, temperature):
    from lit_align.models import load_model

    model = load_model("builtin:tiny").train()
    assert chunkable_head(model) is not None
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    kwargs = {"attention_mask": attention_mask, "position_ids": position_ids, "temperature": temperature,
              "stats": ("entropy",)}
    results = {}
    for chunk_size in (None, 5):
        model.zero_grad()
        logps, stats = next_token_logps(model, input_ids, 4, chunk_size=chunk_size, **kwargs)
        logps.sum().backward()
        results[chunk_size] = logps.detach(), stats["entropy"], {n: p.grad.clone() for n, p in model.named_parameters()}
    (plain, plain_entropy, plain_grads), (chunked, chunked_entropy, chunked_grads) = results[None], results[5]
    assert plain.shape == (2, 8)
    # the same network forward; the head and the log-softmax over the vocabulary in other kernels
    vocab, hidden_size = model.config.vocab_size, model.config.hidden_size
    assert_rounding_close(chunked, plain, scale=plain.abs().max(), terms=max(vocab, hidden_size))
    assert_rounding_close(chunked_entropy, plain_entropy, scale=plain.abs().max(), terms=max(vocab, hidden_size))
    for name, grad in plain_grads.items():  # through the network: every position's reduction, summed
        assert_rounding_close(chunked_grads[name], grad, terms=max(vocab, hidden_size) * plain.numel(), msg=name)


def test_soft_capped_models_fall_back_to_the_plain_path(tiny_path):
    from lit_align.models import load_model

    model = load_model("builtin:tiny")
    model.config.final_logit_softcapping = 30.0
    assert chunkable_head(model) is None
    input_ids = torch.randint(3, model.config.vocab_size, (1, 6))
    logps, _ = next_token_logps(model, input_ids, 1, chunk_size=4)  # silently the plain path
    plain = token_logps(model(input_ids).logits[:, :-1], input_ids[:, 1:])
    assert_rounding_close(logps, plain, terms=model.config.vocab_size)


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("soft_capped", [False, True])
def test_layout_outputs_are_the_logits_at_the_scored_tokens_in_grid_order(tiny_path, padding_free, soft_capped):
    """Completions after left-padded prompts, padded or packed (``layouts.completions``): the hidden states and head
    (a chunkable model) make, and the logits (one that is not) are, the plain forward's logits at the positions that
    predict each completion token, row by row."""
    from lit_align import layouts
    from lit_align.logps import Projection, layout_outputs
    from lit_align.models import load_model

    model = load_model("builtin:tiny")
    model.config.final_logit_softcapping = 30.0 if soft_capped else None  # Llama ignores it: the same logits
    g = torch.Generator().manual_seed(2)
    prompt_ids, completion_ids = torch.randint(3, 90, (3, 5), generator=g), torch.randint(3, 90, (3, 4), generator=g)
    prompt_mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    layout = layouts.completions(prompt_ids, prompt_mask, completion_ids, completion_mask, padding_free, model)
    with torch.no_grad():
        outputs = layout_outputs(model, layout)
        attention = torch.cat([prompt_mask, completion_mask], 1)
        plain = model(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=attention,
                      position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits[:, 4:-1][completion_mask.bool()]
    assert isinstance(outputs, Projection) != soft_capped
    logits = outputs.logits() if isinstance(outputs, Projection) else outputs
    assert logits.shape == plain.shape == (7, model.config.vocab_size)
    assert_rounding_close(logits, plain, terms=model.config.hidden_size * model.config.num_hidden_layers)


def test_entropy_with_its_gradient_plain_and_chunked(tiny_path):
    """``entropy_grad`` (GRPO's entropy bonus trains on it): the same entropy, with the gradient of
    ``-sum p log p`` of the tempered logits, from the plain path and the chunked one (float64: a formula)."""
    from lit_align.models import load_model

    model = load_model("builtin:tiny", dtype="float64")
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids).logits[:, 2:-1] / 0.7
    direct = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    weights = torch.rand(direct.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = torch.autograd.grad((direct * weights).sum(), [model.lm_head.weight])[0]
    _, plain = next_token_logps(model, ids, 3, temperature=0.7, stats=("entropy",))
    assert not plain["entropy"].requires_grad
    for chunk_size in (None, 4):
        _, trained = next_token_logps(model, ids, 3, chunk_size, temperature=0.7, stats=("entropy",),
                                      entropy_grad=True)
        torch.testing.assert_close(trained["entropy"], direct, rtol=1e-10, atol=1e-12)
        (got,) = torch.autograd.grad((trained["entropy"] * weights).sum(), [model.lm_head.weight])
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("keep", [False, True])
def test_chunked_entropy_gradient_with_the_log_probs_gradient(keep):
    """Both outputs trained at once (the log-probs' and the entropy's gradients in one backward), kept or recomputed
    tiles: the gradients of the plain formula, in float64."""
    hidden, weight, b, labels, grad_out = inputs(torch.float64)
    grad_entropy = torch.randn(N, T, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    logps, stats = chunked_token_logps(hidden, weight, labels, b, chunk_size=4, scale=0.5, stats=("argmax", "entropy"),
                                       block_size=16, keep_logits=keep, entropy_grad=True)
    got = torch.autograd.grad((logps * grad_out).sum() + (stats["entropy"] * grad_entropy).sum(), [hidden, weight, b])
    logits = (hidden @ weight.T + b) * 0.5
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    plain = token_logps(logits, labels)
    want = torch.autograd.grad((plain * grad_out).sum() + (entropy * grad_entropy).sum(), [hidden, weight, b])
    torch.testing.assert_close(stats["entropy"], entropy, rtol=1e-10, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)
