"""A user's own single data file with the shipped configs, which name ``val_split: test`` (issue 56): ``lit-align fit -c
configs/<recipe>.yaml --data.init_args.path my_rows.parquet`` trains on every row without validation, as TRL does with
its defaults (no evaluation), and one line says so and names the options; ``validate`` reads the whole file. Through
the real CLI, on files written here (parquet and JSON Lines), with the model swapped for ``builtin:tiny``."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from helpers import assert_one_line_error, read_metrics, run_main

from lit_align.data.sources import load_rows

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ROWS = 24

NOTICE = ("lit_align: no validation: {path} is a single file, whose one split is 'train' (data.val_split is 'test'); "
          "for validation set data.val_fraction (a held-out fraction of the training rows, e.g. 0.1) or "
          "data.val_path (a separate file); for none, data.val_split: null")


def write_rows(path: Path, kind: str) -> Path:
    """``ROWS`` rows of the sort task of ``kind`` (``preference``, ``completion``, ``prompt``) as ``path``."""
    rows = load_rows("builtin:sort", "train", kind).select(range(ROWS))
    if path.suffix == ".parquet":
        rows.to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows.to_list()))
    return path


def logged(caplog) -> list[str]:
    """The lines the run logged (``rank_zero_info``: the console shows them), and clear them."""
    lines = [record.getMessage() for record in caplog.records]
    caplog.clear()
    return lines


def fit_args(recipe: str, path: Path, root: Path, *extra: str) -> list[str]:
    return ["fit", "-c", str(CONFIGS / f"{recipe}.yaml"), "--data.init_args.path", str(path),
            "--model.init_args.model", "builtin:tiny", "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(root),
            "--trainer.logger.init_args.version", "run", "--export.path", str(root / "export"), *extra]


# GRPO: a round of 2 optimizer steps, 4 prompts x 4 completions each
GRPO = ("--data.init_args.batch_size", "8", "--model.init_args.num_generations", "4",
        "--model.init_args.steps_per_generation", "2", "--model.init_args.max_completion_length", "4")


@pytest.mark.parametrize("recipe, kind, suffix, extra", [
    ("dpo", "preference", ".parquet", ()),
    ("dpo", "preference", ".jsonl", ()),
    ("sft", "completion", ".parquet", ("--data.init_args.batch_size", "8")),
    ("sft", "completion", ".jsonl", ("--data.init_args.batch_size", "8")),
    ("grpo", "prompt", ".parquet", GRPO),
    ("grpo", "prompt", ".jsonl", GRPO),
])
def test_a_single_file_trains_with_a_shipped_config_on_every_row_without_validation(tmp_path, capfd, caplog, recipe,
                                                                                      kind, suffix, extra):
    path = write_rows(tmp_path / f"mine{suffix}", kind)
    code, out, err = run_main(fit_args(recipe, path, tmp_path, *extra), capfd)
    assert code == 0, err
    lines = logged(caplog)
    assert [line for line in lines if "no validation" in line] == [NOTICE.format(path=path)]
    assert f"lit_align: {ROWS} training rows from {path}" in lines  # every row trains: none held out
    run = tmp_path / recipe / "run"
    metrics = read_metrics(run)
    names = {name for row in metrics for name in row}
    steps = sorted({int(row["step"]) for row in metrics if "train/loss" in row or "train/reward" in row})
    assert steps == [0, 1]
    assert not [name for name in names if name.startswith("val/")]  # no validation loop ran, none half-ran
    assert [p.name for p in (run / "checkpoints").glob("*.ckpt")] == ["epoch=0-step=2.ckpt"]
    assert (tmp_path / "export" / "config.json").is_file()


def test_validate_reads_every_row_of_a_single_file(tmp_path, capfd, caplog):
    """``lit-align validate`` on a single file: its one split is the validation rows, all of them."""
    path = write_rows(tmp_path / "mine.parquet", "preference")
    code, out, err = run_main(["validate", "-c", str(CONFIGS / "dpo.yaml"), "--data.init_args.path", str(path),
                               "--data.init_args.val_batch_size", "100", "--trainer.enable_progress_bar", "false",
                               "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path)], capfd)
    assert code == 0, err
    notice = [line for line in logged(caplog) if "single file" in line]
    assert notice == [NOTICE.format(path=path).replace("no validation", f"validating on every row of {path}")]
    assert "val/rewards/accuracies" in out


def test_val_split_null_trains_without_the_notice_and_a_fraction_holds_rows_out(tmp_path, capfd, caplog):
    path = write_rows(tmp_path / "mine.jsonl", "preference")
    code, out, err = run_main(fit_args("dpo", path, tmp_path, "--data.init_args.val_split", "null"), capfd)
    assert code == 0, err
    assert not [line for line in logged(caplog) if "no validation" in line]
    code, out, err = run_main(fit_args("dpo", path, tmp_path / "b", "--data.init_args.val_fraction", "0.25",
                                       "--trainer.val_check_interval", "2"), capfd)
    assert code == 0, err
    lines = logged(caplog)
    assert f"lit_align: {ROWS * 3 // 4} training rows from {path}" in lines
    assert not [line for line in lines if "no validation" in line]
    assert any("val/rewards/accuracies" in row for row in read_metrics(tmp_path / "b" / "dpo" / "run"))


def test_a_split_a_source_lacks_is_one_line_naming_the_option(tmp_path, capfd):
    """A directory dataset without a test split, and a single file asked for another training split: one line
    naming the setting and what to set."""
    folder = tmp_path / "pairs"
    folder.mkdir()
    write_rows(folder / "train.jsonl", "preference")
    code, _, err = run_main(fit_args("dpo", folder, tmp_path), capfd)
    assert assert_one_line_error(code, err) == (
        f"error: {folder}: Unknown split \"test\". Should be one of ['train']. (data.val_split is 'test'); for "
        "validation set data.val_fraction (a held-out fraction of the training rows, e.g. 0.1) or data.val_path (a "
        "separate file); for none, data.val_split: null")
    path = write_rows(tmp_path / "mine.jsonl", "preference")
    code, _, err = run_main(fit_args("dpo", path, tmp_path, "--data.init_args.train_split", "dev"), capfd)
    assert assert_one_line_error(code, err) == (
        f"error: {path}: a single file has one split, 'train', not 'dev' (data.train_split is 'dev'); set "
        "data.train_split to a split it has")


def test_a_single_val_path_file_is_read_whole(tmp_path):
    from lit_align.data import PreferenceDataModule

    train, val = write_rows(tmp_path / "train.jsonl", "preference"), write_rows(tmp_path / "val.parquet", "preference")
    data = PreferenceDataModule(path=str(train), val_path=str(val), tokenizer="builtin:tiny")
    assert data.validation("fit") == (str(val), "train")
    data.setup("fit")
    assert len(data.train_data) == len(data.val_data) == ROWS
    assert datasets.Dataset.from_parquet(str(val)).num_rows == ROWS
