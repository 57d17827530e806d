"""RewardModule under lightning.Trainer: the rewards read at each row's last token, the loss and metrics, learning,
LoRA (task SEQ_CLS), the export that AutoModelForSequenceClassification and GRPO's reward models load, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import assert_one_line_error, fit, read_metrics, run_main, write_sort_rows
from lightning.pytorch.loggers import CSVLogger
from transformers import AutoModelForSequenceClassification

from lit_align.callbacks import HFExport
from lit_align.data import PreferenceDataModule, RewardDataModule
from lit_align.errors import LitAlignError
from lit_align.losses.reward import reward_loss
from lit_align.modules import RewardModule
from lit_align.rewards import RewardModel
from numerics import TINY_TERMS, assert_rounding_close


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> str:
    return write_sort_rows(tmp_path_factory.mktemp("reward_pairs") / "pairs.jsonl", 16, "pairs")


def data(path: str, **kw) -> RewardDataModule:
    return RewardDataModule(**{"path": path, "batch_size": 4, "max_length": 32, "val_split": None, "shuffle": False,
                               "tokenizer": "builtin:tiny", **kw})


def first_batch(path: str, margin: bool = False) -> dict[str, torch.Tensor]:
    dm = data(path)
    dm.setup("fit")
    batch = dm.collate([dm.train_data[i] for i in range(4)])
    if margin:
        batch["margin"] = torch.tensor([0.5, -0.25, 1.0, 0.0])
    return batch


def module(**kw) -> RewardModule:
    L.seed_everything(0, verbose=False)
    rm = RewardModule(model="builtin:tiny", **kw)
    rm.configure_model()
    return rm


def test_rewards_are_each_rows_score_alone_and_the_loss_is_bradley_terrys(pairs_file):
    """Right padding does not move a reward (the classifier reads each row's last real token), and the step's loss is
    ``reward_loss`` of those rewards, margin and centering included."""
    rm = module(center_rewards_coefficient=0.01)
    batch = first_batch(pairs_file, margin=True)
    assert (batch["attention_mask"] == 0).any()  # the rows differ in length: some are padded
    chosen, rejected = rm.rewards(batch)
    with torch.no_grad():
        alone = torch.stack([rm.network(input_ids=row[mask.bool()][None]).logits[0, 0]
                             for row, mask in zip(batch["input_ids"], batch["attention_mask"])])
    assert_rounding_close(torch.cat([chosen, rejected]).detach(), alone, terms=TINY_TERMS, msg="rewards")
    losses, stats = rm.pair_outputs(batch)
    expected = reward_loss(chosen, rejected, batch["margin"], 0.01)
    assert torch.equal(losses, expected)
    assert not torch.equal(losses, reward_loss(chosen, rejected))  # the margin and the centering moved it
    assert stats["accuracy"].item() == (chosen > rejected).float().mean().item()
    assert_rounding_close(stats["min_reward"], alone.min(), terms=TINY_TERMS, msg="min_reward")


def test_training_moves_the_body_and_the_score_head_and_logs_trls_metrics(tmp_path, pairs_file):
    rm = module(learning_rate=1e-3)
    before = {k: v.clone() for k, v in rm.policy.state_dict().items()}
    fit(rm, data(pairs_file, val_split="train"), tmp_path, max_steps=4, logger=CSVLogger(tmp_path, name="m"),
        val_check_interval=4)
    after = rm.policy.state_dict()
    assert not torch.equal(before["score.weight"], after["score.weight"])
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])
    rows = read_metrics(next(tmp_path.glob("m/version_*/metrics.csv")))
    logged = set().union(*rows)
    for name in ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward"):
        assert f"train/{name}" in logged and f"val/{name}" in logged, name
    assert "train/num_tokens" in logged
    # held-out figures are the mean over the held-out pairs of what the trained model gives them
    dm = data(pairs_file, batch_size=16)
    dm.setup("fit")
    with torch.no_grad():
        chosen, rejected = rm.rewards(dm.collate(list(dm.train_data)))
    val = next(r for r in rows if "val/accuracy" in r)
    assert val["val/accuracy"] == pytest.approx((chosen > rejected).float().mean().item())
    assert val["val/margin"] == pytest.approx((chosen - rejected).mean().item(), abs=1e-5)


def test_the_export_loads_as_a_sequence_classifier_and_scores_as_a_grpo_reward_model(tmp_path, pairs_file):
    rm = module(learning_rate=1e-3)
    fit(rm, data(pairs_file), tmp_path, max_steps=2, callbacks=[HFExport(path=str(tmp_path / "rm"))])
    _, info = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", output_loading_info=True)
    assert not info["missing_keys"]
    assert "AutoModelForSequenceClassification.from_pretrained" in (tmp_path / "rm" / "README.md").read_text()
    batch = first_batch(pairs_file)
    with torch.no_grad():
        chosen, _ = rm.rewards(batch)
    # GRPO's reward model on the same text: prompt + completion, the EOS appended as the rows had it
    rows = [json.loads(line) for line in Path(pairs_file).read_text().splitlines()][:4]
    prompts, completions = [r["prompt"] for r in rows], [r["chosen"] for r in rows]
    scores = RewardModel(str(tmp_path / "rm"))(prompts=prompts, completions=completions)
    assert_rounding_close(scores, chosen, terms=TINY_TERMS, msg="GRPO's reward model vs the trained module")


def test_lora_trains_adapters_and_the_score_head_and_both_exports_score_alike(tmp_path, pairs_file):
    rm = module(learning_rate=1e-2, peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
                export_merged=True)
    trainable = {n for n, p in rm.policy.named_parameters() if p.requires_grad}
    assert any("score" in n for n in trainable) and all("lora_" in n or "score" in n for n in trainable)
    fit(rm, data(pairs_file), tmp_path, max_steps=2, callbacks=[HFExport(path=str(tmp_path / "rm"))])
    batch = first_batch(pairs_file)
    with torch.no_grad():
        chosen, rejected = rm.rewards(batch)
    # the merged model; the adapter alone (on the base model's config, so it is told the one label, as GRPO's
    # reward models are: lit_align.rewards.RewardModel)
    for path, kwargs in ((tmp_path / "rm", {}), (tmp_path / "rm" / "adapter", {"num_labels": 1})):
        network = AutoModelForSequenceClassification.from_pretrained(path, **kwargs).eval()
        network.config.pad_token_id = 0
        with torch.no_grad():
            logits = network(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        assert_rounding_close(logits, torch.cat([chosen, rejected]), terms=TINY_TERMS, msg=str(path))


def test_the_default_lora_export_an_adapter_scores_as_a_grpo_reward_model(tmp_path, pairs_file):
    """``export_merged: false`` (the default) writes the adapter with its score head: GRPO's reward model loads it on
    its base model and gives the trained module's rewards, not a fresh random head's."""
    rm = module(learning_rate=1e-2, peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    fit(rm, data(pairs_file), tmp_path, max_steps=2, callbacks=[HFExport(path=str(tmp_path / "rm"))])
    assert (tmp_path / "rm" / "adapter_config.json").exists()
    with torch.no_grad():
        chosen, _ = rm.rewards(first_batch(pairs_file))
    rows = [json.loads(line) for line in Path(pairs_file).read_text().splitlines()][:4]
    for seed in (0, 1):  # a head drawn at load would differ from seed to seed
        torch.manual_seed(seed)
        scores = RewardModel(str(tmp_path / "rm"))(prompts=[r["prompt"] for r in rows],
                                                  completions=[r["chosen"] for r in rows])
        assert_rounding_close(scores, chosen, terms=TINY_TERMS, msg=f"adapter export, seed {seed}")


def test_bad_settings_are_one_line_naming_the_field(pairs_file, tmp_path):
    with pytest.raises(LitAlignError, match=r"^model.center_rewards_coefficient must be >= 0 or null, got -1"):
        RewardModule(center_rewards_coefficient=-1.0)
    with pytest.raises(LitAlignError, match=r"^model.model_init_kwargs.num_labels is 2: a reward model has one output"):
        RewardModule(model_init_kwargs={"num_labels": 2})
    with pytest.raises(LitAlignError, match=r"^data: RewardModule trains on lit_align.data.RewardDataModule"):
        fit(RewardModule(), PreferenceDataModule(path=pairs_file, val_split=None, batch_size=4), tmp_path)


class PoisonOneMargin(L.Callback):
    """Before the second step, a NaN margin for the pair at batch position 2, which makes that pair's loss NaN."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.dataset_row = int(batch["dataset_rows"][2])
            batch["margin"] = torch.tensor([0.0, 0.0, float("nan"), 0.0])


def test_a_nonfinite_loss_names_the_pairs_dataset_rows(tmp_path, pairs_file):
    """The numeric guard names the offending pair by its batch position and its dataset row (the collate's
    ``dataset_rows``), and nothing is updated."""
    rm = module(learning_rate=1e-3)
    poison = PoisonOneMargin()
    with pytest.raises(LitAlignError) as error:
        fit(rm, data(pairs_file), tmp_path, max_steps=2, callbacks=[poison])
    assert poison.dataset_row == 6  # no pair dropped, no shuffle: batch 1's position 2 is the file's row 6
    assert str(error.value) == (
        "non-finite training loss (nan) at step 1, batch 1, rows [2] (dataset rows [6]); nothing was updated "
        "(set model.on_nonfinite_loss: skip to skip such batches)")
    assert all(torch.isfinite(p).all() for p in rm.policy.parameters())


def test_a_bad_margin_through_the_cli_is_one_error_line(tmp_path, capfd, write_jsonl):
    path = write_jsonl([{"prompt": "sort 31:", "chosen": "13", "rejected": "31", "margin": "wide"}])
    code, _, err = run_main(["fit", "-c", "configs/reward.yaml", "--data.init_args.path", path,
                             "--data.init_args.val_split", "null", "--trainer.max_steps", "1",
                             "--trainer.logger", "false", "--export.enabled", "false",
                             "--trainer.default_root_dir", str(tmp_path)], capfd)
    assert_one_line_error(code, err, f"{path} row 0: field 'margin' must be a finite number, got 'wide'")
