"""The ``lit-align`` console script: LightningCLI over every lit_align module and data module.

    lit-align fit -c configs/dpo.yaml
    lit-align fit -c configs/dpo.yaml --trainer.max_steps 50 --model.beta 0.2
    lit-align fit -c configs/dpo.yaml --print_config
    lit-align from-trl dpo --config trl_dpo.yaml -o my_dpo.yaml   # a TRL config file, translated

A mistake in the user's data or settings prints one ``error:`` line and exits with status 2.
"""

from __future__ import annotations

import errno
import os
import pickletools
import re
import shlex
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_align.callbacks import HFExport, SigtermCheckpoint
from lit_align.checkpoint_io import AtomicCheckpointIO
from lit_align.errors import LitAlignError, condensed
from lit_align.imports import import_object



# where options that moved are now set: (section, option) -> the new place
MOVED = {("data", name): f"model.{name}" for name in
         ("num_generations", "steps_per_generation", "num_iterations", "generation_batch_size")}
UNKNOWN_OPTION = re.compile(r"Problem with given class_path '([\w.]+)':\s+Option '(\w+)' is not accepted")
UNKNOWN_TOP_LEVEL = re.compile(r"Subcommand '(\w+)' does not accept option '(\w+)[\w.]*'")  # a.b: nested


class AlignParser(LightningArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # ``--trainer.max_step 3`` is a mistake, not ``max_steps``
        super().__init__(*args, **kwargs)
        self.argv: list[str] = sys.argv[1:]

    def parse_args(self, args=None, *rest, **kwargs):
        self.argv = list(sys.argv[1:] if args is None else args)  # for ``error``: the config files given
        return super().parse_args(args, *rest, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        """A ``LitAlignError`` raised while parsing (a link refusing a setting) is one ``error:`` line, as anywhere;
        so is an option its class does not have (``unknown_option``), and any other mistake the parser stops on
        (``condensed``) instead of the usage of every option."""
        cause = ex
        while cause is not None and not isinstance(cause, LitAlignError):
            cause = cause.__cause__
        if cause is not None:
            raise cause
        unknown = UNKNOWN_OPTION.search(str(message))
        if unknown is not None:
            raise LitAlignError(unknown_option(*unknown.groups()))
        top = UNKNOWN_TOP_LEVEL.search(str(message))
        trl = None if top is None else top.group(2) if _trl_field(top.group(2)) else _trl_file_field(self.argv)
        if trl is not None:
            raise LitAlignError(f"the config's top-level {trl!r} is a TRL field: this looks like a TRL config "
                                f"file (trl COMMAND --config FILE); translate it first: lit-align from-trl COMMAND "
                                f"--config FILE -o OUT, then lit-align {top.group(1)} -c OUT (docs/trl_configs.md)")
        if self.exit_on_error:  # the outermost parser: the user's mistake (inner parsers' errors are tried and caught)
            raise LitAlignError(f"{condensed(str(message), self.argv)} ({self.prog.replace(' [options]', '')} --help "
                                f"lists the options)")
        super().error(message, ex)


def _trl_file_field(argv: list[str]) -> str | None:
    """The first top-level key of the command line's config files (``-c``) that is a TRL field, if any."""
    import yaml

    for i, arg in enumerate(argv[:-1]):
        if arg in ("-c", "--config"):
            try:
                keys = yaml.safe_load(Path(argv[i + 1]).read_text())
            except (OSError, yaml.YAMLError):
                continue
            found = [key for key in keys if isinstance(key, str) and _trl_field(key)] if isinstance(keys, dict) else []
            if found:
                return found[0]
    return None


def _trl_field(name: str) -> bool:
    """Whether a top-level config key is a field of a TRL config file (``lit_align.from_trl``), a recipe
    repository's ``dataset_mixture`` or one of TRL's older names included."""
    from lit_align.from_trl.translate import OLDER_NAMES
    from lit_align.from_trl.trl_fields import commands_with

    return bool(commands_with(name)) or name in OLDER_NAMES or name == "dataset_mixture"


def unknown_option(class_path: str, name: str) -> str:
    """The message for option ``name`` that ``class_path`` does not take: where it moved, or which recipe has it."""
    from lit_align.hub import recipe_defaults
    from lit_align.modules import AlignModule

    cls = import_object(class_path)
    section = "model" if issubclass(cls, AlignModule) else "data"
    if (section, name) in MOVED:
        return (f"{section}.{name} has moved: the module owns a round's shape, set {MOVED[section, name]} instead "
                f"(under model.init_args)")
    owners = [c.__name__ for c in _subclasses(AlignModule) if name in recipe_defaults(c) and not issubclass(cls, c)]
    if section == "model" and owners:
        return f"model.{name} is an option of {', '.join(sorted(set(owners)))}, not of {cls.__name__}"
    return (f"{section}.{name}: {cls.__name__} has no such option (lit-align fit --{section}.help {class_path} "
            "lists them)")


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def one_owner(owner: str, follower: str, name: str, default: Any = None) -> Callable[..., Any]:
    """A link ``<owner>.<name> -> <follower>.<name>`` for a setting two sections read but one owns. A value set under
    the follower that differs from the owner's is refused rather than silently replaced; None or ``default`` (the
    setting's default on either side) counts as not set. Given the follower's ``class_path`` too (a third source),
    the default is that class's (RLOO's ``num_generations`` is 2, GRPO's 8)."""
    def follow(owned: Any, followed: Any, class_path: str | None = None) -> Any:
        unset = default if class_path is None else class_default(class_path, name, default)
        owned = unset if owned is None else owned
        if followed not in (None, unset) and followed != owned:
            raise LitAlignError(f"{follower}.{name} is set by {owner}.{name} ({owner}: owns it; {follower}: follows "
                                f"it): set {owner}.{name} instead")
        return owned

    return follow


def class_default(class_path: str, name: str, fallback: Any) -> Any:
    """The ``__init__`` default of ``name`` in the class ``class_path`` (its bases' included), else ``fallback``."""
    from lit_align.hub import recipe_defaults

    try:
        return recipe_defaults(import_object(class_path)).get(name, fallback)
    except (ImportError, AttributeError, ValueError):
        return fallback


class AlignCLI(LightningCLI):
    def __init__(self, *args, parser_class: type[LightningArgumentParser] = AlignParser, **kwargs):
        super().__init__(*args, parser_class=parser_class, **kwargs)

    def _parse_ckpt_path(self) -> None:
        """Check ``--ckpt_path`` before anything is built, and keep the user's config as it is.

        LightningCLI would lay the checkpoint's hyper-parameters over the config, silently dropping what the user
        set; instead the module compares them on resume (``AlignModule.on_load_checkpoint``) and refuses a
        difference that a resume cannot honour.
        """
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if path is not None:
            check_checkpoint_file(path)

    def add_arguments_to_parser(self, parser) -> None:
        # always on, configured under `export:` (like any callback, but no need to list it in every config)
        parser.add_lightning_class_args(HFExport, "export")
        # owned by the model: the export carries the chat template and the EOS token (the data ends its rows with
        # it); the loss reads assistant_only_loss (the data drops the rows whose cut leaves no assistant token)
        for name, default in (("chat_template", None), ("assistant_only_loss", False), ("eos_token", None)):
            parser.link_arguments((f"model.init_args.{name}", f"data.init_args.{name}"), f"data.init_args.{name}",
                                  compute_fn=one_owner("model", "data", name, default), apply_on="parse")

    def parse_arguments(self, parser, args) -> None:
        argv = sys.argv[1:] if args is None else args
        self.command = "lit-align " + shlex.join(map(str, argv)) if isinstance(argv, (list, tuple)) else None
        super().parse_arguments(parser, args)

    def before_fit(self) -> None:
        """The export's model card cites how this run was started and carries its resolved config."""
        for callback in self.trainer.callbacks:
            if isinstance(callback, HFExport):
                callback.command = self.command
                callback.config = self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False)

    def instantiate_trainer(self, **kwargs):
        """The trainer, plus crash safety: atomic checkpoint writes, a checkpoint on SIGTERM (docs/reliability.md)."""
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # keep any other CheckpointIO the user chose
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if trainer.checkpoint_callback is not None:
            trainer.callbacks.append(SigtermCheckpoint())
        return trainer


def check_checkpoint_file(path: str) -> None:
    """Raise ``LitAlignError`` unless ``path`` is a whole Lightning checkpoint (Lightning's ``last`` / ``best`` /
    ``hpc`` names and remote URLs are left to Lightning). A checkpoint is a zip archive (``torch.save``): a file cut
    short loses the directory at its end, which ``zipfile`` reads first; a flipped bit fails a member's CRC-32, which
    ``torch.load`` does not check (``testzip`` reads the file once: ~0.3 s per 500 MB from the page cache, a disk
    read otherwise); and what Lightning wrote names ``state_dict`` and ``pytorch-lightning_version`` in its pickle,
    found without unpickling it."""
    if path in ("last", "best", "hpc", "registry") or "://" in path:
        return
    file = Path(path)
    if not file.exists():
        raise LitAlignError(f"--ckpt_path {path}: no such file")
    if not file.is_file():
        raise LitAlignError(f"--ckpt_path {path}: not a file (expected a .ckpt file, e.g. <run>/checkpoints/last.ckpt)")
    if file.stat().st_size == 0:
        raise LitAlignError(f"--ckpt_path {path}: the file is empty")
    try:
        with zipfile.ZipFile(file) as archive:
            pickle = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            if not any(info.CRC for info in archive.infolist()):
                return  # saved with torch's compute_crc32 off: zipfile reads no member against a CRC of 0
            damaged = archive.testzip()
            if damaged is None:
                names = {arg for _, arg, _ in pickletools.genops(archive.read(pickle)) if isinstance(arg, str)}
    except (zipfile.BadZipFile, StopIteration, OSError, ValueError) as exc:
        raise LitAlignError(f"--ckpt_path {path}: not a readable checkpoint ({exc or 'no data.pkl inside'}); "
                            "it may be truncated") from None
    if damaged is not None:
        raise LitAlignError(f"--ckpt_path {path}: the file is corrupt: {damaged} inside it fails its CRC-32 check "
                            "(damaged on disk or in a copy); resume from another checkpoint")
    if not {"state_dict", "pytorch-lightning_version"} <= names:
        raise LitAlignError(f"--ckpt_path {path}: not a Lightning checkpoint (no state_dict and "
                            "pytorch-lightning_version in it: a plain torch.save of weights?); resume from a "
                            "checkpoint a run wrote, e.g. <run>/checkpoints/last.ckpt, or start from weights with "
                            "model.model set to a Hugging Face directory")


def main(args: list[str] | None = None) -> None:
    """Entry point: ``lit-align {fit,validate,test} -c CONFIG [--key value ...]``, or ``lit-align from-trl COMMAND
    --config FILE`` (a TRL config file as a lit_align config: ``lit_align.from_trl``)."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["from-trl"]:
        from lit_align.from_trl import main as from_trl

        return from_trl(argv[1:])
    run(args)


# Lightning's notices that a user can do nothing about: the frozen reference (or teacher) stays in eval mode; on
# resume the callbacks come from the same config, so they are the ones that wrote the checkpoint; ``run(args)`` is
# how lit_align.pipeline chains stages in one process; Lightning's own use of a torch API torch deprecated
BY_DESIGN = (r"Found \d+ module\(s\) in eval mode at the start of training",
             r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint",
             r"LightningCLI's args parameter is intended to run from within Python",
             r"`isinstance\(treespec, LeafSpec\)` is deprecated",
             r"Since DeepSpeed handles gradient clipping internally")  # its engine clips at gradient_clip_val


DESCRIPTION = ("lit_align: SFT, DPO, KTO, reward models, GRPO, RLOO and on-policy distillation on PyTorch Lightning. "
               "`lit-align fit -c configs/<x>.yaml` trains (validate, test, predict as in Lightning); "
               "`lit-align from-trl COMMAND --config trl.yaml -o out.yaml` translates a TRL config file.")


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """lit_align's own warnings (``lit_align: ...``) as the one line they are written as, not Python's
    ``file:line: UserWarning:`` and the source line after it; anyone else's as before."""
    text = str(message)
    if text.startswith("lit_align:"):
        return f"warning: {text}\n"
    return one_line_warning.others(message, category, filename, lineno, line)


one_line_warning.others = warnings.formatwarning


def run(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI in this process and return it (``cli.trainer``, ``cli.model``); user errors exit with status 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for message in BY_DESIGN:
        warnings.filterwarnings("ignore", message)
    if warnings.formatwarning is not one_line_warning:
        one_line_warning.others = warnings.formatwarning
        warnings.formatwarning = one_line_warning
    from lit_align.data import AlignDataModule  # importing the packages registers every subclass by short name
    from lit_align.modules import AlignModule

    try:
        return AlignCLI(
            AlignModule,
            AlignDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            parser_kwargs={"prog": "lit-align", "description": DESCRIPTION},
            args=args,
        )
    except SIGTERMException:  # stopped at a step boundary (SIGTERM, Ctrl-C); SigtermCheckpoint saved the state
        sys.exit(SigtermCheckpoint.exit_status)
    except Exception as exc:  # noqa: BLE001
        error = _user_error(exc)
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


VAL_CHECK_HINT = (" (a small dataset: set trainer.val_check_interval to at most that, or "
                  "trainer.check_val_every_n_epoch: null to count batches across epochs)")


def _user_error(exc: BaseException) -> str | None:
    """The message for the user behind ``exc``, or None for a bug (which keeps its traceback):

    - a ``LitAlignError``: itself, or the cause jsonargparse wraps it in when a class's ``__init__`` rejects its
      arguments (``ValueError: Does not validate against any of the Union subtypes``);
    - a setting Lightning rejects (``MisconfigurationException``, or a ``ValueError`` raised inside Lightning, e.g.
      ``val_check_interval`` larger than the training batches);
    - a package a configured class needs and the machine lacks (Lightning's ``Requirement ... not met``: a
      ``WandbLogger`` without wandb);
    - the file system refusing a path or running out of space (an ``OSError`` naming its file): a full disk during a
      checkpoint or export leaves the previous files whole (``AtomicCheckpointIO``, ``HFExport``).
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LitAlignError):
            return str(exc)
        if isinstance(exc, MisconfigurationException) or (isinstance(exc, ValueError) and _raised_in_lightning(exc)):
            message = " ".join(str(exc).split())
            return message + VAL_CHECK_HINT if message.startswith("`val_check_interval`") else message
        if isinstance(exc, ModuleNotFoundError) and "Requirement" in str(exc):  # a logger's package (wandb, ...)
            return f"a package the config needs is not installed: {' '.join(str(exc).split())}"
        if isinstance(exc, OSError) and exc.filename is not None:
            return f"{exc.filename}: {exc.strerror or exc}"
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"{exc.strerror}: the disk is full (files written before stay whole)"
        seen.add(id(exc))
        exc = exc.__cause__
    return None


def _raised_in_lightning(exc: BaseException) -> bool:
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and f"{os.sep}lightning{os.sep}" in last.tb_frame.f_code.co_filename


if __name__ == "__main__":
    main()
