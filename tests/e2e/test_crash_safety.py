"""Crash safety of ``lit-align fit``, with real processes and real signals.

- ``kill -9`` in the middle of a checkpoint write leaves the previous ``last.ckpt`` whole, and the run resumes from it.
- SIGTERM: the current step finishes, ``last.ckpt`` is saved, the process exits with status 143 and no traceback, and
  resuming from that checkpoint gives the uninterrupted run's losses.
- A disk that fills up during a checkpoint write is one ``error:`` line; the previous checkpoint stays whole and no
  temp file is left.
- ``lit-align`` installs ``AtomicCheckpointIO`` (its own tests: tests/test_checkpoint_io.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import FillsUp, assert_one_line_error, read_metrics, run_main, write_sort_rows

from lit_align.checkpoint_io import AtomicCheckpointIO
from lit_align.cli import main

TESTS = Path(__file__).resolve().parents[1]  # tests/
DPO = str(TESTS.parent / "configs" / "dpo.yaml")


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> str:
    return write_sort_rows(tmp_path_factory.mktemp("crash_pairs") / "pairs.jsonl", 40, "pairs")


def fit_args(pairs: str, root: Path, max_steps: int, *extra: str, every: int = 1) -> list[str]:
    """configs/dpo.yaml on ``pairs``: 4 pairs a step, a loss logged every step, ``last.ckpt`` every ``every`` steps."""
    return [
        "fit", "-c", DPO, "--data.init_args.path", pairs, "--data.init_args.val_split", "null",
        "--data.init_args.batch_size", "4", "--trainer.max_steps", str(max_steps), "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(root),
        "--export.enabled", "false", "--trainer.val_check_interval", "1.0",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.dirpath", str(root / "ckpt"), "--trainer.callbacks.every_n_train_steps", str(every),
        "--trainer.callbacks.save_last", "true", *extra,
    ]


def run_cli(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "lit_align", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def run_in_process(args: list[str]) -> None:
    argv, sys.argv = sys.argv, ["lit-align"]
    try:
        main(args)
    finally:
        sys.argv = argv


def losses(root: Path) -> dict[int, float]:
    """``{step: train/loss}`` over every version directory under ``root/dpo`` (a resume logs into a new one)."""
    out = {}
    for path in sorted((root / "dpo").glob("version_*")):
        out.update({int(r["step"]): r["train/loss"] for r in read_metrics(path) if "train/loss" in r})
    return out


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_leaves_the_previous_one_resumable(tmp_path, pairs_file, tiny_path):
    marker = tmp_path / "writing"
    proc = run_cli(fit_args(pairs_file, tmp_path, 6, "--trainer.callbacks+=helpers.HangInCheckpointWrite",
                            "--trainer.callbacks.step", "2", "--trainer.callbacks.marker", str(marker)))
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.communicate()[1]
    proc.send_signal(signal.SIGKILL)  # half of step 3's checkpoint is on disk
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL

    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 2  # the previous one, whole
    leftovers = [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".")  # the half-written temp file, hidden beside it

    with pytest.warns(UserWarning, match="resumed with another length"):  # 4 steps now, the checkpoint's run 6
        run_in_process(fit_args(pairs_file, tmp_path, 4, "--ckpt_path", str(last)))
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_sigterm_saves_exits_143_and_resumes_exactly(tmp_path, pairs_file, tiny_path, accumulate):
    """With ``accumulate_grad_batches: 2`` the signal lands in the first micro-batch of step 3: the checkpoint waits
    for the window's end, so the resumed run still equals the uninterrupted one."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    window = ["--trainer.accumulate_grad_batches", str(accumulate)]
    proc = run_cli(fit_args(pairs_file, cut, 6, *window, "--trainer.callbacks+=helpers.SigtermAt",
                            "--trainer.callbacks.step", "3", every=100))  # no regular checkpoint before the signal
    run_in_process(fit_args(pairs_file, full, 6, *window))  # the uninterrupted run, meanwhile
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    last = cut / "ckpt" / "last.ckpt"
    assert f"saved {last}" in err + out
    assert [p.name for p in last.parent.iterdir()] == ["last.ckpt"]
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 4  # step 3 finished first

    run_in_process(fit_args(pairs_file, cut, 6, *window, "--ckpt_path", str(last)))
    reference = losses(full)
    assert sorted(reference) == list(range(6))
    assert losses(cut) == reference


def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_keeps_the_previous_checkpoint(
        tmp_path, pairs_file, tiny_path, capfd, monkeypatch):
    """From step 2 on the disk is full after 4 kB of a checkpoint: torch's writer then raises a RuntimeError whose
    context is the ENOSPC."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        return real_save(obj, FillsUp(f, 4096) if obj["global_step"] >= 2 else f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    code, _, err = run_main(fit_args(pairs_file, tmp_path, 3), capfd)
    line = assert_one_line_error(code, err, f"checkpoint {tmp_path / 'ckpt'}", "No space left on device",
                                 "the previous checkpoint there, if any, is whole")
    assert "step=2" in line
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]  # no .tmp
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 1


def test_cli_installs_atomic_checkpoint_io_and_the_sigterm_callback(tmp_path, pairs_file, tiny_path):
    from lit_align.callbacks import SigtermCheckpoint
    from lit_align.cli import run

    argv, sys.argv = sys.argv, ["lit-align"]
    try:
        cli = run(fit_args(pairs_file, tmp_path, 1))
    finally:
        sys.argv = argv
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert any(isinstance(c, SigtermCheckpoint) for c in cli.trainer.callbacks)
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("signum,status", [("TERM", 143), ("INT", 130)])
def test_sigterm_or_ctrl_c_under_async_rollouts_stops_the_producer_and_resumes(tmp_path, tiny_path, signum, status):
    """``model.async_rollouts``: SIGTERM (or a Ctrl-C) at step 3 ends the run with status 143 (130) and ``last.ckpt``
    after step 3, as without it; the producer process is gone with it (no orphan), and the checkpoint resumes (its
    rounds in flight asked again)."""
    prompts = write_sort_rows(tmp_path / "prompts.jsonl", 48, "prompts")
    pid_file = tmp_path / "producer.pid"
    args = ["fit", "-c", str(TESTS.parent / "configs" / "grpo.yaml"), "--model.init_args.model", "builtin:tiny",
            "--model.init_args.async_rollouts", "true", "--model.init_args.max_completion_length", "4",
            "--model.init_args.num_generations", "2", "--model.init_args.steps_per_generation", "1",
            "--data.init_args.path", prompts, "--data.init_args.val_split", "null", "--data.init_args.batch_size", "4",
            "--trainer.max_steps", "6", "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--export.enabled", "false",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.dirpath", str(tmp_path / "ckpt"), "--trainer.callbacks.every_n_train_steps", "100",
            "--trainer.callbacks.save_last", "true"]
    proc = run_cli(args + ["--trainer.callbacks+=helpers.RecordProducerPid", "--trainer.callbacks.path", str(pid_file),
                           "--trainer.callbacks+=helpers.SigtermAt", "--trainer.callbacks.step", "3",
                           "--trainer.callbacks.signum", signum])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == status, err
    assert "Traceback" not in err and f"{'SIGTERM' if signum == 'TERM' else 'Ctrl-C'} at step 4: saved" in err + out
    with pytest.raises(ProcessLookupError):  # the producer went with the trainer
        os.kill(int(pid_file.read_text()), 0)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 4
    run_in_process(args + ["--ckpt_path", str(last)])
    resumed = sorted((tmp_path / "grpo").glob("version_*"))[-1]
    assert sorted(int(r["step"]) for r in read_metrics(resumed) if "train/loss" in r) == [4, 5]
