"""Test helpers importable from tests (``from helpers import ...``) and, with ``PYTHONPATH=tests``, from a CLI run
(``--trainer.callbacks+=helpers.RecordBatches``)."""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy

TESTS = Path(__file__).resolve().parent

# what a launcher sets for its ranks: a run started as a subprocess gets none of this process's (Lightning would take
# itself for externally launched and wait for ranks it never starts)
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI run in a subprocess: this one's, without launcher variables, ``tests`` importable."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH")]))
    return {**env, **extra}


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """A CSVLogger ``metrics.csv`` as a list of rows, empty cells dropped, numbers parsed; or a run directory's
    TensorBoard events (the shipped configs' logger) as one row per step (``lit_align.pipeline.read_metrics``)."""
    if Path(path).is_dir():
        from lit_align.pipeline import read_metrics as read_run

        rows: dict[int, dict[str, float]] = {}
        for name, points in read_run(Path(path)).items():
            for step, value in points:
                rows.setdefault(step, {"step": float(step)})[name] = value
        return [rows[step] for step in sorted(rows)]
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def trainer(root: str | Path | None = None, max_steps: int = 1, callbacks=(), **kwargs) -> L.Trainer:
    """The one Trainer the in-process tests fit with: CPU, one device, quiet; no logger, no checkpoints and no
    sanity validation unless asked (``logger=CSVLogger(...)``, ``enable_checkpointing=True``, ...)."""
    settings = {"accelerator": "cpu", "devices": 1, "max_steps": max_steps, "logger": False,
                "enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False,
                "num_sanity_val_steps": 0, "log_every_n_steps": 1, **kwargs}
    if root is not None:
        settings["default_root_dir"] = root
    return L.Trainer(callbacks=list(callbacks), **settings)


def fit(module: L.LightningModule, datamodule: L.LightningDataModule, root: str | Path | None = None,
        max_steps: int = 1, callbacks=(), ckpt_path: str | None = None, **kwargs) -> L.Trainer:
    """``trainer(...).fit(module, datamodule)``: the shared fit harness; returns the trainer. Tests observe the run
    through callbacks (hooks, ``outputs``), the logged metrics (``read_metrics``) and the objects themselves."""
    run = trainer(root, max_steps, callbacks, **kwargs)
    run.fit(module, datamodule, ckpt_path=ckpt_path)
    return run


def metric_at(rows: list[dict[str, float]], name: str, step: int) -> float:
    """The value of ``name`` logged at ``step`` (exactly one such row)."""
    values = [r[name] for r in rows if name in r and int(r["step"]) == step]
    assert len(values) == 1, f"{name} at step {step}: {values}"
    return values[0]


class RecordBatches(L.Callback):
    """Write every training batch this rank sees to ``<out_dir>/rank<R>.json``: ``[{step, input_ids}]``.

    Args:
        out_dir: where the per-rank files go.
    """

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.seen: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append({"step": trainer.global_step, "input_ids": batch["input_ids"].tolist(),
                          "completion_mask": batch["completion_mask"].tolist()})

    def on_train_end(self, trainer, pl_module) -> None:
        out = Path(self.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
            "world_size": trainer.world_size, "batches": self.seen,
        }))


def left_padded(tokenizer, prompts):
    """Left-padded ``(prompt_ids, prompt_mask)`` of several prompt strings, as PromptDataModule collates them."""
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    return (torch.tensor([[pad] * (width - len(i)) + i for i in ids]),
            torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids]))


class SigtermAt(L.Callback):
    """Send this process a real SIGTERM (or ``signum``: ``INT`` for a Ctrl-C) during the training step at ``step``
    (Lightning's handler, or ``SigtermCheckpoint``'s for Ctrl-C, takes it from there).

    Args:
        step: the global step whose batch receives the signal.
        signum: the signal's name without ``SIG``.
    """

    def __init__(self, step: int, signum: str = "TERM"):
        self.step, self.signum = step, getattr(signal, f"SIG{signum}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class DiskFullOnSave(L.Callback):
    """Every checkpoint save fails as a full disk makes it fail (``OSError`` ENOSPC, no file named)."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class RecordValidation(L.Callback):
    """Appends the global step of every validation run to ``path``, one per line."""

    def __init__(self, path: str):
        self.path = path

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            with open(self.path, "a") as file:
                file.write(f"{trainer.global_step}\n")


class FillsUp:
    """A file that takes ``room`` more bytes, then fails each write as a full disk does (``OSError`` ENOSPC)."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


class HangInCheckpointWrite(L.Callback):
    """From step ``step`` on, every ``torch.save`` writes half a checkpoint's bytes, touches ``marker`` and hangs: a
    process killed then dies in the middle of a checkpoint write.

    Args:
        step: the first global step whose checkpoint write hangs.
        marker: file created once the write is half done.
    """

    def __init__(self, step: int, marker: str):
        self.step, self.marker = step, marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        real_save = torch.save

        def hanging_save(obj, f, *args, **kwargs):
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            if isinstance(f, (str, Path)):
                f = open(f, "wb")  # noqa: SIM115 - never closed: the process is killed
            f.write(data[: len(data) // 2])
            f.flush()
            Path(self.marker).touch()
            time.sleep(600)

        torch.save = hanging_save


def write_sort_rows(path: Path, n: int, kind: str) -> str:
    """``n`` sort-task rows as JSONL at ``path``: ``kind`` ``prompts`` (prompt, answer) or ``pairs`` (prompt, chosen,
    rejected); digit strings of 3-5 characters, distinct and in no order."""
    digits = [f"{(i * 7919) % 100000:05d}"[: 3 + i % 3] for i in range(n)]
    if kind == "prompts":
        rows = [{"prompt": f"sort {d}:", "answer": "".join(sorted(d))} for d in digits]
    else:
        rows = [{"prompt": f"sort {d}:", "chosen": " " + "".join(sorted(d)), "rejected": " " + d[::-1] + "0"}
                for d in digits]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_main(args: list[str], capfd) -> tuple[int, str, str]:
    """``main(args)`` in-process: (exit code, stdout, stderr). A non-SystemExit exception fails the test."""
    code, argv = 0, sys.argv
    sys.argv = ["lit-align"]  # not pytest's own arguments (LightningCLI warns when it sees both)
    try:
        from lit_align.cli import main

        main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    out, err = capfd.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def run_single(args: list[str]) -> None:
    """The CLI in this process, on one device."""
    from lit_align.cli import main

    argv, sys.argv = sys.argv, ["lit-align"]
    try:
        main([*args, "--trainer.devices", "1"])
    finally:
        sys.argv = argv


def ddp_and_single(tmp_path_factory, ddp_args, single_args=None, strategy: list[str] | None = None) -> tuple[Path, Path]:
    """Run the CLI with ``ddp_args(out_dir)`` on 2 ranks (a subprocess; ``strategy``: the arguments that pick the
    strategy, DDP by default) and meanwhile, in this process and with ``single_args(out_dir)``, on one; returns both
    output directories."""
    ddp_dir, single_dir = tmp_path_factory.mktemp("ddp"), tmp_path_factory.mktemp("single")
    env = cli_env()
    ddp = subprocess.Popen(
        [sys.executable, "-m", "lit_align", *ddp_args(ddp_dir), *(strategy or ["--trainer.strategy", "ddp"]),
         "--trainer.devices", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ddp_dir,
    )
    if single_args is not None:
        run_single(single_args(single_dir))
    output, _ = ddp.communicate(timeout=600)
    assert ddp.returncode == 0, output[-5000:]
    return ddp_dir, single_dir


def reward_digit_fraction(completions, **_):
    """Fraction of digits in the completion: random completions spread, so advantages (and gradients) are non-zero."""
    return digit_fraction(completions)


def reward_constant(completions, **_):
    """The same reward for every completion: every group scores alike."""
    return [1.0] * len(completions)


def flat_prompt(prompt) -> bool:
    """The prompts ``reward_flat_on_some_prompts`` scores flat: about half, by a checksum of the text."""
    return zlib.crc32(str(prompt).encode()) % 2 == 0


def reward_flat_on_some_prompts(prompts, completions, **_):
    """The same reward for every completion of a ``flat_prompt`` (its group teaches nothing), a spread one elsewhere
    (a checksum of the completion: two distinct completions almost never tie)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [0.5 if flat_prompt(p) else zlib.crc32(t.encode()) / 2**32 for p, t in zip(prompts, texts)]


def digit_fraction(completions, **_):
    """A reward that spreads random completions (fraction of digits), so advantages and gradients are non-zero."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


class ReplayRollouts(L.Callback):
    """Record what GRPO's engine returns on this rank (``record_dir``), or replay recorded rounds (``replay_dir``).

    Replaying, each round's completions come from the recording of whichever rank sampled that prompt in that round,
    in the order of this run's prompts (rewards are recomputed from them): a one-process run then trains on exactly
    the completions a DDP run sampled, so their losses can be compared (sampling itself depends on each rank's
    random stream). Both work through the engine interface: the module's ``engine`` is replaced by one that
    records or replays (``lit_align.generation.Engine``).

    Args:
        record_dir: write ``<record_dir>/rank<R>.pt`` at the end of training.
        replay_dir: read every ``rank*.pt`` there and replay it instead of sampling.
    """

    def __init__(self, record_dir: str | None = None, replay_dir: str | None = None):
        self.record_dir, self.replay_dir = record_dir, replay_dir
        self.rounds: list[dict] = []

    def setup(self, trainer, pl_module, stage) -> None:
        if self.replay_dir is None:
            pl_module.rollouts.engine = _RecordingEngine(pl_module.rollouts.engine, self.rounds)
        else:
            pl_module.rollouts.engine = _ReplayingEngine([torch.load(p) for p in sorted(Path(self.replay_dir).glob("rank*.pt"))])

    def on_train_end(self, trainer, pl_module) -> None:
        if self.record_dir is not None:
            Path(self.record_dir).mkdir(parents=True, exist_ok=True)
            torch.save(self.rounds, Path(self.record_dir) / f"rank{trainer.global_rank}.pt")


def _prompt_keys(prompt_ids, prompt_mask) -> list[str]:
    return [json.dumps(ids[m.bool()].tolist()) for ids, m in zip(prompt_ids, prompt_mask)]


class _RecordingEngine:
    def __init__(self, inner, rounds: list[dict]):
        self.inner, self.rounds = inner, rounds

    def generate(self, model, prompt_ids, prompt_mask, num_samples, eos_token_ids, pad_token_id):
        rollout = self.inner.generate(model, prompt_ids, prompt_mask, num_samples, eos_token_ids, pad_token_id)
        self.rounds.append({
            "prompts": [key for key in _prompt_keys(prompt_ids, prompt_mask) for _ in range(num_samples)],
            "ids": [row[m.bool()] for row, m in zip(rollout.completion_ids, rollout.completion_mask)],
            "truncated": list(rollout.truncated),
        })
        return rollout


class _ReplayingEngine:
    def __init__(self, recorded: list[list[dict]]):
        self.by_round = [{} for _ in recorded[0]]  # round -> prompt -> its recorded completions
        for rank in recorded:
            for k, rnd in enumerate(rank):
                for prompt, ids, truncated in zip(rnd["prompts"], rnd["ids"], rnd["truncated"]):
                    self.by_round[k].setdefault(prompt, []).append((ids, truncated))
        self.calls = 0

    def generate(self, model, prompt_ids, prompt_mask, num_samples, eos_token_ids, pad_token_id):
        from lit_align.generation import Rollout

        recorded = self.by_round[self.calls]
        self.calls += 1
        rows = [row for key in _prompt_keys(prompt_ids, prompt_mask) for row in recorded[key]]
        width = max(len(ids) for ids, _ in rows)
        completion_ids = torch.stack([torch.cat([ids, ids.new_full((width - len(ids),), pad_token_id)])
                                      for ids, _ in rows])
        mask = torch.stack([torch.arange(width) < len(ids) for ids, _ in rows]).long()
        return Rollout(completion_ids, mask, torch.stack([t for _, t in rows]))


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy, let onto CPU (gloo) for tests. Lightning refuses ``FSDPStrategy`` itself without a
    GPU (an exact type check) and passes no ``device_id`` on CPU, which torch's FSDP then refuses; given
    ``device_id=cpu`` explicitly, torch's FSDP shards and trains on CPU. Full state dicts are gathered without
    ``offload_to_cpu`` (which crashes when the parameters already live on CPU)."""

    def _setup_model(self, model):
        import torch.distributed.fsdp as fsdp

        real = fsdp.FullyShardedDataParallel

        class OnCPU(real):
            def __init__(self, *args, device_id=None, **kwargs):
                super().__init__(*args, device_id=torch.device("cpu"), **kwargs)

        fsdp.FullyShardedDataParallel = OnCPU
        try:
            return super()._setup_model(model)
        finally:
            fsdp.FullyShardedDataParallel = real

    def lightning_module_state_dict(self):
        with _no_cpu_offload():
            return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer):
        with _no_cpu_offload():
            return super().optimizer_state(optimizer)


@contextlib.contextmanager
def _no_cpu_offload():
    import lightning.pytorch.strategies.fsdp as lightning_fsdp
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def context(module, world_size, rank0_only=True):
        return FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT,
                                    FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
                                    FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only))

    real = lightning_fsdp._get_full_state_dict_context
    lightning_fsdp._get_full_state_dict_context = context
    try:
        yield
    finally:
        lightning_fsdp._get_full_state_dict_context = real


def trl_pair_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A lit_align ``[chosen; rejected]`` batch in the format TRL's experimental CPO and ORPO trainers read
    (``chosen_input_ids``, ``chosen_attention_mask``, ``chosen_labels``: -100 outside the completion, rejected
    alike), so both sides run the same tokens."""
    pairs = len(batch["input_ids"]) // 2
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    out = {}
    for side, rows in (("chosen", slice(0, pairs)), ("rejected", slice(pairs, None))):
        out[f"{side}_input_ids"] = batch["input_ids"][rows]
        out[f"{side}_attention_mask"] = batch["attention_mask"][rows]
        out[f"{side}_labels"] = labels[rows]
    return out


def pair_metrics(module, batch) -> dict[str, float]:
    """The batch's metrics as ``training_step`` logs them (pair means)."""
    out, weights = module.pair_outputs(batch)
    out = {name: value.detach() for name, value in out.items()}
    return {name: float(out[name].mean() if name not in weights else
                        (out[name] * weights[name]).sum() / weights[name].sum()) for name in module.metrics}


def pair_metric_scales(ours: dict[str, float], beta: float) -> dict[str, float]:
    """The magnitude of what enters each metric of a reference-free pair recipe (``tests/numerics.py`` rule 3)."""
    s = max(abs(ours["logps/chosen"]), abs(ours["logps/rejected"]))
    return {"loss": beta * s + abs(ours["loss"]) + abs(ours["nll_loss"]), "rewards/accuracies": 1.0,
            "logps/chosen": s, "logps/rejected": s, "nll_loss": max(abs(ours["nll_loss"]), 1.0),
            **{name: beta * s for name in ("rewards/chosen", "rewards/rejected", "rewards/margins")}}


class LoggedSteps(L.Callback):
    """What training logged after each batch: ``steps[i]`` is ``trainer.callback_metrics`` after batch ``i``."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def assert_same_gradients(model: torch.nn.Module, reference: torch.nn.Module, positions: int) -> None:
    """Every parameter's gradient in ``model`` equals ``reference``'s up to fp32 rounding of what each weight's
    gradient sums (``positions`` positions' products over the tiny model's longest reduction), and is not zero."""
    from numerics import TINY_TERMS, assert_rounding_close

    theirs = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert theirs[name].grad.abs().max() > 0, name
        assert_rounding_close(param.grad, theirs[name].grad, terms=positions * TINY_TERMS, msg=f"{name} gradient")


class ScriptedEngine:
    """An ``Engine`` whose every ``generate`` call "samples" the next texts of ``script`` (one per row it is given),
    with log-prob ``-(position + 1) / 100`` at each token; it records the prompts (unpadded) it was called with. Once
    the script is used up, ``then`` (another engine) samples, if given: a first turn forced, the rest sampled."""

    def __init__(self, tokenizer, script: list[list[str]], then=None):
        self.tokenizer, self.script, self.prompts, self.then = tokenizer, list(script), [], then

    def generate(self, model, prompt_ids, prompt_mask, num_samples, eos_token_ids, pad_token_id):
        from lit_align.generation import Rollout

        if not self.script and self.then is not None:
            return self.then.generate(model, prompt_ids, prompt_mask, num_samples, eos_token_ids, pad_token_id)
        texts = self.script.pop(0)
        self.prompts.append([p[m.bool()].tolist() for p, m in zip(prompt_ids, prompt_mask)])
        assert len(texts) == len(prompt_ids) * num_samples
        ids = [self.tokenizer(t)["input_ids"] for t in texts]
        width = max(map(len, ids))
        completion_ids = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in ids])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
        logps = -(torch.arange(width) + 1).float().expand(len(ids), width) / 100 * mask
        truncated = torch.tensor([r[-1] not in eos_token_ids for r in ids])
        return Rollout(completion_ids, mask, truncated, logps)


class CounterEnvironment:
    """A test environment (``model.environment_factory: helpers.CounterEnvironment``): a counter the model moves
    with its ``increment`` tool; rewarded 1.0 when the counter ends at the row's ``answer``."""

    def reset(self, **row) -> str:
        self.target, self.count = int(row["answer"]), 0
        return f" (reach {self.target})"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count == self.target)


class BrokenEnvironment:
    """A test environment whose ``reset`` raises."""

    def reset(self, **row) -> None:
        raise ValueError("no such level")


def replay_rollout(prompts, module):
    """A test ``rollout_func``: each prompt rendered by the module's tokenizer, completion ``"<k>|env|ok</s>"`` for
    the k-th prompt with ``|env|`` marked as not sampled (``env_mask`` 0), log-probs -0.5, and a ``score`` column
    (k) for ``reward_score``."""
    tok = module.tokenizer
    prompt_ids = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) if isinstance(p, list)
                  else tok(p)["input_ids"] for p in prompts]
    parts = [[tok(f"{k}")["input_ids"], tok("|env|")["input_ids"], tok("ok</s>")["input_ids"]]
             for k in range(len(prompts))]
    return {"prompt_ids": prompt_ids, "completion_ids": [a + b + c for a, b, c in parts],
            "logprobs": [[-0.5] * (len(a) + len(b) + len(c)) for a, b, c in parts],
            "env_mask": [[1] * len(a) + [0] * len(b) + [1] * len(c) for a, b, c in parts],
            "score": [float(k) for k in range(len(prompts))]}


def out_of_vocab_rollout(prompts, module):
    """``replay_rollout`` with the first completion's first id one past the tokenizer's last."""
    output = replay_rollout(prompts, module)
    output["completion_ids"][0][0] = len(module.tokenizer)
    return output


def reward_score(completions, score, **_):
    """Reads a rollout_func's own column."""
    return list(score)


def bad_rollout(prompts, module):
    """A test ``rollout_func`` that returns the completions alone (no ids)."""
    return ["12"] * len(prompts)


def add(a: int, b: int) -> int:
    """Add two whole numbers (a test tool: ``model.tools: [helpers.add]``).

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def increment_call(by: int) -> str:
    """A first turn that calls ``CounterEnvironment.increment`` (the built-in tool template's call format)."""
    return f'<tool_call>{{"name": "increment", "arguments": {{"by": {by}}}}}</tool_call></s>'


class ForceToolCalls(L.Callback):
    """Script the first round's first turns (a plain Lightning callback, usable from the CLI): on a rank listed in
    ``calling_ranks`` every completion calls ``increment(1)``, elsewhere every one answers ``no``; the turns after a
    tool result, and later rounds, are sampled by the module's own engine."""

    def __init__(self, completions: int, calling_ranks: list[int] = (0,)):
        self.completions, self.calling_ranks = completions, list(calling_ranks)

    def on_fit_start(self, trainer, pl_module) -> None:
        turn = increment_call(1) if trainer.global_rank in self.calling_ranks else "no</s>"
        pl_module.rollouts.engine = ScriptedEngine(pl_module.tokenizer, [[turn] * self.completions], then=pl_module.rollouts.engine)


# A tool-using SFT prompt/completion row: an earlier exchange in the prompt; the completion calls the tool, gets its
# result (a tool turn) and answers. Each piece as the builtin:tools template renders it, with whether it is an
# assistant turn's (assistant_mask) and whether it is the completion's (completion_mask).
TOOL_ROW = {
    "prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"role": "user", "content": "4821+3907 mod 7?"}],
    "completion": [{"role": "assistant", "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "compute", "arguments": {}}}]},
                   {"role": "tool", "name": "compute", "content": "66666666"},
                   {"role": "assistant", "content": "6"}],
    "tools": '[{"type": "function", "function": {"name": "compute", "description": "Compute the answer.", '
             '"parameters": {"type": "object", "properties": {}}}}]',
}
TOOL_ROW_PIECES = [  # (text, assistant, completion)
    ("<|system|>tools: compute()\n<|user|>hi\n<|assistant|>", 0, 0),
    ("hello</s>", 1, 0),
    ("<|user|>4821+3907 mod 7?\n<|assistant|>", 0, 0),
    ('<tool_call>{"name": "compute", "arguments": {}}</tool_call></s>', 1, 1),
    ("<|tool|>66666666\n<|assistant|>", 0, 1),
    ("6</s>", 1, 1),
]


def tool_row_tokens(tokenizer) -> dict[str, list[int]]:
    """``TOOL_ROW``'s ``input_ids``, ``completion_mask`` and ``assistant_mask``, piece by piece."""
    out = {"input_ids": [], "completion_mask": [], "assistant_mask": []}
    for text, assistant, completion in TOOL_ROW_PIECES:
        piece = tokenizer(text)["input_ids"]
        out["input_ids"] += piece
        out["assistant_mask"] += [assistant] * len(piece)
        out["completion_mask"] += [completion] * len(piece)
    return out


def reward_that_raises(completions, **_):
    raise ValueError("no reward today")


class RecordProducerPid(L.Callback):
    """Writes the rollout producer's process id (``model.async_rollouts``) to ``path`` at the first step."""

    def __init__(self, path: str):
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.producer is not None and not os.path.exists(self.path):
            Path(self.path).write_text(str(pl_module.producer.process.pid))


def prefer_token(model, tokenizer, prompts: list[str], text: str, steps: int = 3) -> int:
    """Train ``model`` (SGD, lr 1) for ``steps`` steps to make ``text``'s first token its next token after each of
    ``prompts`` (a change of weights every engine must follow); returns that token."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    target = tokenizer(text, add_special_tokens=False)["input_ids"][0]
    prompt_ids, prompt_mask = left_padded(tokenizer, prompts)
    for _ in range(steps):
        logits = model(input_ids=prompt_ids, attention_mask=prompt_mask).logits[:, -1]
        torch.nn.functional.cross_entropy(logits, torch.full((len(prompts),), target)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return target


def mapped_resident_kib(module) -> int:
    """The resident KiB of the file mappings that hold ``module``'s parameters and buffers (``/proc/self/smaps``;
    other mappings of the same files, other models', are not counted)."""
    addresses = [t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]]
    total, holds = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                holds = len(fields) >= 6 and fields[4] != "0" and any(start <= a < end for a in addresses)
            elif holds and fields[0] == "Rss:":
                total += int(fields[1])
    return total
