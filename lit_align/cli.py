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

from lit_align.callbacks import HFExport
from lit_align.errors import LitAlignError


class AlignCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # always on, configured under `export:` (like any callback, but no need to list it in every config)
        parser.add_lightning_class_args(HFExport, "export")


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
