"""lit_align.losses.preference_free against hand computations (plain Python floats, from the CPO, SimPO, AlphaPO and
ORPO papers' formulas) and against TRL's own ``CPOTrainer.cpo_loss`` and ``ORPOTrainer.odds_ratio_loss`` on the same
log-probs. Both sides in float64 (``tests/numerics.py``, rule 2)."""

from __future__ import annotations

import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from lit_align.errors import LitAlignError
from lit_align.losses.preference_free import CPOLoss, cpo_loss, log1mexp, odds_ratio_loss
from numerics import assert_formula, assert_rounding_close, f64, formula

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

BETA = 0.2
PI_C, PI_R = [-10.0, -3.0, -6.0], [-12.0, -2.0, -5.5]  # summed log-probs
AVG_C, AVG_R = [-0.9, -0.05, -2.0], [-1.4, -0.02, -0.7]  # per-token averages (ORPO's p = exp(avg) in (0, 1))


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def cpo_hand(loss_type: str, c: float, r: float, eps: float = 0.0, gamma: float = 0.5, alpha: float = 0.0) -> float:
    if alpha:
        c, r = (1 - math.exp(c) ** -alpha) / alpha, (1 - math.exp(r) ** -alpha) / alpha
    d = c - r
    if loss_type == "simpo":
        d -= gamma / BETA
    if loss_type in ("sigmoid", "simpo"):
        return -(1 - eps) * logsig(BETA * d) - eps * logsig(-BETA * d)
    if loss_type == "hinge":
        return max(0.0, 1 - BETA * d)
    return (d - 1 / (2 * BETA)) ** 2  # ipo


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "simpo"])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1}, {"alpha": 0.3}, {"simpo_gamma": 1.5}])
def test_cpo_loss_by_hand(loss_type, options):
    averaged = loss_type in ("ipo", "simpo")
    c, r = (AVG_C, AVG_R) if averaged else (PI_C, PI_R)
    losses, chosen_rewards, rejected_rewards = cpo_loss(f64(c), f64(r), BETA, loss_type, **options)
    eps = options.get("label_smoothing", 0.0) if loss_type in ("sigmoid", "simpo") else 0.0
    alpha = options.get("alpha", 0.0)
    for i in range(3):
        assert float(losses[i]) == formula(cpo_hand(loss_type, c[i], r[i], eps, options.get("simpo_gamma", 0.5),
                                                    alpha)), i
        shape = (lambda x: (1 - math.exp(-alpha * x)) / alpha) if alpha else (lambda x: x)
        assert float(chosen_rewards[i]) == formula(BETA * shape(c[i]))
        assert float(rejected_rewards[i]) == formula(BETA * shape(r[i]))


def _trl_fake(**settings):
    return SimpleNamespace(accelerator=SimpleNamespace(device="cpu"), **settings)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "simpo"])
@pytest.mark.parametrize("alpha,eps", [(0.0, 0.0), (0.0, 0.15), (0.25, 0.1)])
def test_cpo_loss_matches_trl(loss_type, alpha, eps):
    cpo = pytest.importorskip("trl.experimental.cpo")
    g = torch.Generator().manual_seed(5)
    chosen = -3 * torch.rand(6, generator=g, dtype=torch.float64)
    rejected = -3 * torch.rand(6, generator=g, dtype=torch.float64)
    fake = _trl_fake(alpha=alpha, loss_type=loss_type, simpo_gamma=0.7, beta=BETA, label_smoothing=eps)
    theirs = cpo.CPOTrainer.cpo_loss(fake, chosen, rejected)
    ours = CPOLoss(loss_type=loss_type, beta=BETA, label_smoothing=eps, simpo_gamma=0.7, alpha=alpha)(chosen, rejected)
    for a, b, what in zip(ours, theirs, ("losses", "chosen_rewards", "rejected_rewards")):
        assert_formula(a, b, what)


def test_alphapo_is_simpo_without_nll_as_in_trl():
    settings = CPOLoss(loss_type="alphapo", alpha=0.2)
    assert (settings.loss_type, settings.cpo_alpha, settings.averaged) == ("simpo", 0.0, True)
    cpo = pytest.importorskip("trl.experimental.cpo")
    config = cpo.CPOConfig(output_dir="unused", loss_type="alphapo", report_to="none", use_cpu=True, bf16=False)
    assert (config.loss_type, config.cpo_alpha) == (settings.loss_type, settings.cpo_alpha)


def test_odds_ratio_loss_by_hand():
    ratio_losses, chosen_rewards, rejected_rewards, log_odds = odds_ratio_loss(f64(AVG_C), f64(AVG_R), BETA)
    for i, (c, r) in enumerate(zip(AVG_C, AVG_R)):
        odds = math.log(math.exp(c) / (1 - math.exp(c))) - math.log(math.exp(r) / (1 - math.exp(r)))
        assert float(log_odds[i]) == formula(odds)
        assert float(ratio_losses[i]) == formula(-BETA * logsig(odds))
        assert (float(chosen_rewards[i]), float(rejected_rewards[i])) == (formula(BETA * c), formula(BETA * r))


def test_log1mexp_is_accurate_on_both_sides_of_log_2():
    x = f64([-1e-12, -1e-3, -0.5, -math.log(2), -1.0, -30.0])
    expected = [math.log(-math.expm1(v)) for v in x.tolist()]
    assert_formula(log1mexp(x), f64(expected))


def test_odds_ratio_loss_matches_trl():
    orpo = pytest.importorskip("trl.experimental.orpo")
    g = torch.Generator().manual_seed(7)
    chosen = -2 * torch.rand(8, generator=g, dtype=torch.float64) - 1e-3
    rejected = -2 * torch.rand(8, generator=g, dtype=torch.float64) - 1e-3
    losses, chosen_rewards, rejected_rewards, ratio, log_odds = orpo.ORPOTrainer.odds_ratio_loss(
        _trl_fake(beta=BETA), chosen, rejected)
    ours = odds_ratio_loss(chosen, rejected, BETA)
    # TRL casts its inputs to fp32 (``.float()``) where lit_align keeps fp64 (at least fp32): the same formula,
    # TRL's side rounded to fp32 (rule 3 with fp32's eps, at the log-odds' scale)
    close = partial(assert_rounding_close, scale=float(log_odds.abs().max()) + 1, terms=4)
    close(ours[0], -losses, msg="ratio losses (TRL's loss subtracts its term)")
    close(ours[1], chosen_rewards, msg="chosen rewards")
    close(ours[2], rejected_rewards, msg="rejected rewards")
    close((-ours[0] / BETA).mean(), ratio, msg="log_odds_ratio")  # TRL's metrics: batch means
    close(ours[3].mean(), log_odds, msg="log_odds_chosen")


@pytest.mark.parametrize("settings,message", [
    ({"loss_type": "dpo"}, "model.loss_type 'dpo': expected one of"),
    ({"beta": 0.0}, "model.beta 0.0: expected a value > 0"),
    ({"label_smoothing": 0.5}, r"model.label_smoothing 0.5: expected a value in \[0, 0.5\)"),
    ({"cpo_alpha": -1.0}, "model.cpo_alpha -1.0: expected a value >= 0"),
])
def test_bad_settings_are_one_line_errors(settings, message):
    with pytest.raises(LitAlignError, match=message) as info:
        CPOLoss(**settings)
    assert "\n" not in str(info.value)
