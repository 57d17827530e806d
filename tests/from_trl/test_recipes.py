"""Public TRL recipe files (tests/fixtures/trl_recipes/, each with its source and commit in index.yaml), as they
are: each translates, or is refused in one line for what has no equivalent; each translation trains 2 steps on CPU
with the model, the data and the rewards swapped for offline ones (the recipe's own training settings kept)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import assert_one_line_error, run_main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "trl_recipes"
INDEX = yaml.safe_load((FIXTURES / "index.yaml").read_text())
# what has no lit_align equivalent, as the refusal names it
REFUSED = {
    "openr1_qwen2.5_1.5b_grpo_demo_code.yaml": "'reward_funcs' names open-r1's 'code'",
    "openr1_qwen2.5_coder_7b_grpo_codeforces.yaml": "'reward_funcs' names open-r1's 'cf_code'",
}
TRANSLATED = [e for e in INDEX if e["file"] not in REFUSED]


def test_the_fixtures_are_public_recipes_with_their_sources():
    assert len(INDEX) >= 15 and len(TRANSLATED) >= 15
    for entry in INDEX:
        assert (FIXTURES / entry["file"]).exists() and len(entry["source"]["commit"]) == 40, entry


def translated(entry: dict, tmp_path: Path, capfd) -> dict:
    out = tmp_path / "lit.yaml"
    code, _, err = run_main(["from-trl", entry["command"], "--config", str(FIXTURES / entry["file"]), "-o",
                             str(out)], capfd)
    assert code == 0, err
    assert "Traceback" not in err
    return yaml.safe_load(out.read_text())


def offline(config: dict, tmp_path: Path) -> dict:
    """The translation with the hub model, data, rewards and GPU-only loading swapped for offline ones, its
    training settings (precision, clipping, accumulation, optimizer, schedule, LoRA, loss) kept; 2 steps."""
    model, data, trainer = config["model"]["init_args"], config["data"]["init_args"], config["trainer"]
    model["model"] = "builtin:tiny"
    if any(part in model.get("optim", "") for part in ("paged", "8bit", "bnb")):  # bitsandbytes: a GPU's
        model["optim"] = "adamw_torch_fused"
    for key in ("model_init_kwargs", "attn_implementation", "chat_template", "dtype", "eos_token"):
        model.pop(key, None)  # a hub revision, bitsandbytes (a GPU), flash attention, a template for another vocab
    if "reward_funcs" in model or "num_generations" in model or config["model"]["class_path"].endswith("GRPOModule"):
        model.update(reward_funcs=["helpers.digit_fraction"], reward_weights=None, engine="auto",
                     max_completion_length=6, num_generations=2, steps_per_generation=1, vllm_mode="colocate")
    path = "builtin:sort"
    if config["data"]["class_path"].endswith("CompletionDataModule"):  # SFT recipes train on conversations
        path = tmp_path / "chats.jsonl"
        path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"sort {i}{i + 1}:"},
                                                         {"role": "assistant", "content": f"{i + 1}{i}"}]}) + "\n"
                                for i in range(1, 9)))
    data.update(path=str(path), mixture=None, train_split="train", val_split=None, val_path=None,
                val_fraction=0.0, batch_size=4, rename_columns=None)
    data.pop("val_batch_size", None)
    trainer.update(max_steps=2, accumulate_grad_batches=1, logger=False, default_root_dir=str(tmp_path / "run"),
                   devices=1, limit_val_batches=0, enable_progress_bar=False, val_check_interval=None,
                   check_val_every_n_epoch=1)
    config["export"] = {"path": str(tmp_path / "run" / "hf_model")}
    return config


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_each_recipe_translates_or_is_refused_in_one_line(entry, tmp_path, capfd):
    if entry["file"] in REFUSED:
        code, _, err = run_main(["from-trl", entry["command"], "--config", str(FIXTURES / entry["file"])], capfd)
        assert_one_line_error(code, err, entry["file"], REFUSED[entry["file"]])
        return
    config = translated(entry, tmp_path, capfd)
    assert config["trainer"]["precision"] in ("bf16-mixed", "16-mixed", "32-true") or "precision" not in config[
        "trainer"]
    fields = yaml.safe_load((FIXTURES / entry["file"]).read_text())
    assert config["model"]["init_args"]["learning_rate"] == float(fields["learning_rate"])


@pytest.mark.parametrize("entry", TRANSLATED, ids=[e["file"] for e in TRANSLATED])
def test_each_translated_recipe_trains_two_steps_offline(entry, tmp_path, capfd):
    config = offline(translated(entry, tmp_path, capfd), tmp_path)
    path = tmp_path / "offline.yaml"
    path.write_text(yaml.safe_dump(config))
    from lit_align.cli import run

    cli = run(["fit", "-c", str(path)])
    assert cli.trainer.global_step == 2
    exported = {p.name for p in (tmp_path / "run" / "hf_model").iterdir()}
    assert {"config.json", "adapter_config.json"} & exported, exported  # the model, or its LoRA adapter


COMMAND_LINES = yaml.safe_load((FIXTURES / "command_lines.yaml").read_text())
REFUSED_LINES = {  # what TRL's documented command lines set that has no lit_align equivalent, or is not there
    "clis_sft_config_override": "examples/cli_configs/example_config.yaml: No such file",  # a path in TRL's repo
    "reward_modeling_cloud_full": "'feedback_method' is not a field of TRL",  # that example script's own arguments
}


@pytest.mark.parametrize("entry", COMMAND_LINES, ids=[e["name"] for e in COMMAND_LINES])
def test_trls_documented_command_lines_translate(entry, tmp_path, capfd):
    out = tmp_path / "lit.yaml"
    code, _, err = run_main(["from-trl", entry["command"], *entry["argv"], "-o", str(out)], capfd)
    if entry["name"] in REFUSED_LINES:
        assert_one_line_error(code, err, REFUSED_LINES[entry["name"]])
        return
    assert code == 0, err
    assert yaml.safe_load(out.read_text())["model"]["init_args"]["model"]  # the model it names
