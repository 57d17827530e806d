"""lit_align.losses.settings: the checks every loss's settings share, each a one-line error naming the option."""

from __future__ import annotations

import pytest

from lit_align.errors import LitAlignError
from lit_align.losses import CPOLoss, DPOLoss, GRPOLoss, KTOLoss
from lit_align.losses.settings import check_choice, check_positive


def test_check_choice_names_the_option_the_value_and_the_choices():
    check_choice("loss_type", "kto", ("kto", "apo_zero_unpaired"))
    with pytest.raises(LitAlignError) as info:
        check_choice("loss_type", "dpo", ("kto", "apo_zero_unpaired"))
    assert str(info.value) == "model.loss_type 'dpo': expected one of ('kto', 'apo_zero_unpaired')"


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_check_positive_refuses_zero_negatives_and_nan(value):
    check_positive("beta", 0.1)
    with pytest.raises(LitAlignError) as info:
        check_positive("beta", value)
    assert str(info.value) == f"model.beta {value}: expected a value > 0"


@pytest.mark.parametrize("build, message", [
    (lambda: KTOLoss(desirable_weight=0.0), "model.desirable_weight 0.0: expected a value > 0"),
    (lambda: CPOLoss(loss_type="kto"), "model.loss_type 'kto': expected one of ('sigmoid', 'hinge', 'ipo', "
                                       "'simpo', 'alphapo')"),
    (lambda: DPOLoss(discopop_tau=-0.5), "model.discopop_tau -0.5: expected a value > 0"),
    (lambda: GRPOLoss(scale_rewards="rank"), "model.scale_rewards 'rank': expected one of ('group', 'batch', 'none')"),
])
def test_every_loss_words_a_mistake_in_its_settings_alike(build, message):
    with pytest.raises(LitAlignError) as info:
        build()
    assert str(info.value) == message
