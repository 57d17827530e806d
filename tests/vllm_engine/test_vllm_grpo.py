"""GRPO with ``engine: vllm`` under a real Trainer: it learns (held-out greedy reward rises), pushes the policy into
the engine once per optimizer step that generates, corrects for vLLM's log-probs (TRL's ``sampling/*`` metrics), and
a run resumed mid-round is exact; under DDP each rank has its own engine, synced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import cli_env, fit, read_metrics, write_sort_rows
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_align.data import PromptDataModule
from lit_align.modules import GRPOModule

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]

ROUND = {"num_generations": 4, "steps_per_generation": 2}


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    return write_sort_rows(tmp_path_factory.mktemp("vllm_prompts") / "prompts.jsonl", 48, "prompts")


class Record(L.Callback):
    """Per step: the loss and the engine's push count after the step; each validation's held-out reward."""

    def __init__(self):
        self.losses: dict[int, float] = {}
        self.pushes: dict[int, int] = {}
        self.val_rewards: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step - 1] = outputs["loss"].item()
        engine = pl_module.rollouts.engine.engine  # None until the module's first generation
        self.pushes[trainer.global_step - 1] = 0 if engine is None else engine.pushes

    def on_validation_epoch_end(self, trainer, pl_module):
        self.val_rewards.append(float(trainer.callback_metrics["val/reward"]))


def grpo(prompts: str, root, max_steps: int, module: dict | None = None, data: dict | None = None,
         ckpt_path: str | None = None, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    model = GRPOModule(model="builtin:tiny", engine="vllm", reward_funcs=["helpers.reward_digit_fraction"],
                       max_completion_length=8, **ROUND, **{"learning_rate": 1e-3, **(module or {})})
    dm = PromptDataModule(path=prompts, batch_size=16, **{"val_split": None, **(data or {})})
    record = Record()
    run = fit(model, dm, root, max_steps, [record, *trainer_kwargs.pop("callbacks", [])], ckpt_path, **trainer_kwargs)
    return run, model, record


def test_learns_and_pushes_once_per_generating_step(tmp_path, prompts_file):
    """Held-out greedy reward (digit fraction) after 24 steps well above the untrained model's; the engine is pushed
    at the rounds' steps (0, 2, 4, ...), and the validations at a round's step reuse that push."""
    run, module, record = grpo(prompts_file, tmp_path, 24, module={"learning_rate": 1e-2},
                               data={"val_fraction": 0.25, "val_batch_size": 12}, val_check_interval=12,
                               check_val_every_n_epoch=None, num_sanity_val_steps=1)
    before, *after = record.val_rewards  # the sanity check: the untrained policy
    print(f"\n[vllm grpo] held-out reward {before:.3f} -> {after}")
    assert after[-1] > before + 0.2
    assert record.pushes[1] - record.pushes[0] == 0 and record.pushes[2] - record.pushes[1] == 1
    assert record.pushes[23] - record.pushes[0] == 11  # rounds at steps 2, 4, ..., 22 (validations share their push)
    assert 0 < float(run.callback_metrics["train/sampling/importance_sampling_ratio/mean"]) <= 3.0
    assert float(run.callback_metrics["train/sampling/sampling_logp_difference/max"]) < 1e-3  # fp32, same weights


def test_resume_mid_round_is_exact(tmp_path, prompts_file):
    """A round serves 2 steps; the step-3 checkpoint is mid-round; later rounds regenerate the same completions."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    _, full, full_record = grpo(prompts_file, tmp_path / "full", 6, callbacks=[checkpoints], enable_checkpointing=True)
    _, resumed, resumed_record = grpo(prompts_file, tmp_path / "resumed", 6,
                                      ckpt_path=str(tmp_path / "ckpt" / "step=3.ckpt"))
    assert sorted(resumed_record.losses) == [3, 4, 5]
    assert resumed_record.losses == {s: full_record.losses[s] for s in (3, 4, 5)}
    full_state, resumed_state = full.policy.state_dict(), resumed.policy.state_dict()
    assert all(torch.equal(full_state[k], resumed_state[k]) for k in full_state)


def test_ddp_runs_one_synced_engine_per_rank(tmp_path, prompts_file, lit_align_cache):
    """2 processes through the CLI: each rank's engine (vLLM's external launcher beside the trainer's process group)
    samples with the policy's current weights at every round (vLLM's log-probs equal the training forward's after the
    updates, on every rank: the logged max is over ranks)."""
    args = [sys.executable, "-m", "lit_align", "fit", "-c", str(REPO / "configs" / "grpo.yaml"),
            "--model.init_args.model", "builtin:tiny", "--model.init_args.engine", "vllm",
            "--model.init_args.reward_funcs", '["helpers.reward_digit_fraction"]',
            "--model.init_args.max_completion_length", "8", "--model.init_args.learning_rate", "1e-2",
            "--model.init_args.warmup_steps", "0", "--data.init_args.path", prompts_file,
            "--data.init_args.val_split", "null", "--data.init_args.batch_size", "8",
            "--model.init_args.num_generations", "4", "--model.init_args.steps_per_generation", "1",
            "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.devices", "2",
            "--trainer.max_steps", "3", "--trainer.val_check_interval", "null", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
            "--export.enabled", "false"]
    env = cli_env(LIT_ALIGN_CACHE=str(lit_align_cache))
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(next((tmp_path / "grpo").glob("version_*")))
    gaps = [r["train/sampling/sampling_logp_difference/max"] for r in rows
            if "train/sampling/sampling_logp_difference/max" in r]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(gaps) == 3 and max(gaps) < 1e-3, gaps
    assert len(set(losses)) == 3, "the policy moved: every step's loss differs"
