"""Asynchronous rollouts (``model.async_rollouts``, ``lit_align.producer``): the synchronous limit equals a synchronous
run bit for bit, staleness stays within its bound, weights reach the producer at the configured steps, and a producer
that fails or dies ends the run with one line within seconds.

GRPO on the tiny built-in model, 4-token completions, one CPU thread on each side.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import fit, read_metrics, write_sort_rows
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lit_align.data import PromptDataModule
from lit_align.errors import LitAlignError
from lit_align.modules.distill import DistillationModule
from lit_align.modules.grpo import GRPOModule

REWARDS = ["lit_align.rewards.sort_accuracy", "helpers.reward_digit_fraction"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    return write_sort_rows(tmp_path_factory.mktemp("async_prompts") / "prompts.jsonl", 48, "prompts")


def run(root: Path, prompts: str, steps: int, callbacks=(), ckpt_path=None, module_cls=GRPOModule,
        trainer_kwargs=None, **model):
    torch.manual_seed(0)
    settings = {"model": "builtin:tiny", "reward_funcs": REWARDS, "max_completion_length": 4, "learning_rate": 1e-2,
                "num_generations": 2, **model}
    module = module_cls(**settings)
    dm = PromptDataModule(path=prompts, val_split=None, batch_size=4)
    trainer = fit(module, dm, max_steps=steps, callbacks=list(callbacks), logger=CSVLogger(root, name="run"),
                  ckpt_path=ckpt_path, **(trainer_kwargs or {}))
    return module, read_metrics(Path(trainer.log_dir) / "metrics.csv"), trainer


def series(metrics, name: str) -> list[float]:
    return [row[name] for row in metrics if name in row]


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("spg,accumulate,versions", [(2, 1, [0, 0, 2, 2]), (1, 2, [0, 1])])
def test_the_synchronous_limit_equals_a_synchronous_run_bit_for_bit(tmp_path, prompts, spg, accumulate, versions):
    """``max_staleness: 0``: every round is sampled in the producer by the current weights, waited for, and trained
    on as a synchronous round: the same losses and the same final weights as without ``async_rollouts``; with
    gradient accumulation too (a round per batch, the weights move every 2)."""
    window = {"trainer_kwargs": {"accumulate_grad_batches": accumulate}}
    steps = 4 // accumulate
    sync, sync_metrics, _ = run(tmp_path / "sync", prompts, steps, steps_per_generation=spg, **window)
    limit, limit_metrics, _ = run(tmp_path / "async", prompts, steps, steps_per_generation=spg, async_rollouts=True,
                                  max_staleness=0, producer_threads=1, **window)
    assert series(limit_metrics, "train/loss") == series(sync_metrics, "train/loss")
    assert series(limit_metrics, "train/reward") == series(sync_metrics, "train/reward")
    assert_same_weights(limit.policy, sync.policy)
    # a round's metrics are written for the steps that sample one (2 here: steps 0 and 2, or both steps' batches)
    assert series(limit_metrics, "train/async/staleness") == [0.0, 0.0]
    assert series(limit_metrics, "train/async/weights_version") == versions
    assert limit.producer is None  # stopped with the run


class KeepSampled(L.Callback):
    """The last round's sampling log-probs as the producer sent them (``produced_round``)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx:  # wrapped once, at the first batch (the producer starts with training)
            return
        take = pl_module.producer.worker.take

        def spy(key):
            produced = take(key)
            self.value = produced.generation.logps.clone()
            return produced

        pl_module.producer.worker.take = spy


def test_rounds_run_ahead_within_the_staleness_bound(tmp_path, prompts):
    """One round (one optimizer step) ahead: the first round is sampled by the initial weights, every later one by
    the weights of the step before its turn (staleness 1), corrected for with the producer's log-probs."""
    old_logps = KeepSampled()
    module, metrics, _ = run(tmp_path, prompts, 5, [old_logps], async_rollouts=True, max_staleness=1,
                             producer_threads=1)
    assert series(metrics, "train/async/staleness") == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert series(metrics, "train/async/weights_version") == [0.0, 0.0, 1.0, 2.0, 3.0]
    assert series(metrics, "train/async/dropped_rounds") == [0.0] * 5
    # a stale round's old log-probs are the producer's (one step, one round: a synchronous run would have none)
    assert module.round.old_logps is not None and torch.equal(module.round.old_logps, old_logps.value)
    assert all(0 <= v <= 1 for v in series(metrics, "train/async/trainer_busy"))
    assert module.generation_rounds == 5


def test_weights_reach_the_producer_every_weight_sync_steps_and_stale_rounds_are_dropped(tmp_path, prompts):
    """Weights pushed every 2 steps: each round's weights are of an even step; a round that would be 2 steps old
    with ``max_staleness: 1`` is dropped and sampled again by the current weights."""
    module, metrics, _ = run(tmp_path, prompts, 6, async_rollouts=True, max_staleness=1, weight_sync_steps=2,
                             producer_threads=1)
    versions, staleness = series(metrics, "train/async/weights_version"), series(metrics, "train/async/staleness")
    dropped = series(metrics, "train/async/dropped_rounds")
    assert all(v % 2 == 0 or s == 0 for v, s in zip(versions, staleness))  # pushed at even steps (or resampled)
    assert max(staleness) <= 1
    assert dropped[-1] >= 1 and dropped == sorted(dropped)
    for step, (v, s) in enumerate(zip(versions, staleness)):
        assert v == step - s


class KillProducer(L.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(pl_module.producer.process.pid, signal.SIGKILL)


def test_a_producer_that_dies_ends_the_run_with_one_line_within_seconds(tmp_path, prompts):
    start = time.perf_counter()
    with pytest.raises(LitAlignError, match=r"model.async_rollouts: the rollout producer process ended \(exit code "
                                            r"-9\)"):
        run(tmp_path, prompts, 6, [KillProducer(2)], async_rollouts=True, max_staleness=1, producer_threads=1)
    assert time.perf_counter() - start < 60


def test_a_reward_that_fails_in_the_producer_is_one_line(tmp_path, prompts):
    with pytest.raises(LitAlignError, match=r"^model.async_rollouts: the rollout producer failed: reward function "
                                            r"'reward_that_raises' raised ValueError: no reward today$"):
        run(tmp_path, prompts, 2, async_rollouts=True, reward_funcs=["helpers.reward_that_raises"],
            producer_threads=1)


def test_resume_at_the_synchronous_limit_equals_the_uninterrupted_run(tmp_path, prompts):
    """Rounds in flight are not in checkpoints: the resumed run asks for them again, and at ``max_staleness: 0``
    ends on the uninterrupted run's weights."""
    settings = dict(async_rollouts=True, max_staleness=0, producer_threads=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    whole, _, _ = run(tmp_path / "whole", prompts, 4, [ckpt], trainer_kwargs={"enable_checkpointing": True},
                      **settings)
    resumed, _, _ = run(tmp_path / "resumed", prompts, 4, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"),
                        **settings)
    assert resumed.generation_rounds == whole.generation_rounds == 4
    assert_same_weights(resumed.policy, whole.policy)


@pytest.mark.parametrize("setting,message", [
    ({"dynamic_sampling": True}, "model.dynamic_sampling decides across ranks"),
    ({"engine": "vllm"}, "model.engine 'vllm' samples on vLLM's own copy of the weights"),
    ({"max_staleness": -1}, "model.max_staleness must be >= 0"),
    ({"weight_sync_steps": 0}, "model.weight_sync_steps must be >= 1"),
])
def test_settings_async_rollouts_cannot_run_are_refused(setting, message):
    with pytest.raises(LitAlignError, match=message):
        GRPOModule(reward_funcs=REWARDS, async_rollouts=True, **setting)


def test_distillation_samples_the_students_rounds_in_the_producer(tmp_path, prompts, tiny_path):
    """On-policy distillation at the synchronous limit: the same run as without ``async_rollouts``."""
    settings = dict(module_cls=DistillationModule, teacher_model=tiny_path, reward_funcs=None, num_generations=1,
                    steps_per_generation=1)
    sync, sync_metrics, _ = run(tmp_path / "sync", prompts, 3, **settings)
    limit, limit_metrics, _ = run(tmp_path / "async", prompts, 3, async_rollouts=True, max_staleness=0,
                                  producer_threads=1, **settings)
    assert series(limit_metrics, "train/loss") == series(sync_metrics, "train/loss")
    assert_same_weights(limit.policy, sync.policy)


def test_vllm_engines_get_new_weights_every_weight_sync_steps():
    """The version a vLLM engine (colocated or a server) reloads weights on moves every ``weight_sync_steps``."""
    from types import SimpleNamespace

    module = GRPOModule(reward_funcs=REWARDS, weight_sync_steps=3)
    versions = []
    for step in range(8):
        module._trainer = SimpleNamespace(global_step=step)
        versions.append(module.weights_version())
    assert versions == [0, 0, 0, 3, 3, 3, 6, 6]


def test_epochs_and_an_epoch_cut_short_keep_rounds_and_prompts_in_step(tmp_path, prompts):
    """``limit_train_batches: 3`` cuts each epoch after 3 rounds while the producer already sampled the 4th: it is
    dropped at the next epoch's first round, which (nothing asked for yet) is sampled by the current weights. Every
    round trained on is the one of the prompts the data yields (``produced_round`` checks the dataset rows)."""
    module, metrics, _ = run(tmp_path, prompts, 7, async_rollouts=True, max_staleness=1, producer_threads=1,
                             trainer_kwargs={"limit_train_batches": 3})
    assert series(metrics, "train/async/staleness") == [0.0, 1.0, 1.0] * 2 + [0.0]
    assert [r["epoch"] for r in metrics if "train/loss" in r] == [0.0] * 3 + [1.0] * 3 + [2.0]
    assert module.producer is None and module.generation_rounds == 7


def test_the_producer_gets_the_policy_without_its_training_hooks(tmp_path, prompts):
    """Gradient checkpointing hooks a local function onto the input embeddings (unpicklable) and mapped activations
    hook every layer: the producer's copy goes without them, and the run trains as with none."""
    module, metrics, _ = run(tmp_path, prompts, 2, async_rollouts=True, gradient_checkpointing=True,
                             mmap_activations=True, producer_threads=1)
    assert series(metrics, "train/async/staleness") == [0.0, 1.0]
    assert module.network.is_gradient_checkpointing  # the trainer's policy keeps them
