"""configs/strategy/*.yaml: each parses with every recipe and builds Lightning's strategy object with its settings;
then FSDP for real, on CPU with 2 processes (``helpers.CPUFSDPStrategy``: Lightning only refuses FSDP without a GPU).

FSDP checks: DPO trains exactly like one process on the same global batch (step-0 and step-1 losses), the checkpoint
holds no reference weights, the export is a Hugging Face directory with the checkpoint's weights, and a run resumes
from that checkpoint; GRPO generates, uses its reference and the chunked log-probs inside the sharded module.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from helpers import ddp_and_single, metric_at, read_metrics
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

from lit_align.cli import AlignCLI
from lit_align.strategies import DecoderLayers
from numerics import TINY_TERMS, assert_rounding_close

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = ["sft.yaml", "dpo.yaml", "grpo.yaml"]
STRATEGIES = sorted(p.name for p in (CONFIGS / "strategy").glob("*.yaml"))


class ParseOnly(AlignCLI):
    """The CLI up to the Trainer: every class in the config is built (the strategy too), the Trainer is not (Lightning
    refuses FSDP and DeepSpeed on a machine without a GPU)."""

    def instantiate_trainer(self, **kwargs):
        return None


def parse(recipe: str, strategy: str) -> dict:
    from lit_align.data import AlignDataModule
    from lit_align.modules import AlignModule

    argv, sys.argv = sys.argv, ["lit-align"]
    try:
        cli = ParseOnly(AlignModule, AlignDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                        auto_configure_optimizers=False,
                        args=["-c", str(CONFIGS / recipe), "-c", str(CONFIGS / "strategy" / strategy),
                              "--model.init_args.model", "builtin:tiny"])
    finally:
        sys.argv = argv
    return cli.config_init["trainer"]


def test_every_strategy_yaml_is_tested():
    assert STRATEGIES == ["ddp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "fsdp.yaml"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_ddp_yaml_builds_ddp(recipe):
    strategy = parse(recipe, "ddp.yaml")["strategy"]
    assert type(strategy) is DDPStrategy
    assert strategy._ddp_kwargs["find_unused_parameters"] is False
    assert strategy._ddp_kwargs["gradient_as_bucket_view"] is True


@pytest.mark.parametrize("recipe", RECIPES)
def test_fsdp_yaml_builds_fsdp_wrapping_decoder_layers(recipe):
    trainer = parse(recipe, "fsdp.yaml")
    strategy = trainer["strategy"]
    assert type(strategy) is FSDPStrategy and trainer["accelerator"] == "gpu"
    assert strategy.sharding_strategy.name == "FULL_SHARD"
    assert strategy._state_dict_type == "full"  # one checkpoint file with whole weights
    assert strategy.kwargs["use_orig_params"] is True
    wrap = strategy.kwargs["auto_wrap_policy"]
    assert isinstance(wrap, DecoderLayers) and wrap.wrap_reference
    checkpointing = strategy._activation_checkpointing_kwargs["auto_wrap_policy"]
    assert isinstance(checkpointing, DecoderLayers) and not checkpointing.wrap_reference


def wrapped_by(policy: DecoderLayers, root: torch.nn.Module) -> list[str]:
    """The modules ``policy`` wraps in ``root``, visiting parents before children as torch's ``_recursive_wrap``."""
    for module in root.modules():
        assert policy(module, recurse=True, nonwrapped_numel=0)
    return [name for name, module in root.named_modules() if policy(module, recurse=False, nonwrapped_numel=0)]


def test_decoder_layers_policy_wraps_each_layer_of_policy_and_reference_and_the_reference_whole(tiny_path):
    from lit_align.modules import DPOModule

    module = DPOModule(model="builtin:tiny")
    module.configure_model()
    layers = len(module.policy.model.layers)
    wrapped = wrapped_by(DecoderLayers(), module)
    assert "reference.model" in wrapped
    assert sorted(wrapped) == sorted(["reference.model", *(f"{m}.model.layers.{i}" for m in ("policy", "reference.model")
                                                           for i in range(layers))])
    no_ref = wrapped_by(DecoderLayers(wrap_reference=False), module)  # activation checkpointing: layers only
    assert "reference.model" not in no_ref and len(no_ref) == 2 * layers


@pytest.mark.parametrize("strategy", ["deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_deepspeed_yamls_build_deepspeed_or_say_how_to_install_it(strategy):
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        with pytest.raises(Exception, match="pip install"):  # Lightning: "... you must have DeepSpeed installed ..."
            parse("dpo.yaml", strategy)
        return
    built = parse("dpo.yaml", strategy)["strategy"]
    assert type(built) is DeepSpeedStrategy
    assert built.config["zero_optimization"]["stage"] == int(strategy[-6])
    assert built.exclude_frozen_parameters


# -- FSDP on CPU, 2 processes ------------------------------------------------------------------------------------------
FSDP = ["-c", str(CONFIGS / "strategy" / "fsdp.yaml"), "--trainer.strategy.class_path", "helpers.CPUFSDPStrategy",
        "--trainer.accelerator", "cpu"]


def args(out: Path, recipe: str, batch_size: int, *extra: str) -> list[str]:
    return ["fit", "-c", str(CONFIGS / recipe), "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1",
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.logger.init_args.save_dir", str(out),
            "--data.init_args.batch_size", str(batch_size), "--data.init_args.shuffle", "false",
            "--data.init_args.val_split", "null", *extra]


@pytest.mark.slow  # two processes (~20-45 s): run by .ci/run (make test-slow), not by make test
def test_fsdp_dpo_trains_like_one_process_and_exports_a_hf_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    fsdp_dir, single_dir = ddp_and_single(
        tmp_path_factory, lambda out: args(out, "dpo.yaml", 2),
        lambda out: args(out, "dpo.yaml", 4, "--trainer.enable_checkpointing", "false", "--export.enabled", "false"),
        strategy=FSDP)
    fsdp, single = (read_metrics(d / "dpo" / "version_0") for d in (fsdp_dir, single_dir))
    assert metric_at(fsdp, "train/loss", 0) == pytest.approx(math.log(2), abs=1e-6)
    assert metric_at(fsdp, "train/loss", 1) != pytest.approx(math.log(2), abs=1e-4)
    assert_rounding_close(metric_at(fsdp, "train/loss", 1), metric_at(single, "train/loss", 1), scale=1.0,
                          terms=TINY_TERMS)  # a loss of ~ln 2 after one update from other reduction orders

    run = fsdp_dir / "dpo" / "version_0"
    (ckpt,) = (run / "checkpoints").glob("*.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    assert state and all(k.startswith("policy.") for k in state)  # no ref_model.*, no FSDP names
    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model").state_dict()
    for key, value in state.items():
        torch.testing.assert_close(exported[key.removeprefix("policy.")], value, rtol=0, atol=0)

    # resume under FSDP: the checkpoint has no reference, which is not a missing key; the policy is the trained one
    resumed_dir, _ = ddp_and_single(
        tmp_path_factory, lambda out: args(out, "dpo.yaml", 2, "--trainer.max_steps", "3", "--ckpt_path", str(ckpt),
                                           "--export.enabled", "false"),
        strategy=FSDP)
    resumed = read_metrics(resumed_dir / "dpo" / "version_0")
    assert sorted(int(r["step"]) for r in resumed if "train/loss" in r) == [2]
    assert math.isfinite(metric_at(resumed, "train/loss", 2))
    assert metric_at(resumed, "train/loss", 2) != pytest.approx(math.log(2), abs=1e-4)  # not a fresh policy


@pytest.mark.slow  # two processes (~20-45 s): run by .ci/run (make test-slow), not by make test
def test_fsdp_grpo_generates_with_a_sharded_policy_and_reference(tmp_path_factory):
    """12 new tokens: the native engine's EOS check (every 8) runs, an all-reduce across the two ranks."""
    grpo = ["--model.init_args.model", "builtin:tiny", "--model.init_args.beta", "0.04",
            "--model.init_args.max_completion_length", "12", "--model.init_args.learning_rate", "1e-2",
            "--model.init_args.warmup_steps", "0", "--model.init_args.logps_chunk_size", "3",
            "--model.init_args.reward_funcs", json.dumps(["helpers.digit_fraction"]),
            "--model.init_args.num_generations", "2", "--model.init_args.steps_per_generation", "1",
            "--trainer.enable_checkpointing", "false", "--export.enabled", "false"]
    fsdp_dir, _ = ddp_and_single(tmp_path_factory, lambda out: args(out, "grpo.yaml", 4, *grpo), strategy=FSDP)
    metrics = read_metrics(fsdp_dir / "grpo" / "version_0")
    for step in (0, 1):
        assert math.isfinite(metric_at(metrics, "train/loss", step))
        assert metric_at(metrics, "train/generation_rounds", step) == step + 1
    assert metric_at(metrics, "train/kl", 0) == pytest.approx(0.0, abs=1e-7)  # the reference is the initial policy
    assert metric_at(metrics, "train/kl", 1) > 1e-6
