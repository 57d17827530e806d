"""``lit-align from-trl``: a TRL config file (``trl <command> --config FILE``) as a lit_align config."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import assert_one_line_error, run_main
from safetensors.torch import load_file

from lit_align.errors import LitAlignError
from lit_align.from_trl import COMMANDS, translate


def write(path, fields: dict) -> str:
    path.write_text(yaml.safe_dump(fields))
    return str(path)


def test_a_trl_distillation_config_trains_with_its_settings_and_exports(tmp_path, capfd):
    """The translated file trains as the TRL file says: its model, teacher, loss settings, batch, accumulation, one
    round per optimizer step (TRL's steps_per_generation default), steps, seed; the student moves; the final model
    is an HF directory in the output directory."""
    out = tmp_path / "run"
    trl = write(tmp_path / "trl.yaml", {
        "model_name_or_path": "builtin:tiny", "teacher_model_name_or_path": "builtin:small",
        "dataset_name": "builtin:sort", "beta": 0.5, "lmbda": 1.0, "temperature": 0.9, "max_completion_length": 6,
        "learning_rate": 1e-3, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 2,
        "seed": 5, "bf16": False, "use_cpu": True, "report_to": "none", "output_dir": str(out),
        "save_strategy": "no", "disable_tqdm": True,
    })
    lit = tmp_path / "lit.yaml"
    code, _, err = run_main(["from-trl", "distillation", "--config", trl, "-o", str(lit)], capfd)
    assert code == 0, err
    from lit_align.cli import run

    argv, sys.argv = sys.argv, ["lit-align"]
    try:
        cli = run(["fit", "-c", str(lit)])
    finally:
        sys.argv = argv
    module, trainer = cli.model, cli.trainer
    assert type(module).__name__ == "DistillationModule"
    assert (module.beta, module.lmbda, module.temperature) == (0.5, 1.0, 0.9)
    assert module.hparams.learning_rate == 1e-3 and module.hparams.max_completion_length == 6
    assert module.round_shape.steps_per_generation == 2 and trainer.accumulate_grad_batches == 2
    assert cli.datamodule.batch_size == 4 and trainer.global_step == 2
    assert trainer.precision == "32-true" and trainer.logger is None and not trainer.checkpoint_callbacks
    assert cli.config["fit"]["seed_everything"] == 5
    exported = load_file(out / "hf_model" / "model.safetensors")
    from lit_align.models import load_model

    fresh = load_model("builtin:tiny").state_dict()
    moved = [k for k, v in exported.items() if not torch.equal(v, fresh[k])]
    assert moved, "the student did not move"


def test_the_docs_example_is_what_the_translation_writes():
    """docs/trl_configs.md's TRL file and its translation, as the page shows them."""
    import re

    page = (Path(__file__).resolve().parents[2] / "docs" / "trl_configs.md").read_text()
    trl, lit = (yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", page, re.S)[:2])
    assert translate("distillation", trl) == lit


def test_each_field_lands_where_lit_align_has_it():
    config = translate("grpo", {
        "model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "model_revision": "v1", "dataset_name": "trl-lib/x",
        "dataset_config": "main", "dataset_train_split": "train", "dataset_test_split": "validation",
        "reward_funcs": ["my.rewards.f"], "num_generations": 8, "beta": 0.04, "loss_type": "dapo",
        "use_vllm": True, "vllm_mode": "colocate", "learning_rate": 1e-6, "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 16, "gradient_accumulation_steps": 4, "num_train_epochs": 1,
        "max_grad_norm": 0.5, "logging_steps": 5, "log_completions": True, "num_completions_to_print": 2,
        "eval_strategy": "steps", "eval_steps": 50, "save_steps": 100, "save_total_limit": 2,
        "report_to": ["tensorboard"], "run_name": "r", "output_dir": "runs/q", "use_peft": True, "lora_r": 32,
        "lora_alpha": 16, "lora_target_modules": "all-linear", "push_to_hub": False, "shuffle_dataset": False,
        "resume_from_checkpoint": "runs/q/last.ckpt", "gradient_checkpointing": True,
    }, "f.yaml")
    model, data, trainer = config["model"]["init_args"], config["data"]["init_args"], config["trainer"]
    assert config["model"]["class_path"] == "lit_align.modules.GRPOModule"
    assert model == {
        "engine": "vllm",
        "peft_config": {"r": 32, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": "all-linear"},
        "steps_per_generation": 4, "model": "Qwen/Qwen2.5-0.5B-Instruct", "model_init_kwargs": {"revision": "v1"},
        "reward_funcs": ["my.rewards.f"], "num_generations": 8, "beta": 0.04, "loss_type": "dapo",
        "vllm_mode": "colocate", "learning_rate": 1e-6, "gradient_checkpointing": True,
        "disable_dropout": False,  # TRL's default, not lit_align's
        "num_generations_eval": 8,  # TRL samples num_generations per evaluation prompt ...
    }
    assert data == {"path": "trl-lib/x", "config_name": "main", "train_split": "train", "val_split": "validation",
                    "batch_size": 8, "val_batch_size": 2,  # ... and its eval batch counts them: 16 / 8 prompts
                    "shuffle": False, "max_length": None, "seed": 42}
    assert trainer["max_epochs"] == 1 and trainer["precision"] == "bf16-mixed"
    assert trainer["accumulate_grad_batches"] == 4 and trainer["gradient_clip_val"] == 0.5
    assert trainer["log_every_n_steps"] == 5 and trainer["default_root_dir"] == "runs/q"
    assert trainer["val_check_interval"] == 200  # 50 optimizer steps of 4 batches
    assert trainer["callbacks"] == [
        {"class_path": "lit_align.callbacks.CompletionsLogger",
         "init_args": {"every_n_steps": 5, "num_completions_to_print": 2}},
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"every_n_train_steps": 100, "save_top_k": 2, "monitor": "step", "mode": "max"}}]
    assert trainer["logger"] == {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                 "init_args": {"save_dir": "runs/q", "name": "r"}}
    assert config["export"] == {"path": "runs/q/hf_model"} and config["ckpt_path"] == "runs/q/last.ckpt"


def test_quantized_loading_is_a_bitsandbytes_config_as_trls():
    """ModelConfig's load_in_4bit / load_in_8bit: the student loaded quantized (QLoRA with use_peft), the arguments
    TRL's get_quantization_config gives BitsAndBytesConfig."""
    four = translate("sft", {"load_in_4bit": True, "dtype": "bfloat16", "use_bnb_nested_quant": True,
                             "bnb_4bit_quant_type": "nf4", "model_revision": "main"})["model"]["init_args"]
    assert four == {"disable_dropout": False, "dtype": "bfloat16", "model_init_kwargs": {"quantization_config": {
        "load_in_4bit": True, "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True}}}
    eight = translate("sft", {"load_in_8bit": True})["model"]["init_args"]
    assert eight == {"disable_dropout": False, "model_init_kwargs": {"quantization_config": {"load_in_8bit": True}}}


def test_trl_defaults_are_written_where_lightnings_differ():
    """A file that leaves them out trains as TRL would: 3 epochs, seed 42 (the data's order too), a log every 10
    steps, clipping at 1.0, bf16 (unless fp16), no evaluation; the steps TRL does not set stay lit_align's."""
    config = translate("dpo", {"model_name_or_path": "m"})
    assert config["trainer"] == {"max_epochs": 3, "precision": "bf16-mixed", "limit_val_batches": 0,
                                 "num_sanity_val_steps": 0, "log_every_n_steps": 10, "gradient_clip_val": 1.0}
    assert config["data"]["init_args"] == {"val_split": None, "seed": 42}  # no evaluation: no test split read
    assert config["seed_everything"] == 42 and "steps_per_generation" not in config["model"]["init_args"]
    assert translate("sft", {"fp16": True})["trainer"]["precision"] == "16-mixed"
    assert "precision" not in translate("sft", {"bf16": False})["trainer"]
    # TRL's max_steps overrides num_train_epochs: no epoch limit then
    assert translate("sft", {"max_steps": 10, "num_train_epochs": 1})["trainer"]["max_epochs"] == -1


SHIPPED = sorted((Path(__file__).resolve().parents[2] / "configs" / "trl").glob("*.yaml"))


@pytest.mark.parametrize("trl", SHIPPED, ids=[p.name for p in SHIPPED])
def test_the_shipped_trl_files_translate_to_configs_that_parse(trl, tmp_path, capfd):
    command = trl.name.split("_")[0]
    code, _, err = run_main(["from-trl", command, "--config", str(trl), "-o", str(tmp_path / "lit.yaml")], capfd)
    assert code == 0, err
    code, _, err = run_main(["fit", "-c", str(tmp_path / "lit.yaml"), "--print_config"], capfd)
    assert code == 0, err


@pytest.mark.parametrize("evaluation", ["steps", "no"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_translated_config_of_each_command_parses(command, evaluation, tmp_path, capfd):
    """Every place the translation writes exists: LightningCLI parses and validates the whole config (with
    evaluation, and without: no test split)."""
    fields = {"model_name_or_path": "builtin:tiny", "dataset_name": "builtin:sort", "learning_rate": 1e-5,
              "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 3,
              "dataset_num_proc": 2, "dataloader_num_workers": 0, "output_dir": str(tmp_path / "run"),
              "eval_strategy": evaluation, "eval_steps": 2, "save_steps": 1, "report_to": "none",
              "use_peft": True, "lora_r": 4}
    fields |= {"distillation": {"teacher_model_name_or_path": "builtin:tiny"},
               "grpo": {"reward_funcs": ["lit_align.rewards.sort_accuracy"], "num_generations": 2},
               "rloo": {"reward_funcs": ["lit_align.rewards.sort_accuracy"], "num_generations": 2}}.get(command, {})
    code, _, err = run_main(["from-trl", command, "--config", write(tmp_path / "trl.yaml", fields),
                             "-o", str(tmp_path / "lit.yaml")], capfd)
    assert code == 0, err
    code, out, err = run_main(["fit", "-c", str(tmp_path / "lit.yaml"), "--print_config"], capfd)
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed["trainer"]["accumulate_grad_batches"] == 2 and printed["data"]["init_args"]["batch_size"] == 4
    assert (printed["data"]["init_args"]["val_split"] is None) == (evaluation == "no")


@pytest.mark.parametrize("fields, needles", [
    ({"model_name_or_path": "m", "neftune_noise_alpha": 5, "dataset_streaming": True, "num_train_epochs": 1.5},
     ["trl.yaml", "3 field(s)", "'neftune_noise_alpha' (TRL's field; lit_align has no equivalent)",
      "'dataset_streaming' is True", "'num_train_epochs' is 1.5"]),
    ({"num_train_epochs": 1.5}, ["trl.yaml", "'num_train_epochs' is 1.5", "whole number"]),
    ({"save_strategy": "best"}, ["'save_strategy' is 'best'"]),
    ({"learnig_rate": 1e-5}, ["'learnig_rate' is not a field of TRL", "did you mean 'learning_rate'?"]),
    ({"max_completion_length": 8}, ["'max_completion_length' is a field of `trl grpo`", "not of `trl dpo`"]),
    ({"beta": "abc", "loss_type": ["nope"]}, ["'beta' is 'abc': expected a number"]),
    ({"beta": 0.1, "rpo_alpha": -1.0}, ["'rpo_alpha'", "rpo_alpha"]),
    ({"bf16": True, "fp16": True}, ["'bf16' and 'fp16'"]),
    ({"env": {"HF_HOME": "/x"}}, ["'env' (set those environment variables in the shell"]),
    ({"save_steps": 1.5}, ["'save_steps' is 1.5"]),
    ({"logging_steps": 0.5, "eval_strategy": "steps"}, ["'logging_steps' is 0.5"]),
    ({"num_train_epochs": None}, ["'num_train_epochs' is None"]),
    ({"load_best_model_at_end": True}, ["'load_best_model_at_end' is True"]),
])
def test_what_does_not_translate_is_one_error_line(fields, needles, tmp_path, capfd):
    out = tmp_path / "lit.yaml"
    code, _, err = run_main(["from-trl", "dpo", "--config", write(tmp_path / "trl.yaml", fields), "-o", str(out)],
                              capfd)
    assert_one_line_error(code, err, *needles)
    assert not out.exists()


def test_a_file_that_is_not_a_trl_config_is_one_error_line(tmp_path, capfd):
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n")
    code, _, err = run_main(["from-trl", "sft", "--config", str(listing)], capfd)
    assert_one_line_error(code, err, "list.yaml", "expected a mapping")
    code, _, err = run_main(["from-trl", "sft", "--config", str(tmp_path / "missing.yaml")], capfd)
    assert_one_line_error(code, err, "missing.yaml", "No such file")


def test_trls_command_line_fields_override_the_file_as_in_trl(tmp_path, capfd):
    """``trl dpo --config FILE --field value ...`` with ``trl`` replaced: values typed as TRL's parser types them
    (bool flags bare or spelled, numbers, lists of several values, YAML mappings), later ones over the file's."""
    trl = write(tmp_path / "trl.yaml", {"model_name_or_path": "a", "beta": 0.1, "learning_rate": 1e-6})
    code, out, err = run_main(["from-trl", "dpo", "--config", trl, "--beta", "0.2", "--max_steps=7", "--use_peft",
                               "--lora_target_modules", "q_proj", "v_proj", "--bf16", "false",
                               "--model_init_kwargs", '{"revision": "v2"}', "--loss_type", "sigmoid"], capfd)
    assert code == 0, err
    config = yaml.safe_load(out)
    model = config["model"]["init_args"]
    assert model == {"peft_config": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05,  # ModelConfig's defaults
                                     "target_modules": ["q_proj", "v_proj"]}, "model": "a", "beta": 0.2,
                     "learning_rate": 1e-6, "model_init_kwargs": {"revision": "v2"},
                     "loss_type": ["sigmoid"]}  # TRL 1.16's is a list
    assert config["trainer"]["max_steps"] == 7 and "precision" not in config["trainer"]
    code, out, err = run_main(["from-trl", "sft", "--model_name_or_path", "m", "--num_train_epochs", "2"], capfd)
    assert code == 0, err
    assert yaml.safe_load(out)["trainer"]["max_epochs"] == 2
    code, _, err = run_main(["from-trl", "sft", "stray", "--model_name_or_path", "m"], capfd)
    assert_one_line_error(code, err, "'stray' follows no --field")


def test_what_trl_reads_differently_per_command():
    """SFT's shuffle_dataset only pre-shuffles (dropped); GRPO's reward model goes first among the rewards, as TRL
    orders them; an online recipe's prompts are not cut; a warmup_steps below 1 is a ratio; a per-device
    evaluation batch that is not whole groups is refused."""
    assert "shuffle" not in translate("sft", {"shuffle_dataset": False})["data"]["init_args"]
    grpo = translate("grpo", {"reward_model_name_or_path": "org/rm", "reward_funcs": "my.f", "warmup_steps": 0.1})
    assert grpo["model"]["init_args"]["reward_funcs"] == ["org/rm", "my.f"]
    assert grpo["model"]["init_args"]["warmup_ratio"] == 0.1 and grpo["data"]["init_args"]["max_length"] is None
    assert translate("dpo", {"warmup_steps": 10})["model"]["init_args"]["warmup_steps"] == 10
    rloo = translate("rloo", {"eval_strategy": "epoch", "per_device_eval_batch_size": 8,  # RLOO's 2 samples
                              "reward_funcs": "my.f"})
    assert (rloo["model"]["init_args"]["num_generations_eval"], rloo["data"]["init_args"]["val_batch_size"]) == (2, 4)
    notes = []
    grpo = translate("grpo", {"eval_strategy": "epoch", "per_device_eval_batch_size": 6, "num_generations": 4,
                              "reward_funcs": "my.f"}, notes=notes)
    assert grpo["data"]["init_args"]["val_batch_size"] == 1 and any("is not whole groups of 4" in n for n in notes)


@pytest.mark.parametrize("order", ["revision first", "kwargs first"])
def test_model_init_kwargs_given_whole_win_over_model_revision_in_any_order(order):
    """TRL's scripts start model_init_kwargs from model_revision and update it with the field given whole; the
    caller's mapping is left as it was."""
    pairs = [("model_revision", "v1"), ("model_init_kwargs", {"revision": "v2", "device_map": None})]
    fields = dict(pairs if order == "revision first" else pairs[::-1])
    before = copy.deepcopy(fields)
    model = translate("dpo", fields)["model"]["init_args"]
    assert model["model_init_kwargs"] == {"revision": "v2", "device_map": None}
    assert fields == before
    assert translate("dpo", {"model_revision": "v1"})["model"]["init_args"]["model_init_kwargs"] == {"revision": "v1"}


def test_null_and_exponent_values_read_as_trl_reads_them():
    """A YAML 1e-5 is text to YAML 1.1 and a number to TRL; bf16: null is TRL's default (bf16 unless fp16); a
    null reward model is none; max_steps 0 is no limit (TRL overrides the epochs only above 0); data_seed orders
    the data."""
    config = translate("grpo", {"learning_rate": "1e-5", "adam_epsilon": "1e-8", "bf16": None,
                                "reward_model_name_or_path": None, "reward_funcs": ["my.f"], "max_steps": 0,
                                "data_seed": 7})
    model, trainer = config["model"]["init_args"], config["trainer"]
    assert model["learning_rate"] == 1e-5 and model["reward_funcs"] == ["my.f"]
    assert trainer["precision"] == "bf16-mixed" and trainer["max_epochs"] == 3 and "max_steps" not in trainer
    assert config["data"]["init_args"]["seed"] == 7 and config["seed_everything"] == 42


def test_a_single_value_of_a_list_field_is_a_list_and_text_fields_stay_text(capfd):
    """One value of TRL's list fields is a one-item list (ModelConfig makes lora_target_modules' one item the item
    itself: all-linear), names and splits stay text."""
    code, out, err = run_main(["from-trl", "grpo", "--lora_target_modules", "q_proj", "--use_peft",
                               "--dataset_name", "x", "--dataset_config", "2020", "--reward_funcs", "my.f"], capfd)
    assert code == 0, err
    config = yaml.safe_load(out)
    assert config["model"]["init_args"]["peft_config"]["target_modules"] == "q_proj"
    assert config["model"]["init_args"]["reward_funcs"] == ["my.f"]
    assert config["data"]["init_args"]["config_name"] == "2020"


def test_an_output_that_cannot_be_written_is_one_error_line(tmp_path, capfd):
    code, _, err = run_main(["from-trl", "sft", "--model_name_or_path", "m", "-o", str(tmp_path / "no" / "x.yaml")],
                            capfd)
    assert_one_line_error(code, err, "x.yaml", "No such file")


def test_a_trl_file_given_to_fit_says_to_translate_it_first(capfd):
    trl = Path(__file__).resolve().parents[2] / "configs" / "trl" / "distillation_smollm2.yaml"
    code, _, err = run_main(["fit", "-c", str(trl)], capfd)
    assert_one_line_error(code, err, "'model_name_or_path' is a TRL field", "lit-align from-trl COMMAND --config FILE")


def test_an_output_onto_the_trl_config_itself_is_refused_and_the_file_kept(tmp_path, capfd):
    trl = tmp_path / "trl.yaml"
    trl.write_text("model_name_or_path: m\nlearning_rate: 1.0e-5\n")
    code, _, err = run_main(["from-trl", "sft", "--config", str(trl), "-o", str(tmp_path / "." / "trl.yaml")], capfd)
    assert_one_line_error(code, err, "is the TRL config itself")
    assert trl.read_text() == "model_name_or_path: m\nlearning_rate: 1.0e-5\n"


def test_settings_that_change_nothing_trained_are_dropped_with_a_note(tmp_path, capfd):
    """Hub, logging and speed-only settings: one note line per reason on stderr and as comments in the config."""
    trl = write(tmp_path / "trl.yaml", {"model_name_or_path": "m", "use_liger_kernel": True, "torch_compile": True,
                                        "logging_first_step": True, "overwrite_output_dir": True,
                                        "hub_strategy": "every_save"})
    out = tmp_path / "lit.yaml"
    code, _, err = run_main(["from-trl", "dpo", "--config", trl, "-o", str(out)], capfd)
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 2 and "note: dropped torch_compile, use_liger_kernel (a speed setting" in notes[1]
    assert notes[0].startswith("note: dropped logging_first_step, overwrite_output_dir (logging")
    assert "# dropped torch_compile, use_liger_kernel (a speed setting" in out.read_text()
    assert "hub_strategy" not in out.read_text().split("model:")[1]  # not pushed: nothing to say


def test_report_to_is_the_installed_logger_else_tensorboard_with_a_note(monkeypatch):
    from lit_align.from_trl import sections

    monkeypatch.setattr(sections, "installed", lambda package: package != "wandb")
    notes = []
    config = translate("dpo", {"report_to": ["wandb"], "output_dir": "o", "run_name": "r"}, notes=notes)
    assert config["trainer"]["logger"] == {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                           "init_args": {"save_dir": "o", "name": "r"}}
    assert notes == ["report_to wandb: not installed here, so TensorBoard instead (trainer.logger takes any "
                     "Lightning logger)"]
    monkeypatch.setattr(sections, "installed", lambda package: True)
    config = translate("dpo", {"report_to": "wandb", "run_name": "r"})
    assert config["trainer"]["logger"] == {"class_path": "lightning.pytorch.loggers.WandbLogger",
                                           "init_args": {"name": "r"}}
    assert translate("dpo", {"report_to": ["trackio"]})["trainer"]["logger"]["class_path"].endswith("TensorBoardLogger")


def test_push_to_hub_is_the_exports_upload():
    config = translate("sft", {"push_to_hub": True, "output_dir": "data/Qwen-SFT", "hub_private_repo": True})
    assert config["export"] == {"path": "data/Qwen-SFT/hf_model", "push_to_hub": True, "hub_model_id": "Qwen-SFT",
                                "hub_private_repo": True}
    config = translate("sft", {"push_to_hub": True, "hub_model_id": "me/x", "output_dir": "o"})
    assert config["export"]["hub_model_id"] == "me/x"
    assert "export" not in translate("sft", {"push_to_hub": False, "hub_model_id": "me/x"})


def test_trls_dataset_mixture_and_a_recipe_repositorys_are_a_data_mixture():
    trl = translate("sft", {"datasets": [{"path": "a/b", "name": "c", "split": "train", "columns": ["messages"]},
                                         {"path": "d/e"}], "eval_strategy": "steps", "test_split_size": 0.1})
    data = trl["data"]["init_args"]
    assert data["mixture"] == [{"path": "a/b", "split": "train", "config_name": "c", "columns": ["messages"]},
                               {"path": "d/e", "split": "train"}]
    assert data["path"] is None and data["val_fraction"] == 0.1
    recipe = translate("sft", {"dataset_mixture": {"datasets": [{"id": "open-r1/Mixture-of-Thoughts", "config": "all",
                                                                  "split": "train", "weight": 1.0}], "seed": 0}})
    assert recipe["data"]["init_args"]["mixture"] == [{"path": "open-r1/Mixture-of-Thoughts", "split": "train",
                                                       "config_name": "all"}]
    weighted = translate("sft", {"dataset_mixture": {"datasets": [{"id": "a", "weight": 0.25}, {"id": "b"}]},
                                 "eval_strategy": "epoch", "test_split_size": 1000})["data"]["init_args"]
    assert weighted["mixture"] == [{"path": "a", "split": "train", "fraction": 0.25}, {"path": "b", "split": "train"}]
    assert weighted["val_fraction"] == 1000  # a count of rows, as datasets' test_size
    with pytest.raises(LitAlignError, match=r"'datasets\[1\].fraction' is 0.3: TRL's normalized shares"):
        translate("sft", {"datasets": [{"path": "a", "fraction": 0.7}, {"path": "b", "fraction": 0.3}]})


def test_trls_reward_names_are_its_functions():
    model = translate("grpo", {"reward_funcs": ["accuracy_reward", "think_format_reward",
                                                "get_soft_overlong_punishment", "my.pkg.fn"]})["model"]["init_args"]
    assert model["reward_funcs"] == [
        "trl.rewards.accuracy_reward", "trl.rewards.think_format_reward",
        {"class_path": "trl.rewards.get_soft_overlong_punishment",
         "init_args": {"max_completion_len": 1280, "soft_punish_cache": 256}}, "my.pkg.fn"]
    from lit_align.rewards import load_reward

    punish = load_reward(model["reward_funcs"][2])  # TRL's own function, built as TRL's script builds it
    assert punish(completion_ids=[[1] * 1024, [1] * 1280]) == [0.0, -1.0]


def test_older_names_and_a_null_dtype_read_as_trl_reads_them():
    config = translate("sft", {"torch_dtype": "bfloat16", "max_seq_length": 1024, "evaluation_strategy": "no"})
    assert config["model"]["init_args"]["dtype"] == "bfloat16"
    assert config["data"]["init_args"]["max_length"] == 1024
    assert "dtype" not in translate("sft", {"torch_dtype": None})["model"]["init_args"]  # transformers' default


def test_accelerates_num_processes_is_the_trainers_devices():
    assert translate("grpo", {"num_processes": 7, "reward_funcs": "my.f"})["trainer"]["devices"] == 7


def test_sft_keeps_dropout_as_trls_sft_trainer_does():
    assert translate("sft", {})["model"]["init_args"]["disable_dropout"] is False
    assert "disable_dropout" not in translate("dpo", {})["model"]["init_args"]  # TRL's default true: lit_align's


def test_another_commands_file_names_its_command(tmp_path, capfd):
    trl = write(tmp_path / "dpo.yaml", {"model_name_or_path": "m", "beta": 0.01, "max_prompt_length": 512,
                                        "precompute_ref_log_probs": True})
    code, _, err = run_main(["from-trl", "sft", "--config", trl], capfd)
    assert_one_line_error(code, err, "'precompute_ref_log_probs' is a field of `trl dpo`", "not of `trl sft`",
                          "lit-align from-trl dpo")


def test_a_nested_trl_file_given_to_fit_says_to_translate_it(tmp_path, capfd):
    trl = write(tmp_path / "trl.yaml", {"dataset_mixture": {"datasets": [{"id": "x"}]}, "model_name_or_path": "m"})
    code, _, err = run_main(["fit", "-c", trl], capfd)
    assert_one_line_error(code, err, "'dataset_mixture' is a TRL field", "lit-align from-trl COMMAND")
    # the key jsonargparse stops at is not TRL's (peft_config.r), another key of the file is
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("peft_config: {r: 8}\nlora_target_modules: [q_proj]\n")
    code, _, err = run_main(["fit", "-c", str(mixed)], capfd)
    assert_one_line_error(code, err, "'lora_target_modules' is a TRL field", "translate it first")


def test_ratios_of_the_runs_steps_checkpoint_and_evaluate_each_epoch_with_a_note():
    notes = []
    config = translate("sft", {"save_strategy": "steps", "save_steps": 0.2, "eval_strategy": "steps",
                               "eval_steps": 0.1}, notes=notes)
    assert config["trainer"]["check_val_every_n_epoch"] == 1 and "val_check_interval" not in config["trainer"]
    assert config["trainer"]["callbacks"][0]["init_args"] == {"every_n_epochs": 1, "save_top_k": -1}
    assert [n.split(" (")[0] for n in notes] == ["eval_steps 0.1", "save_steps 0.2"]
