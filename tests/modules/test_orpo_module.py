"""ORPOModule: TRL's experimental ORPOTrainer on the same batch (loss, metrics, gradients), the packed batch agreeing
with the plain one, no reference model, learning under lightning.Trainer, and the settings it refuses.

TRL's side: its own ``get_batch_loss_metrics`` in fp32 on the CPU, on lit_align's tokens (``helpers.trl_pair_batch``;
``tests/modules/test_cpo_module.py`` says why, and why ``logits/*`` are not compared). Tolerance: rule 3.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import LoggedSteps, assert_same_gradients, fit, pair_metric_scales, pair_metrics, trl_pair_batch
from lit_align.data import PreferenceDataModule
from lit_align.data.tasks import SortTask
from lit_align.errors import LitAlignError
from lit_align.modules import ORPOModule
from numerics import TINY_TERMS, assert_rounding_close

BETA = 0.1
PAIRS = 8
COMPARED = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen")


@pytest.fixture(scope="module")
def batch():
    data = PreferenceDataModule(path="builtin:sort", tokenizer="builtin:tiny", batch_size=PAIRS, max_length=64,
                                val_split=None, shuffle=False)
    data.setup("fit")
    return data.collate([data.train_data[i] for i in range(PAIRS)])


def orpo_scales(ours, beta=BETA):
    return pair_metric_scales(ours, beta) | {"log_odds_ratio": 1.0, "log_odds_chosen": 1.0}


@pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`
@pytest.mark.parametrize("beta", [BETA, 0.5])
def test_loss_metrics_and_gradients_match_trl(beta, batch, tiny_path, tmp_path):
    orpo = pytest.importorskip("trl.experimental.orpo")
    args = orpo.ORPOConfig(output_dir=str(tmp_path), beta=beta, max_length=64, bf16=False, use_cpu=True,
                           report_to="none")
    trainer = orpo.ORPOTrainer(model=tiny_path, args=args, train_dataset=SortTask().preference_rows("train").select(
        range(PAIRS)), processing_class=AutoTokenizer.from_pretrained(tiny_path))
    trainer.model.train()
    trainer.model.zero_grad()
    trl_loss, theirs = trainer.get_batch_loss_metrics(trainer.model, trl_pair_batch(batch))
    trl_loss.backward()
    module = ORPOModule(model=tiny_path, beta=beta)
    module.configure_model()
    assert module.reference is None
    out, _ = module.pair_outputs(batch)
    out["loss"].mean().backward()
    ours = pair_metrics(module, batch)
    size = orpo_scales(ours, beta)
    assert_rounding_close(ours["loss"], trl_loss.item(), scale=size["loss"], terms=TINY_TERMS, msg="loss")
    for name in COMPARED:
        assert_rounding_close(ours[name], theirs[name], scale=size[name], terms=TINY_TERMS, msg=name)
    # the NLL covers the chosen rows' prompts: it differs from the completion-only one by far more than rounding
    completion_only = -(out["logps/chosen"]).mean()  # per-token averages of the chosen completions
    assert abs(ours["nll_loss"] - float(completion_only)) > 1e-2
    assert_same_gradients(module.policy, trainer.model, int(batch["attention_mask"].sum()))


def test_padding_free_gives_the_plain_batch_values(batch):
    plain, packed = ORPOModule(), ORPOModule(padding_free=True)
    plain.configure_model()
    packed.configure_model()
    with torch.no_grad():
        ours, theirs = pair_metrics(plain, batch), pair_metrics(packed, batch)
    size = orpo_scales(ours) | {"logits/chosen": 1.0, "logits/rejected": 1.0}
    for name in ORPOModule.metrics:
        assert_rounding_close(theirs[name], ours[name], scale=size[name], terms=TINY_TERMS, msg=name)


def test_training_moves_the_policy_and_logs_trls_metrics(tmp_path, tiny_path):
    record = LoggedSteps()
    module = ORPOModule(model="builtin:tiny", learning_rate=1e-3)
    fit(module, PreferenceDataModule(path="builtin:sort", batch_size=8, max_length=32, val_split=None), tmp_path,
        max_steps=8, callbacks=[record])
    before = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    assert any(not torch.equal(before[k], v) for k, v in module.policy.state_dict().items())
    assert set(f"train/{name}" for name in ORPOModule.metrics) <= set(record.steps[-1])
    assert record.steps[-1]["train/loss"] < record.steps[0]["train/loss"]


@pytest.mark.parametrize("settings,message", [
    ({"share_prompt": True}, "model.share_prompt: ORPO's NLL term scores the chosen rows' prompt tokens"),
    ({"beta": 0.0}, "model.beta 0.0: expected a value > 0"),
])
def test_bad_settings_are_one_line_errors(settings, message):
    with pytest.raises(LitAlignError, match=message) as info:
        ORPOModule(**settings)
    assert "\n" not in str(info.value)
