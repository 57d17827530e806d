"""GRPOModule under a real ``lightning.Trainer``, checked by counting: generation rounds, steps, checkpoints, when old
log-probs exist, the reference model, the logged metrics (TRL's names) and the completions log; then a 2-process DDP run
through the CLI.

The runs use the tiny built-in model, 4-token completions and a 48-prompt file, on one CPU thread.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from helpers import fit, metric_at, read_metrics, write_sort_rows
from lightning.pytorch.loggers import CSVLogger

from lit_align.callbacks import CompletionsLogger
from lit_align.data import PromptDataModule
from lit_align.errors import LitAlignError
from lit_align.generation import Rollout
from lit_align.losses.grpo import group_advantages
from lit_align.models import load_model
from lit_align.modules.grpo import GRPOModule
from lit_align.modules.online import completion_token_logps
from numerics import TINY_TERMS, assert_rounding_close

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]  # tests/
REWARDS = ["lit_align.rewards.sort_accuracy", "helpers.reward_digit_fraction"]


class GenerationProbe(L.Callback):
    """Counts the engine's ``generate`` calls (with the global step of each) and records the prompts of each round;
    with ``out_dir``, writes them to ``<out_dir>/rank<R>.json`` at the end (used by the DDP run through the CLI)."""

    def __init__(self, out_dir: str | None = None):
        self.out_dir = out_dir
        self.generate_steps: list[int] = []
        self.round_prompts: list[list] = []
        self.old_logps_present: list[bool] = []
        self.round_pos: list[int] = []
        self.ratios: list[float | None] = []  # per step: max |exp(logps - old_logps) - 1| over real tokens
        self._rounds = self._step = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._rounds, self._step = pl_module.generation_rounds, trainer.global_step
        self.round_pos.append(batch["round_pos"])
        if batch["round_pos"] == 0:
            self.round_prompts.append(list(batch["prompts"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.generation_rounds > self._rounds:  # this step sampled a round
            self.generate_steps.append(self._step)
        self.old_logps_present.append(pl_module.round.old_logps is not None)
        old = outputs["step"].old_logps
        if old is None:
            self.ratios.append(None)
        else:  # the rollout's old log-probs are 0 past each completion's end: compare real tokens only
            valid = old != 0
            self.ratios.append(float((torch.exp(outputs["logps"] - old) - 1)[valid].abs().max()))

    def on_train_end(self, trainer, pl_module) -> None:
        if self.out_dir is None:
            return
        out = Path(self.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
            "world_size": trainer.world_size, "global_step": trainer.global_step,
            "generate_steps": self.generate_steps, "round_prompts": self.round_prompts,
            "generation_rounds": pl_module.generation_rounds,
        }))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    return write_sort_rows(tmp_path_factory.mktemp("grpo_prompts") / "prompts.jsonl", 48, "prompts")


def fit_grpo(root: Path, prompts: str, max_steps: int, model: dict | None = None, data: dict | None = None,
             callbacks: list | None = None, **trainer_kwargs) -> SimpleNamespace:
    """Fit GRPOModule on the tiny model; the probe also records each step's ratio ``exp(logps - old)``."""
    torch.manual_seed(0)
    data = {"batch_size": 4, "num_generations": 2, **(data or {})}
    rounds = {k: data[k] for k in ("num_generations", "steps_per_generation", "num_iterations") if k in data}
    module = GRPOModule(**{"model": "builtin:tiny", "reward_funcs": REWARDS, "max_completion_length": 4,
                           "learning_rate": 1e-3, **rounds, **(model or {})})
    dm = PromptDataModule(path=prompts, val_split=None, **{k: v for k, v in data.items() if k not in rounds})
    probe = GenerationProbe()
    run = fit(module, dm, max_steps=max_steps, callbacks=[probe, *(callbacks or [])],
              logger=CSVLogger(root, name="grpo"), **trainer_kwargs)
    return SimpleNamespace(trainer=run, module=module, probe=probe, ratios=probe.ratios,
                           metrics=read_metrics(Path(run.log_dir) / "metrics.csv"), log_dir=Path(run.log_dir),
                           root=root)


def metric(run, name: str, step: int) -> float:
    return metric_at(run.metrics, name, step)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, prompts_file, tiny_path):
    """spg=3, num_iterations=2 (a round serves 6 steps), beta>0, checkpoints every 4 steps, completions every 5."""
    root = tmp_path_factory.mktemp("grpo_run_a")
    callbacks = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=4, save_top_k=-1),
                 CompletionsLogger(every_n_steps=5, max_rows=3)]
    return fit_grpo(root, prompts_file, 12, model={"beta": 0.04}, data={"steps_per_generation": 3, "num_iterations": 2},
                    callbacks=callbacks, enable_checkpointing=True)


@pytest.fixture(scope="module")
def run_b(tmp_path_factory, prompts_file, tiny_path):
    """spg=4, num_iterations=1 (a round serves 4 steps), beta=0."""
    return fit_grpo(tmp_path_factory.mktemp("grpo_run_b"), prompts_file, 12, data={"steps_per_generation": 4})


# -- counting ------------------------------------------------------------------------------------------------------------
def test_one_generation_per_spg_times_iterations_steps(run_a, run_b):
    assert run_a.probe.generate_steps == [0, 6]  # 12 steps / (3 * 2)
    assert run_a.probe.round_pos == [0, 1, 2, 3, 4, 5] * 2
    assert run_a.module.generation_rounds == 2
    assert run_b.probe.generate_steps == [0, 4, 8]  # 12 steps / 4
    assert run_b.probe.round_pos == [0, 1, 2, 3] * 3
    assert run_b.module.generation_rounds == 3
    assert run_a.probe.round_prompts[0] != run_a.probe.round_prompts[1]  # a new round draws new prompts
    assert len(run_a.probe.round_prompts[0]) == 4 * 3 // 2


def test_max_steps_is_exact(run_a, run_b):
    assert run_a.trainer.global_step == 12
    assert run_b.trainer.global_step == 12
    assert len(run_a.ratios) == len(run_b.ratios) == 12  # one training step (one loss) per optimizer step


def test_checkpoint_cadence_is_exact_and_reference_is_not_saved(run_a):
    files = sorted((run_a.root / "ckpt").glob("*.ckpt"))
    steps = sorted(torch.load(f, map_location="cpu", weights_only=False)["global_step"] for f in files)
    assert steps == [4, 8, 12]
    assert sorted(f.name for f in files) == ["epoch=0-step=12.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    state = torch.load(files[0], map_location="cpu", weights_only=False)["state_dict"]
    assert any(k.startswith("policy.") for k in state)
    assert not any(k.startswith("reference.") for k in state)


def test_reference_is_frozen_unchanged_and_policy_trained(run_a, run_b, tiny_path):
    initial = load_model("builtin:tiny").state_dict()
    ref = run_a.module.reference.model
    assert ref is not None and not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    for name, value in ref.state_dict().items():
        assert torch.equal(value, initial[name]), name
    for run in (run_a, run_b):
        policy = run.module.policy.state_dict()
        changed = [name for name, value in policy.items() if not torch.equal(value, initial[name])]
        assert len(changed) > len(policy) // 2
    assert run_b.module.reference is None  # beta = 0: no reference loaded


# -- old log-probs ---------------------------------------------------------------------------------------------------------
def test_old_logps_used_and_round_start_ratio_is_one(run_a, run_b):
    for run, size in ((run_a, 6), (run_b, 4)):
        assert all(run.probe.old_logps_present)
        assert all(r is not None for r in run.ratios)
        starts = run.ratios[::size]
        assert max(starts) < 1e-4, starts  # fresh old log-probs: ratio 1 on the first step of each round
        later = [r for i, r in enumerate(run.ratios) if i % size]
        assert max(later) > 1e-4  # the policy has moved since the round was sampled: the ratio is real
        for step in range(0, 12, size):
            assert metric(run, "train/clip_ratio/region_mean", step) == 0.0


class LogpsEngine:
    """4 completions of 3 tokens (rows 0 and 2 truncated), with sampling log-probs."""

    def __init__(self):
        self.rollout = Rollout(torch.full((4, 3), 20), torch.ones(4, 3, dtype=torch.long),
                               torch.tensor([True, False, True, False]), torch.full((4, 3), -1.5))

    def generate(self, *args, **kwargs):
        return self.rollout


def stub_round(tokenizer, spg: int = 1, iterations: int = 1, accumulate: int = 1, all_gather=lambda t: t,
               engine=None, **options):
    """``(module, round)``: ``make_round`` on 2 prompts x 2 fixed completions, with a stand-in single-device
    Trainer."""
    module = GRPOModule(reward_funcs=["helpers.reward_digit_fraction"], num_generations=2,
                        steps_per_generation=spg, num_iterations=iterations, **options)
    module.tokenizer, module.rollouts.engine = tokenizer, engine or LogpsEngine()
    module._trainer = SimpleNamespace(accumulate_grad_batches=accumulate, world_size=1, global_step=0, global_rank=0,
                                      strategy=SimpleNamespace(reduce=lambda t, reduce_op=None: t,
                                                                all_gather=all_gather))
    batch = {"prompt_ids": torch.tensor([[30, 31], [0, 32]]), "prompt_mask": torch.tensor([[1, 1], [0, 1]]),
             "prompts": ["ab", "c"], "columns": {}, "round_pos": 0}
    return module, module.make_round(batch)


@pytest.mark.parametrize("spg,iterations,accumulate,needed", [
    (1, 1, 1, False),  # on-policy: one step per round
    (2, 1, 2, False),  # the round's 2 steps accumulate into one optimizer step
    (2, 1, 4, False),  # two rounds per optimizer step
    (4, 1, 1, True),  # 4 optimizer steps per round
    (3, 2, 1, True),  # two passes over the round
    (1, 2, 1, True),
    (1, 2, 2, False),  # both passes in one accumulation window: the policy has not moved
    (2, 1, 3, True),  # windows of 3 microsteps straddle rounds of 2
])
def test_old_logps_computed_only_when_the_policy_moves_within_a_round(tokenizer, spg, iterations, accumulate, needed):
    module, r = stub_round(tokenizer, spg, iterations, accumulate)
    assert (r.old_logps is not None) == needed
    if needed:
        assert torch.equal(r.old_logps, module.rollouts.engine.rollout.logps)  # the engine's, no extra forward
    assert r.num_tokens == 12 / spg  # dapo's normalizer: the round's 12 tokens spread over its spg steps


def test_mask_truncated_completions(tokenizer):
    _, r = stub_round(tokenizer, spg=2)
    assert r.loss_mask.sum(1).tolist() == [3, 3, 3, 3]
    _, r = stub_round(tokenizer, spg=2, mask_truncated_completions=True)
    assert r.loss_mask.sum(1).tolist() == [0, 3, 0, 3]  # truncated rows leave the loss
    assert r.num_tokens == 6 / 2
    assert float(r.stats["completions/clipped_ratio"]) == 0.5


# -- metrics ---------------------------------------------------------------------------------------------------------------
ROUND_NAMES = ["train/reward", "train/reward_std", "train/rewards/sort_accuracy/mean",
               "train/rewards/sort_accuracy/std", "train/rewards/reward_digit_fraction/mean",
               "train/frac_reward_zero_std", "train/completions/mean_length", "train/completions/clipped_ratio",
               "train/completions/mean_terminated_length", "train/completions/max_terminated_length"]
TRL_NAMES = [*ROUND_NAMES, "train/entropy", "train/clip_ratio/region_mean", "train/clip_ratio/low_mean",
             "train/clip_ratio/high_mean", "train/loss", "train/generation_rounds"]


def test_metrics_have_trl_names_and_values(run_a, run_b):
    for run, round_steps in ((run_a, (0, 6)), (run_b, (0, 4, 8))):
        for step in range(12):
            for name in TRL_NAMES:
                if step in round_steps or name not in ROUND_NAMES:
                    metric(run, name, step)
                else:  # a round's metrics come once, at its first step, as TRL logs them where it samples
                    assert not any(name in row and row["step"] == step for row in run.metrics), (name, step)
    assert "train/kl" not in run_b.metrics[0]
    # the policy starts as the reference: log-prob differences d of rounding size, k3 ~ d^2 / 2
    assert metric(run_a, "train/kl", 0) == pytest.approx(0.0, abs=1e-7)
    assert metric(run_a, "train/kl", 11) > 1e-7
    assert [metric(run_a, "train/generation_rounds", s) for s in (0, 5, 6, 11)] == [1.0, 1.0, 2.0, 2.0]
    assert [metric(run_b, "train/generation_rounds", s) for s in (0, 3, 4, 11)] == [1.0, 1.0, 2.0, 3.0]
    # the last round's reward is the mean of its rewards
    rewards = torch.tensor(run_a.module.round.rewards)
    assert metric(run_a, "train/reward", 6) == pytest.approx(float(rewards.mean()), rel=1e-6, abs=1e-7)
    assert metric(run_a, "train/reward_std", 6) == pytest.approx(float(rewards.std()), rel=1e-6, abs=1e-7)
    accuracy = torch.tensor(run_a.module.round.reward_funcs["sort_accuracy"])
    assert metric(run_a, "train/rewards/sort_accuracy/std", 6) == pytest.approx(float(accuracy.std()), abs=1e-7)
    lengths = run_a.module.round.completion_mask.sum(1).float()
    assert metric(run_a, "train/completions/mean_length", 6) == pytest.approx(float(lengths.mean()))
    # TRL's num_tokens: the prompt and sampled tokens of every round so far, written as it stands at every step
    tokens = [metric(run_b, "train/num_tokens", s) for s in range(12)]
    assert tokens[0] > 0 and tokens[3] == tokens[0] < tokens[4] == tokens[7] < tokens[8] == tokens[11]
    assert 1.0 <= metric(run_a, "train/completions/mean_length", 0) <= 4.0
    assert 0.0 <= metric(run_a, "train/completions/clipped_ratio", 0) <= 1.0
    assert metric(run_a, "train/entropy", 0) > 0


def test_completions_logger_writes_rows_at_its_cadence(run_a, prompts_file):
    with open(run_a.log_dir / "completions.csv", newline="") as f:
        rows = list(csv.reader(f))
    names = run_a.module.rollouts.reward_names
    assert len(names) == 2 and rows[0] == ["step", "prompt", "completion", "reward", *names, "advantage"]
    assert [r[0] for r in rows[1:]] == ["5"] * 3 + ["10"] * 3  # every 5 steps, max_rows=3
    prompts = {json.loads(line)["prompt"] for line in Path(prompts_file).read_text().splitlines()}
    assert all(r[1] in prompts for r in rows[1:])
    logged = run_a.module.round  # step 10 is in the second round
    assert [r[1] for r in rows[4:]] == [str(p) for p in logged.prompts[:3]]
    assert [r[2] for r in rows[4:]] == logged.completions[:3]
    assert [float(r[3]) for r in rows[4:]] == pytest.approx(logged.rewards[:3])
    for k, name in enumerate(names):  # each function's value; the reward is their weighted sum
        assert [float(r[4 + k]) for r in rows[4:]] == pytest.approx(logged.reward_funcs[name][:3])
    assert [float(r[6]) for r in rows[4:]] == pytest.approx(logged.advantages[:3].tolist())


def test_gradient_accumulation_counts_optimizer_steps(tmp_path, prompts_file, tiny_path):
    """accumulate 2, spg 2: one round per optimizer step, on-policy (no old log-probs), no completions row at step 0."""
    run = fit_grpo(tmp_path, prompts_file, 2, data={"steps_per_generation": 2}, accumulate_grad_batches=2,
                   callbacks=[CompletionsLogger(every_n_steps=1, max_rows=1)])
    assert run.trainer.global_step == 2
    assert run.probe.generate_steps == [0, 1]  # microbatches 0 and 2
    assert run.ratios == [None] * 4 and run.probe.old_logps_present == [False] * 4
    with open(run.log_dir / "completions.csv", newline="") as f:
        assert [r[0] for r in csv.reader(f)] == ["step", "1", "2"]


# -- the training forward ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": 0.0}, "model.temperature must be > 0"),
    ({"loss_type": "ppo"}, "model.loss_type 'ppo'"),
    ({"scale_rewards": "global"}, "model.scale_rewards 'global'"),
    ({"engine": "vllm-nope"}, "model.engine 'vllm-nope'"),
    ({"engine": "vllm", "vllm_mode": "remote"}, "model.vllm_mode 'remote': expected 'colocate' or 'server'"),
    ({"engine": "vllm", "top_p": 0.9}, "model.vllm_importance_sampling_correction needs vLLM's sampling log-probs"),
    ({"engine": "vllm", "vllm_importance_sampling_mode": "tokens"}, "model.vllm_importance_sampling_mode 'tokens'"),
    ({"engine": "vllm", "vllm_tensor_parallel_size": 2}, "model.vllm_tensor_parallel_size 2: only 1"),
    ({"engine": "vllm", "vllm_gpu_memory_utilization": 1.5}, "model.vllm_gpu_memory_utilization must be in"),
    ({"engine": "vllm", "loss_type": "vespo"}, "model.vllm_importance_sampling_mode 'sequence_mask': loss_type 'vespo'"),
    ({"sync_ref_model": True}, "model.sync_ref_model mixes the policy into the reference model: it needs model.beta"),
    ({"sync_ref_model": True, "beta": 0.1, "peft_config": {"r": 2}}, "model.sync_ref_model mixes the policy"),
    ({"importance_sampling_level": "seq"}, "model.importance_sampling_level 'seq'"),
])
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(LitAlignError, match=match):
        GRPOModule(reward_funcs=REWARDS, **kwargs)


def test_engine_vllm_without_vllm_says_how_to_install(monkeypatch):
    """The main environment has no vLLM (it lives in ``make test-vllm``'s): choosing it names the install."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM imports
    with pytest.raises(LitAlignError, match=r"model.engine 'vllm' needs vLLM: pip install -e '.\[vllm\]'"):
        GRPOModule(reward_funcs=REWARDS, engine="vllm")


# -- DDP through the CLI ---------------------------------------------------------------------------------------------------
@pytest.mark.slow  # two processes (~20-45 s): run by .ci/run (make test-slow), not by make test
def test_ddp_two_processes_generate_once_per_round_on_each_rank(tmp_path, prompts_file, lit_align_cache, tiny_path):
    out = tmp_path / "probe"
    cmd = [
        sys.executable, "-m", "lit_align", "fit", "-c", str(REPO / "configs" / "grpo.yaml"),
        "--seed_everything", "0",
        "--model.init_args.model", "builtin:tiny",
        "--model.init_args.reward_funcs", json.dumps(REWARDS),
        "--model.init_args.beta", "0.0",
        "--model.init_args.max_completion_length", "4",
        "--data.init_args.path", prompts_file,
        "--data.init_args.val_split", "null",
        "--data.init_args.batch_size", "4",
        "--model.init_args.num_generations", "2",
        "--model.init_args.steps_per_generation", "2",
        "--model.init_args.num_iterations", "1",
        "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.devices", "2",
        "--trainer.max_steps", "4", "--trainer.accumulate_grad_batches", "1",
        "--trainer.val_check_interval", "1.0", "--trainer.num_sanity_val_steps", "0",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(tmp_path / "logs"), "--trainer.logger.name", "grpo",
        "--trainer.callbacks+=test_grpo_module.GenerationProbe", f"--trainer.callbacks.out_dir={out}",
        "--export.enabled", "false",
    ]
    here = str(Path(__file__).resolve().parent)  # GenerationProbe lives in this file
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "LIT_ALIGN_CACHE": str(lit_align_cache)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["world_size"] == 2 and rank["global_step"] == 4
        assert rank["generate_steps"] == [0, 2]  # once per round of 2 steps, on each rank
        assert rank["generation_rounds"] == 2
        assert [len(p) for p in rank["round_prompts"]] == [4, 4]  # 4 * 2 / 2 prompts per rank per round
    for r in range(2):
        assert not set(ranks[0]["round_prompts"][r]) & set(ranks[1]["round_prompts"][r])  # distinct prompts
    seen = [p for rank in ranks for rnd in rank["round_prompts"] for p in rnd]
    assert len(set(seen)) == 16

    metrics_csv = next((tmp_path / "logs" / "grpo").glob("version_*/metrics.csv"))
    with open(metrics_csv, newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/generation_rounds")]
    last = max(rows, key=lambda row: int(row["step"]))
    assert int(last["step"]) == 3 and float(last["train/generation_rounds"]) == 4 / 2


@pytest.mark.parametrize("scale_rewards", ["group", "batch"])
def test_advantages_are_normalized_over_every_ranks_rewards(tokenizer, scale_rewards):
    """As TRL: rewards are gathered before the advantages, so ``batch`` divides by the global batch's std (groups
    never span ranks, so ``group`` is unchanged); each rank keeps its own rows."""
    other = torch.tensor([0.0, 3.0, 1.0, 5.0])  # another rank's rewards, spread wider than this rank's
    engine = LogpsEngine()
    digit, letter = tokenizer.convert_tokens_to_ids(["1", "a"])
    engine.rollout.completion_ids = torch.tensor([[digit] * 3, [letter] * 3, [digit, letter, letter], [letter] * 3])
    _, r = stub_round(tokenizer, all_gather=lambda t: torch.stack([t, other.to(t).view_as(t)]), engine=engine,
                      scale_rewards=scale_rewards)
    mine = torch.tensor(r.rewards)
    assert mine.unique().numel() == 3  # rewards 1, 0, 1/3, 0: non-zero advantages
    expected = group_advantages(torch.cat([mine, other]), 2, scale_rewards)[:4]
    assert torch.equal(r.advantages, expected)  # the same function on the same gathered rewards
    alone = group_advantages(mine, 2, scale_rewards)
    assert torch.allclose(r.advantages, alone) == (scale_rewards == "group")


def test_each_step_drops_the_columns_that_are_padding_in_all_its_rows(tmp_path, prompts_file, tokenizer):
    """A round is as wide as its longest prompt and completion; each step's forward gets its own rows' widths, and
    its log-probs are still the engine's at the round's first step (the ratio is 1)."""
    torch.manual_seed(0)
    module = GRPOModule(model="builtin:tiny", reward_funcs=REWARDS, max_completion_length=12, learning_rate=1e-3,
                        num_generations=2, steps_per_generation=4)
    module.configure_model()
    head = module.policy.lm_head  # biased towards EOS: completions end at different lengths
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[tokenizer.eos_token_id] = 2.5
    module.policy.lm_head = biased
    dm = PromptDataModule(path=prompts_file, val_split=None, batch_size=4)
    seen = []  # (forward's prompt and completion widths, its rows' longest prompt and completion, round widths)
    ratios = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rows, r = outputs["step"], pl_module.round
            seen.append((rows.prompt_ids.shape[1], rows.completion_ids.shape[1], int(rows.prompt_mask.sum(1).max()),
                         int(rows.completion_mask.sum(1).max()), r.prompt_ids.shape[1], r.completion_ids.shape[1]))
            valid = rows.old_logps != 0
            ratios.append(float((torch.exp(outputs["logps"] - rows.old_logps) - 1)[valid].abs().max()))

    fit(module, dm, max_steps=8, callbacks=[Record()])
    assert len(seen) == 8
    for prompt_width, width, longest_prompt, longest, _, _ in seen:
        assert (prompt_width, width) == (longest_prompt, longest)  # no column is padding in every row
    assert any(width < round_width for _, width, _, _, _, round_width in seen)
    assert any(prompt_width < round_width for prompt_width, _, _, _, round_width, _ in seen)
    assert max(ratios[0], ratios[4]) < 1e-4  # round starts: the trimmed forward gives the engine's log-probs


def test_padding_free_training_matches_padded_training(tmp_path, prompts_file, tiny_path):
    """The same run with ``padding_free``: the same losses step by step, and it is refused without sdpa/eager."""
    runs = [fit_grpo(tmp_path / str(flag), prompts_file, 4, model={"padding_free": flag, "beta": 0.04},
                     data={"steps_per_generation": 2}) for flag in (False, True)]
    for step in range(4):
        for name in ("train/loss", "train/entropy"):
            value = metric(runs[0], name, step)
            assert_rounding_close(metric(runs[1], name, step), value, scale=max(abs(value), 1.0), terms=TINY_TERMS,
                                  msg=f"{name} at {step}")
    model = load_model("builtin:tiny")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(LitAlignError, match="padding_free needs sdpa or eager attention"):
        completion_token_logps(model, torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                               torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), padding_free=True)


@pytest.mark.parametrize("recipe", ["grpo", "rloo", "distill", "dpo", "sft", "kto", "cpo", "orpo", "reward"])
def test_defaults_are_trls_except_the_ones_the_readme_lists(recipe):
    """Every option named as in TRL defaults as in TRL, but the differences docs/grpo.md gives reasons for
    ("Defaults")."""
    import dataclasses

    import trl

    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig

    from lit_align.hub import recipe_defaults
    from lit_align.data import RewardDataModule
    from lit_align.modules import (
        CPOModule, DistillationModule, DPOModule, KTOModule, ORPOModule, RewardModule, RLOOModule, SFTModule,
    )

    module, config = {"grpo": (GRPOModule, trl.GRPOConfig), "rloo": (RLOOModule, trl.RLOOConfig),
                      "distill": (DistillationModule, trl.DistillationConfig),
                      "dpo": (DPOModule, trl.DPOConfig), "sft": (SFTModule, trl.SFTConfig),
                      "kto": (KTOModule, trl.KTOConfig), "cpo": (CPOModule, CPOConfig),
                      "orpo": (ORPOModule, ORPOConfig), "reward": (RewardModule, trl.RewardConfig)}[recipe]
    theirs = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    ours = recipe_defaults(module)
    differ = {k: (v, theirs[k]) for k, v in ours.items() if k in theirs and v != theirs[k]}
    listed = {"gradient_checkpointing": (False, True)}
    round_defaults = {"disable_dropout": (True, False)}
    listed |= {"grpo": round_defaults, "rloo": round_defaults,
               "distill": {},
               "sft": {"completion_only_loss": (True, None),  # None: on for prompt-completion rows
                       "padding_free": (None, False)},  # None: on where exact and cheaper (packs_by_default)
               "dpo": {"padding_free": (None, False)}, "kto": {}, "cpo": {}, "orpo": {}, "reward": {}}[recipe]
    assert differ == listed
    if recipe == "reward":  # the reward model's data options are TRL's too
        data = recipe_defaults(RewardDataModule)
        assert {k: data[k] for k in ("max_length", "num_proc")} == {"max_length": theirs["max_length"],
                                                                   "num_proc": theirs["dataset_num_proc"]}


# -- settings flow one way, model -> data -----------------------------------------------------------------------------
def test_in_python_the_round_is_set_once_on_the_module_and_the_data_follows_it(tmp_path, prompts_file):
    """The module owns the round's shape and hands it, with its tokenizer, to the DataModule (``connect``, from its
    ``setup``): a DataModule given neither follows the module, and never reads it."""
    module = GRPOModule(model="builtin:tiny", reward_funcs=REWARDS, max_completion_length=4, num_generations=2,
                        steps_per_generation=3)
    dm = PromptDataModule(path=prompts_file, val_split=None, batch_size=4)  # neither G (default 8) nor a tokenizer
    probe = GenerationProbe()
    fit(module, dm, max_steps=3, callbacks=[probe])
    assert dm.round_shape is module.round_shape and dm.prompts_per_round == 6  # 4 x 3 completions / 2 per prompt
    assert dm.tokenizer.name_or_path == module.tokenizer.name_or_path
    assert probe.generate_steps == [0]  # one round serves the 3 steps


# -- validation ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_generations_eval", [None, 3])
def test_num_generations_eval_samples_that_many_completions_per_validation_prompt(num_generations_eval, prompts_file):
    """None (lit_align's default): one greedy completion per prompt; n: n sampled with the training settings (TRL's
    num_generations_eval), val/reward their mean."""
    from helpers import _RecordingEngine, digit_fraction, trainer

    module = GRPOModule(model="builtin:tiny", reward_funcs=["helpers.reward_digit_fraction"], max_completion_length=4,
                        num_generations=2, num_generations_eval=num_generations_eval)
    dm = PromptDataModule(path=prompts_file, val_path=prompts_file, val_split="train", batch_size=4,
                          val_batch_size=5)
    rounds: list[dict] = []
    module.rollouts.greedy_engine = _RecordingEngine(module.rollouts.greedy_engine, rounds)
    module.rollouts.engine = _RecordingEngine(module.rollouts.engine, rounds)
    metrics = trainer(limit_val_batches=2).validate(module, dm)[0]
    assert len(rounds) == 2 and len(rounds[0]["prompts"]) == 5 * (num_generations_eval or 1)
    completions = [[{"role": "assistant", "content": module.tokenizer.decode(ids, skip_special_tokens=True)}]
                   for rnd in rounds for ids in rnd["ids"]]
    assert metrics["val/reward"] == pytest.approx(sum(digit_fraction(completions)) / len(completions), abs=1e-6)
    with pytest.raises(LitAlignError, match="model.num_generations_eval must be >= 1"):
        GRPOModule(model="builtin:tiny", reward_funcs=REWARDS, num_generations_eval=0)


# -- TRL 1.16's loss options through `lit-align fit` ------------------------------------------------------------------------
def test_trl_loss_options_are_accepted_by_lit_align_fit_and_move_their_metrics(tmp_path, prompts_file, capfd,
                                                                               tiny_path):
    """CISPO with GDPO's advantages, the adaptive entropy bonus on the high-entropy tokens, the off-policy mask and an
    fp32 LM head (padding-free rows), with and without a reference synced to the policy after every step (alpha 1): the entropy
    coefficient climbs by its delta every step and, applied from the second step on, moves the loss away from the
    policy term; CISPO logs its clip ratio; the synced reference leaves no KL while the unsynced one does."""
    from helpers import run_main

    def run(name: str, *options: str):
        code, _, err = run_main([
            "fit", "-c", str(REPO / "configs" / "grpo.yaml"), "--model.init_args.model", "builtin:tiny",
            "--model.init_args.reward_funcs", json.dumps(REWARDS), "--model.init_args.max_completion_length", "4",
            "--model.init_args.beta", "0.04", "--model.init_args.learning_rate", "1e-2",
            "--model.init_args.warmup_steps", "0", *options,
            "--data.init_args.path", prompts_file, "--data.init_args.val_split", "null",
            "--data.init_args.batch_size", "4", "--model.init_args.num_generations", "2",
            "--model.init_args.steps_per_generation", "1", "--trainer.max_steps", "3",
            "--trainer.val_check_interval", "1.0", "--trainer.num_sanity_val_steps", "0",
            "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks", "[]", "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir", str(tmp_path), "--trainer.logger.name", name,
            "--trainer.default_root_dir", str(tmp_path), "--export.enabled", "false"], capfd)
        assert code == 0, err
        return read_metrics(tmp_path / name / "version_0")

    options = ["--model.init_args.loss_type", "cispo", "--model.init_args.epsilon_high", "5.0",
               "--model.init_args.multi_objective_aggregation", "normalize_then_sum",
               "--model.init_args.use_adaptive_entropy", "true", "--model.init_args.entropy_coef", "0.1",
               "--model.init_args.entropy_target", "100.0", "--model.init_args.top_entropy_quantile", "0.5",
               "--model.init_args.off_policy_mask_threshold", "0.5", "--model.init_args.cast_lm_head_to_fp32", "true",
               "--model.init_args.padding_free", "true"]  # the entropy's gradient through the chunked head
    synced = run("synced", *options, "--model.init_args.sync_ref_model", "true",
                 "--model.init_args.ref_model_sync_steps", "1", "--model.init_args.ref_model_mixup_alpha", "1.0")
    unsynced = run("unsynced", *options)
    for metrics in (synced, unsynced):
        assert [metric_at(metrics, "train/entropy_coef", s) for s in range(3)] == pytest.approx([0.105, 0.11, 0.115])
        assert metric_at(metrics, "train/loss", 0) == metric_at(metrics, "train/policy_loss", 0)  # none applied yet
        assert metric_at(metrics, "train/loss", 1) < metric_at(metrics, "train/policy_loss", 1) - 1e-3
        assert 0.0 <= metric_at(metrics, "train/cispo_clip_ratio", 0) <= 1.0
        assert "train/clip_ratio/low_mean" not in metrics[0]  # CISPO's metric instead of the clip family's
    # the first update is the bonus's at step 1 (rewards are flat on the tiny model): the policy moves from there, and
    # each round's synced reference is the policy it trains
    assert metric_at(synced, "train/kl", 2) == pytest.approx(0.0, abs=1e-9)
    assert metric_at(unsynced, "train/kl", 2) > 1e-6


def test_grpo_page_lists_every_grpo_config_field():
    """The "GRPOConfig fields" table of docs/grpo.md names every field TRL's ``GRPOConfig`` adds to
    ``TrainingArguments``, each with what it is here; every ``model.`` option it names is one of ``GRPOModule``'s (the
    table cannot rot either way)."""
    import dataclasses
    import inspect
    import re

    import transformers
    import trl

    text = (REPO / "docs" / "grpo.md").read_text()
    table = text.split("\n## GRPOConfig fields\n", 1)[1].split("\n#", 1)[0]
    body = table.split("|---|---|\n", 1)[1].split("\n\n", 1)[0]
    rows = [line.split(" | ") for line in body.splitlines()]
    listed = {name for first, _ in rows for name in re.findall(r"`(\w+)`", first)}
    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig)} - base
    assert sorted(theirs - listed) == [], "GRPOConfig fields missing from the table in docs/grpo.md"
    assert sorted(listed - theirs) == [], "rows of the table in docs/grpo.md that are not GRPOConfig fields"
    options = {name for cls in GRPOModule.__mro__ if "__init__" in cls.__dict__
               for name in inspect.signature(cls.__init__).parameters}
    for first, second in rows:
        assert second.strip(" |"), f"{first}: nothing said"
        named = re.findall(r"`model\.(\w+)`", second)
        if "`model.` the same names" in second:
            named += re.findall(r"`(\w+)`", first)
        assert set(named) <= options, f"{first}: {sorted(set(named) - options)} are not GRPOModule options"


def test_the_adaptive_entropy_coefficient_is_saved_and_restored():
    """A resume continues the controller where it was (TRL saves it beside the checkpoint too)."""
    settings = {"reward_funcs": REWARDS, "use_adaptive_entropy": True, "entropy_coef": 0.1}
    saved = GRPOModule(**settings)
    saved.entropy_control.step(0.05)  # below the default target 0.2: up by 0.005
    checkpoint = {"hyper_parameters": dict(saved.hparams)}
    saved.on_save_checkpoint(checkpoint)
    resumed = GRPOModule(**settings)
    assert resumed.entropy_control.coef == 0.1 and resumed.entropy_control.applied() == 0.0
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.entropy_control.coef == pytest.approx(0.105) and resumed.entropy_control.last_entropy == 0.05
    assert resumed.entropy_control.applied() == pytest.approx(0.105)


# -- dynamic sampling (DAPO): groups whose completions all scored alike are not trained on ------------------------------
class RoundsSeen(L.Callback):
    """Each round the module sampled: its trained prompts, and the metrics of dynamic sampling."""

    def __init__(self):
        self.rounds: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch["round_pos"] == 0:
            self.rounds.append((pl_module.round.prompts, dict(pl_module.round.stats)))


@pytest.mark.parametrize("dynamic", [True, False])
def test_dynamic_sampling_never_trains_on_groups_that_scored_alike(dynamic, tmp_path, prompts_file):
    """About half of the prompts get one reward for all their completions (``flat_prompt``): with dynamic sampling
    no step trains on them, and the round samples more of the served prompts only as far as it needs; without it
    they are trained on (the check can fail)."""
    from helpers import flat_prompt

    seen = RoundsSeen()
    model = {"reward_funcs": ["helpers.reward_flat_on_some_prompts"], "dynamic_sampling": dynamic,
             "max_num_gen_batches": 4}
    run = fit_grpo(tmp_path, prompts_file, 6, model=model, data={"steps_per_generation": 2}, callbacks=[seen])
    trained = [p for prompts, _ in seen.rounds for p in prompts]
    assert len(seen.rounds) == 3 and len(trained) == 3 * 8  # 4 prompts x 2 completions per round, 3 rounds
    assert any(flat_prompt(p) for p in trained) is not dynamic
    if dynamic:
        for prompts, stats in seen.rounds:
            batches = int(stats["dynamic_sampling/gen_batches"])
            assert 1 <= batches <= 4 and stats["dynamic_sampling/kept_groups"] == 4
            assert stats["dynamic_sampling/sampled_groups"] == 4 * batches
        assert metric(run, "train/frac_reward_zero_std", 0) > 0  # over everything sampled, the flat groups included


def test_dynamic_sampling_fills_the_round_when_its_batches_run_out(tmp_path, prompts_file):
    """Every group scores alike: all ``max_num_gen_batches`` batches are sampled, none is kept, and the round is
    filled with the first groups (zero advantage), so training goes on and says so in its metrics."""
    seen = RoundsSeen()
    model = {"reward_funcs": ["helpers.reward_constant"], "dynamic_sampling": True, "max_num_gen_batches": 3}
    run = fit_grpo(tmp_path, prompts_file, 2, model=model, callbacks=[seen])
    (_, first), (_, second) = seen.rounds
    assert first["dynamic_sampling/gen_batches"] == 3 and first["dynamic_sampling/kept_groups"] == 0
    assert first["dynamic_sampling/sampled_groups"] == 3 * 2
    assert run.module.round.advantages.abs().max() == 0
    assert metric(run, "train/dynamic_sampling/gen_batches", 1) == 3.0
