"""Token log-probs (``lit_align.logps.token_logps``) and their masked sums (``lit_align.losses.dpo.sequence_logps``)
against hand computations on small known numbers."""

from __future__ import annotations

import math

import pytest
import torch

from lit_align.logps import token_logps
from lit_align.losses.dpo import sequence_logps as summed
from numerics import assert_formula, assert_rounding_close, f64, formula

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

# [N=2, T=3, V=4] logits and their labels; labels at masked positions are garbage (out of vocabulary).
LOGITS = [
    [[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0], [3.0, -2.0, 1.0, 0.25]],
    [[-0.5, 0.5, 2.5, 1.5], [4.0, 1.0, -3.0, 0.0], [0.1, 0.2, 0.3, 0.4]],
]
LABELS = [[1, 3, 999], [2, -7, 0]]
MASK = [[1, 1, 0], [1, 0, 1]]


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What DPO sums: token log-probs of the masked labels (garbage labels where masked), summed per sequence."""
    mask = mask.bool()
    return summed(token_logps(logits, labels.masked_fill(~mask, 0)), mask)


def log_softmax_at(row: list[float], index: int) -> float:
    return row[index] - math.log(sum(math.exp(x) for x in row))


def test_sequence_logps_matches_hand_computation():
    expected = [
        sum(log_softmax_at(LOGITS[n][t], LABELS[n][t]) for t in range(3) if MASK[n][t]) for n in range(2)
    ]
    # written out for the first sequence: log_softmax([1, 2, .5, -1])[1] + log_softmax([0, 0, 0, 0])[3]
    assert expected[0] == pytest.approx(
        2.0 - math.log(math.e + math.e**2 + math.e**0.5 + math.e**-1) - math.log(4), abs=1e-12
    )
    got = sequence_logps(f64(LOGITS), torch.tensor(LABELS), torch.tensor(MASK))
    assert got.shape == (2,)
    assert got.dtype == torch.float64  # an fp64 model keeps fp64; anything narrower is computed in fp32
    assert got.tolist() == formula(expected)
    assert sequence_logps(torch.tensor(LOGITS), torch.tensor(LABELS), torch.tensor(MASK)).dtype == torch.float32


def test_sequence_logps_ignores_masked_positions():
    logits, labels, mask = torch.tensor(LOGITS), torch.tensor(LABELS), torch.tensor(MASK)
    base = sequence_logps(logits, labels, mask)
    scrambled = logits.clone()
    scrambled[0, 2] = torch.tensor([100.0, -100.0, 7.0, 3.0])  # masked position of sequence 0
    scrambled[1, 1] = torch.tensor([-9.0, 9.0, 0.0, 1.0])  # masked position of sequence 1
    assert torch.equal(sequence_logps(scrambled, labels, mask), base)
    # and a masked-out sequence sums to exactly 0
    assert sequence_logps(logits, labels, torch.zeros_like(mask)).tolist() == [0.0, 0.0]


def test_token_logps_matches_log_softmax_gather():
    logits = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 7), generator=torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert_formula(token_logps(logits, labels), expected)


def test_token_logps_bf16_close_to_fp32():
    gen = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(3, 9, 104, generator=gen)
    labels = torch.randint(0, 104, (3, 9), generator=gen)
    bf16 = logits.to(torch.bfloat16)
    out = token_logps(bf16, labels)
    assert out.dtype == torch.float32 and out.shape == (3, 9)
    # the half-precision path upcasts: the fp32 path on the same (rounded) values, one row at a time ...
    assert_rounding_close(out, token_logps(bf16.float(), labels), scale=logits.abs().max(), terms=104)
    # ... and within bf16 rounding of the exact fp32 log-probs: half a bf16 unit (2^-9 relative) on the label's logit
    # and on the logsumexp (a weighted mean of the logits' errors), at most 0.06 here (measured: 0.032; a bf16
    # log_softmax is off by 0.078)
    reference = token_logps(logits, labels)
    assert (out - reference).abs().max() <= 2 * 2**-9 * logits.abs().max()
    assert not torch.equal(out, reference)  # the rounding is really there (the comparison is not vacuous)

