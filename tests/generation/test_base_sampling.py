"""What every engine shares and the native engine samples with: the completion mask from EOS, the top-k/top-p filter
by hand and against transformers' warpers, the inverse-CDF draw's frequencies and log-probs, and the settings."""

from __future__ import annotations

import math

import pytest
import torch

from lit_align.errors import LitAlignError
from lit_align.generation import (
    AutoEngine, ENGINES, HFEngine, NativeEngine, Engine, SamplingConfig, VLLMEngine, completion_mask_from_eos,
    filter_logits, make_engine, sample_next,
)
from lit_align.generation.native import penalize_repetition
from numerics import assert_rounding_close

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

NEG = float("-inf")


def test_completion_mask_from_eos_by_hand():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0], [9, 9, 9, 2]])
    mask, truncated = completion_mask_from_eos(ids, [2])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert truncated.tolist() == [False, True, False, False]
    mask, truncated = completion_mask_from_eos(ids, [2, 6])  # several EOS ids: the first of any ends the row
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, False, False]


# -- the filter, by hand -------------------------------------------------------------------------------------------
def test_filter_logits_top_k_by_hand():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [5.0, 5.0, 1.0, 5.0]])
    before = logits.clone()
    assert filter_logits(logits, top_k=2).tolist() == [[NEG, 3.0, 2.0, NEG], [5.0, 5.0, NEG, 5.0]]  # ties kept
    assert filter_logits(logits, top_k=1).tolist() == [[NEG, 3.0, NEG, NEG], [5.0, 5.0, NEG, 5.0]]
    assert filter_logits(logits, top_k=0).tolist() == logits.tolist()  # off
    assert filter_logits(logits, top_k=9).tolist() == logits.tolist()  # more than the vocabulary: off
    assert torch.equal(logits, before)  # pure


def test_filter_logits_top_p_by_hand():
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1]])
    logits = probs.log()
    keep = lambda **kw: (filter_logits(logits, **kw) > NEG).int().tolist()[0]  # noqa: E731
    # (no top_p exactly at a cumulative probability: there the softmax's last bit, which depends on the CPU's kernels,
    # would decide)
    assert keep(top_p=0.45) == [0, 1, 0, 0]  # the top token alone holds 0.5
    assert keep(top_p=0.55) == [0, 1, 1, 0]  # 0.5 < 0.55: the next one is needed
    assert keep(top_p=0.85) == [0, 1, 1, 1] or keep(top_p=0.85) == [1, 1, 1, 0]  # 0.8 < 0.85: one of the 0.1 ties
    assert keep(top_p=0.01) == [0, 1, 0, 0]  # the most likely token is always kept
    assert keep(top_p=1.0) == [1, 1, 1, 1]
    # top-k first, then top-p on what top-k kept: renormalized [0.5, 0.3] / 0.8 = [0.625, 0.375]
    assert keep(top_k=2, top_p=0.6) == [0, 1, 0, 0]
    assert keep(top_k=2, top_p=0.7) == [0, 1, 1, 0]
    kept = filter_logits(logits, top_p=0.55)  # the kept logits themselves are untouched
    assert kept[0, 1] == logits[0, 1] and kept[0, 2] == logits[0, 2]


def test_filter_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    for top_k, top_p in [(5, 1.0), (0, 0.9), (10, 0.5), (0, 0.3)]:
        expected = logits
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(None, expected)
        assert torch.equal(filter_logits(logits, top_k, top_p) > NEG, expected > NEG), (top_k, top_p)


def test_min_p_and_repetition_penalty_by_hand():
    # probabilities ~ [0.6, 0.3, 0.09, 0.01]: min_p 0.2 keeps those >= 0.12 (the first two)
    logits = torch.tensor([[0.6, 0.3, 0.09, 0.01]]).log()
    assert (filter_logits(logits, min_p=0.2) > NEG).tolist() == [[True, True, False, False]]
    assert (filter_logits(logits, min_p=0.0) > NEG).all() and (filter_logits(logits, min_p=None) > NEG).all()
    # the penalty divides positive logits, multiplies negative ones, only for the tokens seen
    logits = torch.tensor([[2.0, -1.0, 3.0, -4.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert penalize_repetition(logits, seen, 2.0).tolist() == [[1.0, -2.0, 3.0, -4.0]]
    assert penalize_repetition(logits, seen, 1.0) is logits


def test_min_p_and_repetition_penalty_match_transformers_processors():
    """On the same logits and the same previous tokens, native's filter and penalty are transformers' processors
    (``generate``'s order: the penalty on the raw logits, then temperature, top-k, top-p, min-p)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    previous = torch.randint(0, 50, (64, 7))  # the prompt and what was generated so far
    seen = torch.zeros(64, 50, dtype=torch.bool).scatter_(1, previous, True)
    for penalty, temperature, top_k, top_p, min_p in [(1.3, 1.0, 0, 1.0, 0.1), (0.8, 0.7, 10, 0.9, 0.05),
                                                      (1.5, 1.3, 0, 1.0, None), (1.0, 1.0, 0, 0.8, 0.3)]:
        expected = RepetitionPenaltyLogitsProcessor(penalty)(previous, logits.clone())
        expected = TemperatureLogitsWarper(temperature)(previous, expected)
        if top_k:
            expected = TopKLogitsWarper(top_k)(previous, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(previous, expected)
        if min_p is not None:
            expected = MinPLogitsWarper(min_p)(previous, expected)
        ours = filter_logits(penalize_repetition(logits / temperature, seen, penalty), top_k, top_p, min_p)
        assert torch.equal(ours > NEG, expected > NEG), (penalty, temperature, top_k, top_p, min_p)
        assert_rounding_close(ours[ours > NEG], expected[expected > NEG], msg=str((penalty, temperature)))
    assert (filter_logits(logits, min_p=0.3) == NEG).any()  # the option removes tokens


def test_sampling_logps_are_neither_penalized_nor_filtered():
    """The draw follows the penalized, filtered distribution; the log-prob is the tempered one's (the trainer's)."""
    torch.manual_seed(0)
    logits = torch.randn(16, 30) * 2
    seen = torch.rand(16, 30) < 0.5
    tokens, logps = sample_next(logits, 0.7, min_p=0.05, repetition_penalty=1.8, seen=seen)
    assert_rounding_close(logps, (logits / 0.7).log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))
    kept = filter_logits(penalize_repetition(logits / 0.7, seen, 1.8), min_p=0.05) > NEG
    assert kept.gather(1, tokens[:, None]).all()
    greedy, _ = sample_next(logits, 0.0, repetition_penalty=1.8, seen=seen)  # greedy honours the penalty too
    assert torch.equal(greedy, penalize_repetition(logits, seen, 1.8).argmax(-1))
    assert not torch.equal(greedy, logits.argmax(-1))


# -- the draw --------------------------------------------------------------------------------------------------------
def test_sampling_stays_in_the_allowed_set_with_the_right_frequencies():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).expand(20000, 5)
    tokens, logps = sample_next(logits, 1.0, top_k=2)
    assert set(tokens.tolist()) == {0, 1}
    assert abs((tokens == 0).float().mean().item() - math.e / (math.e + 1)) < 0.02  # softmax over the kept two
    # log-probs are those of the unfiltered distribution (HFEngine's definition), whatever the filter
    torch.testing.assert_close(logps, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens, _ = sample_next(probs.log().expand(20000, 4), 0.5, top_p=0.9)  # T=0.5: [.69, .25, .06, .01]
    assert set(tokens.tolist()) == {0, 1}  # 0.69 + 0.25 >= 0.9
    sharp = (probs.log() / 0.5).softmax(-1)[:2]
    assert abs((tokens == 0).float().mean().item() - (sharp[0] / sharp.sum()).item()) < 0.02

    tokens, logps = sample_next(torch.tensor([[0.0, 3.0, 1.0]]), 0.0)
    assert tokens.tolist() == [1] and logps is None  # greedy


def test_a_zero_uniform_draw_cannot_pick_a_filtered_token():
    """``torch.rand`` returns exactly 0 about once in 2**24 draws: with a single token kept (top-k 1, or top-p on a
    peaked step) that draw must still give the kept token, not a filtered one."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    for kwargs in ({"top_k": 1}, {"top_p": 0.5}):
        for u in (0.0, 1.0 - 2**-53):  # the CDF's two ends: the kept token, not the filtered ones around it
            tokens, logps = sample_next(logits, 1.0, noise=torch.tensor([u], dtype=torch.float64), **kwargs)
            assert tokens.tolist() == [2]
            assert_rounding_close(logps, logits.log_softmax(-1)[:, 2], scale=5.0, terms=4)


def test_inverse_cdf_by_blocks_equals_the_full_cumulative_sum():
    """Blocks of 4 over 10 tokens (two whole blocks and a tail), and one block of the whole row, weights with zeros
    and whole zero blocks: for every
    uniform on a fine grid the draw is the first token whose cumulative weight exceeds ``u * total``, and never a token
    of weight 0, at either end of [0, 1)."""
    from lit_align.generation.native import inverse_cdf

    weights = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 1.5, 0.0, 0.0, 2.0],  # a zero first block
                            [1.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # zero blocks after
                            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 7.0]])  # only the tail
    grid = torch.cat([torch.linspace(0, 1, 1001, dtype=torch.float64)[:-1], torch.tensor([1 - 2**-53])])
    for u in grid:
        uniform = torch.full((3,), float(u), dtype=torch.float64)
        cum = weights.double().cumsum(-1)
        expected = torch.searchsorted(cum, (uniform[:, None] * cum[:, -1:]).clamp(max=cum[:, -1:] * (1 - 1e-15)),
                                      right=True).squeeze(-1)
        for block in (4, 16):  # by blocks; one block (the whole row)
            drawn = inverse_cdf(weights, uniform, block=block)
            assert torch.equal(drawn, expected), (float(u), block, drawn, expected)
            assert (weights.gather(-1, drawn[:, None]) > 0).all()


def test_the_draw_inverts_the_cdf_at_the_rows_uniform():
    """Row i takes the first token whose cumulative probability exceeds ``u_i``: with probabilities [.1, .2, .3, .4]
    (CDF .1 .3 .6 1.0), u = .05 .15 .29 .31 .99 pick tokens 0 1 1 2 3."""
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().expand(5, 4)
    tokens, _ = sample_next(logits, 1.0, noise=torch.tensor([0.05, 0.15, 0.29, 0.31, 0.99], dtype=torch.float64))
    assert tokens.tolist() == [0, 1, 1, 2, 3]


def test_seeded_draws_are_the_default_noise():
    """``noise`` defaults to one float64 ``torch.rand`` per row: giving that same draw samples the same tokens."""
    logits = torch.randn(64, 50)
    torch.manual_seed(3)
    default = sample_next(logits, 0.8, top_k=10)
    torch.manual_seed(3)
    given = sample_next(logits, 0.8, top_k=10, noise=torch.rand(64, dtype=torch.float64))
    assert torch.equal(default[0], given[0]) and torch.equal(default[1], given[1])


# -- the settings, in one place ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1},
                                 {"max_new_tokens": 0}])
def test_out_of_range_settings_are_refused_by_every_engine(bad):
    with pytest.raises(LitAlignError, match="top_p"):
        SamplingConfig(**bad)
    for engine in ENGINES.values():
        with pytest.raises(LitAlignError, match="top_p"):
            engine(**bad)
    with pytest.raises(LitAlignError, match="eos_check_every"):
        NativeEngine(eos_check_every=0)


@pytest.mark.parametrize("bad,match", [({"min_p": 1.5}, r"model.min_p must be in \[0, 1\]"),
                                       ({"repetition_penalty": 0.0}, "model.repetition_penalty must be > 0"),
                                       ({"generation_kwargs": [1]}, "model.generation_kwargs must be a mapping")])
def test_new_sampling_settings_are_checked_by_every_engine(bad, match):
    for engine in (SamplingConfig, *ENGINES.values()):
        with pytest.raises(LitAlignError, match=match):
            engine(**bad)


def test_generation_kwargs_go_to_the_engines_that_have_them_and_native_refuses_them():
    with pytest.raises(LitAlignError, match=r"model.generation_kwargs \['suppress_tokens'\]: engine 'native' takes"):
        NativeEngine(generation_kwargs={"suppress_tokens": [3]})
    with pytest.raises(LitAlignError, match=r"model.generation_kwargs \['num_return_sequences'\]: engine 'hf' sets"):
        HFEngine(generation_kwargs={"num_return_sequences": 2, "top_k": 3})
    assert HFEngine(generation_kwargs={"suppress_tokens": [3]}).config.generation_kwargs == {"suppress_tokens": [3]}


def test_engines_are_built_by_name():
    assert ENGINES == {"auto": AutoEngine, "hf": HFEngine, "native": NativeEngine, "vllm": VLLMEngine}
    engine = make_engine("native", max_new_tokens=5, temperature=0.7, top_k=3, eos_check_every=2)
    assert isinstance(engine, NativeEngine) and isinstance(engine, Engine)
    assert engine.config == SamplingConfig(max_new_tokens=5, temperature=0.7, top_k=3)
    assert engine.eos_check_every == 2
    assert isinstance(make_engine("hf"), HFEngine) and make_engine("hf").config == SamplingConfig()
    known = r"\['auto', 'hf', 'native', 'vllm'\]"
    with pytest.raises(LitAlignError, match=rf"model.engine 'vllm-nope': expected one of {known}"):
        make_engine("vllm-nope")
