"""lit_align.attention: attention under a packed layout's mask, computing only what the mask lets through, gives
``F.scaled_dot_product_attention``'s values and gradients under the full mask (rule 3 of tests/numerics.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_align.attention import SparseAttention, SparseMask, plan, sparse_mask
from lit_align.layouts import packed_rows, shared_prompt_completions, shared_prompt_pairs
from lit_align.logps import attention_mask_4d, layout_logps
from lit_align.models import load_model
from numerics import assert_rounding_close, needs_torch_bf16

pytestmark = pytest.mark.numerics


def pair_mask(specs: list[tuple[int, int, int]]) -> torch.Tensor:
    """DPO's packed shared-prompt rows (``[prompt, chosen, rejected]`` pairs, several per row) for ``(prompt, chosen,
    rejected)`` lengths."""
    n, width = len(specs), max(p + max(c, r) for p, c, r in specs)
    ids = torch.ones(2 * n, width, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, c, r) in enumerate(specs):
        for row, length in ((i, c), (n + i, r)):
            attention[row, :p + length], completion[row, p:p + length] = 1, 1
    batch = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
    return packed_rows(shared_prompt_pairs(batch)).allowed


def completions_mask(prompts: list[int], completions: list[int], per_prompt: int) -> torch.Tensor:
    """GRPO's packed rows of each prompt followed by its completions (``shared_prompt_completions``)."""
    width, length = max(prompts), max(completions)
    prompt_mask = torch.tensor([[0] * (width - p) + [1] * p for p in prompts for _ in range(per_prompt)])
    completion_mask = torch.tensor([[1] * c + [0] * (length - c) for c in completions])
    prompt_ids = torch.tensor([[i + 1] * width for i in range(len(prompts)) for _ in range(per_prompt)])
    return packed_rows(shared_prompt_completions(prompt_ids, prompt_mask, torch.ones_like(completion_mask),
                                                 completion_mask)).allowed


MASKS = {
    "pairs": lambda: pair_mask([(150, 120, 100), (60, 50, 70), (30, 20, 40)]),
    "completions": lambda: completions_mask([40, 90], [30, 50, 10, 64, 20, 33, 64, 5], 4),
    "causal": lambda: torch.ones(2, 1, 300, 300, dtype=torch.bool).tril_(),
}


def attend(query, key, value, mask):
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True, scale=0.125)
    return (out, *torch.autograd.grad(out, (query, key, value), torch.linspace(-1, 1, out.numel()).view_as(out)))


@pytest.mark.parametrize("name", sorted(MASKS))
def test_sparse_attention_matches_full_mask(name, monkeypatch):
    allowed = MASKS[name]()
    rows, _, length, _ = allowed.shape
    torch.manual_seed(0)
    query, key, value = (torch.randn(rows, heads, length, 16, requires_grad=True) for heads in (6, 2, 2))
    expected = attend(query, key, value, allowed)
    calls, apply = [], SparseAttention.apply
    monkeypatch.setattr(SparseAttention, "apply", lambda *args: calls.append(1) or apply(*args))
    actual = attend(query, key, value, sparse_mask(allowed))
    assert calls, "the sparse kernel did not run"
    for what, a, e, terms in zip(("output", "d query", "d key", "d value"), actual, expected,
                                 (length, 16 * length, length, length)):
        assert type(a) is torch.Tensor
        assert_rounding_close(a, e, terms=terms, msg=what)


def test_plan_skips_what_the_mask_hides():
    allowed = MASKS["pairs"]()
    width = allowed.shape[3]
    tiles = plan(allowed, tile=64)
    computed = sum((t.stop - t.start) * len(torch.arange(width)[p.keys]) for t in tiles for p in t.parts)
    assert allowed.sum() <= computed < 0.6 * allowed[:, 0].numel()  # a fraction of the rows' square, all it lets in
    # a pair's rejected tokens: the prompt's keys unmasked, the chosen ones skipped, their own keys causally
    assert any([p.causal for p in t.parts] == [False, True] and t.parts[0].keys.start == 0
               and t.parts[0].keys.stop < t.start for t in tiles)
    for t in tiles:  # each tile's parts hold every key its queries see, once, and a mask only where one is needed
        seen = torch.zeros(width, dtype=torch.long)
        for p in t.parts:
            seen[p.keys] += 1
            assert p.mask is None or not p.mask.eq(0).all()
        assert seen.max() <= 1 and not (allowed[t.row, 0, t.start:t.stop] & (seen == 0)).any()
    unmasked = [t for t in plan(MASKS["causal"]()) if all(p.mask is None for p in t.parts)]
    assert len(unmasked) == 4 and [len(t.parts) for t in unmasked] == [1, 2] * 2  # 300 causal rows: 150 + 150


def test_sparse_mask_is_the_plain_mask_elsewhere():
    allowed = MASKS["completions"]()
    mask = sparse_mask(allowed)
    assert type(mask[:, :, :5]) is torch.Tensor and torch.equal(mask[:, :, :5], allowed[:, :, :5])
    assert int(mask.sum()) == int(allowed.sum())
    rows, _, length, _ = allowed.shape
    torch.manual_seed(0)
    query, key, value = (torch.randn(rows, 4, length, 8, dtype=torch.float64) for _ in range(3))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)  # fp64: the plain kernels
    assert torch.equal(out, F.scaled_dot_product_attention(query, key, value, attn_mask=allowed))


def test_packed_logps_take_the_sparse_path():
    model = load_model("builtin:tiny")
    allowed = MASKS["pairs"]()
    assert isinstance(attention_mask_4d(model, allowed), SparseMask)
    model.config._attn_implementation = "eager"
    assert type(attention_mask_4d(model, allowed)) is torch.Tensor  # additive for eager


@needs_torch_bf16
def test_sparse_attention_in_bf16():
    """bf16 against fp32: no further from it than the full-mask kernel in bf16 (rule 4)."""
    allowed = MASKS["pairs"]()
    rows, _, length, _ = allowed.shape
    torch.manual_seed(0)
    inputs = [torch.randn(rows, heads, length, 16) for heads in (6, 2, 2)]
    reference = attend(*(x.clone().requires_grad_() for x in inputs), allowed)
    half = [x.bfloat16().requires_grad_() for x in inputs]
    full, sparse = attend(*half, allowed), attend(*half, sparse_mask(allowed))
    for r, f, s in zip(reference, full, sparse):
        assert (s.float() - r).abs().max() <= 2 * (f.float() - r).abs().max() + 1e-6


def packed_pairs(vocab_size: int):
    """Two pairs of random tokens, each pair's prompt shared, packed (DPO's padding-free layout)."""
    ids = torch.randint(3, vocab_size, (4, 40))
    attention = torch.ones_like(ids)
    attention[1, 30:] = attention[3, 25:] = 0
    completion = attention.clone()
    completion[:, :12] = 0
    ids[2:, :12] = ids[:2, :12]  # pairs share their prompt
    return packed_rows(shared_prompt_pairs({"input_ids": ids, "attention_mask": attention,
                                            "completion_mask": completion}))


def test_layout_logps_equal_with_and_without_sparse_attention(monkeypatch):
    torch.manual_seed(0)
    model = load_model("builtin:tiny")
    layout = packed_pairs(model.config.vocab_size)
    sparse = layout_logps(model, layout).tokens
    (grad_sparse,) = torch.autograd.grad(sparse.sum(), model.model.layers[0].self_attn.q_proj.weight)
    monkeypatch.setattr("lit_align.logps.sparse_mask", lambda allowed, kv_groups=1: allowed)
    plain = layout_logps(model, layout).tokens
    (grad_plain,) = torch.autograd.grad(plain.sum(), model.model.layers[0].self_attn.q_proj.weight)
    assert_rounding_close(sparse, plain, terms=384)
    assert_rounding_close(grad_sparse, grad_plain, scale=grad_plain.abs().max() * 40, terms=384)


@needs_torch_bf16
def test_sparse_attention_under_autocast():
    """bf16 autocast (``precision: bf16-mixed``): the kernel gets what autocast gives the full-mask call, fp32 queries
    after the rotary embedding and bf16 values alike."""
    allowed = MASKS["pairs"]()
    rows, _, length, _ = allowed.shape
    torch.manual_seed(0)
    query = torch.randn(rows, 6, length, 16, requires_grad=True)
    key, value = (torch.randn(rows, 2, length, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full, sparse = attend(query, key, value, allowed), attend(query, key, value, sparse_mask(allowed))
    for f, s in zip(full, sparse):
        assert s.dtype == f.dtype
        assert_rounding_close(s, f, dtype=torch.bfloat16)


def test_a_grouped_models_keys_reach_the_kernel_unrepeated(monkeypatch):
    """transformers repeats a GQA model's keys and values to every query head before ``sdpa`` under a mask; under a
    ``SparseMask`` its ``sdpa`` function hands them over unrepeated (``sdpa_attention_forward``), and its output's
    memory is laid out as the callers transpose it (no copy there): the packed log-probs and their gradients are
    the plain path's."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import sdpa_attention

    repeats, repeat_kv = [], sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *args: repeats.append(1) or repeat_kv(*args))

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    model.config._attn_implementation = "sdpa"
    layout = packed_pairs(config.vocab_size)
    seen, apply = [], SparseAttention.apply

    def recording(query, key, value, tiles, scale):
        out = apply(query, key, value, tiles, scale)
        seen.append((query.shape[1], key.shape[1], value.shape[1], out.transpose(1, 2).is_contiguous()))
        return out

    monkeypatch.setattr(SparseAttention, "apply", recording)
    weight = model.model.layers[0].self_attn.k_proj.weight
    sparse = layout_logps(model, layout).tokens
    (grad_sparse,) = torch.autograd.grad(sparse.sum(), weight)
    assert seen == [(4, 2, 2, True)] * 2 and repeats == []
    monkeypatch.setattr("lit_align.logps.sparse_mask", lambda allowed, kv_groups=1: allowed)
    plain = layout_logps(model, layout).tokens
    (grad_plain,) = torch.autograd.grad(plain.sum(), weight)
    assert len(seen) == 2 and len(repeats) == 4  # the plain mask: torch's own attention, on repeated keys
    assert_rounding_close(sparse, plain, terms=64)
    assert_rounding_close(grad_sparse, grad_plain, scale=grad_plain.abs().max() * 40, terms=64)
