"""RLOO math in ``lit_align.losses.rloo``: the KL-penalized rewards, leave-one-out advantages and the per-completion
clipped loss.

Expected values are written out by hand; the last tests run TRL's own ``RLOOTrainer`` methods on a stand-in ``self``:
``_generate_and_score_completions`` (its rewards, KL penalty, baselines and normalization, with fixed completions,
rewards and log-probs handed in) and ``_compute_loss``, and compare with lit_align's. Every input is float64, so each
comparison is rule 2 of ``tests/numerics.py`` (a formula, to 1e-9).
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lit_align.losses.rloo import leave_one_out_advantages, rloo_rewards, rloo_sequence_losses, sequence_kl
from numerics import assert_formula, f64, formula

pytestmark = pytest.mark.numerics

nan = math.nan


def close(actual: torch.Tensor, expected) -> None:
    assert_formula(actual, torch.as_tensor(expected, dtype=torch.float64))


# -- leave_one_out_advantages ----------------------------------------------------------------------------------------
# Two groups of G=3: A = [1, 2, 6] (baselines (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5), B = [2, 2, 2] (advantage 0).
REWARDS = f64([1.0, 2.0, 6.0, 2.0, 2.0, 2.0])


def test_leave_one_out_by_hand():
    close(leave_one_out_advantages(REWARDS, 3), [1 - 4, 2 - 3.5, 6 - 1.5, 0.0, 0.0, 0.0])
    # G=2: each baseline is the sibling's reward
    close(leave_one_out_advantages(f64([0.0, 1.0, 5.0, 3.0]), 2), [-1.0, 1.0, 2.0, -2.0])


def test_leave_one_out_normalized_over_the_batch_by_hand():
    # advantages [-3, -1.5, 4.5, 0, 0, 0]: mean 0, squared deviations 9 + 2.25 + 20.25 = 31.5, unbiased var 6.3
    std = math.sqrt(6.3)
    close(leave_one_out_advantages(REWARDS, 3, normalize=True), [a / (std + 1e-4) for a in [-3, -1.5, 4.5, 0, 0, 0]])


def test_leave_one_out_nan_rewards_leave_the_baselines_and_get_zero():
    # A = [1, NaN, 3, 5]: baselines over scorable siblings (3+5)/2=4, -, (1+5)/2=3, (1+3)/2=2
    # B = [NaN, 7, NaN, NaN]: one scorable completion, no sibling: advantage 0
    rewards = f64([1.0, nan, 3.0, 5.0, nan, 7.0, nan, nan])
    close(leave_one_out_advantages(rewards, 4), [-3.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0])
    # normalized over the scorable [-3, 0, 3] (B's lone completion is NaN before the end too): mean 0, var 9
    close(leave_one_out_advantages(rewards, 4, normalize=True), [-3 / 3.0001, 0.0, 0.0, 3 / 3.0001, 0, 0, 0, 0])


def test_rloo_rewards_clip_then_kl_by_hand():
    logps = f64([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    ref = f64([[-1.5, -1.0, -9.0], [-0.5, -1.5, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kl = sequence_kl(logps, ref, mask)
    close(kl, [0.5 - 1.0, -0.5 + 0.5 + 0.0])  # first-order log ratio, summed over real tokens: may be negative
    close(rloo_rewards(f64([3.0, -2.0]), kl, beta=0.1), [3.0 + 0.05, -2.0])
    close(rloo_rewards(f64([3.0, -2.0]), kl, beta=0.1, reward_clip_range=(-1.0, 1.0)), [1.0 + 0.05, -1.0])
    assert rloo_rewards(f64([nan]), f64([1.0]), beta=0.1).isnan().all()  # unscorable stays unscorable
    with pytest.raises(ValueError, match="needs kl"):
        rloo_rewards(f64([1.0]), None, beta=0.1)


# -- rloo_sequence_losses ----------------------------------------------------------------------------------------------
def test_sequence_losses_by_hand():
    # sequence log ratios: row 0 (0.5 + 0.0) = 0.5 -> ratio e^0.5 = 1.6487 > 1.2: clipped high for A > 0
    #                      row 1 (-0.4) -> ratio e^-0.4 = 0.6703 < 0.8: clipped low for A < 0
    #                      row 2 (0.1) -> ratio 1.1052, inside the band
    old = f64([[-1.0, -1.0], [-1.0, -1.0], [-2.0, -2.0]])
    logps = f64([[-0.5, -1.0], [-1.4, -7.0], [-1.9, -2.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    adv = f64([2.0, -1.0, 0.5])
    losses, info = rloo_sequence_losses(logps, old, adv, mask, 0.2, 0.2)
    close(losses, [-1.2 * 2.0, 0.8 * 1.0, -math.exp(0.1) * 0.5])
    close(info["high_clipped"], [1.0, 0.0, 0.0])
    close(info["low_clipped"], [0.0, 1.0, 0.0])
    # on-policy (old None): ratio 1 with gradient, the loss is -A, its gradient -A per real token
    logps = logps.clone().requires_grad_()
    losses, _ = rloo_sequence_losses(logps, None, adv, mask)
    close(losses, -adv)
    losses.mean().backward()
    close(logps.grad, -(adv / 3).unsqueeze(1) * mask)


# -- against TRL's RLOOTrainer -----------------------------------------------------------------------------------------
@pytest.fixture
def float64_default():
    """TRL's ``nanstd`` divides integer counts (Bessel's correction), which gives the default dtype: float64 here."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def _trl_generate_and_score(rewards, policy_logps, ref_logps, mask, num_generations, beta, normalize, clip_range):
    """TRL's ``RLOOTrainer._generate_and_score_completions`` on fixed completions (lengths from ``mask``), rewards and
    per-token log-probs: returns TRL's advantages and its logged metrics."""
    trl = pytest.importorskip("trl")
    n, c = mask.shape
    lengths = mask.sum(1).tolist()
    metrics = {"train": defaultdict(list)}
    forwards = iter([policy_logps, ref_logps])  # first the policy's (old) log-probs, then the reference's
    fake = SimpleNamespace(
        accelerator=SimpleNamespace(device="cpu", process_index=0, reduce=lambda t, reduction="sum": t,
                                    gather=lambda t: t),
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        _generate=lambda prompts: ([[1]] * n, [[5] * k for k in lengths], ["x"] * n),  # padded to the mask by TRL
        _tokenizer=SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None, mask_truncated_completions=False,
        eos_token_ids=[9], args=SimpleNamespace(per_device_train_batch_size=n, gradient_checkpointing_kwargs=None),
        _get_per_token_logps_and_entropies=lambda *a, **k: (next(forwards), None, None),
        beta=beta, ref_model=object(), num_generations=num_generations,
        _calculate_rewards=lambda *a: rewards.unsqueeze(1).clone(), reward_weights=torch.ones(1),
        reward_clip_range=clip_range, normalize_advantages=normalize, reward_func_names=["r"], _metrics=metrics,
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list), "images": []},
        _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False,
    )
    inputs = [{"prompt": "p"} for _ in range(n)]
    out = trl.RLOOTrainer._generate_and_score_completions(fake, inputs)
    return out, {k: v[-1] for k, v in metrics["train"].items()}


@pytest.mark.parametrize("normalize,clip", [(False, None), (True, None), (False, (-1.0, 1.5))])
def test_advantages_match_trl_generate_and_score(normalize, clip, float64_default):
    g = torch.Generator().manual_seed(0)
    n, c, group = 12, 5, 4
    rewards = torch.randn(n, generator=g, dtype=torch.float64) * 2
    rewards[[1, 6]] = nan  # two unscorable completions, in different groups
    mask = (torch.arange(c) < torch.randint(1, c + 1, (n,), generator=g).unsqueeze(1)).long()
    mask[0] = 1  # the longest completion spans all c columns
    policy = -torch.rand(n, c, generator=g, dtype=torch.float64) * 3
    ref = policy + 0.5 * torch.randn(n, c, generator=g, dtype=torch.float64)
    beta = 0.05
    trl_out, trl_metrics = _trl_generate_and_score(rewards, policy, ref, mask, group, beta, normalize, clip)

    kl = sequence_kl(policy, ref, mask)
    ours = leave_one_out_advantages(rloo_rewards(rewards, kl, beta, clip), group, normalize)
    close(ours, trl_out["advantages"])
    close((policy * mask).sum(1), trl_out["old_logps"])  # the loss's old log-probs: the policy's, summed
    assert float((policy - ref)[mask.bool()].mean()) == formula(trl_metrics["kl"])
    assert (ours != 0).sum() >= n - 2  # only the unscorable ones are 0
    # each option moves the advantages by more than the tolerance
    plain = leave_one_out_advantages(rloo_rewards(rewards), group)
    assert (ours - plain).abs().max() > 1e-3


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_loss_and_clip_metrics_match_trl_compute_loss(epsilon_high):
    trl = pytest.importorskip("trl")
    g = torch.Generator().manual_seed(1)
    n, c = 16, 5
    old = -torch.rand(n, c, generator=g, dtype=torch.float64) * 3
    logps = old + 0.3 * torch.randn(n, c, generator=g, dtype=torch.float64)  # sequence ratios well outside the band
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, c, generator=g) > 0.3).long()
    mask[:, 0] = 1
    eps = 0.2
    metrics = {"train": defaultdict(list)}
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False, epsilon_low=eps, epsilon_high=eps if epsilon_high is None else epsilon_high,
        model=SimpleNamespace(training=True), _metrics=metrics,
        accelerator=SimpleNamespace(reduce=lambda t, reduction="sum": t, gather=lambda t: t),
    )
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1),
              "completion_ids": torch.zeros_like(mask), "completion_mask": mask.double(),
              "old_logps": (old * mask).sum(1), "advantages": advantages}
    trl_loss = trl.RLOOTrainer._compute_loss(fake, None, inputs)
    trl_metrics = {k: v[-1] for k, v in metrics["train"].items()}

    losses, info = rloo_sequence_losses(logps, old, advantages, mask, eps, epsilon_high)
    close(losses.mean(), trl_loss)
    assert float(info["low_clipped"].mean()) == formula(trl_metrics["clip_ratio/low_mean"])
    assert float(info["high_clipped"].mean()) == formula(trl_metrics["clip_ratio/high_mean"])
    assert float((info["low_clipped"] + info["high_clipped"]).mean()) == formula(trl_metrics["clip_ratio/region_mean"])
    assert trl_metrics["clip_ratio/low_mean"] > 0 and trl_metrics["clip_ratio/high_mean"] > 0  # both sides exercised
    if epsilon_high is not None:  # the option moves the loss
        assert abs(float(losses.mean() - rloo_sequence_losses(logps, old, advantages, mask, eps)[0].mean())) > 1e-3
