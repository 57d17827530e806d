"""DDP on CPU: two ranks with B rows each train exactly like one process with 2B rows (DPO, SFT, GRPO).

The two-rank run is the real CLI in a subprocess (``--trainer.strategy ddp --trainer.devices 2``); the one-process
run is in-process. Both record every batch they train on with ``helpers.RecordBatches`` (a plain Lightning callback
passed on the command line), read their rows unshuffled, and log every step. Then:

- the ranks saw disjoint pairs, and together exactly the one-process batch (per step);
- the logged step-0 metrics agree (``train/loss`` is ln 2 on both sides: policy == reference; the log-probs are
  data-dependent), and so does the step-1 loss, which comes after one optimizer step: it checks that the ranks'
  gradients were averaged into the same update the one-process run made.

SFT is checked the same way (its loss is the mean over the loss tokens of all ranks). GRPO samples its completions,
and a rank's random stream is not the one process's, so the ranks record what they sampled
(``helpers.ReplayRollouts``) and the one-process run replays those completions and rewards instead of sampling: it
checks that the loss, the KL and the update are the same over the same completions, not that sampling is.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import ddp_and_single, metric_at, read_metrics, run_single
from numerics import TINY_TERMS, assert_rounding_close

pytestmark = pytest.mark.slow  # two processes per check (~70 s in all): run by .ci/run (make test-slow), not by make test

TESTS = Path(__file__).resolve().parents[1]  # tests/
CONFIGS = TESTS.parent / "configs"
DPO = str(CONFIGS / "dpo.yaml")
STEPS = 2


def common_args(out: Path, batch_size: int, config: str = DPO, callback: dict | None = None) -> list[str]:
    callback = callback or {"class_path": "helpers.RecordBatches", "init_args": {"out_dir": str(out / "batches")}}
    return [
        "fit", "-c", config, "--trainer.max_steps", str(STEPS), "--trainer.log_every_n_steps", "1",
        "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.enable_checkpointing", "false",
        "--trainer.logger.init_args.save_dir", str(out), "--trainer.callbacks", json.dumps([callback]),
        "--data.init_args.batch_size", str(batch_size), "--data.init_args.shuffle", "false",
        "--data.init_args.val_split", "null", "--export.enabled", "false",
    ]


def pairs(batch: dict) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(chosen, rejected) token sequences of a recorded [chosen; rejected] batch, padding stripped."""

    def strip(seq):
        while seq and seq[-1] == 0:
            seq = seq[:-1]
        return tuple(seq)

    rows = [strip(r) for r in batch["input_ids"]]
    half = len(rows) // 2
    return list(zip(rows[:half], rows[half:]))


def by_step(record: dict) -> dict[int, list]:
    return {b["step"]: pairs(b) for b in record["batches"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ddp_dir, single_dir = ddp_and_single(tmp_path_factory, lambda out: common_args(out, 2),
                                         lambda out: common_args(out, 4))
    return {
        "ddp": [json.loads((ddp_dir / "batches" / f"rank{r}.json").read_text()) for r in (0, 1)],
        "single": json.loads((single_dir / "batches" / "rank0.json").read_text()),
        "ddp_metrics": read_metrics(ddp_dir / "dpo" / "version_0"),
        "single_metrics": read_metrics(single_dir / "dpo" / "version_0"),
    }


def test_ranks_see_disjoint_halves_of_the_single_process_batch(runs):
    rank0, rank1 = runs["ddp"]
    assert rank0["world_size"] == rank1["world_size"] == 2
    assert runs["single"]["world_size"] == 1
    r0, r1, single = by_step(rank0), by_step(rank1), by_step(runs["single"])
    assert sorted(r0) == sorted(r1) == sorted(single) == list(range(STEPS))
    for step in range(STEPS):
        assert len(r0[step]) == len(r1[step]) == 2 and len(single[step]) == 4
        assert not set(r0[step]) & set(r1[step]), f"step {step}: both ranks trained on the same pair"
        assert sorted(r0[step] + r1[step]) == sorted(single[step]), f"step {step}: ranks' pairs != one-process batch"
    # and different steps are different rows
    assert not set(single[0]) & set(single[1])


def test_logged_metrics_match_single_process(runs):
    ddp, single = runs["ddp_metrics"], runs["single_metrics"]
    loss0 = metric_at(ddp, "train/loss", 0)
    # policy == reference: each pair's margin is 0 up to rounding, so each loss is ln 2 to a few units of fp32
    assert loss0 == pytest.approx(math.log(2), rel=1e-6)
    assert metric_at(single, "train/loss", 0) == pytest.approx(math.log(2), rel=1e-6)
    for name in ("train/logps/chosen", "train/logps/rejected"):  # data-dependent: mean over all 4 pairs
        value = metric_at(single, name, 0)
        assert_rounding_close(metric_at(ddp, name, 0), value, terms=TINY_TERMS, msg=name)
    # after one optimizer step: same averaged gradient -> same weights -> same loss on the next batch
    loss1 = metric_at(ddp, "train/loss", 1)
    assert loss1 != pytest.approx(math.log(2), abs=1e-4)
    assert_rounding_close(loss1, metric_at(single, "train/loss", 1), scale=1.0, terms=TINY_TERMS)


# -- SFT ---------------------------------------------------------------------------------------------------------------
def test_sft_two_ranks_train_like_one_process(tmp_path_factory):
    def args(out, batch_size):  # no warmup: step 0 must move the weights for step 1 to check the update
        return [*common_args(out, batch_size, str(CONFIGS / "sft.yaml")), "--model.init_args.warmup_steps", "0"]

    # the DDP run also exports into its run directory (every rank takes part: Lightning broadcasts log_dir)
    ddp_dir, single_dir = ddp_and_single(
        tmp_path_factory, lambda out: [*args(out, 4), "--export.enabled", "true", "--export.path", "null"],
        lambda out: args(out, 8))
    exported = ddp_dir / "sft" / "version_0" / "hf_model"
    assert (exported / "config.json").exists() and (exported / "model.safetensors").exists()
    ddp = read_metrics(ddp_dir / "sft" / "version_0")
    single = read_metrics(single_dir / "sft" / "version_0")
    batches = [by_step(json.loads((ddp_dir / "batches" / f"rank{r}.json").read_text())) for r in (0, 1)]
    assert sorted(batches[0][0] + batches[1][0]) == sorted(by_step(json.loads(
        (single_dir / "batches" / "rank0.json").read_text()))[0])
    for step in range(STEPS):  # step 1: after one (token-weighted, rank-averaged) update
        for name in ("train/loss", "train/mean_token_accuracy"):
            value = metric_at(single, name, step)
            assert_rounding_close(metric_at(ddp, name, step), value, scale=max(abs(value), 1.0), terms=TINY_TERMS,
                                  msg=f"{name} at {step}")
        assert metric_at(ddp, "train/num_tokens", step) == metric_at(single, "train/num_tokens", step)  # a count


# -- GRPO --------------------------------------------------------------------------------------------------------------
def grpo_args(out: Path, batch_size: int, callback: dict) -> list[str]:
    model = ["--model.init_args.model", "builtin:tiny", "--model.init_args.beta", "0.04",
             "--model.init_args.max_completion_length", "4", "--model.init_args.learning_rate", "1e-2",
             "--model.init_args.warmup_steps", "0",
             "--model.init_args.reward_funcs", json.dumps(["lit_align.rewards.sort_accuracy", "helpers.digit_fraction"]),
             "--model.init_args.num_generations", "2", "--model.init_args.steps_per_generation", "1"]
    return [*common_args(out, batch_size, str(CONFIGS / "grpo.yaml"), callback), *model]


def test_grpo_two_ranks_train_like_one_process_on_the_same_completions(tmp_path_factory):
    record = {}

    def ddp(out):
        record["dir"] = str(out / "rollouts")
        return grpo_args(out, 4, {"class_path": "helpers.ReplayRollouts", "init_args": {"record_dir": record["dir"]}})

    ddp_dir, single_dir = ddp_and_single(tmp_path_factory, ddp)  # then replay what the ranks sampled, in one process
    run_single(grpo_args(single_dir, 8, {"class_path": "helpers.ReplayRollouts",
                                         "init_args": {"replay_dir": record["dir"]}}))
    ddp_m = read_metrics(ddp_dir / "grpo" / "version_0")
    single_m = read_metrics(single_dir / "grpo" / "version_0")
    for step in range(STEPS):
        for name in ("train/reward", "train/reward_std", "train/completions/mean_length",
                     "train/completions/min_length", "train/completions/max_length"):  # the same replayed rows
            assert metric_at(ddp_m, name, step) == pytest.approx(metric_at(single_m, name, step), rel=1e-6), name
        for name in ("train/loss", "train/kl"):  # log-probs in other batches and orders
            value = metric_at(single_m, name, step)
            assert_rounding_close(metric_at(ddp_m, name, step), value, scale=max(abs(value), 1.0), terms=TINY_TERMS,
                                  msg=f"{name} at {step}")
    # policy == reference before any update: log-prob differences d of rounding size, so k3 ~ d^2 / 2 ~ 0
    assert metric_at(ddp_m, "train/kl", 0) == pytest.approx(0.0, abs=1e-7)
    assert metric_at(ddp_m, "train/kl", 1) > 1e-6  # ...and not after: the step-1 match checks the averaged update


def test_grpo_async_rollouts_on_two_ranks_at_the_synchronous_limit_equal_the_synchronous_run(tmp_path_factory):
    """Each rank has its own producer sampling its own prompts: at ``max_staleness: 0`` two ranks train exactly as two
    synchronous ranks do (the same rewards, losses and KL at every step)."""
    callback = {"class_path": "lightning.pytorch.callbacks.Callback"}
    sync_dir, _ = ddp_and_single(tmp_path_factory, lambda out: grpo_args(out, 4, callback))
    async_dir, _ = ddp_and_single(tmp_path_factory, lambda out: [
        *grpo_args(out, 4, callback), "--model.init_args.async_rollouts", "true", "--model.init_args.max_staleness", "0",
        "--model.init_args.producer_threads", "1"])
    sync_m, async_m = (read_metrics(d / "grpo" / "version_0") for d in (sync_dir, async_dir))
    for step in range(STEPS):
        for name in ("train/reward", "train/loss", "train/kl", "train/completions/mean_length"):
            assert metric_at(async_m, name, step) == metric_at(sync_m, name, step), f"{name} at {step}"
        assert metric_at(async_m, "train/async/staleness", step) == 0.0
