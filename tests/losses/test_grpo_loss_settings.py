"""``lit_align.losses.grpo_loss``: the GRPO loss settings' refusals and warnings (TRL's rules, one ``LitAlignError`` line
naming the field) and the entropy coefficient's controller, by hand. The loss itself, through ``GRPOLoss.__call__``,
is compared with TRL's ``_compute_loss`` in ``test_grpo_losses.py``.
"""

from __future__ import annotations

import pytest

from lit_align.errors import LitAlignError
from lit_align.losses.grpo_loss import EntropyControl, GRPOLoss


def test_entropy_control_by_hand():
    static = EntropyControl(coef=0.1)
    static.step(0.05)
    assert static.applied() == 0.1  # static: always the coefficient
    control = EntropyControl(coef=0.1, adaptive=True, coef_min=0.0, coef_max=0.11, delta=0.005, target=0.2)
    assert control.applied() == 0.0  # no entropy measured yet
    control.step(0.1)  # below the target: more bonus, applied next step
    assert (control.coef, control.applied()) == (pytest.approx(0.105), pytest.approx(0.105))
    control.step(0.1)
    assert control.coef == 0.11  # capped at coef_max
    control.step(0.3)  # above the target: less, and not applied
    assert (control.coef, control.applied()) == (pytest.approx(0.105), 0.0)
    restored = EntropyControl(coef=0.1, adaptive=True)
    restored.load_state_dict(control.state_dict())
    assert (restored.coef, restored.last_entropy) == (control.coef, 0.3)


@pytest.mark.parametrize("kwargs,match", [
    ({"loss_type": "ppo"}, "model.loss_type 'ppo'"),
    ({"importance_sampling_level": "batch"}, "model.importance_sampling_level 'batch'"),
    ({"multi_objective_aggregation": "max"}, "model.multi_objective_aggregation 'max'"),
    ({"sapo_temperature_neg": 0.0}, "model.sapo_temperature_neg must be > 0"),
    ({"top_entropy_quantile": 1.5}, "model.top_entropy_quantile must be in"),
    ({"off_policy_mask_threshold": -0.1}, "model.off_policy_mask_threshold must be >= 0"),
    ({"use_adaptive_entropy": True, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "model.entropy_coef_min"),
])
def test_grpo_loss_refuses_bad_settings(kwargs, match):
    with pytest.raises(LitAlignError, match=match):
        GRPOLoss(**kwargs)


@pytest.mark.parametrize("kwargs,warns", [
    ({"loss_type": "luspo"}, "'luspo' is meant with importance_sampling_level 'sequence'"),
    ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, "VESPO computes sequence-level weights"),
    ({"loss_type": "dapo", "importance_sampling_level": "sequence"}, "GSPO's setup is loss_type 'grpo'"),
])
def test_grpo_loss_warns_as_trl(kwargs, warns):
    with pytest.warns(UserWarning, match=warns):
        GRPOLoss(**kwargs)
