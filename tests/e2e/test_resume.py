"""Exact resume and determinism: a run interrupted at step k and resumed with ``ckpt_path`` logs the same per-step
losses and ends with the same weights as the uninterrupted run (CPU, fp32, seeded), for DPO (mid-epoch, across an
epoch boundary), KTO, CPO and ORPO (mid-epoch), the reward model (mid-epoch, its random score head restored from
the checkpoint), GRPO and distillation (mid-round, with one teacher or two: the round's buffer comes from the
checkpoint; later rounds regenerate the same completions, from the same source). Two runs of one seeded config give
one loss trajectory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import fit as run_fit
from helpers import cli_env, read_metrics, write_sort_rows
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_align.data import PreferenceDataModule, PromptDataModule, RewardDataModule, UnpairedPreferenceDataModule
from lit_align.modules import (
    CPOModule, DistillationModule, DPOModule, GRPOModule, KTOModule, ORPOModule, RewardModule,
)

TESTS = Path(__file__).resolve().parents[1]  # tests/
REPO = TESTS.parent


class Losses(L.Callback):
    """``{global step: loss}`` of every training batch, and each batch's row sums (its data)."""

    def __init__(self):
        self.by_step: dict[int, float] = {}
        self.firsts: dict[int, list] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._step = trainer.global_step
        ids = batch.get("input_ids", batch.get("prompt_ids"))
        self.firsts[self._step] = ids.sum(1).tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.by_step[self._step] = outputs["loss"].item()


def fit(module_cls, module_kw, data_cls, data_kw, root: Path, max_steps: int, ckpt_every: int | None = None,
        ckpt_path: str | None = None):
    L.seed_everything(0, verbose=False)
    module = module_cls(model="builtin:tiny", learning_rate=1e-3, **module_kw)
    dm = data_cls(val_split=None, **data_kw)
    losses = Losses()
    callbacks = [losses]
    if ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", filename="{step}", every_n_train_steps=ckpt_every,
                                         save_top_k=-1))
    run_fit(module, dm, root, max_steps, callbacks, ckpt_path, enable_checkpointing=bool(ckpt_every))
    return losses, {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> str:
    """18 pairs: with batch_size 4, 5 batches per epoch (the last one short)."""
    return write_sort_rows(tmp_path_factory.mktemp("resume_pairs") / "pairs.jsonl", 18, "pairs")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    return write_sort_rows(tmp_path_factory.mktemp("resume_prompts") / "prompts.jsonl", 24, "prompts")


DPO_DATA = {"batch_size": 4, "max_length": 32}


def test_dpo_resume_mid_epoch_is_exact_and_runs_are_deterministic(tmp_path, pairs_file, tiny_path):
    data = {"path": pairs_file, **DPO_DATA}
    full, full_weights = fit(DPOModule, {}, PreferenceDataModule, data, tmp_path / "full", 8, ckpt_every=3)
    assert sorted(full.by_step) == list(range(8))  # epoch 0 is steps 0-4, epoch 1 steps 5-7

    # determinism: the same seeded config again gives the same trajectory and weights
    again, again_weights = fit(DPOModule, {}, PreferenceDataModule, data, tmp_path / "again", 8)
    assert again.by_step == full.by_step
    assert_same_weights(again_weights, full_weights)

    # resume at step 3 (mid-epoch 0): the remaining batches of epoch 0 in order, then epoch 1's own order
    ckpt = tmp_path / "full" / "ckpt" / "step=3.ckpt"
    resumed, resumed_weights = fit(DPOModule, {}, PreferenceDataModule, data, tmp_path / "resumed", 8,
                                   ckpt_path=str(ckpt))
    assert sorted(resumed.by_step) == [3, 4, 5, 6, 7]
    assert {s: full.firsts[s] for s in resumed.firsts} == resumed.firsts, "resume changed the data order"
    assert resumed.by_step == {s: full.by_step[s] for s in resumed.by_step}
    assert_same_weights(resumed_weights, full_weights)
    assert full.firsts[0] != full.firsts[5]  # epoch 1 is reshuffled (seeded by epoch), not a replay of epoch 0


def test_dpo_resume_from_an_epoch_end_checkpoint(tmp_path, pairs_file, tiny_path):
    data = {"path": pairs_file, **DPO_DATA}
    full, full_weights = fit(DPOModule, {}, PreferenceDataModule, data, tmp_path / "full", 7, ckpt_every=5)
    resumed, resumed_weights = fit(DPOModule, {}, PreferenceDataModule, data, tmp_path / "resumed", 7,
                                   ckpt_path=str(tmp_path / "full" / "ckpt" / "step=5.ckpt"))
    assert sorted(resumed.by_step) == [5, 6]
    assert resumed.by_step == {s: full.by_step[s] for s in resumed.by_step}
    assert_same_weights(resumed_weights, full_weights)


@pytest.mark.parametrize("module_cls,data_cls,batch_size", [
    (KTOModule, UnpairedPreferenceDataModule, 6),  # 36 unpaired rows: 6 batches an epoch, the KL batch at collate
    pytest.param(CPOModule, PreferenceDataModule, 4, marks=pytest.mark.slow),  # DPO's pairs and loader, tested above
    pytest.param(ORPOModule, PreferenceDataModule, 4, marks=pytest.mark.slow),
], ids=["kto", "cpo", "orpo"])
def test_kto_cpo_orpo_resume_mid_epoch_is_exact(module_cls, data_cls, batch_size, tmp_path, pairs_file, tiny_path):
    data = {"path": pairs_file, "batch_size": batch_size, "max_length": 32}
    full, full_weights = fit(module_cls, {}, data_cls, data, tmp_path / "full", 8, ckpt_every=3)
    resumed, resumed_weights = fit(module_cls, {}, data_cls, data, tmp_path / "resumed", 8,
                                   ckpt_path=str(tmp_path / "full" / "ckpt" / "step=3.ckpt"))
    assert sorted(resumed.by_step) == [3, 4, 5, 6, 7]
    assert resumed.firsts == {s: full.firsts[s] for s in resumed.firsts}
    assert resumed.by_step == {s: full.by_step[s] for s in resumed.by_step}
    assert_same_weights(resumed_weights, full_weights)


def test_reward_model_resume_mid_epoch_is_exact(tmp_path, pairs_file, tiny_path):
    """18 pairs, 4 a batch: the checkpoint at step 3 is mid-epoch 0; the run goes on into epoch 1. The score head
    starts from seeded random weights: the resumed run takes them (trained) from the checkpoint."""
    data = {"path": pairs_file, **DPO_DATA}
    full, full_weights = fit(RewardModule, {}, RewardDataModule, data, tmp_path / "full", 7, ckpt_every=3)
    assert sorted(full.by_step) == list(range(7))
    resumed, resumed_weights = fit(RewardModule, {}, RewardDataModule, data, tmp_path / "resumed", 7,
                                   ckpt_path=str(tmp_path / "full" / "ckpt" / "step=3.ckpt"))
    assert sorted(resumed.by_step) == [3, 4, 5, 6]
    assert resumed.firsts == {s: full.firsts[s] for s in resumed.firsts}
    assert resumed.by_step == {s: full.by_step[s] for s in resumed.by_step}
    assert_same_weights(resumed_weights, full_weights)
    assert "score.weight" in full_weights


GRPO_DATA = {"batch_size": 4}
GRPO_ROUND = {"num_generations": 2, "steps_per_generation": 3, "num_iterations": 2}  # the module's
GRPO_MODEL = {"reward_funcs": ["helpers.reward_digit_fraction"], "max_completion_length": 4, **GRPO_ROUND}
DYNAMIC = {"reward_funcs": ["helpers.reward_flat_on_some_prompts"], "dynamic_sampling": True, "max_num_gen_batches": 3}


@pytest.mark.parametrize("settings", [{}, DYNAMIC], ids=["plain", "dynamic_sampling"])
def test_grpo_resume_mid_round_is_exact(settings, tmp_path, prompts_file, tiny_path):
    """A round serves 6 steps; checkpoint at step 4 is mid-round; the run goes on into round 2 (new generation).
    With dynamic sampling the data serves 3 batches of prompts per round and the round samples what it needs."""
    data, model = {"path": prompts_file, **GRPO_DATA}, {**GRPO_MODEL, **settings}
    full, full_weights = fit(GRPOModule, model, PromptDataModule, data, tmp_path / "full", 9, ckpt_every=4)
    again, _ = fit(GRPOModule, model, PromptDataModule, data, tmp_path / "again", 9)
    assert again.by_step == full.by_step  # determinism, generation included

    resumed, resumed_weights = fit(GRPOModule, model, PromptDataModule, data, tmp_path / "resumed", 9,
                                   ckpt_path=str(tmp_path / "full" / "ckpt" / "step=4.ckpt"))
    assert sorted(resumed.by_step) == [4, 5, 6, 7, 8]
    assert resumed.firsts == {s: full.firsts[s] for s in resumed.firsts}
    assert resumed.by_step == {s: full.by_step[s] for s in resumed.by_step}
    assert_same_weights(resumed_weights, full_weights)


@pytest.mark.parametrize("teachers", [1, 2])
def test_distill_resume_mid_round_is_exact(teachers, tmp_path, prompts_file, tiny_path):
    """Rounds of 2 steps, each the student's samples or the teacher's (lmbda 0.5, seq_kd): the step-3 checkpoint is
    mid-round; the resumed run trains on the saved round, then draws the coins and samples the completions the
    uninterrupted run did. With two teachers (rows alternating) the saved round carries each row's teacher id."""
    from lit_align.models import build_builtin

    teacher = str(build_builtin("tiny", tmp_path / "teacher", seed=1))
    model = {"teacher_model": teacher, "lmbda": 0.5, "seq_kd": True, "max_completion_length": 4,
             "steps_per_generation": 2}
    data = {"path": prompts_file, **GRPO_DATA}
    if teachers == 2:
        model["teacher_model"] = {"a": teacher, "b": str(build_builtin("tiny", tmp_path / "teacher_b", seed=2))}
        rows = [{**json.loads(line), "teacher_id": "ab"[i % 2]}
                for i, line in enumerate(Path(prompts_file).read_text().splitlines())]
        data["path"] = str(tmp_path / "rows.jsonl")
        Path(data["path"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    full, full_weights = fit(DistillationModule, model, PromptDataModule, data, tmp_path / "full", 9, ckpt_every=3)
    resumed, resumed_weights = fit(DistillationModule, model, PromptDataModule, data, tmp_path / "resumed", 9,
                                   ckpt_path=str(tmp_path / "full" / "ckpt" / "step=3.ckpt"))
    assert sorted(resumed.by_step) == [3, 4, 5, 6, 7, 8]
    assert resumed.firsts == {s: full.firsts[s] for s in resumed.firsts}
    assert resumed.by_step == {s: full.by_step[s] for s in resumed.by_step}
    assert_same_weights(resumed_weights, full_weights)
    saved = torch.load(tmp_path / "full" / "ckpt" / "step=3.ckpt", weights_only=False)["lit_align_grpo"]["rounds"][0]
    assert sorted(set(saved["extra"].get("teacher_id", []))) == ([] if teachers == 1 else ["a", "b"])


@pytest.mark.slow
def test_grpo_ddp_resume_mid_round_is_exact(tmp_path, prompts_file, lit_align_cache, tiny_path):
    """2 processes: each rank's round (from its own prompts) comes back from the checkpoint rank 0 wrote."""
    def cmd(root: Path, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "lit_align", "fit", "-c", str(REPO / "configs" / "grpo.yaml"),
            "--seed_everything", "0", "--model.init_args.model", "builtin:tiny",
            "--model.init_args.reward_funcs", json.dumps(GRPO_MODEL["reward_funcs"]),
            "--model.init_args.max_completion_length", "4", "--model.init_args.learning_rate", "1e-3",
            "--data.init_args.path", prompts_file, "--data.init_args.val_split", "null",
            "--data.init_args.batch_size", "2", "--model.init_args.num_generations", "2",
            "--model.init_args.steps_per_generation", "3",
            "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.devices", "2",
            "--trainer.max_steps", "5", "--trainer.val_check_interval", "1.0", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(root),
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.dirpath", str(root / "ckpt"), "--trainer.callbacks.filename", "{step}",
            "--trainer.callbacks.every_n_train_steps", "2", "--trainer.callbacks.save_top_k", "-1",
            "--export.enabled", "false", *extra,
        ]

    env = cli_env(LIT_ALIGN_CACHE=str(lit_align_cache))

    def run(args):
        proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]

    run(cmd(tmp_path))  # rounds of 3 steps: the step-2 checkpoint is mid-round
    run(cmd(tmp_path, "--ckpt_path", str(tmp_path / "ckpt" / "step=2.ckpt")))
    runs = [{int(r["step"]): r["train/loss"] for r in read_metrics(p) if "train/loss" in r}
            for p in sorted((tmp_path / "grpo").glob("version_*"))]
    assert sorted(runs[0]) == list(range(5)) and sorted(runs[1]) == [2, 3, 4]
    assert runs[1] == {s: runs[0][s] for s in runs[1]}
