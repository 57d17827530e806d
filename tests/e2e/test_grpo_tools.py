"""GRPO with tools end to end: a run resumed mid-round trains on the round's saved tool-calling rollouts (completion
ids, tool mask, environment rewards) exactly as the uninterrupted run did; under DDP every rank runs its own
rollouts' tools and the tool metrics are over both ranks. First turns are scripted (``helpers.ForceToolCalls``): the
built-in model does not call tools untrained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import ForceToolCalls, cli_env, metric_at, read_metrics
from helpers import fit as run_fit
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_align.data import PromptDataModule
from lit_align.modules import GRPOModule

REPO = Path(__file__).resolve().parents[2]
TOOL_DATA = {"batch_size": 4, "chat_template": "builtin:tools"}
TOOL_MODEL = {"environment_factory": "helpers.CounterEnvironment", "chat_template": "builtin:tools",
              "max_tool_calling_iterations": 1, "max_completion_length": 120, "num_generations": 2,
              "steps_per_generation": 3}


class Losses(L.Callback):
    def __init__(self):
        self.by_step: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.by_step[trainer.global_step - 1] = outputs["loss"].item()


def fit(prompts: str, root: Path, max_steps: int, ckpt_every: int | None = None, ckpt_path: str | None = None):
    """Train ``max_steps`` (one round of 3 steps at most); returns the losses, the weights and the round."""
    L.seed_everything(0, verbose=False)
    module = GRPOModule(model="builtin:tiny", learning_rate=1e-3, **TOOL_MODEL)
    dm = PromptDataModule(path=prompts, val_split=None, **TOOL_DATA)
    losses = Losses()
    callbacks = [losses, ForceToolCalls(completions=12)]
    if ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", filename="{step}", every_n_train_steps=ckpt_every,
                                         save_top_k=-1))
    run_fit(module, dm, root, max_steps, callbacks, ckpt_path, enable_checkpointing=bool(ckpt_every))
    return losses.by_step, {k: v.detach().clone() for k, v in module.policy.state_dict().items()}, module.round



@pytest.fixture(scope="module")
def counter_prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("counter_prompts") / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"count to {n % 3 + 1}"}], "answer": str(n % 3 + 1)}
            for n in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_grpo_with_tools_resume_mid_round_is_exact(tmp_path, counter_prompts_file, tiny_path):
    """A round of tool-calling rollouts (first turns scripted, the rest sampled) serves 3 steps; resumed from the
    step-1 checkpoint, the round's completions, tool mask and environment rewards come back from it (the environments
    themselves do not), and steps 1-2 train exactly as in the uninterrupted run."""
    full, full_weights, full_round = fit(counter_prompts_file, tmp_path / "full", 3, ckpt_every=1)
    assert (full_round.tool_mask == 0).any(1).all()  # every rollout has a tool turn
    resumed, resumed_weights, resumed_round = fit(counter_prompts_file, tmp_path / "resumed", 3,
                                                  ckpt_path=str(tmp_path / "full" / "ckpt" / "step=1.ckpt"))
    assert sorted(resumed) == [1, 2]
    assert torch.equal(resumed_round.tool_mask, full_round.tool_mask)
    assert torch.equal(resumed_round.completion_ids, full_round.completion_ids)
    assert resumed_round.rewards == full_round.rewards
    assert resumed == {s: full[s] for s in resumed}
    assert [k for k in full_weights if not torch.equal(full_weights[k], resumed_weights[k])] == []


@pytest.mark.slow
def test_grpo_with_tools_under_ddp(tmp_path, counter_prompts_file, lit_align_cache, tiny_path):
    """2 processes through the CLI, each running its own rollouts' tools: rank 0's completions all call the tool,
    rank 1's none, so the logged call frequency (over both ranks) is 0.5 and each rank's episodes end as it ran them."""
    force = {"class_path": "helpers.ForceToolCalls", "init_args": {"completions": 12, "calling_ranks": [0]}}
    args = [sys.executable, "-m", "lit_align", "fit", "-c", str(REPO / "configs" / "grpo.yaml"),
            "--model.init_args.model", "builtin:tiny", "--model.init_args.reward_funcs", "[]",
            *[a for k, v in TOOL_MODEL.items() for a in (f"--model.init_args.{k}", str(v))],
            "--model.init_args.learning_rate", "1e-3", "--model.init_args.warmup_steps", "0",
            "--data.init_args.path", counter_prompts_file, "--data.init_args.val_split", "null",
            *[a for k, v in TOOL_DATA.items() for a in (f"--data.init_args.{k}", str(v))],
            "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.devices", "2",
            "--trainer.max_steps", "2", "--trainer.val_check_interval", "null", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
            "--trainer.callbacks", json.dumps([force]), "--export.enabled", "false"]
    proc = subprocess.run(args, cwd=tmp_path, env=cli_env(LIT_ALIGN_CACHE=str(lit_align_cache)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(tmp_path / "grpo" / "version_0")
    assert metric_at(rows, "train/tools/call_frequency", 0) == 0.5
    assert metric_at(rows, "train/tools/failure_frequency", 0) == 0.0
    # CounterEnvironment's reward: rank 0's counters end at 1 (right for a third of the rows), rank 1's at 0 (never)
    assert 0.0 < metric_at(rows, "train/rewards/CounterEnvironment/mean", 0) < 0.5
