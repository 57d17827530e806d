"""lit_align.losses against hand computations on small known numbers."""

from __future__ import annotations

import math

import pytest
import torch

from lit_align.losses import DPO_LOSS_TYPES, dpo_loss, sequence_logps, token_logps

# [N=2, T=3, V=4] logits and their labels; labels at masked positions are garbage (out of vocabulary).
LOGITS = [
    [[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0], [3.0, -2.0, 1.0, 0.25]],
    [[-0.5, 0.5, 2.5, 1.5], [4.0, 1.0, -3.0, 0.0], [0.1, 0.2, 0.3, 0.4]],
]
LABELS = [[1, 3, 999], [2, -7, 0]]
MASK = [[1, 1, 0], [1, 0, 1]]


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
    got = sequence_logps(torch.tensor(LOGITS), torch.tensor(LABELS), torch.tensor(MASK))
    assert got.shape == (2,)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(expected, abs=1e-5)


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
    logits = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (3, 7), generator=torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logps(logits, labels), expected, atol=1e-6, rtol=0)


def test_token_logps_bf16_close_to_fp32():
    gen = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(3, 9, 104, generator=gen)
    labels = torch.randint(0, 104, (3, 9), generator=gen)
    bf16 = logits.to(torch.bfloat16)
    out = token_logps(bf16, labels)
    assert out.dtype == torch.float32 and out.shape == (3, 9)
    # the half-precision path upcasts: identical to the fp32 path on the same (rounded) values ...
    torch.testing.assert_close(out, token_logps(bf16.float(), labels), atol=1e-5, rtol=0)
    # ... and within bf16 rounding of the exact fp32 log-probs (measured: 0.032; a bf16 log_softmax is off by 0.078)
    reference = token_logps(logits, labels)
    assert (out - reference).abs().max() < 0.06
    assert not torch.equal(out, reference)  # the rounding is really there (the comparison is not vacuous)


BETA = 0.1
PI_C, PI_R, REF_C, REF_R = [-10.0, -3.0], [-12.0, -30.0], [-11.0, -4.0], [-11.5, -11.0]
# log-ratios: chosen [1.0, 1.0], rejected [-0.5, -19.0]; delta [1.5, 20.0]


def _dpo(loss_type, **kw):
    return dpo_loss(
        torch.tensor(PI_C), torch.tensor(PI_R), torch.tensor(REF_C), torch.tensor(REF_R),
        beta=BETA, loss_type=loss_type, **kw,
    )


def test_dpo_sigmoid_loss_formula():
    losses, chosen, rejected = _dpo("sigmoid")
    # -log(sigmoid(beta * delta)) = log(1 + exp(-beta * delta))
    assert losses.tolist() == pytest.approx([math.log(1 + math.exp(-0.15)), math.log(1 + math.exp(-2.0))], abs=1e-6)
    assert chosen.tolist() == pytest.approx([0.1, 0.1], abs=1e-6)
    assert rejected.tolist() == pytest.approx([-0.05, -1.9], abs=1e-6)


def test_dpo_hinge_loss_formula():
    losses, chosen, rejected = _dpo("hinge")
    assert losses.tolist() == pytest.approx([1 - 0.15, 0.0], abs=1e-6)  # relu(1 - beta * delta)
    assert chosen.tolist() == pytest.approx([0.1, 0.1], abs=1e-6)
    assert rejected.tolist() == pytest.approx([-0.05, -1.9], abs=1e-6)


def test_dpo_ipo_loss_formula():
    losses, chosen, rejected = _dpo("ipo", chosen_lengths=torch.tensor([4, 2]), rejected_lengths=torch.tensor([2, 0]))
    # (chosen_logratio / len_c - rejected_logratio / len_r - 1 / (2 beta))^2, a zero length counts as 1
    expected = [(1.0 / 4 - (-0.5) / 2 - 5.0) ** 2, (1.0 / 2 - (-19.0) / 1 - 5.0) ** 2]
    assert expected == [20.25, 210.25]
    assert losses.tolist() == pytest.approx(expected, abs=1e-4)
    assert chosen.tolist() == pytest.approx([0.1, 0.1], abs=1e-6)
    assert rejected.tolist() == pytest.approx([-0.05, -1.9], abs=1e-6)


def test_dpo_rewards_are_detached_and_gradient_matches_formula():
    pi_c = torch.tensor(PI_C, requires_grad=True)
    pi_r = torch.tensor(PI_R, requires_grad=True)
    losses, chosen, rejected = dpo_loss(pi_c, pi_r, torch.tensor(REF_C), torch.tensor(REF_R), beta=BETA)
    assert not chosen.requires_grad and not rejected.requires_grad
    losses.sum().backward()
    # d/d pi_c of -logsigmoid(beta * delta) = -beta * sigmoid(-beta * delta); d/d pi_r is its negative
    sig = [1 / (1 + math.exp(0.15)), 1 / (1 + math.exp(2.0))]
    assert pi_c.grad.tolist() == pytest.approx([-BETA * s for s in sig], abs=1e-6)
    assert pi_r.grad.tolist() == pytest.approx([BETA * s for s in sig], abs=1e-6)


def test_dpo_loss_at_identical_policy_and_reference_is_ln2():
    x = torch.tensor([-5.0, -17.25])
    losses, chosen, rejected = dpo_loss(x, x - 1, x, x - 1, beta=0.3)
    assert losses.tolist() == [torch.tensor(math.log(2)).item()] * 2
    assert chosen.tolist() == [0.0, 0.0] and rejected.tolist() == [0.0, 0.0]


def test_dpo_loss_rejects_bad_arguments():
    assert DPO_LOSS_TYPES == ("sigmoid", "hinge", "ipo")
    with pytest.raises(ValueError, match="unknown DPO loss_type 'kto'"):
        _dpo("kto")
    with pytest.raises(ValueError, match="needs chosen_lengths"):
        _dpo("ipo")
