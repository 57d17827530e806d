"""The reward model's loss in ``lit_align.losses.reward``: by hand, and against TRL's own
``RewardTrainer.compute_loss`` (run on a stand-in ``self`` whose model returns fixed rewards). Every input is float64,
so each comparison is rule 2 of ``tests/numerics.py`` (a formula, to 1e-9).
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lit_align.losses.reward import reward_loss, reward_metrics
from numerics import assert_formula, f64, formula

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

CHOSEN = f64([1.5, -0.25, 0.75])
REJECTED = f64([0.5, 0.5, 0.75])
MARGIN = f64([0.5, 0.0, -1.0])


def log1p_exp(x: float) -> float:
    """-logsigmoid(-x) = log(1 + e^x), written out."""
    return math.log(1.0 + math.exp(x))


def test_bradley_terry_loss_by_hand():
    # -logsigmoid(d) = log(1 + e^-d) with d = r_c - r_r = [1.0, -0.75, 0.0]
    expected = [log1p_exp(-1.0), log1p_exp(0.75), math.log(2.0)]  # 0.3132617, 1.1368710, 0.6931472
    assert_formula(reward_loss(CHOSEN, REJECTED), f64(expected))
    assert expected == pytest.approx([0.3132617, 1.1368710, 0.6931472], abs=1e-7)


def test_margin_and_centering_move_the_loss_by_hand():
    # d - margin = [0.5, -0.75, 1.0]: a margin asks for a gap of at least that much
    with_margin = [log1p_exp(-0.5), log1p_exp(0.75), log1p_exp(-1.0)]
    assert_formula(reward_loss(CHOSEN, REJECTED, MARGIN), f64(with_margin))
    # + coef * (r_c + r_r)^2, (r_c + r_r) = [2.0, 0.25, 1.5]
    coef = 0.01
    centered = [m + coef * s**2 for m, s in zip(with_margin, [2.0, 0.25, 1.5])]
    assert_formula(reward_loss(CHOSEN, REJECTED, MARGIN, coef), f64(centered))
    assert reward_loss(CHOSEN, REJECTED, MARGIN).mean().item() != formula(reward_loss(CHOSEN, REJECTED).mean().item())
    # a coefficient of 0 adds nothing; None (TRL's default) is off
    assert_formula(reward_loss(CHOSEN, REJECTED, None, 0.0), reward_loss(CHOSEN, REJECTED))


def test_the_loss_is_differentiable_and_pushes_chosen_up_and_rejected_down():
    chosen, rejected = CHOSEN.clone().requires_grad_(), REJECTED.clone().requires_grad_()
    reward_loss(chosen, rejected).mean().backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()
    # d loss / d r_c = -sigmoid(-d) / B
    assert_formula(chosen.grad, -torch.sigmoid(-(CHOSEN - REJECTED)) / 3)


def test_metrics_by_hand():
    stats = reward_metrics(CHOSEN, REJECTED)
    assert stats["accuracy"].item() == formula(1 / 3)  # only pair 0's chosen is strictly higher (ties are not)
    assert stats["margin"].item() == formula((1.0 - 0.75 + 0.0) / 3)
    assert stats["min_reward"].item() == -0.25 and stats["max_reward"].item() == 1.5
    assert stats["mean_reward"].item() == formula((1.5 - 0.25 + 0.75 + 0.5 + 0.5 + 0.75) / 6)


class FixedRewards(torch.nn.Module):
    """A stand-in reward model: returns the given rewards as ``[2B, 1]`` logits, whatever the input."""

    def __init__(self, rewards: torch.Tensor):
        super().__init__()
        self.rewards = rewards

    def forward(self, **_):
        return SimpleNamespace(logits=self.rewards[:, None])


def trl_compute_loss(chosen, rejected, margin=None, center_rewards_coefficient=None):
    """TRL's ``RewardTrainer.compute_loss`` on a stand-in ``self``: its loss and the metrics it appended."""
    import trl

    model = FixedRewards(torch.cat([chosen, rejected]))
    accelerator = SimpleNamespace(gather_for_metrics=lambda t: t, gather=lambda t: t)
    this = SimpleNamespace(model=model, args=SimpleNamespace(center_rewards_coefficient=center_rewards_coefficient),
                           accelerator=accelerator, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                           _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * len(chosen), 3, dtype=torch.long),
              "attention_mask": torch.ones(2 * len(chosen), 3, dtype=torch.long)}
    if margin is not None:
        inputs["margin"] = margin
    loss = trl.RewardTrainer.compute_loss(this, model, inputs)
    return loss, {name: values[-1] for name, values in this._metrics["train"].items()}


@pytest.mark.parametrize("margin,coef", [(None, None), (MARGIN, None), (None, 0.01), (MARGIN, 0.05)])
def test_loss_and_metrics_equal_trls_compute_loss(margin, coef):
    pytest.importorskip("trl")
    theirs, their_metrics = trl_compute_loss(CHOSEN, REJECTED, margin, coef)
    assert_formula(reward_loss(CHOSEN, REJECTED, margin, coef).mean(), theirs)
    ours = reward_metrics(CHOSEN, REJECTED)
    for name in ("margin", "min_reward", "mean_reward", "max_reward"):
        assert ours[name].item() == formula(their_metrics[name]), name
    assert ours["accuracy"].float().item() == their_metrics["accuracy"]  # TRL takes this mean in float32
