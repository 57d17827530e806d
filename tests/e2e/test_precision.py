"""Precision and memory options end to end, on CPU: every recipe trains a few steps under ``bf16-true`` and
``bf16-mixed`` with finite losses and fp32 log-probs; ``model.logps_chunk_size`` leaves every recipe's losses unchanged."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import metric_at, read_metrics, run_single

from lit_align.logps import next_token_logps
from numerics import TINY_TERMS, assert_rounding_close, needs_torch_bf16

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL = {  # a few rows, a few tokens: what each recipe needs to take 2 steps quickly
    "sft": ["--data.init_args.batch_size", "8", "--model.init_args.warmup_steps", "0"],  # step 0 moves the weights
    "dpo": ["--data.init_args.batch_size", "4", "--model.init_args.warmup_ratio", "0"],
    "grpo": ["--model.init_args.model", "builtin:tiny", "--model.init_args.beta", "0.04",
             "--model.init_args.max_completion_length", "4", "--model.init_args.warmup_steps", "0",
             "--model.init_args.reward_funcs", json.dumps(["helpers.digit_fraction"]),
             "--data.init_args.batch_size", "8", "--model.init_args.num_generations", "2",
             "--model.init_args.steps_per_generation", "2"],
}


def fit(out: Path, recipe: str, *extra: str) -> list[dict]:
    run_single(["fit", "-c", str(CONFIGS / f"{recipe}.yaml"), "--trainer.max_steps", "2",
                "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
                "--trainer.enable_model_summary", "false", "--trainer.enable_checkpointing", "false",
                "--trainer.logger.init_args.save_dir", str(out), "--data.init_args.val_split", "null",
                "--export.enabled", "false", *SMALL[recipe], *extra])
    return read_metrics(out / recipe / "version_0")


@needs_torch_bf16  # packed rows (the CPU default) run torch's masked bf16 attention
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("recipe", ["sft", "dpo", "grpo"])
def test_recipes_train_in_bf16(tmp_path, recipe, precision):
    metrics = fit(tmp_path, recipe, "--trainer.precision", precision, "--model.init_args.logps_chunk_size", "16")
    for step in (0, 1):
        assert math.isfinite(metric_at(metrics, "train/loss", step)), (recipe, precision, step)


@pytest.mark.parametrize("recipe", ["sft", "dpo", "grpo"])
def test_chunked_logps_leave_the_losses_unchanged(tmp_path, recipe):
    plain = fit(tmp_path / "plain", recipe)
    chunked = fit(tmp_path / "chunked", recipe, "--model.init_args.logps_chunk_size", "5")
    for step in (0, 1):  # step 1: after an update computed from the chunked gradients
        loss = metric_at(plain, "train/loss", step)
        assert_rounding_close(metric_at(chunked, "train/loss", step), loss, scale=max(abs(loss), 1.0),
                              terms=TINY_TERMS, msg=f"loss at step {step}")
    if recipe == "grpo":  # same completions (same seed, same policy at generation), same KL to the reference
        # k3 KL ~ d^2 / 2 of log-prob differences d: its rounding is d's (log-probs of up to ~10 nats) times d
        kl = metric_at(plain, "train/kl", 1)
        assert_rounding_close(metric_at(chunked, "train/kl", 1), kl, scale=10 * math.sqrt(2 * kl), terms=TINY_TERMS)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_log_probs_are_fp32_from_a_bf16_model_and_under_autocast(tiny_path, chunk_size):
    from lit_align.models import load_model

    model = load_model("builtin:tiny", dtype="bfloat16")
    input_ids = torch.randint(3, model.config.vocab_size, (2, 9))
    logps, stats = next_token_logps(model, input_ids, 3, chunk_size, stats=("entropy",))
    assert logps.dtype == stats["entropy"].dtype == torch.float32
    fp32 = load_model("builtin:tiny")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, _ = next_token_logps(fp32, input_ids, 3, chunk_size)
    assert mixed.dtype == torch.float32
    exact, _ = next_token_logps(fp32, input_ids, 3, chunk_size)
    # bf16 weights: close (a few bf16 units of the log-probs' size), not equal
    assert_rounding_close(logps, exact, dtype=torch.bfloat16)
    assert_rounding_close(mixed, exact, dtype=torch.bfloat16)
    assert not torch.equal(logps, exact)
