"""lit_align.optimizers through ``lit-align fit``: ``model.learning_rate`` / ``model.weight_decay`` are the learning
rate and weight decay of any ``model.optimizer`` too (one owner each, TRL's names); a second owner that disagrees, two
ways of choosing the optimizer, and an argument the optimizer rejects are each one ``error:`` line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers import assert_one_line_error, run_main, write_sort_rows

DPO = str(Path(__file__).resolve().parents[1] / "configs" / "dpo.yaml")  # learning_rate: 1.0e-3


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> str:
    return write_sort_rows(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 16, "pairs")


def args(tmp_path, pairs: str, *extra: str) -> list[str]:
    return ["fit", "-c", DPO, "--data.init_args.path", pairs, "--data.init_args.val_split", "null",
            "--trainer.max_steps", "1", "--trainer.val_check_interval", "1.0", "--trainer.enable_progress_bar",
            "false", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false", "--export.enabled",
            "false", "--trainer.default_root_dir", str(tmp_path), *extra]


def test_model_learning_rate_and_weight_decay_reach_a_lightningcli_optimizer(tmp_path, pairs, tiny_path):
    from lit_align.cli import run

    argv, sys.argv = sys.argv, ["lit-align"]
    try:
        cli = run(args(tmp_path, pairs, "--model.init_args.learning_rate", "0.05", "--model.init_args.weight_decay",
                       "0.01", "--model.init_args.optimizer", "{class_path: torch.optim.SGD, init_args: {momentum: 0.9}}"))
    finally:
        sys.argv = argv
    (optimizer,) = cli.trainer.optimizers
    assert type(optimizer) is torch.optim.SGD
    assert (optimizer.defaults["lr"], optimizer.defaults["weight_decay"], optimizer.defaults["momentum"]) == (
        0.05, 0.01, 0.9)


@pytest.mark.parametrize("extra,message", [
    (["--model.init_args.optimizer", "{class_path: torch.optim.SGD, init_args: {lr: 0.05, momentum: 0.9}}"],
     "model.optimizer sets lr=0.05, but model.learning_rate is 0.001: set it once, as model.learning_rate "
     "(lit_align gives it to every optimizer)"),
    (["--model.init_args.optim", "sgd", "--model.init_args.optimizer", "torch.optim.SGD"],
     "model.optim 'sgd' and model.optimizer both choose the optimizer: set one"),
    (["--model.init_args.optimizer", "{class_path: torch.optim.SGD, init_args: {momentum: -1}}"],
     "model.optimizer: Invalid momentum value: -1.0"),
    (["--model.init_args.weight_decay", "0.1", "--model.init_args.optimizer", "torch.optim.Rprop"],
     "model.weight_decay is 0.1, but model.optimizer (Rprop) takes no weight_decay"),
], ids=["second_lr", "optim_and_optimizer", "invalid_argument", "no_weight_decay"])
def test_optimizer_mistakes_are_one_error_line(tmp_path, pairs, capfd, tiny_path, extra, message):
    code, _, err = run_main(args(tmp_path, pairs, *extra), capfd)
    assert assert_one_line_error(code, err) == f"error: {message}"


def test_a_plain_callable_from_python_must_agree_with_the_learning_rate():
    """Outside the CLI ``model.optimizer`` may be any ``params -> optimizer``: it set its own arguments, so they must
    agree with the model's instead of being replaced."""
    from lit_align.errors import LitAlignError
    from lit_align.optimizers import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(2))]
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    assert build_optimizer("adamw_torch", sgd, params, 0.1, 0.0).defaults["momentum"] == 0.9
    with pytest.raises(LitAlignError, match=r"model.optimizer sets lr=0.1, but model.learning_rate is 0.001"):
        build_optimizer("adamw_torch", sgd, params, 1e-3, 0.0)
