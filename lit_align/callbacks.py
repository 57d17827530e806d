"""When things happen: Lightning Callbacks only (what is computed lives in the modules)."""

from __future__ import annotations

import csv
import signal
import threading
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_align.errors import LitAlignError
from lit_align.export_dir import check_target, write_export
from lit_align.hub import CONFIG_NAME, check_hub_token, model_card, push_to_hub
from lit_align.reference import RefModelSync  # noqa: F401 - its home is lit_align.reference; configs name it here too
from lit_align.strategies import full_policy_state_dict


def run_dir(trainer: L.Trainer) -> Path:
    """The run's own directory: the logger's version directory (CSV, TensorBoard); for loggers whose ``save_dir`` is
    shared by every run (W&B's ``.``, MLflow's ``./mlruns``) ``<default_root_dir>/<name>/<version>``, so one run's
    export never lands on another's; ``default_root_dir`` without a logger. The same on every rank (broadcast)."""
    logger = trainer.logger
    if logger is None:
        return Path(trainer.default_root_dir)
    if isinstance(logger, (CSVLogger, TensorBoardLogger)):
        return Path(trainer.log_dir)
    path = Path(trainer.default_root_dir) / str(logger.name or "run") / str(logger.version) if trainer.is_global_zero else None
    return Path(trainer.strategy.broadcast(path))


class HFExport(L.Callback):
    """At the end of fit, write the policy and tokenizer as a Hugging Face model directory, with a model card.

    The directory is ``<run dir>/<dirname>`` (e.g. ``runs/dpo/version_0/hf_model``) unless ``path`` is given. It may
    replace only an empty directory or an earlier lit_align export the user has not added to; anything else, and a
    path that cannot be created, is refused before training (``lit_align.export_dir``). It is written beside its final
    place and renamed in, so an interrupted export or a full disk never leaves a half-written model. Its
    ``README.md`` is a model card (``lit_align.hub.model_card``: base model, recipe and its settings, data, final
    metrics, the command and config that reproduce the run, which ``lit-align`` sets as ``command`` and ``config``). With ``push_to_hub`` the directory is then uploaded (TRL's names).

    Args:
        dirname: directory name inside the run directory.
        path: an explicit output directory instead: new, empty, or an earlier lit_align export (then replaced).
        enabled: set false to skip the export.
        push_to_hub: upload the export to the Hugging Face Hub at the end (needs a token: ``hf auth login``).
        hub_model_id: the repo, ``org/name`` or ``name`` (under your account); required with ``push_to_hub``.
        hub_private_repo: create the repo private (None: the account's default).
    """

    def __init__(self, dirname: str = "hf_model", path: str | None = None, enabled: bool = True,
                 push_to_hub: bool = False, hub_model_id: str | None = None, hub_private_repo: bool | None = None):
        self.dirname, self.path, self.enabled = dirname, path, enabled
        self.push_to_hub, self.hub_model_id, self.hub_private_repo = push_to_hub, hub_model_id, hub_private_repo
        if push_to_hub and not hub_model_id:
            raise LitAlignError("export.push_to_hub needs export.hub_model_id (the repo: 'org/name' or 'name')")
        self.command: str | None = None  # how the run was started (``lit-align`` sets it)
        self.config: str | None = None  # the run's resolved config (YAML), written beside the weights
        self.exported_to: Path | None = None
        self.pushed_to: str | None = None

    def target(self, trainer: L.Trainer) -> Path:
        """Where the export goes; refuses (before training, and again at the end) a path the export would destroy or
        cannot create (``lit_align.export_dir.check_target``)."""
        target = Path(self.path) if self.path else run_dir(trainer) / self.dirname  # every rank: log_dir broadcasts
        check_target(target)
        return target

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled:
            self.target(trainer)  # a mistake found now costs nothing; at the end it would cost the run
            if self.push_to_hub:
                check_hub_token()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        target = self.target(trainer)
        state_dict = full_policy_state_dict(trainer, pl_module.policy)  # every rank: gathers sharded weights
        if not trainer.is_global_zero:
            return

        def write(folder: Path) -> None:
            pl_module.export(folder, state_dict=state_dict)
            self.write_card(folder, trainer, pl_module, title=self.hub_model_id or target.name)

        write_export(target, write)
        self.exported_to = target
        rank_zero_info(f"lit_align: exported the Hugging Face model to {target}")
        if self.push_to_hub:
            message = f"lit_align: {type(pl_module).__name__} after {trainer.global_step} steps"
            self.pushed_to = push_to_hub(target, self.hub_model_id, self.hub_private_repo, message)
            rank_zero_info(f"lit_align: pushed {target} to {self.pushed_to}")

    def write_card(self, folder: Path, trainer: L.Trainer, pl_module: L.LightningModule, title: str) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        if self.config is not None:
            (folder / CONFIG_NAME).write_text(self.config)
        card = model_card(pl_module, trainer.datamodule, metrics, title, self.command, self.config is not None)
        (folder / "README.md").write_text(card)


class CompletionsLogger(L.Callback):
    """Every ``every_n_steps`` optimizer steps, show the latest generation round's prompts, completions and rewards
    (TRL's ``log_completions``).

    The first ``max_rows`` rows of the round (each prompt's completions in a row) go to ``<run dir>/completions.csv``
    and to the logger: a text table under TensorBoard (``completions``), a table where the logger has ``log_table``
    (W&B). The first ``num_completions_to_print`` are printed as a table on the console (TRL's name; 0: none).
    Columns: step, prompt, completion, reward (weighted sum), each reward function's value when there are several,
    advantage, and the columns reward functions logged (``log_extra``). Works with any module exposing its latest
    ``round`` (``lit_align.generation_round.GenerationRound``: the online recipes, GRPO and RLOO).

    Args:
        every_n_steps: cadence in optimizer steps.
        max_rows: rows written per round at most.
        num_completions_to_print: rows printed to the console per round.
    """

    def __init__(self, every_n_steps: int = 10, max_rows: int = 16, num_completions_to_print: int = 4):
        self.every_n_steps, self.max_rows, self.num_completions_to_print = every_n_steps, max_rows, num_completions_to_print
        self._last_step: int | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        latest = getattr(pl_module, "round", None)
        step = trainer.global_step  # optimizer steps done; 0 until the first one (gradient accumulation)
        if not trainer.is_global_zero or latest is None or step == 0 or step % self.every_n_steps:
            return
        if self._last_step == trainer.global_step:  # several batches per step under gradient accumulation
            return
        self._last_step = trainer.global_step
        columns, rows = self.table(latest, step)
        path = run_dir(trainer) / "completions.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(columns)
            writer.writerows(rows)
        for logger in trainer.loggers:
            if hasattr(logger, "log_table"):
                logger.log_table(key="completions", columns=columns, data=rows)
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("completions", markdown_table(columns, rows), step)
        if self.num_completions_to_print:
            print_table(columns, rows[: self.num_completions_to_print], f"Step {step}")

    def table(self, latest, step: int) -> tuple[list[str], list[list]]:
        """The round's first ``max_rows`` rows as ``(columns, rows)``."""
        per_func = latest.reward_funcs if len(latest.reward_funcs) > 1 else {}
        extra = latest.extra
        columns = ["step", "prompt", "completion", "reward", *per_func, "advantage", *extra]
        advantages = latest.advantages.tolist()
        rows = [[step, _text(latest.prompts[i]), latest.completions[i], latest.rewards[i],
                 *(per_func[k][i] for k in per_func), advantages[i], *(extra[k][i] for k in extra)]
                for i in range(min(self.max_rows, len(latest.completions)))]
        return columns, rows


def _text(prompt) -> str:
    """A prompt as one string: its text, or a conversation's messages as ``role: content`` lines."""
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt)
    return str(prompt)


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """Rows as a Markdown table (TensorBoard renders a text summary as Markdown)."""
    def cell(value) -> str:
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def print_table(columns: list[str], rows: list[list], title: str) -> None:
    """Rows as a table on the console (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(*columns[1:], title=title, show_lines=True)  # the step is the title
    for row in rows:
        table.add_row(*(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row[1:]))
    Console().print(table)


class SigtermCheckpoint(L.Callback):
    """On SIGTERM (preemption, ``kill``, a scheduler's time limit) or a first Ctrl-C, save ``last.ckpt`` before the
    run exits.

    Lightning already handles SIGTERM: it lets the current batch finish, stops every rank (the flag is broadcast under
    DDP) and raises ``SIGTERMException``; outside SLURM it saves nothing. This callback saves a checkpoint at that
    point, a clean step boundary (under gradient accumulation, the end of the window the signal fell in), into the
    ``ModelCheckpoint``'s directory, so ``lit-align fit -c CONFIG --ckpt_path <dir>/last.ckpt`` resumes exactly.
    During ``fit`` a first Ctrl-C takes the same path (Python's KeyboardInterrupt would stop anywhere, a half-done
    optimizer step included); a second one stops at once. ``lit-align`` adds it to every run that checkpoints, and then
    exits with status 143 after SIGTERM, 130 after Ctrl-C (128 + the signal: the run is not finished).
    """

    exit_status = 143  # the last run's: 128 + SIGTERM, or 128 + SIGINT after a Ctrl-C

    def __init__(self) -> None:
        self.saved_to: Path | None = None
        self._deferred = False
        self._previous_sigint = None
        self._trainer: L.Trainer | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        SigtermCheckpoint.exit_status = 128 + signal.SIGTERM
        if threading.current_thread() is threading.main_thread():
            self._trainer, self._previous_sigint = trainer, signal.signal(signal.SIGINT, self._interrupt)

    def _interrupt(self, signum, frame) -> None:
        """A first Ctrl-C: Lightning's SIGTERM flag (the step finishes, every rank stops, ``on_exception`` saves); the
        next one is Python's KeyboardInterrupt again."""
        signal.signal(signal.SIGINT, self._previous_sigint or signal.default_int_handler)
        SigtermCheckpoint.exit_status = 128 + signal.SIGINT
        self._trainer._signal_connector.received_sigterm = True
        rank_zero_info("lit_align: Ctrl-C: finishing this step, then saving last.ckpt (Ctrl-C again to stop at once)")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._trainer is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous_sigint or signal.default_int_handler)
            self._trainer = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        """Lightning stops after the batch the signal arrived in. Inside a gradient-accumulation window that would
        lose the window's gradients (a checkpoint holds parameters and optimizer state, not ``.grad``), so the stop
        waits for the window's last batch: the flag Lightning checks right after this hook is held back until then."""
        signals = trainer._signal_connector
        accumulating = trainer.fit_loop.epoch_loop._should_accumulate()
        if signals.received_sigterm and accumulating:
            signals.received_sigterm, self._deferred = False, True
        elif self._deferred and not accumulating:
            signals.received_sigterm, self._deferred = True, False

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        checkpoint = trainer.checkpoint_callback
        if (not isinstance(exception, SIGTERMException) or checkpoint is None or trainer.state.fn != TrainerFn.FITTING
                or trainer.sanity_checking):
            return
        directory = getattr(checkpoint, "dirpath", None) or run_dir(trainer) / "checkpoints"
        path = Path(directory) / "last.ckpt"
        loop = trainer.fit_loop.epoch_loop
        # inside a step (an asynchronous round's wait ends on the signal: lit_align.producer) the state is the one
        # before it; Lightning's restart counts a checkpoint as written after a step (one more logged step): not here
        inside = int(loop.batch_progress.current.ready > loop.batch_progress.current.processed)
        loop._batches_that_stepped -= inside
        try:
            trainer.save_checkpoint(path)
        finally:
            loop._batches_that_stepped += inside
        self.saved_to = path
        cause = "Ctrl-C" if SigtermCheckpoint.exit_status == 128 + signal.SIGINT else "SIGTERM"
        rank_zero_info(f"lit_align: {cause} at step {trainer.global_step}: saved {path} "
                       f"(resume with --ckpt_path {path})")
