"""What a resume may change, through the real CLI: the user's settings are never silently replaced by the
checkpoint's; a setting a resume cannot honour, a checkpoint of another recipe, a checkpoint file that is not whole,
another batch size, another reference: each is one ``error:`` line and exit status 2 (docs/reliability.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import assert_one_line_error, read_metrics, run_main, write_sort_rows

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def args(recipe: str, root: Path, rows: str, max_steps: int, *extra: str) -> list[str]:
    """A short CPU run of ``configs/<recipe>.yaml`` on ``rows``, checkpointing every 2 steps under ``root``."""
    online = ["--model.init_args.model", "builtin:tiny", "--model.init_args.max_completion_length", "4",
              "--model.init_args.num_generations", "2", "--model.init_args.steps_per_generation", "1"]
    data = {"sft": [], "dpo": ["--data.init_args.max_length", "32"], "kto": ["--data.init_args.max_length", "32"],
            "grpo": online, "rloo": online,
            "distill": [*online, "--model.init_args.teacher_model", "builtin:tiny",
                        "--trainer.check_val_every_n_epoch", "1"]}[recipe]  # its config counts steps across epochs
    return ["fit", "-c", str(CONFIGS / f"{recipe}.yaml"), "--data.init_args.path", rows,
            "--data.init_args.val_split", "null", "--data.init_args.batch_size", "4", "--trainer.max_steps",
            str(max_steps), "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.version", "run",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.every_n_train_steps", "2", "--trainer.callbacks.save_top_k", "-1",
            "--trainer.callbacks.filename", "{step}", "--trainer.val_check_interval", "1.0",
            "--export.enabled", "false", *data, *extra]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> str:
    return write_sort_rows(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 40, "pairs")


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, pairs, tiny_path) -> Path:
    """A 4-step DPO run with checkpoints at steps 2 and 4; returns the step-2 checkpoint."""
    root = tmp_path_factory.mktemp("dpo")
    code = _run(args("dpo", root, pairs, 4))
    assert code == 0
    return root / "dpo" / "run" / "checkpoints" / "step=2.ckpt"


def _run(argv: list[str]) -> int:
    from lit_align.cli import main

    try:
        main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def test_a_resume_keeps_the_users_settings_and_refuses_a_model_setting_it_cannot_honour(tmp_path, pairs, dpo_run,
                                                                                      capfd):
    code, _, err = run_main([*args("dpo", tmp_path, pairs, 4), "--ckpt_path", str(dpo_run),
                             "--model.init_args.beta", "0.5"], capfd)
    assert_one_line_error(code, err, f"--ckpt_path {dpo_run}: model.beta is 0.5 in this run but 0.1 in the checkpoint",
                          "only these model settings may change: logps_chunk_size")
    # what a resume may change: trainer settings (max_steps, logging), how numbers are computed (chunking) and how
    # the rows are validated (val_batch_size)
    with pytest.warns(UserWarning, match=r"learning-rate schedule \(linear\) now spans 5 optimizer steps instead of "
                                         r"the checkpoint's 4"):  # said, not silent
        code, _, err = run_main([*args("dpo", tmp_path, pairs, 5), "--ckpt_path", str(dpo_run),
                                 "--model.init_args.logps_chunk_size", "8", "--data.init_args.val_batch_size", "2"],
                                capfd)
    assert code == 0, err
    saved = yaml.safe_load((tmp_path / "dpo" / "run" / "config.yaml").read_text())
    assert saved["model"]["init_args"]["logps_chunk_size"] == 8  # the user's value, not the checkpoint's
    assert [int(r["step"]) for r in read_metrics(tmp_path / "dpo" / "run") if "train/loss" in r] \
        == [2, 3, 4]


@pytest.mark.parametrize("recipe,setting,value,saved", [
    ("kto", "loss_type", "apo_zero_unpaired", "'kto'"), ("kto", "desirable_weight", "2.0", "1.0"),
    ("rloo", "beta", "0.5", "0.05"), ("rloo", "normalize_advantages", "true", "False"),
    ("distill", "lmbda", "1.0", "0.5"), ("distill", "beta", "0.5", "1.0"),
])
def test_a_changed_loss_setting_of_kto_or_rloo_is_refused_as_dpos_is(tmp_path, pairs, recipe, setting, value, saved,
                                                                      capfd):
    """The recipes added last follow DPO's rule: their loss settings are model settings, so a resume that changes one
    is one error line (it would silently train another objective on the checkpoint's state)."""
    rows = pairs if recipe == "kto" else write_sort_rows(tmp_path / "prompts.jsonl", 16, "prompts")
    checkpoint = tmp_path / recipe / "run" / "checkpoints" / "step=2.ckpt"
    assert _run(args(recipe, tmp_path, rows, 2)) == 0
    code, _, err = run_main([*args(recipe, tmp_path, rows, 3), "--ckpt_path", str(checkpoint),
                             f"--model.init_args.{setting}", value], capfd)
    shown = {"true": "True"}.get(value, repr(value) if setting == "loss_type" else value)
    assert_one_line_error(code, err, f"--ckpt_path {checkpoint}: model.{setting} is {shown} in this run but {saved} in "
                                     "the checkpoint")


def test_a_checkpoint_of_another_recipe_is_refused(tmp_path, pairs, dpo_run, capfd):
    prompts = write_sort_rows(tmp_path / "prompts.jsonl", 16, "prompts")
    code, _, err = run_main([*args("grpo", tmp_path, prompts, 3), "--ckpt_path", str(dpo_run)], capfd)
    assert_one_line_error(code, err, f"--ckpt_path {dpo_run} is a DPOModule checkpoint; this run is GRPOModule")


@pytest.mark.parametrize("kind", ["missing", "directory", "empty", "truncated"])
def test_a_bad_checkpoint_path_is_one_error_line(tmp_path, pairs, dpo_run, kind, capfd):
    path = {"missing": tmp_path / "nope.ckpt", "directory": dpo_run.parent, "empty": tmp_path / "empty.ckpt",
            "truncated": tmp_path / "cut.ckpt"}[kind]
    if kind == "empty":
        path.touch()
    if kind == "truncated":
        path.write_bytes(dpo_run.read_bytes()[:1000])
    expected = {"missing": "no such file", "directory": "not a file", "empty": "the file is empty",
                "truncated": "not a readable checkpoint"}[kind]
    code, _, err = run_main([*args("dpo", tmp_path, pairs, 4), "--ckpt_path", str(path)], capfd)
    assert_one_line_error(code, err, f"--ckpt_path {path}: {expected}")


def test_another_batch_size_is_refused_instead_of_retraining_or_skipping_rows(tmp_path, pairs, dpo_run, capfd):
    """The loader's position is counted in batches: DPO resumed with batch_size 8 (was 4) would retrain pairs, GRPO
    with a larger one would skip prompts."""
    argv = args("dpo", tmp_path, pairs, 4, "--ckpt_path", str(dpo_run))
    code, _, err = run_main([*argv, "--data.init_args.batch_size", "8"], capfd)
    assert_one_line_error(code, err, "data.batch_size is 8 in this run but 4 in the checkpoint")

    prompts = write_sort_rows(tmp_path / "prompts.jsonl", 24, "prompts")
    assert _run(args("grpo", tmp_path / "grpo", prompts, 2)) == 0
    grpo_ckpt = tmp_path / "grpo" / "grpo" / "run" / "checkpoints" / "step=2.ckpt"
    code, _, err = run_main([*args("grpo", tmp_path / "again", prompts, 4), "--ckpt_path", str(grpo_ckpt),
                             "--data.init_args.batch_size", "8"], capfd)
    assert_one_line_error(code, err, "data.batch_size is 8 in this run but 4 in the checkpoint")


@pytest.mark.parametrize("strategy", ["frozen", "precomputed"])
def test_a_reference_whose_files_changed_is_refused(tmp_path, pairs, tiny_path, strategy, capfd):
    """The reference is re-read from its files on resume (frozen: loaded again; precomputed: its log-probs computed
    again, as the cache key follows the files); rewritten meanwhile (as ``configs/sft.yaml`` rewrites
    ``runs/sft/hf_model`` on every run), the resumed run would train against another reference."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "sft_model"
    shutil.copytree(tiny_path, model_dir)
    precompute = ["--model.init_args.precompute_ref_log_probs", "true"] if strategy == "precomputed" else []
    assert _run(args("dpo", tmp_path / "run", pairs, 2, "--model.init_args.model", str(model_dir), *precompute)) == 0
    ckpt = tmp_path / "run" / "dpo" / "run" / "checkpoints" / "step=2.ckpt"
    rewritten = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        next(rewritten.parameters()).add_(0.01)
    rewritten.save_pretrained(model_dir)
    code, _, err = run_main([*args("dpo", tmp_path / "again", pairs, 4, "--model.init_args.model", str(model_dir),
                                   *precompute), "--ckpt_path", str(ckpt)], capfd)
    assert_one_line_error(code, err, f"the reference model's files ({model_dir}) changed since the checkpoint")


def test_a_checkpoint_without_hyper_parameters_is_refused(tmp_path, pairs, dpo_run, capfd):
    """Without the settings it was written with, no resume rule could be checked: not taken on trust."""
    import torch

    checkpoint = torch.load(dpo_run, map_location="cpu", weights_only=False)
    del checkpoint["hyper_parameters"]
    bare = tmp_path / "bare.ckpt"
    torch.save(checkpoint, bare)
    code, _, err = run_main([*args("dpo", tmp_path, pairs, 4), "--ckpt_path", str(bare)], capfd)
    assert_one_line_error(code, err, f"--ckpt_path {bare}: not a lit_align checkpoint: it has no hyper_parameters "
                                     "(the settings it was written with)")


@pytest.mark.parametrize("setting,value,shown", [
    ("seed", "1", (1, 0)), ("shuffle", "false", (False, True)), ("max_length", "16", (16, 32)), ("path", None, None)])
def test_a_data_setting_that_shapes_the_batches_is_refused(tmp_path, pairs, dpo_run, setting, value, shown, capfd):
    """The batches a resume trains on must be the checkpoint run's: another order (seed, shuffle), other rows (path)
    or other truncation (max_length) would give other losses from the same position, as another batch size would."""
    if setting == "path":
        value = write_sort_rows(tmp_path / "other.jsonl", 40, "pairs")
        shown = (value, pairs)
    code, _, err = run_main([*args("dpo", tmp_path, pairs, 4), "--ckpt_path", str(dpo_run),
                             f"--data.init_args.{setting}", value], capfd)
    assert_one_line_error(code, err, f"--ckpt_path {dpo_run}: data.{setting} is {shown[0]!r} in this run but "
                                     f"{shown[1]!r} in the checkpoint", "only these data settings may change: "
                                     "num_workers")


def mixture(weight: float, rows: list[str]) -> str:
    return json.dumps([{"path": rows[0], "rename_columns": {"answer": "completion"}},
                       {"path": rows[1], "rename_columns": {"answer": "completion"}, "weight": weight}])


@pytest.fixture(scope="module")
def sft_mixture_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A 2-step SFT run on a packed, interleaved mixture of two sources; returns its step-2 checkpoint and sources."""
    root = tmp_path_factory.mktemp("sft")
    rows = [write_sort_rows(root / f"{name}.jsonl", 40, "prompts") for name in ("a", "b")]
    code = _run(args("sft", root, rows[0], 2, "--data.init_args.mixture", mixture(1.0, rows),
                     "--data.init_args.mixture_strategy", "interleave", "--data.init_args.packing", "true",
                     "--data.init_args.max_length", "32"))
    assert code == 0
    return root / "sft" / "run" / "checkpoints" / "step=2.ckpt", rows


@pytest.mark.parametrize("change,expected", [
    ({"packing": "false"}, "data.packing is False in this run but True in the checkpoint"),
    ({"packing_strategy": "wrapped"}, "data.packing_strategy is 'wrapped' in this run but 'bfd' in the checkpoint"),
    ({"weight": 3.0}, "data.mixture[1].weight is 3.0 in this run but 1.0 in the checkpoint"),
])
def test_packing_and_mixture_weights_are_refused_on_resume(tmp_path, sft_mixture_run, change, expected, capfd):
    ckpt, rows = sft_mixture_run
    settings = {"mixture_strategy": "interleave", "packing": "true", "max_length": "32", **change}
    weight = settings.pop("weight", 1.0)
    extra = [a for name, value in settings.items() for a in (f"--data.init_args.{name}", value)]
    code, _, err = run_main([*args("sft", tmp_path, rows[0], 4, "--data.init_args.mixture", mixture(weight, rows),
                                   *extra), "--ckpt_path", str(ckpt)], capfd)
    assert_one_line_error(code, err, expected)
