"""CPOModule (CPO, SimPO, AlphaPO): TRL's experimental CPOTrainer on the same batch (loss, metrics, gradients), the
layouts agreeing, no reference model, and learning under lightning.Trainer.

TRL's side: its own ``get_batch_loss_metrics`` (forward, log-probs, NLL, ``cpo_loss``) in fp32 on the CPU, on
lit_align's tokens (``helpers.trl_pair_batch``): TRL's experimental trainers tokenize pairs their own older way,
lit_align as its DPO does. ``logits/*`` are not compared: TRL's average every logit of the padded batch, prompts and
padding included, lit_align's the completion tokens' (docs/cpo_orpo.md).
Tolerance: ``tests/numerics.py`` rule 3.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import LoggedSteps, assert_same_gradients, fit, pair_metric_scales, pair_metrics, trl_pair_batch
from lit_align.data import PreferenceDataModule
from lit_align.data.tasks import SortTask
from lit_align.modules import CPOModule
from numerics import TINY_TERMS, assert_rounding_close

BETA = 0.1
PAIRS = 8
COMPARED = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "nll_loss")


@pytest.fixture(scope="module")
def batch():
    data = PreferenceDataModule(path="builtin:sort", tokenizer="builtin:tiny", batch_size=PAIRS, max_length=64,
                                val_split=None, shuffle=False)
    data.setup("fit")
    return data.collate([data.train_data[i] for i in range(PAIRS)])


def trl_cpo(tiny_path, tmp_path, **config):
    cpo = pytest.importorskip("trl.experimental.cpo")
    args = cpo.CPOConfig(output_dir=str(tmp_path), beta=BETA, max_length=64, bf16=False, use_cpu=True,
                         report_to="none", **config)
    rows = SortTask().preference_rows("train").select(range(PAIRS))
    return cpo.CPOTrainer(model=tiny_path, args=args, train_dataset=rows,
                          processing_class=AutoTokenizer.from_pretrained(tiny_path))


CASES = {"sigmoid": {}, "hinge": {"loss_type": "hinge"}, "ipo": {"loss_type": "ipo"},
         "simpo": {"loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": 0.8},
         "simpo-smoothed-nll": {"loss_type": "simpo", "label_smoothing": 0.1},
         "alphapo": {"loss_type": "alphapo", "alpha": 0.2}, "sigmoid-alpha": {"alpha": 0.1, "cpo_alpha": 0.5}}


@pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`
@pytest.mark.parametrize("case", CASES)
def test_loss_metrics_and_gradients_match_trl(case, batch, tiny_path, tmp_path):
    trainer = trl_cpo(tiny_path, tmp_path, **CASES[case])
    trainer.model.train()
    trainer.model.zero_grad()
    trl_loss, theirs = trainer.get_batch_loss_metrics(trainer.model, trl_pair_batch(batch))
    trl_loss.backward()
    module = CPOModule(model=tiny_path, beta=BETA, **CASES[case])
    module.configure_model()
    assert module.reference is None  # no reference model at all
    out, _ = module.pair_outputs(batch)
    out["loss"].mean().backward()
    ours = pair_metrics(module, batch)
    size = pair_metric_scales(ours, BETA)
    assert_rounding_close(ours["loss"], trl_loss.item(), scale=size["loss"], terms=TINY_TERMS, msg="loss")
    for name in COMPARED:
        assert_rounding_close(ours[name], theirs[name], scale=size[name], terms=TINY_TERMS, msg=name)
    assert abs(ours["rewards/margins"]) > 1e-4
    assert_same_gradients(module.policy, trainer.model, int(batch["attention_mask"].sum()))


@pytest.mark.parametrize("layout", [{"share_prompt": False}, {"padding_free": True}])
def test_the_layouts_give_the_shared_prompt_rows_values(layout, batch):
    """The plain batch and the packed one compute what the shared-prompt rows (the default) compute."""
    default, other = CPOModule(loss_type="simpo"), CPOModule(loss_type="simpo", **layout)
    default.configure_model()
    other.configure_model()
    with torch.no_grad():
        ours, theirs = pair_metrics(default, batch), pair_metrics(other, batch)
    size = pair_metric_scales(ours, BETA) | {"logits/chosen": 1.0, "logits/rejected": 1.0}
    for name in CPOModule.metrics:
        assert_rounding_close(theirs[name], ours[name], scale=size[name], terms=TINY_TERMS, msg=name)


def test_training_moves_the_policy_and_lifts_the_chosen(tmp_path, tiny_path):
    record = LoggedSteps()
    module = CPOModule(model="builtin:tiny", learning_rate=1e-3)
    data = PreferenceDataModule(path="builtin:sort", batch_size=8, max_length=32, val_split=None)
    fit(module, data, tmp_path, max_steps=8, callbacks=[record])
    before = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    after = module.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert set(f"train/{name}" for name in CPOModule.metrics) <= set(record.steps[-1])
    assert record.steps[-1]["train/nll_loss"] < record.steps[0]["train/nll_loss"]  # the behaviour-cloning term learns
