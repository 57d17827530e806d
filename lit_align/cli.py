"""The ``lit-align`` console script: LightningCLI over every lit_align module and data module.

    lit-align fit -c configs/dpo.yaml
    lit-align fit -c configs/dpo.yaml --trainer.max_steps 50 --model.beta 0.2
    lit-align fit -c configs/dpo.yaml --print_config

A mistake in the user's data or settings prints one ``error:`` line and exits with status 2.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_align.callbacks import HFExport, SigtermCheckpoint
from lit_align.checkpoint_io import AtomicCheckpointIO
from lit_align.errors import LitAlignError
from lit_align.generation_round import ROUND_SETTINGS

SIGTERM_EXIT = 143  # 128 + SIGTERM, as a shell reports a process the signal ended: the run is not finished


class AlignCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # always on, configured under `export:` (like any callback, but no need to list it in every config)
        parser.add_lightning_class_args(HFExport, "export")
        # a GRPO round's shape: set once under `data:` (the DataModule shapes the batches), read by the module too
        for name in ROUND_SETTINGS:
            parser.link_arguments(f"data.init_args.{name}", f"model.init_args.{name}", apply_on="parse")

    def instantiate_trainer(self, **kwargs):
        """The trainer, plus crash safety: atomic checkpoint writes, a checkpoint on SIGTERM (README: Reliability)."""
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # keep any other CheckpointIO the user chose
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if trainer.checkpoint_callback is not None:
            trainer.callbacks.append(SigtermCheckpoint())
        return trainer


def main(args: list[str] | None = None) -> None:
    """Entry point: ``lit-align {fit,validate,test} -c CONFIG [--key value ...]``."""
    run(args)


def run(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI in this process and return it (``cli.trainer``, ``cli.model``); user errors exit with status 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
            args=args,
        )
    except SIGTERMException:  # Lightning stopped at a step boundary; SigtermCheckpoint saved the state
        sys.exit(SIGTERM_EXIT)
    except Exception as exc:  # noqa: BLE001
        error = _user_error(exc)
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def _user_error(exc: BaseException) -> LitAlignError | None:
    """The LitAlignError behind ``exc``: itself, or the cause jsonargparse wraps it in when a class's ``__init__``
    rejects its arguments (``ValueError: Does not validate against any of the Union subtypes``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LitAlignError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__
    return None


if __name__ == "__main__":
    main()
