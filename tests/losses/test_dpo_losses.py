"""lit_align.losses.dpo against hand computations: every loss type, the f-divergences, label smoothing, lists of
loss types with weights, LD-DPO's ld_alpha, the sft term and WPO weights. Each formula is written out again here in
plain Python floats, from the papers / TRL's documented formulas, independently of the implementation. Both sides in
float64 (``tests/numerics.py``, rule 2)."""

from __future__ import annotations

import math

import pytest
import torch

from lit_align.losses.dpo import (
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSS_TYPES,
    dpo_loss,
    f_divergence_scores,
    sequence_logps,
    sft_nll,
    wpo_weights,
)
from lit_align.losses import dpo_loss as reexported
from numerics import f64, formula

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

BETA = 0.1
# three pairs, chosen so that sorting the batch (aot) pairs them differently
PI_C, PI_R = [-10.0, -3.0, -6.0], [-12.0, -30.0, -5.0]
REF_C, REF_R = [-11.0, -4.0, -6.5], [-11.5, -11.0, -7.0]
U_C, U_R = [1.0, 1.0, 0.5], [-0.5, -19.0, 2.0]  # log-ratios pi - ref
LEN_C, LEN_R = [4, 2, 3], [2, 0, 5]  # a zero length counts as 1
SFT_NLL = 2.5


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def smoothed(z: float, eps: float) -> float:
    return -(1 - eps) * logsig(z) - eps * logsig(-z)


def hand(loss_type: str, i: int, eps: float = 0.0, tau: float = 0.05) -> float:
    """Pair ``i``'s loss, reverse KL, beta = BETA."""
    uc, ur, b = U_C[i], U_R[i], BETA
    z = b * (uc - ur)
    if loss_type == "sigmoid":
        return -logsig(z)
    if loss_type == "hinge":
        return max(0.0, 1 - z)
    if loss_type == "ipo":
        return (uc / max(LEN_C[i], 1) - ur / max(LEN_R[i], 1) - 1 / (2 * b)) ** 2
    if loss_type == "sigmoid_norm":
        return -logsig(b * (uc / max(LEN_C[i], 1) - ur / max(LEN_R[i], 1)))
    if loss_type == "exo_pair":
        return sig(z) * (logsig(z) - math.log(1 - eps)) + sig(-z) * (logsig(-z) - math.log(eps))
    if loss_type == "robust":
        return ((1 - eps) * -logsig(z) - eps * -logsig(-z)) / (1 - 2 * eps)
    if loss_type == "nca_pair":
        return -logsig(b * uc) - 0.5 * logsig(-b * uc) - 0.5 * logsig(-b * ur)
    if loss_type == "bco_pair":
        return -logsig(b * uc) - logsig(-b * ur)
    if loss_type == "sppo_hard":
        return (uc - 0.5 / b) ** 2 + (ur + 0.5 / b) ** 2
    if loss_type == "aot":
        # policy margins pi_c - pi_r = [2, 27, -1] sort to [-1, 2, 27]; reference margins [.5, 7, .5] to [.5, .5, 7]
        return smoothed(b * [-1.5, 1.5, 20.0][i], eps)
    if loss_type == "aot_unpaired":
        # u_c sorts to [.5, 1, 1], u_r to [-19, -.5, 2]
        return smoothed(b * [19.5, 1.5, -1.0][i], eps)
    if loss_type == "apo_zero":
        return (1 - sig(b * uc)) + sig(b * ur)
    if loss_type == "apo_down":
        return sig(b * uc) + (1 - sig(b * (uc - ur)))
    if loss_type == "discopop":
        mix = sig(z / tau)
        return -logsig(z) * (1 - mix) + math.exp(-z) * mix
    if loss_type == "sft":
        return SFT_NLL
    raise AssertionError(loss_type)


def run(loss_type="sigmoid", **kwargs):
    return dpo_loss(
        f64(PI_C), f64(PI_R), f64(REF_C), f64(REF_R), beta=BETA,
        loss_type=loss_type, chosen_lengths=torch.tensor(LEN_C), rejected_lengths=torch.tensor(LEN_R),
        sft_nll=f64(SFT_NLL), **kwargs,
    )


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_each_loss_type_matches_hand_computation(loss_type):
    eps = 1e-3 if loss_type == "exo_pair" else 0.0
    losses, chosen, rejected = run(loss_type, label_smoothing=eps)
    assert losses.shape == (3,)
    assert losses.tolist() == formula([hand(loss_type, i, eps) for i in range(3)])
    # the rewards are beta * (pi - ref) whatever the loss
    assert chosen.tolist() == formula([BETA * u for u in U_C])
    assert rejected.tolist() == formula([BETA * u for u in U_R])


def test_sigmoid_written_out():
    losses, _, _ = run("sigmoid")
    # -log(sigmoid(0.1 * (1 + 0.5))), -log(sigmoid(0.1 * (1 + 19))), -log(sigmoid(0.1 * (0.5 - 2)))
    expected = [math.log(1 + math.exp(-0.15)), math.log(1 + math.exp(-2.0)), math.log(1 + math.exp(0.15))]
    assert losses.tolist() == formula(expected)
    assert reexported is dpo_loss  # lit_align.losses.dpo_loss is the same function


def test_loss_at_identical_policy_and_reference_is_ln2():
    x = f64([-5.0, -17.25])
    losses, chosen, rejected = dpo_loss(x, x - 1, x, x - 1, beta=0.3)
    assert losses.tolist() == formula([math.log(2)] * 2)
    assert chosen.tolist() == [0.0, 0.0] and rejected.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("loss_type,eps", [("robust", 0.1), ("exo_pair", 0.1), ("aot", 0.2), ("aot_unpaired", 0.2)])
def test_label_smoothing(loss_type, eps):
    losses, _, _ = run(loss_type, label_smoothing=eps)
    assert losses.tolist() == formula([hand(loss_type, i, eps) for i in range(3)])
    if loss_type != "exo_pair":  # it changes the loss (exo_pair needs eps > 0 anyway)
        assert not torch.allclose(losses, run(loss_type)[0])


def test_label_smoothing_is_ignored_where_trl_ignores_it():
    for loss_type in ("sigmoid", "hinge", "ipo", "bco_pair", "discopop"):
        assert torch.equal(run(loss_type, label_smoothing=0.3)[0], run(loss_type)[0])  # the same computation


def test_discopop_tau():
    losses, _, _ = run("discopop", discopop_tau=0.5)
    assert losses.tolist() == formula([hand("discopop", i, tau=0.5) for i in range(3)])
    assert not torch.allclose(losses, run("discopop")[0])


# -- f-divergences: f'(t) at t = pi / ref = exp(u) ---------------------------------------------------------------------
def f_prime(kind: str, u: float, alpha: float = 0.5) -> float:
    t = math.exp(u)
    if kind == "reverse_kl":
        return math.log(t)
    if kind == "forward_kl":
        return 1 - 1 / t
    if kind == "js_divergence":
        return math.log(2 * t / (t + 1))
    if kind == "alpha_divergence":
        return (t ** (alpha - 1) - 1) / (alpha - 1)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind,alpha", [("forward_kl", 0.5), ("js_divergence", 0.5), ("alpha_divergence", 0.5),
                                        ("alpha_divergence", 0.3)])
def test_f_divergence_sigmoid_and_ipo(kind, alpha):
    scores_c = [f_prime(kind, u, alpha) for u in U_C]
    scores_r = [f_prime(kind, u, alpha) for u in U_R]
    losses, chosen, _ = run("sigmoid", f_divergence_type=kind, f_alpha_divergence_coef=alpha)
    expected = [-logsig(BETA * (c - r)) for c, r in zip(scores_c, scores_r)]
    assert losses.tolist() == formula(expected)
    assert chosen.tolist() == formula([BETA * u for u in U_C])  # rewards stay beta * log-ratio
    losses, _, _ = run("ipo", f_divergence_type=kind, f_alpha_divergence_coef=alpha)
    expected = [(c / max(lc, 1) - r / max(lr, 1) - 5.0) ** 2
                for c, r, lc, lr in zip(scores_c, scores_r, LEN_C, LEN_R)]
    assert losses.tolist() == formula(expected)


def test_f_divergence_limits():
    u = f64([0.7, -2.0, 0.0])
    # alpha -> 1 is reverse KL; at u = 0 (t = 1) every f'(t) is 0 but JS's log 1 = 0 too
    assert torch.equal(f_divergence_scores(u, "alpha_divergence", 1.0), u)
    assert f_divergence_scores(u, "js_divergence")[2].item() == formula(0.0)
    # the exponent (alpha - 1) * u is clamped at 80, so a huge negative log-ratio stays finite
    big = f_divergence_scores(f64([-1000.0]), "alpha_divergence", 0.5)
    assert big.item() == formula((math.exp(80.0) - 1) / -0.5)
    with pytest.raises(ValueError, match="unknown f_divergence_type 'kl'"):
        f_divergence_scores(u, "kl")


def test_f_divergence_only_for_difference_losses():
    assert set(F_DIVERGENCE_LOSS_TYPES) < set(DPO_LOSS_TYPES)
    for loss_type in set(DPO_LOSS_TYPES) - set(F_DIVERGENCE_LOSS_TYPES):
        with pytest.raises(ValueError, match="expected 'reverse_kl', or only loss types from"):
            run(loss_type, f_divergence_type="forward_kl")


# -- several loss types ----------------------------------------------------------------------------------------------
def test_list_of_loss_types_with_weights():
    losses, _, _ = run(["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0])  # MPO's mix
    expected = [0.8 * hand("sigmoid", i) + 0.2 * hand("bco_pair", i) + 1.0 * SFT_NLL for i in range(3)]
    assert losses.tolist() == formula(expected)
    losses, _, _ = run(["sigmoid", "hinge"])  # weights default to 1
    assert losses.tolist() == formula([hand("sigmoid", i) + hand("hinge", i) for i in range(3)])
    with pytest.raises(ValueError, match=r"model.loss_weights \[1.0\]: expected one weight per loss_type"):
        run(["sigmoid", "hinge"], loss_weights=[1.0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown DPO loss_type 'kto'"):
        run("kto")
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="needs chosen_lengths"):
        dpo_loss(x, x, x, x, loss_type="ipo")
    with pytest.raises(ValueError, match="needs sft_nll"):
        dpo_loss(x, x, x, x, loss_type="sft")


def test_rewards_are_detached_and_gradient_matches_formula():
    pi_c = f64(PI_C).requires_grad_()
    pi_r = f64(PI_R).requires_grad_()
    losses, chosen, rejected = dpo_loss(pi_c, pi_r, f64(REF_C), f64(REF_R), beta=BETA)
    assert not chosen.requires_grad and not rejected.requires_grad
    losses.sum().backward()
    # d/d pi_c of -logsigmoid(beta * delta) = -beta * sigmoid(-beta * delta); d/d pi_r is its negative
    s = [sig(-BETA * (c - r)) for c, r in zip(U_C, U_R)]
    assert pi_c.grad.tolist() == formula([-BETA * x for x in s])
    assert pi_r.grad.tolist() == formula([BETA * x for x in s])


# -- per-token pieces: rows [chosen_1, chosen_2; rejected_1, rejected_2] ---------------------------------------------
TOKENS = f64([
    [-1.0, -2.0, -3.0, 0.0, 0.0],  # chosen 1: 3 tokens
    [0.0, -0.5, -0.25, 0.0, 0.0],  # chosen 2: 2 tokens (a leading non-completion position)
    [-4.0, -1.0, -2.0, -8.0, -16.0],  # rejected 1: 5 tokens
    [-1.5, 0.0, 0.0, 0.0, 0.0],  # rejected 2: 1 token
])
MASK = torch.tensor([
    [1, 1, 1, 0, 0],
    [0, 1, 1, 0, 0],
    [1, 1, 1, 1, 1],
    [1, 0, 0, 0, 0],
]).bool()


def test_ld_alpha_weights_the_longer_completions_tail():
    # pair 1: shared length min(3, 5) = 3, rejected's tokens 4 and 5 weigh alpha; pair 2: min(2, 1) = 1, chosen's
    # second token weighs alpha
    a = 0.25
    expected = [-6.0, -0.5 + a * -0.25, -7.0 + a * (-8.0 - 16.0), -1.5]
    assert sequence_logps(TOKENS, MASK, a).tolist() == formula(expected)
    plain = [-6.0, -0.75, -31.0, -1.5]
    assert sequence_logps(TOKENS, MASK).tolist() == formula(plain)
    assert sequence_logps(TOKENS, MASK, 1.0).tolist() == formula(plain)
    # ld_alpha = 0: only the shared lengths count
    assert sequence_logps(TOKENS, MASK, 0.0).tolist() == formula([-6.0, -0.5, -7.0, -1.5])


def test_sft_nll_is_the_token_mean_over_chosen():
    assert sft_nll(TOKENS, MASK).item() == formula((1 + 2 + 3 + 0.5 + 0.25) / 5)


def test_wpo_weights():
    sum_sq = torch.full_like(TOKENS, -0.5)
    sum_sq[0, 1] = -1.0
    tokens = TOKENS.clone().requires_grad_(True)
    weights = wpo_weights(tokens, sum_sq, MASK)
    assert not weights.requires_grad
    # exp(mean over each completion of (log p - log sum p^2)); the pair's weight is chosen's times rejected's
    chosen_1 = math.exp(((-1.0 + 0.5) + (-2.0 + 1.0) + (-3.0 + 0.5)) / 3)
    chosen_2 = math.exp(((-0.5 + 0.5) + (-0.25 + 0.5)) / 2)
    rejected_1 = math.exp(((-4.0 - 1.0 - 2.0 - 8.0 - 16.0) + 5 * 0.5) / 5)
    rejected_2 = math.exp(-1.5 + 0.5)
    assert weights.tolist() == formula([chosen_1 * rejected_1, chosen_2 * rejected_2])
    # they multiply each pair's loss
    pair_weights = f64([0.5, 2.0, 0.0])
    losses, _, _ = run(["sigmoid", "sft"], pair_weights=pair_weights)
    expected = [w * (hand("sigmoid", i) + SFT_NLL) for i, w in enumerate([0.5, 2.0, 0.0])]
    assert losses.tolist() == formula(expected)
