"""GRPO math in ``lit_align.losses``: advantages (and GDPO's), TRL's eight loss types, their options and reductions.

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

from lit_align.losses.grpo import (
    aggregate_grpo_loss, decoupled_advantages, group_advantages, grpo_token_losses, high_entropy_mask,
    importance_sampling_ratio, masked_mean, masked_total, off_policy_mask, sequence_means, vespo_gamma_weights,
)
from lit_align.losses.grpo_loss import EntropyControl, GRPOLoss
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


def test_decoupled_advantages_match_trl_formula(float64_default):
    """TRL's ``normalize_then_sum`` (GDPO) advantages, written as ``_generate_and_score_completions`` computes them,
    with its own ``nanstd``."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    g = torch.Generator().manual_seed(3)
    per_func = torch.randn(12, 3, generator=g, dtype=torch.float64)
    per_func[2, 1] = per_func[7, 0] = nan  # a function that did not apply to a completion
    per_func[9] = nan  # one no function scored
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    grouped = per_func.view(-1, 4, 3)
    reward_k = (grouped - grouped.nanmean(1, keepdim=True)) / (trl_utils.nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    rewards = (reward_k.view(-1, 3) * weights).nansum(1)
    rewards[per_func.isnan().all(1)] = nan
    trl_adv = (rewards - rewards.nanmean()) / (trl_utils.nanstd(rewards) + 1e-4)
    ours = decoupled_advantages(per_func, weights, 4)
    close(ours, trl_adv.nan_to_num(0.0))
    assert not torch.allclose(ours, group_advantages((per_func * weights).nansum(1), 4, "group"))  # not GRPO's


def _trl_compute_loss(loss_type, logps, old, ref, advantages, mask, beta, eps, eps_high, num_items, spg,
                      entropies=None, trainer=None, args=None, inputs=None):
    """Run TRL's ``GRPOTrainer._compute_loss`` on fixed per-token log-probs (and entropies); return (loss, TRL's
    metrics, the stand-in ``self``). ``trainer`` / ``args`` / ``inputs`` override the stand-in's attributes, its
    ``args`` and the batch."""
    trl = pytest.importorskip("trl")
    metrics = {"train": defaultdict(list)}
    entropies = torch.zeros_like(logps) if entropies is None else entropies
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=eps, epsilon_high=eps_high,
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=mask.shape[1], _entropy_bonus_enabled=False,
        use_adaptive_entropy=False, entropy_coef=0.0, _last_world_entropy=math.inf, _entropy_window_stats=None,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=spg,
                             sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                             vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, entropy_target=0.2,
                             entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0),
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction="sum": t, gather=lambda t: t,
                                    pad_across_processes=lambda t, dim=0, pad_index=0: t, sync_gradients=True),
        _metrics=metrics, get_off_policy_mask=trl.GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=trl.GRPOTrainer.get_gamma_weights,
    )
    fake.get_high_entropy_mask = lambda e, m, q: trl.GRPOTrainer.get_high_entropy_mask(fake, e, m, q)
    vars(fake).update(trainer or {})
    vars(fake.args).update(args or {})
    batch = {
        "prompt_ids": torch.zeros(len(mask), 1, dtype=torch.long), "prompt_mask": torch.ones(len(mask), 1),
        "completion_ids": torch.zeros_like(mask), "completion_mask": mask, "advantages": advantages,
        "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": torch.tensor(float(num_items)),
        **(inputs or {}),
    }
    loss = trl.GRPOTrainer._compute_loss(fake, None, batch)
    return loss, {k: v[-1] for k, v in metrics["train"].items()}, fake


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

    trl_loss, trl_metrics, _ = _trl_compute_loss(loss_type, logps, old, ref, advantages, mask.double(), beta, eps,
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


# -- TRL 1.16's other loss types and options: by hand ------------------------------------------------------------------
def test_cispo_clips_a_detached_weight_by_hand():
    logps, old = _logps_for(RATIOS)  # ratios [[1.5, 1.25, 0.5], [0.5, 1.5, 1.0]], A = +2, -1
    logps.requires_grad_(True)
    losses, info = grpo_token_losses(logps, old, ADV, epsilon_high=1.3, loss_type="cispo")
    weights = f64([[1.3, 1.25, 0.5], [0.5, 1.3, 1.0]])  # min(ratio, 1.3), no gradient
    close(losses.detach(), -weights * ADV[:, None] * logps.detach())
    losses.sum().backward()
    close(logps.grad, -weights * ADV[:, None])  # REINFORCE scaled by the clipped weight
    close(info["cispo_clipped"], [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # ratio > 1.3 with A > 0 only


def test_sapo_soft_gate_by_hand():
    logps, old = _logps_for(RATIOS)
    losses, info = grpo_token_losses(logps, old, ADV, loss_type="sapo", sapo_temperatures=(1.0, 1.05))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    row0 = [-sig(r - 1) * 4 * 2.0 for r in (1.5, 1.25, 0.5)]  # tau 1 for A > 0
    row1 = [sig(1.05 * (r - 1)) * 4 / 1.05 for r in (0.5, 1.5, 1.0)]  # tau 1.05 for A <= 0: -(...) * -1
    close(losses, [row0, row1])
    assert not info  # nothing clipped: no clip metrics


def test_sequence_level_weight_is_the_exp_of_the_mean_log_ratio_by_hand():
    old = f64([[-1.0, -2.0, -0.5], [-3.0, -1.5, -0.7]])
    logps = old + f64([[0.3, -0.1, 5.0], [0.2, 0.2, 0.2]])  # the 5.0 is padding: left out of the mean
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    losses, info = grpo_token_losses(logps, old, f64([1.0, -1.0]), 0.2, 0.28, loss_type="grpo", mask=mask,
                                     importance_sampling_level="sequence")
    w0, w1 = math.exp(0.1), math.exp(0.2)  # exp((0.3 - 0.1) / 2), exp(0.6 / 3)
    close(losses, [[-w0], [w1]])  # one term per sequence, inside the band [0.8, 1.28]
    assert losses.shape == (2, 1) and info["high_clipped"].shape == (2, 1)


def test_delta_caps_the_unclipped_ratio_by_hand():
    logps, old = _logps_for(RATIOS)
    losses, _ = grpo_token_losses(logps, old, ADV, 0.2, 0.28, loss_type="dapo", delta=1.4)
    # row 1, A=-1, ratio 1.5: -min(-min(1.5, 1.4), -1.28) = 1.4 instead of 1.5; nothing else moves
    close(losses, [[-2.56, -2.5, -1.0], [0.8, 1.4, 1.0]])


def test_vespo_gamma_weights_by_hand():
    mask = torch.ones(3, 2, dtype=torch.float64)
    log_ratio = f64([[0.0, 0.0], [math.log(2.0), 0.0], [0.5 * math.log(0.5), 0.5 * math.log(0.5)]])  # w = 1, 2, 0.5
    phi = vespo_gamma_weights(f64([[1.0], [1.0], [-1.0]]), log_ratio, mask)
    # phi(w) = e^lambda w^k e^(-lambda w): 1 at w = 1; (k, lambda) = (2, 3) for A >= 0, (3, 2) for A < 0
    close(phi, [[1.0], [math.exp(3) * 4 * math.exp(-6)], [math.exp(2) * 0.125 * math.exp(-1)]])
    # the sampling engine's token weights multiply w: 2 * 0.5 = 1
    is_ratio = f64([[1.0, 1.0], [0.5, 1.0], [1.0, 1.0]])
    close(vespo_gamma_weights(f64([[1.0], [1.0], [-1.0]]), log_ratio, mask, is_ratio)[1], [1.0])
    logps = f64([[-1.0, -2.0]]).requires_grad_()
    losses, info = grpo_token_losses(logps, logps.detach() - math.log(2.0) / 2, f64([2.0]), loss_type="vespo")
    close(info["phi_seq"], [[4 * math.exp(-3)]])
    close(losses.detach(), -4 * math.exp(-3) * 2.0 * logps.detach())


def test_luspo_weighs_each_sequence_by_its_length_by_hand():
    close(aggregate_grpo_loss(TOKEN_LOSSES, MASK, "luspo"), (3 + 26 + 9) / 3)
    close(aggregate_grpo_loss(TOKEN_LOSSES, MASK, "sapo"), 17 / 3)  # sapo reduces as grpo
    close(aggregate_grpo_loss(TOKEN_LOSSES, MASK, "cispo", num_tokens=5.0), 38 / 5)  # cispo and vespo as dapo
    close(aggregate_grpo_loss(f64([[2.0], [1.0], [4.0]]), MASK, "luspo"), (2 * 2 + 1 * 4 + 4 * 1) / 3)


def test_bias_corrected_kl_gradient_on_policy_by_hand():
    """On-policy the ratio is 1 but has a gradient: d(kl * ratio) = d kl + kl (TRL's use_bias_correction_kl)."""
    logps = f64([[-1.0, -2.0]]).requires_grad_()
    ref = logps.detach() + f64([[math.log(2.0), -math.log(2.0)]])
    losses, info = grpo_token_losses(logps, None, f64([0.0]), ref_logps=ref, beta=1.0, use_bias_correction_kl=True)
    losses.sum().backward()
    d = torch.tensor([math.log(2.0), -math.log(2.0)], dtype=torch.float64)
    kl = torch.exp(d) - d - 1
    close(info["kl"], kl[None])
    close(logps.grad, (-(torch.exp(d) - 1) + kl)[None])  # d kl / d logps = -(e^d - 1), plus kl * d ratio


def test_off_policy_mask_by_hand():
    logps = f64([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    sampling = logps + f64([[0.3, 0.1], [0.3, 0.1], [0.05, nan]])  # mean KL 0.2, 0.2, 0.05 / 2 (NaN counts 0)
    mask = torch.ones(3, 2, dtype=torch.float64)
    kept = off_policy_mask(f64([1.0, -1.0, -1.0]), logps, sampling, mask, threshold=0.1)
    close(kept, [[1.0], [0.0], [1.0]])  # dropped: negative advantage and KL above the threshold


def test_high_entropy_mask_by_hand():
    entropy = f64([[0.125, 0.875, 0.5, 7.0], [0.25, 0.75, 0.1875, 0.0]])  # fp32-exact: TRL's threshold is fp32
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])  # 7.0 is padding
    # 6 tokens: 0.125 0.1875 0.25 0.5 0.75 0.875; the 2/3 quantile (linear) is 0.5 + 1/3 * 0.25 = 0.5833
    top = high_entropy_mask(entropy, mask, 1 / 3)
    assert top.tolist() == [[False, True, False, False], [False, True, False, False]]
    assert high_entropy_mask(entropy, mask, 1.0).tolist() == mask.bool().tolist()
    assert high_entropy_mask(entropy, mask, 0.0).tolist() == [[False, True, False, False], [False] * 4]  # the top one
    # the threshold from a pool (every rank's entropies): the median of [0.125, 0.25, 0.5, 0.625] is 0.375
    assert high_entropy_mask(entropy, mask, 0.5, f64([0.125, 0.25, 0.5, 0.625])).sum() == 3


def test_decoupled_advantages_by_hand():
    """GDPO: each function normalized within its group, summed with the weights, the sum normalized over the batch."""
    per_func = f64([[0.0, 1.0], [1.0, 1.0], [2.0, 0.0], [4.0, 0.0]])  # two groups of G=2, two functions
    # function 0: groups [0, 1] and [2, 4] -> +-0.5 / (std 0.7071 + 1e-4), +-1 / (1.4142 + 1e-4) = +-0.70700
    # function 1: constant in each group -> 0; weights (1, 2) leave the sum as function 0's
    a, b = 0.5 / (math.sqrt(0.5) + 1e-4), 1.0 / (math.sqrt(2.0) + 1e-4)
    summed = torch.tensor([-a, a, -b, b], dtype=torch.float64)
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    close(decoupled_advantages(per_func, f64([1.0, 2.0]), 2), expected)
    per_func[1] = nan  # a completion no function scored: advantage 0, left out of the batch statistics
    out = decoupled_advantages(per_func, f64([1.0, 2.0]), 2)
    assert out[1] == 0 and not out.isnan().any()


# -- against TRL's _compute_loss: every loss type and option, values and gradients -------------------------------------
BASE = {"beta": 0.04, "epsilon_high": 0.28}
OPTION_CASES = {  # name: (GRPOLoss settings, what the batch adds: vLLM's "is_ratio" level, the adaptive start entropy)
    **{t: ({"loss_type": t}, {}) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "sapo", "vespo")},
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.2}, {}),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, {}),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, {}),
    "gspo_sapo": ({"loss_type": "sapo", "importance_sampling_level": "sequence"}, {}),
    "delta": ({"delta": 1.25}, {}),
    "sapo_temperatures": ({"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 3.0}, {}),
    "vespo_params": ({"loss_type": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_pos": 1.0, "vespo_k_neg": 5.0,
                      "vespo_lambda_neg": 4.0}, {}),
    "no_bias_correction_kl": ({"use_bias_correction_kl": False}, {}),
    "top_entropy_quantile": ({"top_entropy_quantile": 0.3}, {}),
    "off_policy_mask": ({"off_policy_mask_threshold": 0.02}, {}),
    "off_policy_mask_vllm": ({"off_policy_mask_threshold": 0.02}, {"is_ratio": "token"}),
    "vllm_sequence_weights": ({}, {"is_ratio": "sequence"}),
    "vespo_vllm": ({"loss_type": "vespo"}, {"is_ratio": "token"}),
    "entropy_coef": ({"entropy_coef": 0.1}, {}),
    "entropy_coef_top_entropy": ({"entropy_coef": 0.1, "top_entropy_quantile": 0.5}, {}),
    "adaptive_entropy": ({"use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 1.5},
                         {"last_entropy": 1.0}),
}
DEFAULT_FOR = {"grpo": "dapo", "bnpo": "dapo", "dr_grpo": "dapo", "sapo": "dapo", "vespo": "dapo", "cispo": "dapo",
               "luspo": "gspo", "gspo": "grpo", "gspo_sapo": "sapo"}  # what each case moves away from


def _trl_settings(settings: GRPOLoss) -> tuple[dict, dict]:
    """The stand-in trainer's attributes and ``args`` for ``settings``, under TRL's names."""
    trainer = {name: getattr(settings, name) for name in ("top_entropy_quantile", "off_policy_mask_threshold",
                                                         "importance_sampling_level", "entropy_coef",
                                                         "use_adaptive_entropy", "loss_type", "beta")}
    trainer |= {"_entropy_bonus_enabled": settings.entropy_bonus, "epsilon_low": settings.epsilon,
                "epsilon_high": settings.epsilon_high}
    args = {name: getattr(settings, name) for name in (
        "use_bias_correction_kl", "delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
        "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_target", "entropy_coef_delta",
        "entropy_coef_min", "entropy_coef_max")}
    return trainer, args


def _batch(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    n, c = 6, 5
    old = -torch.rand(n, c, generator=g, dtype=torch.float64) * 3
    logps = (old + 0.3 * torch.randn(n, c, generator=g, dtype=torch.float64)).requires_grad_()
    ref = old + 0.3 * torch.randn(n, c, generator=g, dtype=torch.float64)
    sampling = old + 0.2 * torch.randn(n, c, generator=g, dtype=torch.float64)
    entropy = (2 * torch.rand(n, c, generator=g, dtype=torch.float64)).requires_grad_()
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, c, generator=g) > 0.25).double()
    mask[:, 0] = 1
    return logps, old, ref, sampling, entropy, advantages, mask


def _ours(settings: GRPOLoss, batch, extra: dict, round_tokens: float, spg: int):
    logps, old, ref, sampling, entropy, advantages, mask = batch
    control = EntropyControl.from_loss(settings)
    control.last_entropy = extra.get("last_entropy", math.inf)
    is_ratio = _is_ratio(batch, extra)
    step = settings(logps, old, advantages, mask, max_completion_length=mask.shape[1], num_tokens=round_tokens / spg,
                    ref_logps=ref, entropy=entropy, sampling_logps=sampling if is_ratio is not None else None,
                    is_ratio=is_ratio, entropy_coef=control.applied())
    return step, control


def _is_ratio(batch, extra):
    logps, old, _, sampling, _, _, mask = batch
    level = extra.get("is_ratio")
    if level is None:
        return None
    return importance_sampling_ratio(old, sampling, mask, f"{level}_truncate", 0.5, 1.5)


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_every_loss_type_and_option_matches_trl_compute_loss(case, float64_default):
    """The loss, its gradients (log-probs and entropies) and TRL's metrics of each option, against TRL's
    ``_compute_loss`` on the same batch; and each option moves the loss by far more than the tolerance."""
    kwargs, extra = OPTION_CASES[case]
    settings = GRPOLoss(**{**BASE, **kwargs})
    batch = _batch()
    logps, old, ref, sampling, entropy, advantages, mask = batch
    spg, round_tokens = 2, float(mask.sum()) * 2 + 3.0
    is_ratio = _is_ratio(batch, extra)
    trainer, args = _trl_settings(settings)
    trainer["_last_world_entropy"] = extra.get("last_entropy", math.inf)
    inputs = {}
    if is_ratio is not None:
        trainer |= {"use_vllm": True, "vllm_importance_sampling_correction": True}
        inputs = {"importance_sampling_ratio": is_ratio, "sampling_per_token_logps": sampling}
    trl_loss, trl_metrics, fake = _trl_compute_loss(settings.loss_type, logps, old, ref, advantages, mask,
                                                    settings.beta, settings.epsilon, settings.epsilon_high,
                                                    round_tokens, spg, entropy, trainer, args, inputs)
    step, control = _ours(settings, batch, extra, round_tokens, spg)
    close(step.loss, trl_loss)
    for ours_grad, trl_grad in zip(torch.autograd.grad(step.loss, [logps, entropy], allow_unused=True),
                                   torch.autograd.grad(trl_loss, [logps, entropy], allow_unused=True)):
        if trl_grad is None:
            assert ours_grad is None or not ours_grad.any()
        else:
            close(ours_grad, trl_grad)

    info, m = step.info, mask
    ours = {"kl": masked_mean(info["kl"], m)}
    if "low_clipped" in info:
        low, high = info["low_clipped"], info["high_clipped"]
        ours |= {"clip_ratio/low_mean": masked_mean(low, m), "clip_ratio/high_mean": masked_mean(high, m),
                 "clip_ratio/region_mean": masked_mean(low + high, m),
                 "clip_ratio/low_min": sequence_means(low, m).min(),
                 "clip_ratio/high_max": sequence_means(high, m).max()}
    if "cispo_clipped" in info:
        ours["cispo_clip_ratio"] = masked_mean(info["cispo_clipped"], m)
    if "phi_seq" in info:
        ours["vespo/phi_seq_mean"] = masked_mean(info["phi_seq"], m)
    if settings.entropy_bonus:
        ours["policy_loss"] = step.policy_loss
        control.step(float(masked_mean(entropy.detach(), step.trained)))
        ours["entropy_coef"] = control.coef
    expected = {k: v for k, v in trl_metrics.items() if k != "entropy"}
    assert sorted(ours) == sorted(expected)  # the same metrics, by TRL's names
    for name, value in ours.items():
        assert float(value) == formula(expected[name]), name
    if settings.use_adaptive_entropy:
        assert control.coef == formula(fake.entropy_coef) and control.coef != settings.entropy_coef

    base_kwargs, base_extra = OPTION_CASES.get(DEFAULT_FOR.get(case, "dapo"))
    if case != "dapo":  # the option moves the loss (or, for a masked-out KL-only change, its gradient)
        base, _ = _ours(GRPOLoss(**{**BASE, **base_kwargs}), batch, base_extra, round_tokens, spg)
        moved = abs(float(base.loss.detach() - step.loss.detach()))
        assert moved > 1e-4 * max(abs(float(step.loss.detach())), 1.0), f"{case} moved the loss by only {moved}"


def test_masked_total_summed_over_ranks_is_the_global_masked_mean_trl_logs():
    """Two ranks with 3 and 1 loss tokens: the metric over both is the mean over their 4 tokens (TRL's
    ``global_masked_mean``), not the mean of the two ranks' means; [N, 1] values count rows."""
    a, mask_a = torch.tensor([[1.0, 2.0, 3.0, 9.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    b, mask_b = torch.tensor([[10.0, 7.0]]), torch.tensor([[1.0, 0.0]])
    total, count = masked_total(a, mask_a) + masked_total(b, mask_b)
    assert (total / count).item() == 4.0  # (1 + 2 + 3 + 10) / 4
    assert (masked_mean(a, mask_a) + masked_mean(b, mask_b)).item() / 2 == 6.0
    rows = torch.tensor([[0.5], [1.0], [0.0]])
    assert masked_total(rows, torch.ones(3, 5)).tolist() == [1.5, 3.0]
