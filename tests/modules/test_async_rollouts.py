"""Asynchronous rollouts (``model.async_rollouts``, ``lit_align.producer``): the synchronous limit equals a synchronous
run bit for bit, staleness stays within its bound, weights reach the producer at the configured steps, a producer
that fails or dies (the weights lock held or not) ends the run with one line within seconds, a SIGTERM while the
trainer waits for a producer that hangs writes the checkpoint, and settings that cannot keep rounds fresh or name no
device are one line.

GRPO on the tiny built-in model, 4-token completions, one CPU thread on each side. The faults inside the producer
(``FaultyLock``) come from a stand-in for its process function (``faulty_produce``: the real one, its weights lock
wrapped), which the spawned process imports from this module.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import fit, read_metrics, write_sort_rows
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_align import producer
from lit_align.callbacks import SigtermCheckpoint
from lit_align.data import PromptDataModule
from lit_align.errors import LitAlignError
from lit_align.modules.distill import DistillationModule
from lit_align.modules.grpo import GRPOModule
from lit_align.producer import produce as real_produce
from lit_align.producer import warn_if_stale

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
    with ``max_staleness: 1`` is dropped and sampled again by the current weights (which the setup's warning says)."""
    with pytest.warns(UserWarning, match="rounds can be 2 steps old, and those older than 1 are dropped"):
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


class FaultyLock:
    """The producer's weights lock, but its ``nth`` acquisition holds it, writes the time to ``marker`` and then
    dies (``fault: die``, SIGKILL) or hangs (``hang``); half a second first, so that the round sent before it reaches
    the trainer."""

    def __init__(self, lock, nth: int, fault: str, marker: str):
        self.lock, self.nth, self.fault, self.marker, self.count = lock, nth, fault, marker, 0

    def acquire(self, *args, **kwargs) -> bool:
        got = self.lock.acquire(*args, **kwargs)
        if got:
            self.count += 1
            if self.count == self.nth:
                time.sleep(0.5)
                Path(self.marker).write_text(repr(time.time()))
                if self.fault == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)
        return got

    def release(self) -> None:
        self.lock.release()

    def __enter__(self):  # (the producer before the fix took the lock with ``with``)
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def faulty_produce(nth: int, fault: str, marker: str, spec, staged, version, lock, *channels) -> None:
    """The producer's process function with its weights lock a ``FaultyLock``."""
    real_produce(spec, staged, version, FaultyLock(lock, nth, fault, marker), *channels)


@pytest.fixture
def watchdog():
    """A test that hangs fails after 120 s instead (SIGALRM raises in the main thread, even in a lock's wait)."""
    def expired(signum, frame):
        raise TimeoutError("the run hung: no wait ended within 120 s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_producer_killed_holding_the_weights_lock_ends_the_run_with_one_line_within_seconds(
        tmp_path, prompts, monkeypatch, watchdog):
    """The producer dies inside its locked section (its second load of the weights: the trainer pushes step 1's
    next): the trainer, which waits for that lock, stops within seconds with the line naming it."""
    marker = tmp_path / "died"
    monkeypatch.setattr(producer, "produce", functools.partial(faulty_produce, 2, "die", str(marker)))
    with pytest.raises(LitAlignError) as error:
        run(tmp_path, prompts, 4, async_rollouts=True, max_staleness=1, producer_threads=1)
    ended = time.time()
    assert str(error.value).startswith("model.async_rollouts: the rollout producer process ended (exit code -9) "
                                       "while it held the weights lock, without a word")
    assert "\n" not in str(error.value)
    assert ended - float(marker.read_text()) < 5  # from the producer's death to the run's end


class SigtermOnMarker(L.Callback):
    """Sends this process a real SIGTERM once ``marker`` exists (the producer hangs), from a thread: the trainer is
    then waiting for the producer. Keeps when it was sent, and the producer's process."""

    def __init__(self, marker: Path):
        self.marker, self.sent, self.done = marker, None, threading.Event()

    def on_train_start(self, trainer, pl_module) -> None:
        threading.Thread(target=self.send, daemon=True).start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.producer = pl_module.producer.process

    def send(self) -> None:
        while not self.marker.exists() and not self.done.wait(0.05):
            pass
        if not self.done.is_set() and signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            self.sent = time.time()  # (Lightning's handler is in place: the signal cannot end pytest)
            os.kill(os.getpid(), signal.SIGTERM)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.done.set()


@pytest.mark.parametrize("nth,waits_in,step", [(1, "take", 0), (2, "push", 1)])
def test_sigterm_while_the_trainer_waits_for_a_hung_producer_writes_the_checkpoint(
        tmp_path, prompts, monkeypatch, watchdog, nth, waits_in, step):
    """A producer that lives but hangs in its locked section: in its first round (the trainer waits for round 0 in
    ``take``) or its second (the trainer waits for the lock to push step 1's weights). A SIGTERM then ends the wait at
    the last optimizer step: ``last.ckpt`` of that step is written, the producer is terminated and the run stops,
    within seconds; the checkpoint resumes."""
    marker = tmp_path / "hangs"
    monkeypatch.setattr(producer, "produce", functools.partial(faulty_produce, nth, "hang", str(marker)))
    signals = SigtermOnMarker(marker)
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=100), SigtermCheckpoint(), signals]
    with pytest.raises(SIGTERMException):
        run(tmp_path, prompts, 4, callbacks, async_rollouts=True, max_staleness=1, producer_threads=1,
            trainer_kwargs={"enable_checkpointing": True})
    stopped = time.time()
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == step
    assert signals.sent is not None and stopped - signals.sent < 5
    assert signals.producer.exitcode is not None  # terminated, not left hanging
    monkeypatch.setattr(producer, "produce", real_produce)
    _, metrics, _ = run(tmp_path / "resumed", prompts, 4, ckpt_path=str(last), async_rollouts=True, max_staleness=1,
                        producer_threads=1)
    assert [int(r["step"]) for r in metrics if "train/loss" in r] == list(range(step, 4))  # resumes from it


def test_settings_that_let_rounds_grow_staler_than_max_staleness_are_one_warning_at_setup():
    """A round asked ``lead`` steps ahead samples weights up to ``weight_sync_steps - 1`` steps older: beyond
    ``max_staleness`` it is dropped, which the setup says in one line with the setting that fixes it; nothing asked
    ahead (``max_staleness: 0``), no bound, or a bound the lead and the sync keep are quiet."""
    with pytest.warns(UserWarning) as warned:
        warn_if_stale(2, 10, 2)  # the fault run's settings: 15 of 20 rounds dropped
    (line,) = [str(w.message) for w in warned]
    assert line == ("lit_align: model.max_staleness is 2 but the weights reach the rollout producer every 10 "
                    "optimizer steps (model.weight_sync_steps) and it samples 2 step(s) ahead: rounds can be 11 steps "
                    "old, and those older than 2 are dropped and sampled again in the trainer "
                    "(train/async/dropped_rounds); set model.weight_sync_steps: 1 or model.max_staleness: null (one "
                    "round ahead, none dropped)")
    for quiet in [(0, 10, 0), (None, 10, 1), (1, 1, 1), (4, 3, 2), (3, 2, 1.5)]:
        warn_if_stale(*quiet)  # a lit_align warning would fail the test


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
    ({"producer_device": "bogus"}, r"^model.producer_device: 'bogus' is not a device \(expected cpu, cuda, cuda:1, "
                                   r"..., or null: the trainer's\)$"),
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


def test_a_producer_device_this_machine_lacks_is_one_line_before_the_producer_starts(tmp_path, prompts):
    with pytest.raises(LitAlignError, match=r"^model.producer_device: 'cuda:99' is not on this machine \(\d+ cuda "
                                            r"device\(s\)\); name one of its devices, or null \(the trainer's\)$"):
        run(tmp_path, prompts, 1, async_rollouts=True, producer_threads=1, producer_device="cuda:99")
