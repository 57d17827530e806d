"""The ``lit-align`` CLI: every shipped config parses, configs/dpo.yaml trains and exports, mistakes are one line.

Most runs are in-process (``lit_align.cli.main([...])``: no 5 s interpreter start); two run the real console
script in subprocesses to check what a user's terminal shows.
"""

from __future__ import annotations

import json
import math
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from helpers import metric_at, read_metrics
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import assert_one_line_error, run_main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
DPO = str(REPO / "configs" / "dpo.yaml")


def test_there_are_configs():
    assert "dpo.yaml" in [c.name for c in CONFIGS]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_config_parses(config, capfd):
    """--print_config parses and validates the whole config (class paths, argument names and types) and exits
    before anything is instantiated, so configs that need the hub are safe here."""
    code, out, err = run_main(["fit", "-c", str(config), "--print_config"], capfd)
    assert code == 0, err
    printed = yaml.safe_load(out)
    source = yaml.safe_load(config.read_text())
    assert {"model", "data", "trainer"} <= set(source)
    assert_contains(printed, source)  # every value the file sets survives (defaults fill in the rest)


def test_shipped_configs_leave_the_engine_to_auto():
    """``auto`` falls back to ``hf`` where ``native`` cannot decode a model (sliding-window layers: Gemma 3), so a
    shipped config swapped to another model family still samples; none pins an engine."""
    engines = {c.name: yaml.safe_load(c.read_text())["model"].get("init_args", {}).get("engine", "auto")
               for c in CONFIGS}
    assert {name for name, engine in engines.items() if engine != "auto"} == set()
    assert "grpo_smollm2.yaml" in engines


def assert_contains(printed, source, where="config"):
    if isinstance(source, dict):
        assert isinstance(printed, dict), where
        for key, value in source.items():
            assert key in printed, f"{where}.{key} missing"
            assert_contains(printed[key], value, f"{where}.{key}")
    elif isinstance(source, list):
        assert isinstance(printed, list) and len(printed) == len(source), where
        for i, (a, b) in enumerate(zip(printed, source)):
            assert_contains(a, b, f"{where}[{i}]")
    else:
        assert printed == source, f"{where}: {printed!r} != {source!r}"


def test_dpo_yaml_trains_and_exports(tmp_path, capfd, tiny_path):
    code, out, err = run_main([
        "fit", "-c", DPO, "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--data.init_args.val_batch_size", "100", "--trainer.logger.init_args.save_dir", str(tmp_path),
    ], capfd)
    assert code == 0, err
    run = tmp_path / "dpo" / "version_0"
    metrics = read_metrics(run)
    assert metric_at(metrics, "train/loss", 0) == pytest.approx(math.log(2), abs=1e-6)
    assert metric_at(metrics, "train/loss", 2) < math.log(2)
    assert 0.0 <= metric_at(metrics, "val/rewards/accuracies", 2) <= 1.0
    assert list((run / "checkpoints").glob("*.ckpt"))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 3 and saved["model"]["init_args"]["beta"] == 0.1

    hf = run / "hf_model"
    exported = AutoModelForCausalLM.from_pretrained(hf)
    start = AutoModelForCausalLM.from_pretrained(tiny_path)
    assert AutoTokenizer.from_pretrained(hf)("sort 31:")["input_ids"] == [35, 31, 34, 36, 101, 10, 8, 84]
    new, old = exported.state_dict(), start.state_dict()
    assert new.keys() == old.keys()
    assert all(not torch.equal(new[k], old[k]) for k in old), "some exported weights equal the starting ones"
    assert not [p for p in run.iterdir() if p.name.startswith(".hf_model")]  # no staging leftovers

    card = (hf / "README.md").read_text()  # the model card
    assert card.startswith("---\nlibrary_name: transformers\ntags:\n- lit_align\n- dpo\n---")
    assert "DPO of `builtin:tiny` with lit_align" in card and "| `beta` | `0.1` |" in card
    assert "`builtin:sort`" in card  # the data
    accuracy = metric_at(metrics, "val/rewards/accuracies", 2)
    assert f"| `val/rewards/accuracies` | {accuracy:.4g} |" in card
    assert "lit-align fit -c lit_align_config.yaml" in card and "--trainer.max_steps 3" in card  # how to reproduce
    assert yaml.safe_load((hf / "lit_align_config.yaml").read_text()) == saved  # the run's resolved config


# Each recipe's TRL-named metrics, as the shipped config logs them (KTO's ``*/rejected`` need undesirable rows: the
# built-in task's, shuffled in)
RECIPE_METRICS = {
    "kto": ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
            "logits/chosen", "logits/rejected", "entropy", "num_tokens"),
    "cpo": ("loss", "nll_loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "num_tokens"),
    "orpo": ("loss", "nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/chosen", "rewards/rejected",
             "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "num_tokens"),
}


@pytest.mark.slow  # ~10 s each; the modules' own tests train them in-process in the default suite
@pytest.mark.parametrize("recipe", RECIPE_METRICS)
def test_kto_cpo_orpo_yamls_train_and_export(recipe, tmp_path, capfd, tiny_path):
    code, _, err = run_main([
        "fit", "-c", str(REPO / "configs" / f"{recipe}.yaml"), "--trainer.max_steps", "4",
        "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
    ], capfd)
    assert code == 0, err
    run = tmp_path / recipe / "version_0"
    metrics = read_metrics(run)
    logged = {name for row in metrics for name in row}
    assert {f"train/{name}" for name in RECIPE_METRICS[recipe]} <= logged
    assert "val/loss" in logged
    if recipe == "kto":  # the reference is the policy at step 0: every row's loss is 1 - sigmoid(0)
        assert metric_at(metrics, "train/loss", 0) == 0.5
        assert metric_at(metrics, "train/rewards/margins", 3) > 0
    else:
        assert metric_at(metrics, "train/loss", 3) < metric_at(metrics, "train/loss", 0)
    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model").state_dict()
    start = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    assert all(not torch.equal(exported[k], start[k]) for k in start), "some exported weights equal the starting ones"


def test_export_path_override(tmp_path, capfd):
    target = tmp_path / "out" / "model"
    code, _, err = run_main([
        "fit", "-c", DPO, "--trainer.max_steps", "1", "--data.init_args.val_split", "null",
        "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", "--trainer.enable_checkpointing",
        "false", "--trainer.default_root_dir", str(tmp_path), "--export.path", str(target),
    ], capfd)
    assert code == 0, err
    assert (target / "config.json").exists() and (target / "tokenizer.json").exists()


# -- mistakes: exit status 2, one `error:` line naming the culprit, no traceback -------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_path) -> Path:
    """A Lightning checkpoint of one DPO step (configs/dpo.yaml)."""
    root = tmp_path_factory.mktemp("checkpoint")
    argv, sys.argv = sys.argv, ["lit-align"]
    try:
        from lit_align.cli import run

        run(["fit", "-c", DPO, "--trainer.max_steps", "1", "--data.init_args.val_split", "null",
             "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", "--export.enabled", "false",
             "--trainer.default_root_dir", str(root)])
    finally:
        sys.argv = argv
    (path,) = (root / "checkpoints").glob("*.ckpt")
    return path


def resume_args(tmp_path, ckpt) -> list[str]:
    return ["fit", "-c", DPO, "--trainer.max_steps", "2", "--data.init_args.val_split", "null",
            "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", "--export.enabled", "false",
            "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", str(ckpt)]


def test_a_plain_state_dict_as_ckpt_path_is_one_error_line(tmp_path, capfd, checkpoint):
    weights = tmp_path / "weights.pt"
    torch.save(torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"], weights)
    code, _, err = run_main(resume_args(tmp_path, weights), capfd)
    assert_one_line_error(code, err, f"--ckpt_path {weights}: not a Lightning checkpoint")


def tensor_data_offset(path: Path) -> tuple[str, int, int]:
    """The largest member of a ``torch.save`` zip (a tensor's bytes): its name, where its data starts, its size."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
    return info.filename, info.header_offset + 30 + name_length + extra_length, info.file_size


def test_a_bit_flipped_checkpoint_is_refused_naming_the_file(tmp_path, capfd, checkpoint):
    """One flipped bit in a tensor's bytes: torch.load would read it as it is; the zip's CRC-32 catches it."""
    member, start, size = tensor_data_offset(checkpoint)
    data = bytearray(checkpoint.read_bytes())
    data[start + size // 2] ^= 0x10
    flipped = tmp_path / "flipped.ckpt"
    flipped.write_bytes(bytes(data))
    torch.load(flipped, map_location="cpu", weights_only=False)  # loads without a word
    code, _, err = run_main(resume_args(tmp_path, flipped), capfd)
    assert_one_line_error(code, err, f"--ckpt_path {flipped}: the file is corrupt: {member} inside it fails its "
                                     "CRC-32 check")


def test_a_checkpoint_saved_without_crcs_is_not_taken_for_corrupt(tmp_path):
    """torch.save can skip the CRC-32s (``torch.utils.serialization.config.save.compute_crc32``): nothing to check."""
    from torch.utils.serialization import config

    from lit_align.cli import check_checkpoint_file

    path = tmp_path / "no_crc.ckpt"
    config.save.compute_crc32 = False
    try:
        torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": {"w": torch.ones(4)}}, path)
    finally:
        config.save.compute_crc32 = True
    check_checkpoint_file(str(path))



def test_bad_data_file(tmp_path, capfd):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "d", "chosen": "e", "rejected": "e"},
    ]) + "\n")
    code, _, err = run_main([
        "fit", "-c", DPO, "--data.init_args.path", str(path), "--data.init_args.val_split", "null",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
    ], capfd)
    line = assert_one_line_error(code, err, str(path), "row 1", "'chosen' and 'rejected' are identical")
    assert line == f"error: {path} row 1: 'chosen' and 'rejected' are identical (a pair must differ)"


def test_nonexistent_model_path(tmp_path, capfd):
    model = str(tmp_path / "no" / "such" / "model")
    code, _, err = run_main(["fit", "-c", DPO, "--model.init_args.model", model,
                             "--trainer.logger.init_args.save_dir", str(tmp_path)], capfd)
    assert_one_line_error(code, err, repr(model), "no such directory")
    empty = tmp_path / "notes"  # a directory, but no model in it
    empty.mkdir()
    (empty / "notes.txt").write_text("todo")
    code, _, err = run_main(["fit", "-c", DPO, "--model.init_args.model", str(empty),
                             "--trainer.logger.init_args.save_dir", str(tmp_path)], capfd)
    assert_one_line_error(code, err, repr(str(empty)), "the directory has none of ['config.json'")


def test_bad_setting_value(tmp_path, capfd):
    code, _, err = run_main(["fit", "-c", DPO, "--data.init_args.batch_size", "0",
                             "--trainer.logger.init_args.save_dir", str(tmp_path)], capfd)
    assert_one_line_error(code, err, "data.batch_size must be >= 1, got 0")
    code, _, err = run_main(["fit", "-c", DPO, "--model.init_args.loss_type", "kto",
                             "--trainer.logger.init_args.save_dir", str(tmp_path)], capfd)
    assert_one_line_error(code, err, "model.loss_type 'kto'")


def test_an_option_the_recipe_does_not_have_is_one_error_line(capfd):
    code, _, err = run_main(["fit", "-c", DPO, "--model.init_args.betta", "0.2"], capfd)
    assert assert_one_line_error(code, err) == ("error: model.betta: DPOModule has no such option (lit-align fit "
                                                "--model.help lit_align.modules.DPOModule lists them)")


@pytest.mark.parametrize("args,needles", [
    (["--trainer.max_stepz", "3"], ["unrecognized arguments: --trainer.max_stepz 3", "lit-align fit --help"]),
    (["--trainer.max_step", "3"], ["unrecognized arguments: --trainer.max_step 3"]),  # no prefix taken for max_steps
    (["--trainer.max_steps", "three"], ["trainer.max_steps: expected int, got 'three'"]),
    (["--model.init_args.beta", "abc"], ["model.init_args.beta: expected float, got 'abc'"]),
    (["--model.class_path", "lit_align.modules.NoSuchModule"], ["model: ", "has no attribute 'NoSuchModule'"]),
    (["-c", "configs/no_such.yaml"], ["config: File does not exist", "no_such.yaml"]),
])
def test_config_mistakes_are_one_error_line_not_the_usage(args, needles, capfd):
    code, out, err = run_main(["fit", "-c", DPO, *args], capfd)
    assert_one_line_error(code, err, *needles)
    assert "usage:" not in err


def test_a_config_file_yaml_cannot_read_is_named(tmp_path, capfd):
    bad = tmp_path / "mine.yaml"
    bad.write_text("data:\n  init_args:\n   batch_size: 4\n  bad\n")
    code, _, err = run_main(["fit", "-c", DPO, "-c", str(bad)], capfd)
    assert_one_line_error(code, err, "Problems parsing config", repr(str(bad)), "line 4")
    typed = tmp_path / "types.yaml"
    typed.write_text("data:\n  init_args:\n    batch_size: sixteen\n")
    code, _, err = run_main(["fit", "-c", DPO, "-c", str(typed)], capfd)
    assert_one_line_error(code, err, "data.init_args.batch_size: expected int, got 'sixteen'")


@pytest.mark.parametrize("args,message", [
    (["--model.init_args.learning_rate", "-1"], "error: model.learning_rate must be >= 0, got -1.0"),
    (["--data.init_args.val_batch_size", "-1"], "error: data.val_batch_size must be >= 1 or null, got -1"),
    (["--data.init_args.num_workers", "-1"], "error: data.num_workers must be >= 0, got -1"),
])
def test_setting_mistakes_are_one_error_line(args, message, capfd):
    code, _, err = run_main(["fit", "-c", DPO, "--trainer.max_steps", "1", *args], capfd)
    assert assert_one_line_error(code, err) == message


def test_a_validation_interval_longer_than_a_small_datasets_epoch_is_one_line_with_its_fixes(tmp_path, capfd):
    """A 6-row file (one batch an epoch) under the shipped dpo.yaml (val_check_interval 50): Lightning's refusal, one
    line saying the two ways out; the second (counting batches across epochs) then trains and validates at 50."""
    rows = tmp_path / "six.jsonl"
    rows.write_text("".join('{"prompt": "sort %d:", "chosen": " 1", "rejected": " 2"}\n' % i for i in range(6)))
    common = ["fit", "-c", DPO, "--data.init_args.path", str(rows), "--data.init_args.val_path", str(rows),
              "--data.init_args.val_split", "train", "--trainer.logger", "false", "--export.enabled", "false",
              "--trainer.default_root_dir", str(tmp_path)]
    code, _, err = run_main(common, capfd)
    assert_one_line_error(code, err, "`val_check_interval` (50) must be less than or equal to the number of the "
                                     "training batches (1)")
    assert err.rstrip().endswith("or trainer.check_val_every_n_epoch: null to count batches across epochs)")
    seen = tmp_path / "validated_at.txt"
    code, _, err = run_main([*common, "--trainer.max_steps", "50", "--trainer.check_val_every_n_epoch", "null",
                             "--trainer.callbacks+=helpers.RecordValidation", "--trainer.callbacks.path", str(seen)],
                            capfd)
    assert code == 0, err
    assert seen.read_text().split() == ["50"]


def test_lightning_and_file_system_refusals_are_one_error_line(tmp_path, capfd):
    """A logger whose save_dir is a file, a disk that fills while saving: what Lightning and the file system refuse
    is a user's mistake too."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, _, err = run_main(["fit", "-c", DPO, "--trainer.max_steps", "1", "--data.init_args.val_split", "null",
                             "--trainer.logger.init_args.save_dir", str(blocker)], capfd)
    assert_one_line_error(code, err, str(blocker))
    code, _, err = run_main(["fit", "-c", DPO, "--trainer.max_steps", "2", "--data.init_args.val_split", "null",
                             "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path),
                             "--trainer.callbacks+=helpers.DiskFullOnSave"], capfd)
    assert assert_one_line_error(code, err) == ("error: No space left on device: the disk is full (files written "
                                                "before stay whole)")


def test_a_logger_whose_package_is_missing_is_one_error_line(tmp_path, capfd, monkeypatch):
    """A config naming WandbLogger (TRL recipes' report_to: wandb) on a machine without wandb: one line saying which
    package, not Lightning's three tracebacks."""
    from lightning.pytorch.loggers import wandb as lightning_wandb

    monkeypatch.setattr(lightning_wandb, "_WANDB_AVAILABLE", lightning_wandb.RequirementCache("wandb>=999"))
    code, _, err = run_main(["fit", "-c", DPO, "--trainer.max_steps", "1", "--trainer.default_root_dir",
                             str(tmp_path), "--trainer.logger", "lightning.pytorch.loggers.WandbLogger"], capfd)
    assert_one_line_error(code, err, "a package the config needs is not installed", "wandb>=999")


def test_typo_in_a_config_file(tmp_path, capfd):
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  init_args:\n    betaa: 0.3\n")
    code, _, err = run_main(["fit", "-c", DPO, "-c", str(typo)], capfd)
    assert assert_one_line_error(code, err).startswith("error: model.betaa: DPOModule has no such option")


def test_console_script_errors_in_subprocesses(tmp_path):
    """What the user's terminal shows: the real entry points, run concurrently (interpreter start is ~5 s)."""
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "p", "chosen": "x", "rejected": "y"}\n{"prompt": "p", "chosen": 7, "rejected": "y"}\n')
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  init_args:\n    betaa: 0.3\n")
    script = Path(sys.executable).parent / "lit-align"
    runs = {
        "data": [str(script), "fit", "-c", DPO, "--data.init_args.path", str(bad), "--data.init_args.val_split",
                 "null", "--trainer.logger.init_args.save_dir", str(tmp_path)],
        "typo": [sys.executable, "-m", "lit_align", "fit", "-c", DPO, "-c", str(typo)],
        # a class's __init__ rejecting a value: jsonargparse wraps the LitAlignError in a ValueError
        "setting": [str(script), "fit", "-c", DPO, "--data.init_args.batch_size", "0"],
        # and a run that works exits 0 (the console-script wrapper does sys.exit(main()))
        "ok": [str(script), "fit", "-c", DPO, "--trainer.max_steps", "1", "--data.init_args.val_split", "null",
               "--trainer.logger", "false", "--trainer.enable_checkpointing", "false", "--export.enabled", "false"],
    }
    procs = {k: subprocess.Popen(v, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for k, v in runs.items()}
    results = {k: (p.communicate(timeout=300), p.returncode) for k, p in procs.items()}

    (out, err), rc = results["data"]
    assert rc == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last == (
        f"error: {bad} row 1: field 'chosen' is a number, but row 0's is a string (a column must have one type)"
    )

    (out, err), rc = results["typo"]
    assert rc == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: model.betaa: DPOModule has no such option")

    (out, err), rc = results["ok"]
    assert rc == 0, err
    assert "AlignCLI object" not in out + err
    # Lightning's notices about lit_align's own design (the frozen reference in eval mode) do not reach the user
    assert "in eval mode at the start of training" not in err and "Warning" not in err, err

    (out, err), rc = results["setting"]
    assert rc == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "error: data.batch_size must be >= 1, got 0"


def test_a_rounds_settings_are_the_modules_and_reach_the_data(tiny_path):
    """``num_generations`` / ``steps_per_generation`` / ``num_iterations`` have one owner (``model:``); the module
    hands its ``RoundShape`` to the data (``connect``), so the two always agree, and batches do not carry them."""
    from lit_align.cli import AlignCLI
    from lit_align.data import AlignDataModule
    from lit_align.modules import AlignModule

    argv, sys.argv = sys.argv, ["lit-align"]
    try:
        cli = AlignCLI(AlignModule, AlignDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                       auto_configure_optimizers=False,
                       args=["-c", str(REPO / "configs" / "grpo.yaml"), "--model.init_args.model", "builtin:tiny",
                             "--model.init_args.num_generations", "4", "--model.init_args.steps_per_generation", "2",
                             "--model.init_args.num_iterations", "3"])
    finally:
        sys.argv = argv
    settings = ("num_generations", "steps_per_generation", "num_iterations")
    assert [getattr(cli.model.round_shape, name) for name in settings] == [4, 2, 3]
    answer = cli.datamodule.connect(round_shape=cli.model.round_shape)
    assert [getattr(cli.datamodule.round_shape, name) for name in settings] == [4, 2, 3] == [
        getattr(answer, name) for name in settings]


def test_a_round_setting_under_data_names_its_new_place(tmp_path, capfd):
    """Configs written before the module owned the round put its settings under ``data:``: one line says where they
    went; an option of another recipe names that recipe."""
    old = tmp_path / "old.yaml"
    old.write_text("data:\n  init_args:\n    num_generations: 4\n")
    base = ["fit", "-c", str(REPO / "configs" / "grpo.yaml"), "--model.init_args.model", "builtin:tiny",
            "--trainer.default_root_dir", str(tmp_path)]
    code, _, err = run_main([*base, "-c", str(old)], capfd)
    assert assert_one_line_error(code, err) == (
        "error: data.num_generations has moved: the module owns a round's shape, set model.num_generations instead "
        "(under model.init_args)")
    code, _, err = run_main([*base, "--data.init_args.steps_per_generation", "2"], capfd)
    assert "set model.steps_per_generation instead" in assert_one_line_error(code, err)
    code, _, err = run_main([*base, "--model.init_args.normalize_advantages", "true"], capfd)
    assert assert_one_line_error(code, err) == (
        "error: model.normalize_advantages is an option of RLOOModule, not of GRPOModule")


# -- the chat template's one owner: model.chat_template ---------------------------------------------------------------
REWRITING_TEMPLATE = "{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['content'] }}{% endfor %}"


def parse(*args: str, config: str = "sft.yaml"):
    """The CLI's objects for ``configs/<config>`` plus ``args``, built but not run."""
    from lit_align.cli import AlignCLI
    from lit_align.data import AlignDataModule
    from lit_align.modules import AlignModule

    argv, sys.argv = sys.argv, ["lit-align"]
    try:
        return AlignCLI(AlignModule, AlignDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                        auto_configure_optimizers=False, args=["-c", str(REPO / "configs" / config), *args])
    finally:
        sys.argv = argv


def test_the_chat_template_is_set_on_the_model_and_a_different_data_chat_template_is_refused(tmp_path, capfd,
                                                                                                tiny_path):
    cli = parse("--model.init_args.chat_template", REWRITING_TEMPLATE)
    assert cli.datamodule.chat_template == cli.model.hparams.chat_template == REWRITING_TEMPLATE
    cli = parse("--model.init_args.chat_template", REWRITING_TEMPLATE,  # the same on both: a saved config rerun
                "--data.init_args.chat_template", REWRITING_TEMPLATE)
    assert cli.datamodule.chat_template == REWRITING_TEMPLATE

    code, _, err = run_main(["fit", "-c", str(REPO / "configs" / "sft.yaml"), "--data.init_args.chat_template",
                             REWRITING_TEMPLATE, "--trainer.max_steps", "1", "--export.enabled", "false",
                             "--trainer.default_root_dir", str(tmp_path)], capfd)
    assert assert_one_line_error(code, err) == (
        "error: data.chat_template is set by model.chat_template (model: owns it; data: follows it): set "
        "model.chat_template instead")


def test_assistant_only_loss_is_set_on_the_model_and_the_data_follows_it(tmp_path, capfd):
    cli = parse("--model.init_args.assistant_only_loss", "true")
    assert cli.datamodule.assistant_only_loss is cli.model.hparams.assistant_only_loss is True
    code, _, err = run_main(["fit", "-c", str(REPO / "configs" / "sft.yaml"), "--data.init_args.assistant_only_loss",
                             "true", "--trainer.max_steps", "1", "--export.enabled", "false",
                             "--trainer.default_root_dir", str(tmp_path)], capfd)
    assert assert_one_line_error(code, err) == (
        "error: data.assistant_only_loss is set by model.assistant_only_loss (model: owns it; data: follows it): "
        "set model.assistant_only_loss instead")


def test_sft_tools_yaml_trains_the_calls_and_answers_not_the_tool_results():
    """configs/sft_tools.yaml: the data follows the model's assistant_only_loss, so a demonstration's loss is over
    its call and its answer; the tool's result (builtin:modsum's digit, 8 times) is not the model's to learn."""
    from lit_align.modules.sft import loss_mask

    cli = parse(config="sft_tools.yaml")
    assert cli.datamodule.assistant_only_loss is cli.model.hparams.assistant_only_loss is True
    cli.datamodule.connect(**cli.model.data_settings())  # what the module's setup hands over
    cli.datamodule.setup("fit")
    rows = [r for r in cli.datamodule.train_data if 1 in r["completion_mask"]][:40]
    batch = cli.datamodule.collate(rows)
    tok = cli.datamodule.tokenizer
    trained = [tok.decode(ids[mask.bool()]) for ids, mask in zip(batch["input_ids"], loss_mask(batch, True, True))]
    calls = [t for t in trained if t.startswith("<tool_call>")]
    assert calls and len(calls) < len(trained)  # some rows call the tool, the others answer directly
    for text in trained:
        call = '<tool_call>{"name": "compute", "arguments": {}}</tool_call></s>'
        assert re.fullmatch(f"({re.escape(call)})?[0-6]</s>", text), text


def test_a_template_that_rewrites_earlier_turns_names_model_chat_template(tmp_path, capfd):
    code, _, err = run_main(["fit", "-c", str(REPO / "configs" / "sft.yaml"), "--data.init_args.path",
                             str(REPO / "tests" / "fixtures" / "formats" / "ultrachat_200k.jsonl"),
                             "--data.init_args.val_split", "null", "--model.init_args.assistant_only_loss", "true",
                             "--model.init_args.chat_template", REWRITING_TEMPLATE,
                             "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false"], capfd)
    line = assert_one_line_error(code, err, "the chat template renders messages[:2] differently")
    assert line.endswith("(use a template that leaves earlier turns as they were: model.chat_template)")


def test_generation_batch_size_sets_the_rounds_steps_over_the_trainers_devices(tmp_path, capfd):
    """TRL's ``generation_batch_size``: ``batch_size * devices * steps_per_generation`` (grpo.yaml: 64 per device);
    the data resolves it with the world size when the module connects it, and setting both is TRL's error."""
    grpo = ["--model.init_args.model", "builtin:tiny", "--model.init_args.steps_per_generation", "null"]
    cli = parse(*grpo, "--model.init_args.generation_batch_size", "512", config="grpo.yaml")
    shape = cli.model.round_shape
    assert shape.resolve(64, 1).steps_per_generation == 8  # 512 / (64 x 1 device)
    assert shape.resolve(64, 2).steps_per_generation == 4  # 512 / (64 x 2 devices)
    code, _, err = run_main(["fit", "-c", str(REPO / "configs" / "grpo.yaml"), "--model.init_args.model",
                             "builtin:tiny", "--model.init_args.generation_batch_size", "96",
                             "--model.init_args.steps_per_generation", "null", "--trainer.default_root_dir",
                             str(tmp_path), "--trainer.logger", "false"], capfd)
    assert assert_one_line_error(code, err) == ("error: model.generation_batch_size 96 must be a positive multiple of "
                                                "the global batch size (data.batch_size 64 x 1 devices = 64)")
    code, _, err = run_main(["fit", "-c", str(REPO / "configs" / "grpo.yaml"), "--model.init_args.model",
                             "builtin:tiny", "--model.init_args.generation_batch_size", "128",
                             "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false"], capfd)
    assert assert_one_line_error(code, err).startswith(
        "error: model.generation_batch_size and model.steps_per_generation cannot both be set")


def test_lit_aligns_warnings_print_as_one_line_and_others_as_python_prints_them():
    from lit_align.cli import one_line_warning

    assert one_line_warning(UserWarning("lit_align: model.max_staleness is 2 ..."), UserWarning, "producer.py",
                            342, "rank_zero_warn(...)") == "warning: lit_align: model.max_staleness is 2 ...\n"
    other = one_line_warning(UserWarning("theirs"), UserWarning, "x.py", 7, "warn()")
    assert other.startswith("x.py:7: UserWarning: theirs")
