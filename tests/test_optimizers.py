"""lit_align.optimizers through ``lit-align fit``: ``model.learning_rate`` / ``model.weight_decay`` are the learning
rate and weight decay of any ``model.optimizer`` too (one owner each, TRL's names); a second owner that disagrees, two
ways of choosing the optimizer, and an argument the optimizer rejects are each one ``error:`` line. ``model.optim``'s
names build what transformers' Trainer builds for them (compared with ``Trainer.get_optimizer_cls_and_kwargs``; the
bitsandbytes ones where it is installed), with TRL's ``adam_*`` settings; the names it cannot build are one line."""

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


def fitted_optimizer(tmp_path, pairs: str, *extra: str) -> torch.optim.Optimizer:
    """The optimizer of a 1-step ``lit-align fit`` of dpo.yaml with ``extra`` (in this process)."""
    from lit_align.cli import run

    argv, sys.argv = sys.argv, ["lit-align"]
    try:
        cli = run(args(tmp_path, pairs, *extra))
    finally:
        sys.argv = argv
    (optimizer,) = cli.trainer.optimizers
    return optimizer


def test_model_learning_rate_and_weight_decay_reach_a_lightningcli_optimizer(tmp_path, pairs, tiny_path):
    optimizer = fitted_optimizer(tmp_path, pairs, "--model.init_args.learning_rate", "0.05",
                                 "--model.init_args.weight_decay", "0.01", "--model.init_args.optimizer",
                                 "{class_path: torch.optim.SGD, init_args: {momentum: 0.9}}")
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


# -- model.optim: transformers' names, built as transformers' Trainer builds them ----------------------------------------
def needs_package(name: str) -> None:
    from lit_align.optimizers import OPTIMIZERS

    if OPTIMIZERS[name].module.startswith("bitsandbytes"):
        pytest.importorskip("bitsandbytes")


def optimizer_names() -> list[str]:
    from lit_align.optimizers import OPTIMIZERS

    return list(OPTIMIZERS)


@pytest.mark.parametrize("name", optimizer_names())
def test_each_name_builds_the_class_and_arguments_transformers_builds(tmp_path, name):
    """Against transformers' own ``Trainer.get_optimizer_cls_and_kwargs``, with TRL's Adam settings set off their
    defaults (their ``lr`` is ours, ``weight_decay`` goes to its parameter groups there, to the class here)."""
    from transformers import Trainer, TrainingArguments

    from lit_align.optimizers import AdamSettings, named_optimizer

    needs_package(name)
    args = TrainingArguments(output_dir=str(tmp_path), optim=name, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6,
                             report_to=[])
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    kwargs.pop("lr")
    assert named_optimizer(name, AdamSettings(beta1=0.8, beta2=0.95, epsilon=1e-6)) == (cls, kwargs)


def test_the_names_are_every_transformers_name_that_torch_transformers_or_bitsandbytes_builds():
    from transformers.training_args import OptimizerNames

    from lit_align.optimizers import OPTIMIZERS

    names = {n.value for n in OptimizerNames}
    assert set(OPTIMIZERS) <= names
    assert names - set(OPTIMIZERS) == {  # each needs another package (or a TPU / an NPU)
        "adamw_torch_xla", "adamw_torch_npu_fused", "adamw_anyprecision", "adamw_torch_4bit", "adamw_torch_8bit",
        "galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise",
        "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise", "lomo", "adalomo", "grokadamw",
        "schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd", "apollo_adamw", "apollo_adamw_layerwise",
        "stable_adamw"}


def test_the_default_is_the_fused_adamw_with_trls_betas_and_eps():
    from lit_align.optimizers import DEFAULT_OPTIM, build_optimizer

    built = build_optimizer(DEFAULT_OPTIM, None, [torch.nn.Parameter(torch.zeros(2))], 1e-6, 0.0)
    assert type(built) is torch.optim.AdamW
    assert {k: built.defaults[k] for k in ("lr", "betas", "eps", "weight_decay", "fused")} == {
        "lr": 1e-6, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "fused": True}


@pytest.mark.parametrize("name,cls,values", [
    ("adamw_torch", torch.optim.AdamW, {"betas": (0.8, 0.95), "eps": 1e-6, "fused": None}),
    ("sgd", torch.optim.SGD, {"momentum": 0}),
    ("adagrad", torch.optim.Adagrad, {"eps": 1e-10}),  # torch's own, as transformers leaves it
    ("rmsprop", torch.optim.RMSprop, {"alpha": 0.99, "eps": 1e-8}),
], ids=["adamw_torch", "sgd", "adagrad", "rmsprop"])
def test_the_built_optimizer_holds_the_settings(name, cls, values):
    from lit_align.optimizers import AdamSettings, build_optimizer

    adam = AdamSettings(beta1=0.8, beta2=0.95, epsilon=1e-6) if name == "adamw_torch" else AdamSettings()
    built = build_optimizer(name, None, [torch.nn.Parameter(torch.zeros(2))], 0.05, 0.01, adam)
    assert type(built) is cls
    assert (built.defaults["lr"], built.defaults["weight_decay"]) == (0.05, 0.01)
    assert {k: built.defaults[k] for k in values} == values


def test_adafactor_is_transformers_with_an_external_learning_rate():
    from transformers.optimization import Adafactor

    from lit_align.optimizers import build_optimizer

    built = build_optimizer("adafactor", None, [torch.nn.Parameter(torch.zeros(2))], 0.05, 0.01)
    assert type(built) is Adafactor
    assert {k: built.defaults[k] for k in ("lr", "weight_decay", "scale_parameter", "relative_step")} == {
        "lr": 0.05, "weight_decay": 0.01, "scale_parameter": False, "relative_step": False}


@pytest.mark.parametrize("name,bits,paged", [("adamw_8bit", 8, False), ("paged_adamw_32bit", 32, True),
                                             ("lion_8bit", 8, False)])
def test_bitsandbytes_names_build_with_their_bits_and_paging(name, bits, paged):
    bitsandbytes = pytest.importorskip("bitsandbytes")
    from lit_align.optimizers import AdamSettings, build_optimizer

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    built = build_optimizer(name, None, model.parameters(), 0.05, 0.0, AdamSettings(beta2=0.95), model)
    assert type(built) is (bitsandbytes.optim.Lion if "lion" in name else bitsandbytes.optim.AdamW)
    assert (built.args.optim_bits, built.is_paged, built.defaults["betas"]) == (bits, paged, (0.9, 0.95))
    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    overridden = [(m, p) for m, p, c in manager.module_weight_config_triple if c == {"optim_bits": 32}]
    assert ((model[0], "weight") in overridden) == (bits == 8)  # transformers keeps the embeddings in 32 bits


def test_a_bitsandbytes_name_without_bitsandbytes_is_one_error_line(tmp_path, pairs, capfd, tiny_path):
    try:
        import bitsandbytes  # noqa: F401
        pytest.skip("bitsandbytes is installed")
    except ImportError:
        pass
    code, _, err = run_main(args(tmp_path, pairs, "--model.init_args.optim", "paged_lion_8bit"), capfd)
    assert assert_one_line_error(code, err) == (
        "error: model.optim 'paged_lion_8bit' needs bitsandbytes: pip install 'lit_align[bnb]'")


SUPPORTED = ("adamw_torch, adamw_torch_fused, adafactor, sgd, adagrad, rmsprop, adamw_bnb_8bit, adamw_8bit, "
             "paged_adamw_32bit, paged_adamw_8bit, ademamix, ademamix_8bit, paged_ademamix_32bit, paged_ademamix_8bit, "
             "lion_32bit, lion_8bit, paged_lion_32bit, paged_lion_8bit, rmsprop_bnb, rmsprop_bnb_8bit, "
             "rmsprop_bnb_32bit")


@pytest.mark.parametrize("extra,message", [
    (["--model.init_args.optim", "adamw_torch_4bit"],
     "model.optim 'adamw_torch_4bit' is one of transformers' optimizers that needs a package lit_align does not build "
     f"with (torchao, torch_xla, torchdistx, GaLore, APOLLO, LOMO, schedule-free, ...): expected one of {SUPPORTED} (or "
     "model.optimizer: {class_path: ..., init_args: ...} for any torch optimizer)"),
    (["--model.init_args.optim", "adam"],
     f"model.optim 'adam' is not an optimizer name: expected one of {SUPPORTED} (or model.optimizer: {{class_path: "
     "..., init_args: ...} for any torch optimizer)"),
    (["--model.init_args.adam_beta1", "1.0"], "model.adam_beta1 must be in [0, 1), got 1.0"),
    (["--model.init_args.adam_epsilon=-1e-8"], "model.adam_epsilon must be >= 0, got -1e-08"),
    (["--model.init_args.optim", "sgd", "--model.init_args.adam_beta2", "0.95"],
     "model.adam_beta2 is 0.95, but model.optim 'sgd' takes no betas: leave model.adam_beta2 at 0.999"),
    (["--model.init_args.optim", "lion_8bit", "--model.init_args.adam_epsilon", "1e-6"],
     "model.adam_epsilon is 1e-06, but model.optim 'lion_8bit' takes no eps: leave model.adam_epsilon at 1e-08"),
    (["--model.init_args.optimizer", "torch.optim.Adam", "--model.init_args.adam_beta1", "0.8"],
     "model.adam_beta1 is 0.8, but model.optimizer's init_args set its own (betas, eps): leave model.adam_beta1 at "
     "0.9"),
], ids=["unsupported", "unknown", "beta_range", "eps_range", "sgd_betas", "lion_eps", "beside_optimizer"])
def test_optim_and_adam_mistakes_are_one_error_line(tmp_path, pairs, capfd, extra, message):
    code, _, err = run_main(args(tmp_path, pairs, *extra), capfd)
    assert assert_one_line_error(code, err) == f"error: {message}"


def test_trls_adam_settings_reach_the_optimizer_through_the_cli(tmp_path, pairs, tiny_path):
    optimizer = fitted_optimizer(tmp_path, pairs, "--model.init_args.adam_beta1", "0.85",
                                 "--model.init_args.adam_beta2", "0.95", "--model.init_args.adam_epsilon", "1e-6")
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    assert (optimizer.defaults["betas"], optimizer.defaults["eps"], optimizer.defaults["lr"]) == ((0.85, 0.95), 1e-6,
                                                                                                  1e-3)
