"""What a resume may change, through the real CLI: the user's settings are never silently replaced by the
checkpoint's; a setting a resume cannot honour, a checkpoint of another recipe, a checkpoint file that is not whole,
another batch size, another reference: each is one ``error:`` line and exit status 2 (README: Reliability)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers import assert_one_line_error, read_metrics, run_main, write_sort_rows

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def args(recipe: str, root: Path, rows: str, max_steps: int, *extra: str) -> list[str]:
    """A short CPU run of ``configs/<recipe>.yaml`` on ``rows``, checkpointing every 2 steps under ``root``."""
    data = {"sft": [], "dpo": ["--data.init_args.max_length", "32"],
            "grpo": ["--model.init_args.model", "builtin:tiny", "--model.init_args.max_completion_length", "4",
                     "--data.init_args.num_generations", "2", "--data.init_args.steps_per_generation", "1"]}[recipe]
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
    # what a resume may change: trainer settings (max_steps, logging) and how numbers are computed (chunking)
    with pytest.warns(UserWarning, match=r"learning-rate schedule \(linear\) now spans 5 optimizer steps instead of "
                                         r"the checkpoint's 4"):  # said, not silent
        code, _, err = run_main([*args("dpo", tmp_path, pairs, 5), "--ckpt_path", str(dpo_run),
                                 "--model.init_args.logps_chunk_size", "8"], capfd)
    assert code == 0, err
    saved = yaml.safe_load((tmp_path / "dpo" / "run" / "config.yaml").read_text())
    assert saved["model"]["init_args"]["logps_chunk_size"] == 8  # the user's value, not the checkpoint's
    assert [int(r["step"]) for r in read_metrics(tmp_path / "dpo" / "run") if "train/loss" in r] \
        == [2, 3, 4]


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


def test_a_reference_whose_files_changed_is_refused(tmp_path, pairs, tiny_path, capfd):
    """The frozen reference is re-read from its files on resume; rewritten meanwhile (as ``configs/sft.yaml``
    rewrites ``runs/sft/hf_model`` on every run), the resumed run would train against another reference."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "sft_model"
    shutil.copytree(tiny_path, model_dir)
    assert _run(args("dpo", tmp_path / "run", pairs, 2, "--model.init_args.model", str(model_dir))) == 0
    ckpt = tmp_path / "run" / "dpo" / "run" / "checkpoints" / "step=2.ckpt"
    rewritten = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        next(rewritten.parameters()).add_(0.01)
    rewritten.save_pretrained(model_dir)
    code, _, err = run_main([*args("dpo", tmp_path / "again", pairs, 4, "--model.init_args.model", str(model_dir)),
                             "--ckpt_path", str(ckpt)], capfd)
    assert_one_line_error(code, err, f"the reference model's files ({model_dir}) changed since the checkpoint")
