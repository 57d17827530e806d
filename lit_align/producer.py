"""Asynchronous rollouts: a producer process samples and scores rounds while the trainer trains.

With ``model.async_rollouts`` an online recipe (``lit_align.modules.online.OnlineModule``) stops alternating
generation and training. Its ``RolloutProducer`` starts another process (``ProducerProcess``, running ``produce``) that
holds its own copy of the policy and its own ``lit_align.rollouts.Rollouts`` (engine, reward functions, tools,
environments). At each round's first step the trainer asks for the rounds up to ``rounds_ahead`` after it (``submit``:
a round's prompts, seed and key; the data looks ahead for it), takes this one (``take``, waiting only if it is not
ready, dropping it if staler than ``max_staleness``), and pushes its weights every ``weight_sync_steps`` optimizer
steps (``push``).

The producer's copy of the policy is sent once, as its first message. Weights then travel through one copy of the
trainable tensors in shared memory, *staged*: the trainer writes them under a lock and stamps them with their version
(its ``global_step``); the producer, between two rounds, copies them into its policy under the same lock when the
version moved. A round comes back with the version that sampled it, so the trainer knows its staleness.

No wait is without a bound and a liveness check. A producer that fails sends its error before it exits; one that
dies otherwise (killed, out of memory), the weights lock held or not, is noticed within ``POLL_S``: every wait of the
trainer (for the lock in ``push``, for a round in ``take``) polls it, and the trainer stops with one line. A SIGTERM
(or a first Ctrl-C: Lightning's flag) ends a wait at an optimizer step's boundary, so that ``SigtermCheckpoint``
writes its checkpoint, the last step's whole state, even while a producer that lives but hangs (a tool, a reward
function) keeps a round from coming; inside an accumulation window, whose gradients a checkpoint cannot hold, and
under DDP, whose ranks agree to stop at step boundaries only, the wait goes on until the round comes or the producer
dies. The producer ignores Ctrl-C (the trainer, which gets it too, stops it), waits for the lock only while its
parent lives, and exits when its parent is gone.
"""

from __future__ import annotations

import copy
import os
import pickle
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_align.errors import LitAlignError
from lit_align.rollouts import Generation, Rollouts, completion_token_logps

POLL_S = 0.2  # how often a waiting trainer checks that the producer is alive (and for a SIGTERM)
PARENT_POLL_S = 1.0  # how often a waiting producer checks that the trainer is alive
POLITE_EXIT_S = 2.0  # how long ``close`` waits for a producer asked to stop before terminating it


@dataclass
class Request:
    key: tuple[int, int]  # (epoch, round in the epoch)
    batch: dict[str, Any]  # the round's prompts, collated (``PromptDataModule.round_batch``), on the CPU
    num_samples: int
    seed: int
    max_steps: int  # for the reward functions' ``trainer_state``
    epoch: int


@dataclass
class ProducedRound:
    key: tuple[int, int]
    version: int  # the trainer's ``global_step`` whose weights sampled it
    generation: Generation
    seconds: float  # the producer's time on it


class ProducerSide:
    """What ``Rollouts`` reads of a LightningModule, in the producer: the policy, its tokenizer and device, and the
    step and trainer fields reward functions see (``trainer_state``)."""

    def __init__(self, policy, tokenizer, device: torch.device):
        self.policy, self.tokenizer, self.device = policy, tokenizer, device
        self.global_step, self._trainer = 0, SimpleNamespace(max_steps=-1, current_epoch=0)


def describe(error: BaseException) -> str:
    """One line for an error raised in the producer: a ``LitAlignError``'s own text, else its type, text and where
    in the code it was raised."""
    if isinstance(error, LitAlignError):
        return str(error)
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {error}{where}"


def sampling_copy(policy: torch.nn.Module) -> bytes:
    """The policy as the producer gets it, pickled: a copy on the CPU without what only training uses (gradient
    checkpointing, the forward and backward hooks of recomputation, activation mapping and input gradients: local
    functions, which cannot be pickled)."""
    copied = copy.deepcopy(policy).cpu()
    if getattr(copied, "is_gradient_checkpointing", False):
        copied.gradient_checkpointing_disable()
    for module in copied.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                      module._backward_pre_hooks):
            hooks.clear()
    try:
        return bytes(ForkingPickler.dumps(copied))
    except Exception as error:  # noqa: BLE001
        raise LitAlignError(f"model.async_rollouts: the policy cannot be sent to the producer process ({error}); "
                            "set model.async_rollouts: false") from error


def next_message(requests, parent: int):
    """The trainer's next message; None when it says stop or is gone (checked every ``PARENT_POLL_S``)."""
    while True:
        try:
            return requests.get(timeout=PARENT_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def load_staged(mine: list[torch.Tensor], staged: list[torch.Tensor], version, lock, parent: int,
                loaded: int | None) -> int | None:
    """The newest staged weights copied into the producer's policy (``mine``) under the lock, if their version moved
    since ``loaded``; the version it now holds. None when the trainer is gone (it died holding the lock, say)."""
    while not lock.acquire(timeout=PARENT_POLL_S):
        if os.getppid() != parent:
            return None
    try:
        if version.value != loaded:
            with torch.no_grad():
                for param, value in zip(mine, staged, strict=True):
                    param.copy_(value)
        return version.value
    finally:
        lock.release()


def produce(spec: dict, staged: list[torch.Tensor], version, lock, requests, results, parent: int) -> None:
    """The producer process: rounds in ``requests`` order, each sampled with the newest weights staged so far."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer too, which stops this process
    torch.set_num_threads(spec["threads"])
    try:
        device = torch.device(spec["device"])
        policy = next_message(requests, parent)
        if policy is None:
            return
        policy = pickle.loads(policy).to(device).eval()
        mine = [p for p in policy.parameters() if p.requires_grad]
        network = policy.get_base_model() if spec["lora"] else policy
        rollouts = Rollouts(**spec["rollouts"])
        rollouts.setup(spec["tokenizer"], network, *spec["setup"])
        side, loaded = ProducerSide(policy, spec["tokenizer"], device), None
        while (request := next_message(requests, parent)) is not None:
            start = time.perf_counter()
            if (loaded := load_staged(mine, staged, version, lock, parent, loaded)) is None:
                return
            side.global_step, side._trainer = loaded, SimpleNamespace(max_steps=request.max_steps,
                                                                      current_epoch=request.epoch)
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in request.batch.items()}
            gen = rollouts.generate(side, batch, request.num_samples, seed=request.seed)  # (as Lightning's batches)
            if gen.logps is None:  # an engine without sampling log-probs: the producer's forward gives them
                gen.logps = completion_token_logps(network, gen.prompt_ids, gen.prompt_mask, gen.completion_ids,
                                                   gen.completion_mask, spec["temperature"],
                                                   chunk_size=spec["chunk_size"])
            gen.weights_version = loaded
            results.put(("round", ProducedRound(request.key, loaded, gen.to("cpu"), time.perf_counter() - start)))
    except BaseException as error:  # noqa: BLE001 -- whatever it is, the trainer gets it as one line
        results.put(("error", describe(error)))


class ProducerProcess:
    """The producer process and its channels, seen from the trainer: ``push`` weights, ``submit`` requests, ``take``
    rounds, ``close``.

    Args:
        module: the online module whose policy, tokenizer and rollout settings the producer copies.
        threads: the producer's CPU threads (``torch.set_num_threads``).
        device: where the producer's policy runs.
        stop: asked while waiting for the producer: True ends the wait with ``SIGTERMException`` (a SIGTERM at a
            step boundary: ``RolloutProducer.stop_requested``).
    """

    def __init__(self, module, threads: int, device: torch.device, stop: Callable[[], bool] = lambda: False):
        policy = module.policy
        self.live = [p for p in policy.parameters() if p.requires_grad]  # the others never change
        self.staged = [p.detach().to("cpu", copy=True).share_memory_() for p in self.live]
        initial = sampling_copy(policy)  # the producer's own copy, sent once (pickled here: an error is ours)
        context = mp.get_context("spawn")
        self.lock, self.version = context.Lock(), context.Value("q", int(module.global_step), lock=False)
        self.requests, self.results = context.Queue(), context.Queue()
        hp = module.hparams
        spec = {"threads": threads, "device": str(device), "lora": module.lora_config is not None,
                "tokenizer": module.tokenizer, "rollouts": module.rollouts_settings,
                "setup": (hp.dtype, hp.trust_remote_code, hp.model_init_kwargs),
                "temperature": module.temperature, "chunk_size": module.logps_chunk_size}
        self.process = context.Process(target=produce, name="lit_align-rollouts", daemon=True, args=(
            spec, self.staged, self.version, self.lock, self.requests, self.results, os.getpid()))
        self.process.start()
        self.requests.put(initial)
        self.pending: list[tuple[int, int]] = []  # submitted, not taken yet
        self.ready: dict[tuple[int, int], ProducedRound] = {}
        self.busy_s = 0.0  # the producer's time on the rounds received so far
        self.stop = stop

    def push(self, version: int) -> None:
        """Stage the policy's trainable weights as ``version`` (the producer loads them before its next round). The
        lock is waited for ``POLL_S`` at a time, checking that the producer lives (it holds the lock only while it
        copies the weights; one that died holding it never gives it back) and for a SIGTERM."""
        while not self.lock.acquire(timeout=POLL_S):
            if not self.process.is_alive():
                self.ended(" while it held the weights lock,")
            self.check_stop()
        try:
            with torch.no_grad():
                for staged, live in zip(self.staged, self.live):
                    staged.copy_(live.detach())
            self.version.value = version
        finally:
            self.lock.release()

    def check_stop(self) -> None:
        """A SIGTERM at a step boundary ends the wait: Lightning's way out (``SigtermCheckpoint`` saves), the producer
        terminated first (Lightning calls no module hook on the way out; whatever it was sampling is not needed)."""
        if self.stop():
            rank_zero_info("lit_align: async rollouts: a SIGTERM (or Ctrl-C) while waiting for the rollout producer: "
                           "stopping at the last optimizer step")
            self.close(polite=False)
            raise SIGTERMException

    @property
    def staged_version(self) -> int:
        return self.version.value

    def submit(self, request: Request) -> None:
        self.requests.put(request)
        self.pending.append(request.key)

    def in_flight(self, key: tuple[int, int]) -> bool:
        return key in self.pending or key in self.ready

    def receive(self, timeout: float | None) -> bool:
        """Move one message from the producer into ``ready``; False when none came within ``timeout``."""
        try:
            kind, payload = self.results.get(timeout=timeout) if timeout else self.results.get_nowait()
        except queue.Empty:
            if self.process.is_alive():
                return False
            kind, payload = self.last_words()
        except (EOFError, OSError):  # the channel broke: the process is gone
            kind, payload = self.last_words()
        if kind == "error":
            raise LitAlignError(f"model.async_rollouts: the rollout producer failed: {payload}")
        self.pending.remove(payload.key)
        self.ready[payload.key] = payload
        self.busy_s += payload.seconds
        return True

    def last_words(self) -> tuple[str, Any]:
        """What a producer that ended sent before it did (its error, sent just before the end), else ``ended``."""
        self.process.join(timeout=5)
        try:
            return self.results.get(timeout=POLL_S)
        except (queue.Empty, EOFError, OSError):
            self.ended()

    def ended(self, where: str = "") -> None:
        self.close()  # its channels
        code = self.process.exitcode
        why = " (-9: SIGKILL, which the out-of-memory killer sends too)" if code == -signal.SIGKILL else ""
        raise LitAlignError(f"model.async_rollouts: the rollout producer process ended (exit code {code}){where} "
                            f"without a word{why}; see its output above") from None

    def queue_depth(self) -> int:
        """Rounds sampled and waiting for their turn."""
        while self.receive(None):
            pass
        return len(self.ready)

    def take(self, key: tuple[int, int]) -> ProducedRound:
        """Round ``key``, waiting for it; rounds of keys before it that were never taken (an epoch cut short by
        ``limit_train_batches``) are dropped."""
        if not self.in_flight(key):
            raise LitAlignError(f"model.async_rollouts: round {key} was never asked of the producer")
        while key not in self.ready:
            self.receive(POLL_S)  # (a producer that died is noticed there)
            if key not in self.ready:
                self.check_stop()
        for older in [k for k in self.ready if k < key]:
            del self.ready[older]
        return self.ready.pop(key)

    def close(self, polite: bool = True) -> None:
        """Stop the producer: asked first (it reads the ask between two rounds; ``polite``), then terminated, then
        killed."""
        if polite and self.process.is_alive():
            self.requests.put(None)
            self.process.join(timeout=POLITE_EXIT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        for channel in (self.requests, self.results):
            channel.cancel_join_thread()
            channel.close()


def available_device(name: str) -> torch.device:
    """``model.producer_device`` as a device of this machine, or one line saying why it is not."""
    device = torch.device(name)  # (its form was checked with the module's settings: ``check_producer_device``)
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, torch.mps, ...
    available = getattr(backend, "is_available", lambda: hasattr(backend, "device_count"))()
    count = backend.device_count() if available else 0
    if count == 0 or (device.index or 0) >= count:
        raise LitAlignError(f"model.producer_device: {name!r} is not on this machine ({count} {device.type} "
                            f"device(s)); name one of its devices, or null (the trainer's)")
    return device


def check_producer_device(name: str | None) -> None:
    """Refuse a ``model.producer_device`` that names no device (``torch.device`` cannot read it), in one line."""
    if name is None:
        return
    try:
        torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise LitAlignError(f"model.producer_device: {name!r} is not a device (expected cpu, cuda, cuda:1, ..., or "
                            "null: the trainer's)") from None


def warn_if_stale(max_staleness: int | None, sync_steps: int, lead: float) -> None:
    """One warning when the settings let rounds grow staler than ``max_staleness`` (then dropped and sampled again
    in the trainer): a round asked ``lead`` optimizer steps before its turn samples the weights last pushed, up to
    ``weight_sync_steps - 1`` steps older. Without a lead (nothing sampled ahead) each round is sampled by the
    current weights."""
    if max_staleness is None or lead <= 0:
        return
    oldest = sync_steps - 1 + lead
    if oldest <= max_staleness:
        return
    rank_zero_warn(f"lit_align: model.max_staleness is {max_staleness} but the weights reach the rollout producer "
                   f"every {sync_steps} optimizer steps (model.weight_sync_steps) and it samples {lead:g} step(s) "
                   f"ahead: rounds can be {oldest:g} steps old, and those older than {max_staleness} are dropped and "
                   f"sampled again in the trainer (train/async/dropped_rounds); set model.weight_sync_steps: "
                   f"{max(1, int(max_staleness - lead + 1))} or model.max_staleness: null (one round ahead, none "
                   "dropped)")


class RolloutProducer:
    """Asynchronous rounds for an online module (module docstring): the producer process, what was asked of it, the
    staleness bound and the ``async/*`` metrics. ``OnlineModule`` makes one at the start of training
    (``model.async_rollouts``), takes each round from it (``round``), tells it of each step (``after_step``) and
    closes it with the run.
    """

    def __init__(self, module):
        from lit_align.capabilities import is_sharded

        trainer, hp = module.trainer, module.hparams
        if is_sharded(module.policy) or type(trainer.strategy).__name__.startswith(("FSDP", "DeepSpeed")):
            raise LitAlignError("model.async_rollouts: the producer needs the whole policy on each rank; FSDP and "
                                "DeepSpeed shard it: use ddp, or model.async_rollouts: false")
        if not hasattr(trainer.datamodule, "round_batch"):
            raise LitAlignError("model.async_rollouts: the producer samples rounds ahead of their turn, which needs "
                                "lit_align's prompt data (lit_align.data.PromptDataModule) under data:")
        self.max_staleness, self.sync_steps, self.trainer = hp.max_staleness, hp.weight_sync_steps, trainer
        device = module.device if hp.producer_device is None else available_device(hp.producer_device)
        warn_if_stale(self.max_staleness, self.sync_steps, self.rounds_ahead(module) * self.steps_per_round(module))
        self.threads = torch.get_num_threads()  # the trainer's, given back at the end
        threads = hp.producer_threads or max(1, self.threads // 2)
        if module.device.type == "cpu":  # the cores split between the two sides
            torch.set_num_threads(max(1, self.threads - threads))
        self.worker = ProducerProcess(module, threads, device, stop=self.stop_requested)
        rank_zero_info(f"lit_align: async rollouts: a producer on {device} ({threads} threads) samples up to "
                       f"{self.rounds_ahead(module)} round(s) ahead; the trainer on {module.device} "
                       f"({torch.get_num_threads()} threads)")
        self.dropped, self.round_start, self.last_wait, self.last_busy = 0, None, 0.0, 0.0

    @property
    def process(self):
        return self.worker.process

    @staticmethod
    def steps_per_round(module) -> float:
        """Optimizer steps per round (a fraction where a round is shorter than an accumulation window)."""
        return module.round_shape.steps / module.trainer.accumulate_grad_batches

    def rounds_ahead(self, module) -> int:
        """Rounds the producer samples before their turn: as many as ``max_staleness`` optimizer steps allow."""
        per_round = self.steps_per_round(module)
        if self.max_staleness is None:
            return 1
        return int(self.max_staleness // per_round) if per_round > 0 else 0

    def stop_requested(self) -> bool:
        """Whether a wait for the producer gives way to a SIGTERM or a first Ctrl-C (Lightning's flag): between two
        optimizer steps, where a checkpoint holds the whole state (inside an accumulation window the wait goes on:
        the window's gradients so far would be in no checkpoint), on one process (DDP's ranks agree to stop at a
        step's boundary, in Lightning's loop)."""
        trainer = self.trainer
        if not trainer.received_sigterm or trainer.world_size > 1:
            return False
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # this epoch's batches trained on
        return done % trainer.accumulate_grad_batches == 0

    def round(self, module, batch: dict[str, Any]) -> Generation:
        """This round's completions: first the rounds up to ``rounds_ahead`` after it are asked for (the data looks
        ahead: ``PromptDataModule.round_batch``; ``module.policy_samples`` says which are the policy's), then this one
        is waited for. Were it sampled more than ``max_staleness`` optimizer steps ago it is dropped and sampled again
        by the module's current policy. Its ``async/*`` metrics go with it (``Generation.metrics``)."""
        worker, step, data = self.worker, module.global_step, module.trainer.datamodule
        epoch, r, num = module.trainer.current_epoch, int(batch["round"]), module.round_shape.num_generations
        arrived = time.perf_counter()
        if not worker.in_flight((epoch, r)):  # nothing asked for yet (start, resume, a new epoch): current weights
            worker.push(step)
        for ahead in range(self.rounds_ahead(module) + 1):
            key = (epoch, r + ahead)
            if worker.in_flight(key) or not module.policy_samples(ahead):
                continue
            prompts = batch if ahead == 0 else data.round_batch(r + ahead)
            if prompts is None:  # past the epoch's last round
                break
            prompts = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in prompts.items()}
            worker.submit(Request(key, prompts, num, module.round_seed(ahead), module.trainer.max_steps, epoch))
        depth = worker.queue_depth()
        produced = worker.take((epoch, r))
        wait = time.perf_counter() - arrived
        gen, version = produced.generation.to(module.device), produced.version
        if gen.dataset_rows is not None and gen.dataset_rows[::num] != batch["dataset_rows"]:
            raise LitAlignError(f"model.async_rollouts: the producer sampled round {r} of epoch {epoch} from other "
                                "prompts than the data yields; was the data changed during the run?")
        if self.max_staleness is not None and step - version > self.max_staleness:  # too old: sampled again here
            self.dropped += 1
            gen, version = module.rollouts.generate(module, batch, num, seed=module.round_seed()), step
        if version == step:
            gen.weights_version = None  # sampled by the current weights: trained on as a synchronous round
        stats = {"async/staleness": step - version, "async/weights_version": version, "async/queue_depth": depth,
                 "async/dropped_rounds": self.dropped, "async/wait_s": wait}
        if self.round_start is not None:  # since the last round began: the share of it each side was busy
            wall = arrived - self.round_start
            stats["async/trainer_busy"] = 1.0 - self.last_wait / wall
            stats["async/producer_busy"] = min(1.0, (worker.busy_s - self.last_busy) / wall)
        self.round_start, self.last_wait, self.last_busy = arrived, wait, worker.busy_s
        gen.metrics.update({name: [float(value)] for name, value in stats.items()})
        return gen

    def after_step(self, step: int) -> None:
        """The weights to the producer every ``weight_sync_steps`` optimizer steps."""
        if step != self.worker.staged_version and step % self.sync_steps == 0:
            self.worker.push(step)

    def close(self) -> None:
        self.worker.close()
        torch.set_num_threads(self.threads)
