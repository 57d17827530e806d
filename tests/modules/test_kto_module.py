"""KTOModule: TRL's KTOTrainer on the same rows (tokens, the KL batch, loss, metrics and gradients), the step-0
loss, learning under lightning.Trainer, and the settings a KTO run refuses.

TRL's side: its own dataset preparation, collator and ``compute_loss``, in fp32 on the CPU (``bf16=False``), with the
same policy and a reference that differs from it (seeded noise), so the rewards and the KL estimate are not zero.
Tolerance: ``tests/numerics.py`` rule 3 (TRL's fused LM head against lit_align's log-probs, same formulas).
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import LoggedSteps, assert_same_gradients, fit
from lit_align.data import UnpairedPreferenceDataModule
from lit_align.data.tasks import SortTask
from lit_align.errors import LitAlignError
from lit_align.modules import KTOModule
from numerics import TINY_TERMS, assert_rounding_close

BETA = 0.1
ROWS = 8  # rows per batch
MAX_LENGTH = 64
TRL_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
               "logits/chosen", "logits/rejected", "entropy")


def unpaired_rows(pairs):
    """Unpaired rows alternating desirable and undesirable: pair i gives its chosen side (i even) or rejected (odd)."""
    return [{"prompt": row["prompt"], "completion": row["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}
            for i, row in enumerate(pairs)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_path):
    import datasets

    root = tmp_path_factory.mktemp("kto_parity")
    ref = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in ref.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    ref.save_pretrained(root / "ref")
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(root / "ref")
    pairs = SortTask().preference_rows("train").select(range(ROWS))
    unpaired = datasets.Dataset.from_list(unpaired_rows(pairs))
    unpaired.to_json(root / "unpaired.jsonl")
    pairs.to_json(root / "pairs.jsonl")
    return {"policy": tiny_path, "ref": str(root / "ref"), "root": root, "pairs": pairs, "unpaired": unpaired}


def trl_trainer(setup, rows, out, **config):
    trl = pytest.importorskip("trl")
    args = trl.KTOConfig(output_dir=str(out), beta=BETA, max_length=MAX_LENGTH, per_device_train_batch_size=ROWS,
                         bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                         dataloader_num_workers=0, **config)
    ref = AutoModelForCausalLM.from_pretrained(setup["ref"], dtype=torch.float32)
    return trl.KTOTrainer(model=setup["policy"], ref_model=ref, args=args, train_dataset=rows,
                          processing_class=AutoTokenizer.from_pretrained(setup["policy"]))


def lit_data(setup, name: str, **kw) -> UnpairedPreferenceDataModule:
    data = UnpairedPreferenceDataModule(path=str(setup["root"] / name), tokenizer=setup["policy"], batch_size=ROWS,
                                        max_length=MAX_LENGTH, val_split=None, shuffle=False, **kw)
    data.setup("fit")
    return data


def test_paired_rows_are_unpaired_and_tokenized_as_trl_does(setup, tmp_path):
    trainer = trl_trainer(setup, setup["pairs"], tmp_path)
    data = lit_data(setup, "pairs.jsonl")
    assert len(trainer.train_dataset) == len(data.train_data) == 2 * ROWS
    for i in range(2 * ROWS):
        theirs, ours = trainer.train_dataset[i], data.train_data[i]
        for key in ("prompt_ids", "completion_ids", "label"):
            assert ours[key] == theirs[key], f"row {i} {key}"
    assert data.train_data["label"] == [True] * ROWS + [False] * ROWS  # TRL's order: a block's chosen sides first


@pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`
def test_loss_metrics_and_gradients_match_trl(setup, tmp_path):
    trainer = trl_trainer(setup, setup["unpaired"], tmp_path)
    data = lit_data(setup, "unpaired.jsonl")
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(ROWS)])
    lit_batch = data.collate([data.train_data[i] for i in range(ROWS)])
    for key in ("input_ids", "attention_mask", "completion_mask", "KL_input_ids", "KL_attention_mask",
                "KL_completion_mask", "label"):
        assert torch.equal(lit_batch[key], trl_batch[key]), key  # the mismatched pairs too (rotated at collate)

    trainer.model.train()
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    trl_loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(trl_batch))
    trl_loss.backward()
    theirs = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    module = KTOModule(model=setup["policy"], ref_model=setup["ref"], beta=BETA)
    module.configure_model()
    out = module.row_outputs(lit_batch)
    out["losses"].mean().backward()
    ours = {name: float(value) for name, value in module.step_metrics(lit_batch, out).items()}
    scale = max(abs(ours["logps/chosen"]), abs(ours["logps/rejected"]))  # the summed log-probs the rewards subtract
    assert_rounding_close(ours["loss"], trl_loss.item(), scale=BETA * scale, terms=TINY_TERMS, msg="loss")
    for name in TRL_METRICS:
        size = scale if name.startswith(("logps", "kl")) else BETA * scale if name.startswith("rewards") else \
            max(abs(ours[name]), 1.0)
        assert_rounding_close(ours[name], theirs[name], scale=size, terms=TINY_TERMS, msg=name)
    assert ours["kl"] > 0.01 and abs(ours["rewards/margins"]) > 1e-4  # the reference differs: not trivially zero
    assert ours["num_tokens"] == float(lit_batch["attention_mask"].sum())
    assert_same_gradients(module.policy, trainer.model, int(lit_batch["attention_mask"].sum()))


@pytest.mark.parametrize("reference", [{}, {"peft_config": {"r": 2, "target_modules": "all-linear"}}],
                         ids=["frozen-copy", "adapters-off"])
def test_step0_loss_is_half_with_the_reference_a_copy_of_the_policy(reference):
    """At step 0 the reference is the policy (a frozen copy, or under LoRA the policy with its freshly initialized
    adapters off), so every log-ratio and the KL estimate are 0: each row's loss is ``1 - sigmoid(0) = 0.5`` times
    its weight."""
    module = KTOModule(model="builtin:tiny", desirable_weight=1.5, undesirable_weight=0.5, **reference)
    module.configure_model()
    data = UnpairedPreferenceDataModule(path="builtin:sort", tokenizer="builtin:tiny", batch_size=ROWS,
                                        max_length=32, val_split=None)
    data.setup("fit")
    batch = data.collate([data.train_data[i] for i in (0, 1, 2, len(data.train_data) - 1)])
    out = module.row_outputs(batch)
    assert float(out["kl"]) == 0.0
    expected = torch.where(batch["label"], 0.75, 0.25)
    assert torch.equal(out["losses"].detach(), expected)
    assert batch["label"].any() and not batch["label"].all()


def test_training_moves_the_policy_and_logs_trls_metrics(tmp_path, tiny_path):
    record = LoggedSteps()
    module = KTOModule(model="builtin:tiny", learning_rate=1e-3)
    data = UnpairedPreferenceDataModule(path="builtin:sort", batch_size=8, max_length=32, val_split=None)
    before = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    fit(module, data, tmp_path, max_steps=6, callbacks=[record])
    after = module.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    last = record.steps[-1]
    for name in ("train/loss", "train/kl", "train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins",
                 "train/logps/chosen", "train/logps/rejected", "train/logits/chosen", "train/entropy",
                 "train/num_tokens"):
        assert name in last and math.isfinite(last[name]), name
    assert last["train/rewards/margins"] > 0  # desirable rows pulled up, undesirable ones down


@pytest.mark.parametrize("label", [True, False])
def test_rows_all_of_one_label_train_and_log_their_side_only(tmp_path, write_jsonl, label):
    """Legitimate (TRL trains on it): the loss is finite, the policy moves, the absent side's metrics are not logged."""
    record = LoggedSteps()
    rows = [{"prompt": f"sort {i}{i + 2}:", "completion": f" {i}{i + 2}", "label": label} for i in range(8)]
    data = UnpairedPreferenceDataModule(path=write_jsonl(rows), batch_size=4, max_length=32, val_split=None)
    with pytest.warns(UserWarning, match="every row is"):
        fit(KTOModule(model="builtin:tiny", learning_rate=1e-3), data, tmp_path, max_steps=2, callbacks=[record])
    present, absent = ("chosen", "rejected") if label else ("rejected", "chosen")
    for step in record.steps:
        assert math.isfinite(step["train/loss"]) and math.isfinite(step[f"train/rewards/{present}"])
        assert f"train/rewards/{absent}" not in step and "train/rewards/margins" not in step


@pytest.mark.parametrize("settings,message", [
    ({"loss_type": "sigmoid"}, "model.loss_type 'sigmoid': expected one of"),
    ({"sync_ref_model": True, "peft_config": {"r": 2}}, "model.sync_ref_model needs a reference model in memory"),
    ({"ref_model": "x", "peft_config": {"r": 2}}, "model.ref_model: with peft_config"),
])
def test_bad_settings_are_one_line_errors(settings, message):
    with pytest.raises(LitAlignError, match=message) as info:
        KTOModule(model="builtin:tiny", **settings)
    assert "\n" not in str(info.value)


def test_kto_needs_two_rows_a_batch_for_its_kl_estimate_and_unpaired_data(tmp_path):
    data = UnpairedPreferenceDataModule(path="builtin:sort", batch_size=1, val_split=None)
    with pytest.raises(LitAlignError, match="data.batch_size 1: KTO's KL estimate"):
        fit(KTOModule(model="builtin:tiny"), data, tmp_path)
    fit(KTOModule(model="builtin:tiny", loss_type="apo_zero_unpaired"), data, tmp_path)  # no KL estimate: fine
    from lit_align.data import PreferenceDataModule

    with pytest.raises(LitAlignError, match="KTOModule trains on unpaired rows: data must be"):
        fit(KTOModule(model="builtin:tiny"), PreferenceDataModule(path="builtin:sort", val_split=None), tmp_path)


def test_val_loss_is_the_mean_over_the_validation_rows_as_trls_eval_loss(tmp_path, write_jsonl):
    """Batches of 4 and 2 rows at step 0 (each row's loss 0.75 desirable, 0.25 undesirable): ``val/loss`` is the mean
    over the 6 rows, 0.5, as TRL's eval loss weighs each batch by its rows, not the batches' mean 0.5625."""
    labels = [True, False, False, False, True, True]
    rows = [{"prompt": f"sort {i}{i + 2}:", "completion": f" {i}{i + 2}", "label": label}
            for i, label in enumerate(labels)]
    path = write_jsonl(rows)
    data = UnpairedPreferenceDataModule(path=path, val_path=path, val_split="train", batch_size=4, val_batch_size=4,
                                        max_length=32, shuffle=False)
    module = KTOModule(model="builtin:tiny", desirable_weight=1.5, undesirable_weight=0.5)
    (metrics,) = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                           enable_model_summary=False).validate(module, data)
    assert metrics["val/loss"] == pytest.approx(0.5, abs=1e-6)
