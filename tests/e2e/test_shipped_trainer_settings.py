"""Every shipped config's trainer settings train on CPU under TRL's defaults: ``bf16-mixed`` and clipping (TRL's
``bf16`` and ``max_grad_norm: 1.0``, which ``lit-align from-trl`` writes) with the config's own optimizer (the fused
AdamW unless it says otherwise), accumulation and gradient checkpointing, 2 optimizer steps each.

The configs' models and data are swapped for offline ones (``builtin:tiny``; the built-in tasks for the hub datasets
of the GPU configs) and their sizes cut to seconds; a config's own ``gradient_clip_val`` is kept (the GPU configs set
1.0), the others get 1.0. The strategy configs need several processes: ``test_strategies_clip_the_global_norm``
(slow) runs DDP and FSDP on 2 CPU ranks; DeepSpeed needs a GPU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from helpers import ddp_and_single, metric_at, read_metrics, run_single

from numerics import TINY_TERMS, assert_rounding_close

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
VALIDATE_ONLY = {"eval_sort.yaml", "eval_smollm2.yaml"}  # `lit-align validate` configs: they do not train
SHIPPED = sorted(p.name for p in CONFIGS.glob("*.yaml") if p.name not in VALIDATE_ONLY)

ROUND = ["--data.init_args.batch_size", "4", "--model.init_args.max_completion_length", "4",
         "--model.init_args.steps_per_generation", "2"]
# GRPO, RLOO: 2 completions a prompt, a reward that spreads the untrained model's (so the advantages, and the
# gradients to clip, are not all zero)
GROUPS = ["--model.init_args.num_generations", "2", "--model.init_args.reward_funcs",
          json.dumps(["helpers.digit_fraction"])]
LONG_ROWS = {"builtin:arith", "builtin:arith-words"}  # the tiny model's tokenizer makes more tokens of them
HUB_DATA = {  # the GPU configs' hub datasets, as the built-in tasks of the same row formats
    "dpo_qwen_ultrafeedback.yaml": ["--data.init_args.path", "builtin:sort", "--data.init_args.max_length", "64",
                                    "--data.init_args.num_workers", "0"],
    "grpo_qwen_gsm8k.yaml": ["--data.init_args.path", "builtin:arith", "--data.init_args.config_name", "null",
                             "--data.init_args.rename_columns", "null", "--data.init_args.max_length", "64"],
}


def offline(name: str) -> list[str]:
    """The overrides that make ``name`` train 2 steps offline in seconds: the tiny model (a teacher: the small one), few rows."""
    source = yaml.safe_load((CONFIGS / name).read_text())
    recipe = source["model"]["class_path"].rsplit(".", 1)[1]
    args = ["--model.init_args.model", "builtin:tiny", *HUB_DATA.get(name, [])]
    if source["data"]["init_args"].get("path") in LONG_ROWS and "max_length" in source["data"]["init_args"]:
        args += ["--data.init_args.max_length", "256"]
    if recipe in ("GRPOModule", "RLOOModule"):
        args += ROUND + GROUPS
    elif recipe == "DistillationModule":
        args += ROUND + ["--model.init_args.teacher_model", "builtin:small"]  # another model: a divergence
    else:
        args += ["--data.init_args.batch_size", "4"]
    clip = source["trainer"].get("gradient_clip_val")
    return args + ["--trainer.gradient_clip_val", str(clip or 1.0)]


def fit_args(name: str, out: Path, *extra: str) -> list[str]:
    return ["fit", "-c", str(CONFIGS / name), "--trainer.accelerator", "cpu", "--trainer.precision", "bf16-mixed",
            "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(out),
            "--trainer.logger", json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                            "init_args": {"save_dir": str(out), "name": "run"}}),
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.enable_checkpointing", "false", "--data.init_args.val_split", "null",
            "--export.enabled", "false", *offline(name), *extra]


def test_every_shipped_config_is_covered():
    assert "dpo_qwen_ultrafeedback.yaml" in SHIPPED and "grpo_qwen_gsm8k.yaml" in SHIPPED
    for name in SHIPPED:
        source = yaml.safe_load((CONFIGS / name).read_text())
        hub = not str(source["data"]["init_args"].get("path", "builtin:")).startswith("builtin:")
        assert not hub or name in HUB_DATA, f"{name} reads a hub dataset: give its offline stand-in in HUB_DATA"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_trainer_settings_train_under_bf16_mixed_with_clipping(tmp_path, tiny_path, name):
    run_single(fit_args(name, tmp_path))
    metrics = read_metrics(tmp_path / "run" / "version_0" / "metrics.csv")
    for step in (0, 1):
        assert math.isfinite(metric_at(metrics, "train/loss", step)), (name, step)
        assert metric_at(metrics, "train/grad_norm", step) > 0, (name, step)


# -- the strategy configs: 2 CPU ranks against one process -------------------------------------------------------------
STRATEGIES = {
    "ddp.yaml": ["-c", str(CONFIGS / "strategy" / "ddp.yaml"), "--trainer.accelerator", "cpu"],
    "fsdp.yaml": ["-c", str(CONFIGS / "strategy" / "fsdp.yaml"), "--trainer.strategy.class_path",
                  "helpers.CPUFSDPStrategy", "--trainer.accelerator", "cpu"],
}


def strategy_args(out: Path, batch_size: int) -> list[str]:
    """DPO with plain SGD, whose update is the clipped gradient itself (AdamW's first step is its sign), clipped far
    below the gradient's norm: a rank clipping its own shard or half-batch by its own norm would update otherwise.
    fp32: Lightning's FSDP on CPU runs without autocast, so a bf16 run would not compare with one process."""
    return fit_args("dpo.yaml", out, "--trainer.precision", "32-true", "--trainer.gradient_clip_val", "0.01",
                    "--model.init_args.optim", "sgd", "--model.init_args.learning_rate", "1.0",
                    "--model.init_args.warmup_ratio", "0", "--data.init_args.shuffle", "false",
                    "--data.init_args.batch_size", str(batch_size))


@pytest.mark.slow  # two processes (~20-45 s each): run by .ci/run (make test-slow), not by make test
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_strategies_clip_the_global_norm(tmp_path_factory, strategy):
    """2 ranks of 2 rows equal one process of 4: the same norm before clipping (``train/grad_norm``, over every
    rank's gradients or shards) and the same loss after the clipped update. Lightning alone refuses norm clipping
    under FSDP."""
    ranks, single = ddp_and_single(tmp_path_factory, lambda out: strategy_args(out, 2),
                                   lambda out: strategy_args(out, 4), strategy=STRATEGIES[strategy])
    two, one = (read_metrics(d / "run" / "version_0" / "metrics.csv") for d in (ranks, single))
    norm = metric_at(one, "train/grad_norm", 0)
    assert norm > 0.1  # far above the clip value: the clipping acts
    assert_rounding_close(metric_at(two, "train/grad_norm", 0), norm, terms=TINY_TERMS, msg="norm before clipping")
    # after the clipped update (a rank clipping by its own shard's norm: ~1e-3 off)
    assert_rounding_close(metric_at(two, "train/loss", 1), metric_at(one, "train/loss", 1), scale=1.0,
                          terms=TINY_TERMS, msg="loss after the clipped update")
