"""GRPO math in ``lit_align.losses``: advantages, the clipped surrogate + k3 KL, and the four loss reductions.

Expected values are written out by hand; the last tests run TRL's own ``GRPOTrainer._compute_loss`` (on a stand-in
``self`` that hands it fixed log-probs) and compare its loss and clip/KL metrics with lit_align's. Every input is
float64, so each comparison is rule 2 of ``tests/numerics.py`` (a formula, to 1e-9).
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lit_align.losses.grpo import aggregate_grpo_loss, group_advantages, grpo_token_losses, importance_sampling_ratio
from numerics import assert_formula, f64, formula

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

nan = math.nan


def close(actual: torch.Tensor, expected) -> None:
    """``actual`` (float64) is the formula's ``expected``."""
    assert_formula(actual, torch.as_tensor(expected, dtype=torch.float64))


# -- group_advantages ----------------------------------------------------------------------------------------------
# Two groups of G=4: A = [1, 2, 3, 6] (mean 3, deviations -2 -1 0 3, unbiased var 14/3, std 2.1602469),
#                    B = [2, 2, 2, 2] (mean 2, std 0: advantage 0).
REWARDS = f64([1.0, 2.0, 3.0, 6.0, 2.0, 2.0, 2.0, 2.0])


def test_group_advantages_group_scaling_by_hand():
    std_a = math.sqrt(14 / 3)  # 2.1602469
    expected = [-2 / (std_a + 1e-4), -1 / (std_a + 1e-4), 0.0, 3 / (std_a + 1e-4), 0.0, 0.0, 0.0, 0.0]
    close(group_advantages(REWARDS, 4, "group"), expected)
    # the same numbers, worked out to 7 decimals: -2 / 2.1603469 = -0.9257772, ...
    worked = [-0.9257772, -0.4628886, 0.0, 1.3886659]
    assert group_advantages(REWARDS, 4, "group")[:4].tolist() == pytest.approx(worked, abs=5e-8)


def test_group_advantages_batch_scaling_by_hand():
    # group means are still subtracted; the std is the whole batch's: mean 2.5, squared deviations sum to 16,
    # unbiased var 16 / 7, std 1.5118579
    std = math.sqrt(16 / 7)  # 1.5118579
    expected = [-2 / (std + 1e-4), -1 / (std + 1e-4), 0.0, 3 / (std + 1e-4), 0.0, 0.0, 0.0, 0.0]
    close(group_advantages(REWARDS, 4, "batch"), expected)


def test_group_advantages_none_is_centered_only():
    close(group_advantages(REWARDS, 4, "none"), [-2.0, -1.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0])


def test_group_advantages_two_generations():
    # G=2: [0, 1] -> mean 0.5, std sqrt(0.5); [5, 3] -> mean 4, std sqrt(2)
    out = group_advantages(f64([0.0, 1.0, 5.0, 3.0]), 2, "group")
    a, b = 0.5 / (math.sqrt(0.5) + 1e-4), 1.0 / (math.sqrt(2) + 1e-4)
    close(out, [-a, a, b, -b])


def test_group_advantages_nan_rewards_are_excluded_and_get_zero():
    # group A: [1, NaN, 3, 5] -> statistics of [1, 3, 5]: mean 3, var (4 + 0 + 4) / 2 = 4, std 2
    # group B: [0, 1, NaN, NaN] -> statistics of [0, 1]: mean 0.5, std sqrt(0.5)
    rewards = f64([1.0, nan, 3.0, 5.0, 0.0, 1.0, nan, nan])
    b = 0.5 / (math.sqrt(0.5) + 1e-4)
    close(group_advantages(rewards, 4, "group"), [-2 / 2.0001, 0.0, 0.0, 2 / 2.0001, -b, b, 0.0, 0.0])
    # batch std over the 5 scored values [1, 3, 5, 0, 1]: mean 2, squared deviations 16, var 16 / 4, std 2
    close(group_advantages(rewards, 4, "batch"), [-2 / 2.0001, 0.0, 0.0, 2 / 2.0001, -0.5 / 2.0001, 0.5 / 2.0001, 0, 0])
    close(group_advantages(rewards, 4, "none"), [-2.0, 0.0, 0.0, 2.0, -0.5, 0.5, 0.0, 0.0])
    assert not group_advantages(rewards, 4, "group").isnan().any()


def test_group_advantages_all_nan_or_single_value_group_is_zero():
    rewards = f64([nan, nan, nan, nan, nan, nan, nan, 7.0])
    for scale in ("group", "batch", "none"):
        close(group_advantages(rewards, 4, scale), [0.0] * 8)


def test_group_advantages_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(REWARDS, 4, "global")


# -- grpo_token_losses -----------------------------------------------------------------------------------------------
# ratios (exp(logps - old)) chosen to hit every case; advantages +2 (row 0) and -1 (row 1); epsilon 0.2, high 0.28
RATIOS = f64([[1.5, 1.25, 0.5], [0.5, 1.5, 1.0]])
ADV = f64([2.0, -1.0])


def _logps_for(ratios: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    old = f64([[-1.0, -2.0, -0.5], [-3.0, -1.5, -0.7]])
    return old + ratios.log(), old


def test_grpo_token_losses_asymmetric_clipping_by_hand():
    logps, old = _logps_for(RATIOS)
    losses, info = grpo_token_losses(logps, old, ADV, epsilon=0.2, epsilon_high=0.28)
    # row 0, A=+2: 1.5 -> min(3.0, 1.28 * 2) = 2.56 (clipped high); 1.25 -> inside [0.8, 1.28]: 2.5;
    #              0.5 -> min(1.0, 0.8 * 2) = 1.0 (the unclipped term binds: no clip)
    # row 1, A=-1: 0.5 -> min(-0.5, -0.8) = -0.8 (clipped low); 1.5 -> min(-1.5, -1.28) = -1.5 (unclipped binds);
    #              1.0 -> -1.0
    close(losses, [[-2.56, -2.5, -1.0], [0.8, 1.5, 1.0]])
    close(info["high_clipped"], [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    close(info["low_clipped"], [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert "kl" not in info


def test_grpo_token_losses_symmetric_clipping_by_hand():
    logps, old = _logps_for(RATIOS)
    losses, info = grpo_token_losses(logps, old, ADV, epsilon=0.2)  # epsilon_high defaults to epsilon
    # now 1.25 > 1.2 is clipped for A > 0: min(2.5, 2.4) = 2.4
    close(losses, [[-2.4, -2.4, -1.0], [0.8, 1.5, 1.0]])
    close(info["high_clipped"], [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    close(info["low_clipped"], [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])


def test_grpo_token_losses_gradient_is_zero_where_clipped():
    logps, old = _logps_for(RATIOS)
    logps.requires_grad_(True)
    losses, _ = grpo_token_losses(logps, old, ADV, epsilon=0.2, epsilon_high=0.28)
    losses.sum().backward()
    # d(-ratio * A)/d logps = -ratio * A where the unclipped term binds, 0 where the clipped one does
    expected = f64([[0.0, -1.25 * 2, -0.5 * 2], [0.0, 1.5, 1.0]])
    close(logps.grad, expected)


def test_grpo_token_losses_on_policy_ratio_one_with_gradient():
    logps = f64([[-1.0, -2.0], [-0.5, -0.1]]).requires_grad_()
    losses, info = grpo_token_losses(logps, None, f64([0.5, -3.0]))
    close(losses.detach(), [[-0.5, -0.5], [3.0, 3.0]])
    losses.sum().backward()
    close(logps.grad, [[-0.5, -0.5], [3.0, 3.0]])  # ratio 1 = exp(logps - logps.detach()) keeps d ratio = ratio
    assert info["low_clipped"].sum() == 0 and info["high_clipped"].sum() == 0


def test_grpo_token_losses_k3_kl_by_hand():
    logps = f64([[-1.0, -2.0, -0.5]])
    ln2 = math.log(2.0)
    ref = logps + f64([[0.0, ln2, -ln2]])  # ref - logps = 0, ln 2, -ln 2
    losses, info = grpo_token_losses(logps, logps.clone(), f64([1.0]), ref_logps=ref, beta=0.1)
    # k3 = exp(d) - d - 1: 0, 2 - ln2 - 1 = 0.3068528, 0.5 + ln2 - 1 = 0.1931472
    kl = [0.0, 1 - ln2, ln2 - 0.5]
    close(info["kl"], [kl])
    close(losses, [[-1.0 + 0.1 * k for k in kl]])
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_token_losses(logps, None, f64([1.0]), beta=0.1)


# -- aggregate_grpo_loss ---------------------------------------------------------------------------------------------
TOKEN_LOSSES = f64([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
# masked row sums 3, 26, 9 over 2, 4, 1 tokens: total 38 over 7 tokens


def test_aggregate_grpo_by_hand():
    close(aggregate_grpo_loss(TOKEN_LOSSES, MASK, "grpo"), (3 / 2 + 26 / 4 + 9 / 1) / 3)  # 17 / 3


def test_aggregate_bnpo_by_hand():
    close(aggregate_grpo_loss(TOKEN_LOSSES, MASK, "bnpo"), 38 / 7)


def test_aggregate_dr_grpo_by_hand():
    close(aggregate_grpo_loss(TOKEN_LOSSES, MASK, "dr_grpo", max_completion_length=4), 38 / (3 * 4))
    close(aggregate_grpo_loss(TOKEN_LOSSES, MASK, "dr_grpo", max_completion_length=10), 38 / 30)
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate_grpo_loss(TOKEN_LOSSES, MASK, "dr_grpo")


def test_aggregate_dapo_by_hand():
    close(aggregate_grpo_loss(TOKEN_LOSSES, MASK, "dapo", num_tokens=5.0), 38 / 5)
    close(aggregate_grpo_loss(TOKEN_LOSSES, MASK, "dapo", num_tokens=9.5), 38 / 9.5)
    close(aggregate_grpo_loss(TOKEN_LOSSES, MASK, "dapo", num_tokens=0.0), 38.0)  # never divides by < 1
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_grpo_loss(TOKEN_LOSSES, MASK, "dapo")


def test_aggregate_fully_masked_row():
    losses = torch.cat([TOKEN_LOSSES, torch.full((1, 4), 100.0)])
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=torch.long)])
    close(aggregate_grpo_loss(losses, mask, "grpo"), 17 / 4)  # the empty row counts as 0 in the mean over rows
    close(aggregate_grpo_loss(losses, mask, "bnpo"), 38 / 7)
    close(aggregate_grpo_loss(losses, mask, "dr_grpo", max_completion_length=4), 38 / 16)
    with pytest.raises(ValueError, match="loss_type"):
        aggregate_grpo_loss(losses, mask, "ppo")


# -- against TRL -----------------------------------------------------------------------------------------------------
@pytest.fixture
def float64_default():
    """TRL's ``nanstd`` divides integer counts (Bessel's correction), which gives the default dtype: float64 here."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def test_group_advantages_match_trl_formula(float64_default):
    """TRL's ``sum_then_normalize`` advantages (``_generate_and_score_completions``) with its own ``nanstd``."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=g, dtype=torch.float64)
    rewards[[1, 5, 6, 13]] = nan  # a few unscorable completions, never a whole group or a lone value
    for scale in ("group", "batch", "none"):
        grouped = rewards.view(-1, 4)
        mean = grouped.nanmean(1).repeat_interleave(4)
        if scale == "batch":
            std = trl_utils.nanstd(rewards).expand_as(rewards)
        else:
            std = trl_utils.nanstd(grouped, dim=1).repeat_interleave(4)
        trl_adv = rewards - mean
        if scale != "none":
            trl_adv = trl_adv / (std + 1e-4)
        close(group_advantages(rewards, 4, scale), torch.nan_to_num(trl_adv, nan=0.0))


def _trl_compute_loss(loss_type, logps, old, ref, advantages, mask, beta, eps, eps_high, num_items, spg):
    """Run TRL's ``GRPOTrainer._compute_loss`` on fixed per-token log-probs; return (loss, TRL's metrics)."""
    trl = pytest.importorskip("trl")
    metrics = {"train": defaultdict(list)}
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=eps, epsilon_high=eps_high,
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=mask.shape[1], _entropy_bonus_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=spg),
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction="sum": t, gather=lambda t: t),
        _metrics=metrics,
    )
    inputs = {
        "prompt_ids": torch.zeros(len(mask), 1, dtype=torch.long), "prompt_mask": torch.ones(len(mask), 1),
        "completion_ids": torch.zeros_like(mask), "completion_mask": mask, "advantages": advantages,
        "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": torch.tensor(float(num_items)),
    }
    loss = trl.GRPOTrainer._compute_loss(fake, None, inputs)
    return loss, {k: v[-1] for k, v in metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_and_clip_metrics_match_trl_compute_loss(loss_type, float64_default):
    g = torch.Generator().manual_seed(1)
    n, c = 6, 5
    old = -torch.rand(n, c, generator=g, dtype=torch.float64) * 3
    logps = old + 0.4 * torch.randn(n, c, generator=g, dtype=torch.float64)  # ratios spread well outside [0.8, 1.28]
    ref = old + 0.3 * torch.randn(n, c, generator=g, dtype=torch.float64)
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, c, generator=g) > 0.3).long()
    mask[:, 0] = 1
    beta, eps, eps_high, spg = 0.04, 0.2, 0.28, 2
    round_tokens = float(mask.sum()) * spg + 3.0  # dapo: tokens of the whole round (this step is 1 of spg)

    trl_loss, trl_metrics = _trl_compute_loss(loss_type, logps, old, ref, advantages, mask.double(), beta, eps,
                                              eps_high, round_tokens, spg)
    token_losses, info = grpo_token_losses(logps, old, advantages, eps, eps_high, ref, beta)
    ours = aggregate_grpo_loss(token_losses, mask, loss_type, max_completion_length=c,
                               num_tokens=round_tokens / spg)  # what GRPOModule passes: per step, per rank
    close(ours, trl_loss)

    m = mask.double()
    masked_mean = lambda x: float((x * m).sum() / m.sum())  # noqa: E731
    assert masked_mean(info["low_clipped"]) == formula(trl_metrics["clip_ratio/low_mean"])
    assert masked_mean(info["high_clipped"]) == formula(trl_metrics["clip_ratio/high_mean"])
    assert masked_mean(info["low_clipped"] + info["high_clipped"]) == formula(
        trl_metrics["clip_ratio/region_mean"])
    assert masked_mean(info["kl"]) == formula(trl_metrics["kl"])
    assert 0 < trl_metrics["clip_ratio/low_mean"] and 0 < trl_metrics["clip_ratio/high_mean"]  # both sides exercised


# -- the sampling engine's importance weights (TRL's vllm_importance_sampling_*) ---------------------------------------
def test_importance_sampling_ratio_by_hand():
    """Token ratios exp(train - sampling) on real tokens (1 on padding); sequences sum the log gap over the completion;
    truncate clamps to [min, max], mask zeroes outside it."""
    train = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    sampling = torch.tensor([[-1.5, -1.0, -3.0], [-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    e = math.exp
    token = importance_sampling_ratio(train, sampling, mask, "token_truncate", None, None)
    torch.testing.assert_close(token, torch.tensor([[e(0.5), e(-1.0), 1.0], [1.0, e(1.0), 1.0]]))
    torch.testing.assert_close(importance_sampling_ratio(train, sampling, mask, "token_truncate", 0.5, 2.0),
                               torch.tensor([[e(0.5), 0.5, 1.0], [1.0, 2.0, 1.0]]))
    torch.testing.assert_close(importance_sampling_ratio(train, sampling, mask, "token_mask", 0.5, 2.0),
                               torch.tensor([[e(0.5), 0.0, 1.0], [1.0, 0.0, 1.0]]))
    torch.testing.assert_close(importance_sampling_ratio(train, sampling, mask, "sequence_truncate", None, 2.0),
                               torch.tensor([[e(-0.5)], [2.0]]))
    torch.testing.assert_close(importance_sampling_ratio(train, sampling, mask, "sequence_mask", None, 2.0),
                               torch.tensor([[e(-0.5)], [0.0]]))
    with pytest.raises(ValueError, match="unknown importance sampling mode"):
        importance_sampling_ratio(train, sampling, mask, "tokens")
