"""lit_align.losses.kto against hand computations (plain Python floats, from the KTO and APO papers' formulas) and
against TRL's own ``KTOTrainer._compute_loss`` run on the same log-probs. Both sides in float64 (``tests/numerics.py``,
rule 2)."""

from __future__ import annotations

import math
from collections import defaultdict
from types import MethodType, SimpleNamespace

import pytest
import torch

from lit_align.errors import LitAlignError
from lit_align.losses.kto import KTOLoss, kl_estimate, kto_loss
from numerics import f64, formula

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

BETA = 0.1
PI = [-10.0, -3.0, -6.0, -20.0, -4.0]
REF = [-11.0, -4.5, -5.0, -18.0, -4.0]
LABELS = [True, False, True, False, False]
KL_PI, KL_REF = [-30.0, -12.0, -9.0, -25.0, -8.0], [-31.0, -14.0, -7.0, -26.0, -9.5]


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kl_estimate_by_hand():
    diffs = [p - r for p, r in zip(KL_PI, KL_REF)]
    assert float(kl_estimate(f64(KL_PI), f64(KL_REF))) == formula(sum(diffs) / len(diffs))
    assert not kl_estimate(f64(KL_PI).requires_grad_(), f64(KL_REF)).requires_grad  # TRL detaches it


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.5)])
def test_kto_loss_by_hand(loss_type, weights):
    kl = 0.7
    desirable_weight, undesirable_weight = weights
    losses, rewards = kto_loss(f64(PI), f64(REF), torch.tensor(LABELS), torch.tensor(kl, dtype=torch.float64), BETA,
                               loss_type, desirable_weight, undesirable_weight)
    for i, (p, r, label) in enumerate(zip(PI, REF, LABELS)):
        u = p - r
        if loss_type == "kto":
            expected = 1 - sig(BETA * (u - kl)) if label else 1 - sig(BETA * (kl - u))
        else:
            expected = 1 - sig(BETA * u) if label else sig(BETA * u)
        expected *= desirable_weight if label else undesirable_weight
        assert float(losses[i]) == formula(expected), i
        assert float(rewards[i]) == formula(BETA * u), i


def test_kto_loss_gradient_flows_to_the_policy_only():
    pi = f64(PI).requires_grad_()
    losses, rewards = kto_loss(pi, f64(REF), torch.tensor(LABELS), 0.3)
    losses.mean().backward()
    assert pi.grad.abs().min() > 0 and not rewards.requires_grad


def _trl_compute_loss(pi, ref, labels, kl_pi, kl_ref, loss_type, desirable_weight, undesirable_weight):
    """TRL's ``KTOTrainer._compute_loss`` on fixed summed log-probs: a stand-in model returns each sequence's sum
    in its first position (TRL sums the per-token log-probs its fused head returns), the reference's values come
    in the batch (TRL's ``precompute_ref_log_probs`` path). Returns (loss, TRL's metrics)."""
    trl = pytest.importorskip("trl")
    n, width = len(pi), 3
    batch = {"input_ids": torch.zeros(n, width, dtype=torch.long), "attention_mask": torch.ones(n, width),
             "completion_mask": torch.ones(n, width), "KL_input_ids": torch.ones(n, width, dtype=torch.long),
             "KL_attention_mask": torch.ones(n, width), "KL_completion_mask": torch.ones(n, width),
             "label": torch.tensor(labels), "ref_logps": ref, "ref_KL_logps": kl_ref}

    def model(input_ids, **_):
        per_token = torch.zeros(n, width - 1, dtype=torch.float64)
        per_token[:, 0] = kl_pi if input_ids is batch["KL_input_ids"] else pi
        return SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                               mean_logits=torch.zeros_like(per_token))

    metrics = {"train": defaultdict(list)}
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda t: t),
        calculate_KL=loss_type == "kto", aux_loss_enabled=False, precompute_ref_logps=True, beta=BETA,
        loss_type=loss_type, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
        _metrics=metrics, _total_train_tokens=0, _tp_size=1,
    )
    fake._compute_kl_logps = MethodType(trl.KTOTrainer._compute_kl_logps, fake)
    loss = trl.KTOTrainer._compute_loss(fake, model, batch, False)
    return loss, {k: v[-1] for k, v in metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_loss_matches_trl_compute_loss(loss_type):
    g = torch.Generator().manual_seed(3)
    n = 7
    pi = -20 * torch.rand(n, generator=g, dtype=torch.float64)
    ref = pi + torch.randn(n, generator=g, dtype=torch.float64)
    kl_pi = -20 * torch.rand(n, generator=g, dtype=torch.float64)
    kl_ref = kl_pi - 0.3 * torch.randn(n, generator=g, dtype=torch.float64) - 0.5  # a positive estimate: not clamped
    labels = [True, False, False, True, True, False, True]
    trl_loss, trl_metrics = _trl_compute_loss(pi, ref, labels, kl_pi, kl_ref, loss_type, 1.2, 0.8)

    settings = KTOLoss(loss_type=loss_type, beta=BETA, desirable_weight=1.2, undesirable_weight=0.8)
    kl = kl_estimate(kl_pi, kl_ref).clamp(min=0) if settings.uses_kl else 0.0
    losses, rewards = settings(pi, ref, torch.tensor(labels), kl)
    assert float(losses.mean()) == formula(float(trl_loss))
    assert float(kl) == formula(trl_metrics["kl"])
    chosen = torch.tensor(labels)
    assert float(rewards[chosen].mean()) == formula(trl_metrics["rewards/chosen"])
    assert float(rewards[~chosen].mean()) == formula(trl_metrics["rewards/rejected"])
    if settings.uses_kl:
        assert float(kl) > 0.1  # the estimate entered the loss


def test_kl_estimate_is_clamped_at_zero_as_in_trl():
    """A negative estimate counts as 0: the loss equals the one with kl = 0 exactly."""
    pi, ref = f64(PI), f64(REF)
    kl = kl_estimate(f64(KL_REF), f64(KL_PI)).clamp(min=0)  # pi and ref swapped: a negative mean, clamped
    assert float(kl) == 0.0
    assert torch.equal(kto_loss(pi, ref, torch.tensor(LABELS), kl)[0], kto_loss(pi, ref, torch.tensor(LABELS), 0.0)[0])


@pytest.mark.parametrize("settings,message", [
    ({"loss_type": "sigmoid"}, "model.loss_type 'sigmoid': expected one of"),
    ({"beta": 0.0}, "model.beta 0.0: expected a value > 0"),
    ({"desirable_weight": -1.0}, "model.desirable_weight -1.0"),
])
def test_bad_settings_are_one_line_errors(settings, message):
    with pytest.raises(LitAlignError, match=message) as info:
        KTOLoss(**settings)
    assert "\n" not in str(info.value)
