"""Asynchronous GRPO against synchronous GRPO on the real model: completions/s and held-out accuracy, side by side.

    python bench/async_grpo.py                                    # make demo-real's GRPO stage, both ways
    python bench/async_grpo.py --start runs/smollm2-words/dpo/hf_model --steps 20 --threads 2

Both runs are ``make demo-real``'s GRPO stage (``configs/grpo_smollm2.yaml`` on ``builtin:arith-words``: 20 optimizer
steps of 32 completions, 8 prompts x 8 a round feeding 2 steps, lr 2e-5) from the same start (the demo's DPO export:
run ``make demo-real`` first), each in a fresh process with ``--threads`` CPU threads:

  - ``sync``: lit_align's default, generation then training, both on every thread;
  - ``async``: ``model.async_rollouts: true`` (one round ahead: ``max_staleness`` null), the producer on half the
    threads and the trainer on the other half (``producer_threads`` null).

Each run's figures: completions/s over the whole ``fit`` (model loading and the producer's start included) and in the
steady state (from the first optimizer step's log to the last one's, TensorBoard's wall times), the mean staleness and
busy fractions (async), then the held-out greedy accuracy of its export on the task's 100 test prompts
(``configs/eval_smollm2.yaml``, the demo's table).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import ROOT, run_child  # noqa: E402

MODES = ("sync", "async")


def child(args) -> None:
    """One run in this process: the GRPO stage, its timings and its held-out accuracy as one ``RESULT`` line."""
    from dataclasses import replace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lit_align.pipeline import RECIPES, WORDS, evaluate, run_stage

    recipe = RECIPES["smollm2-words"]
    overrides = WORDS + ["--data.init_args.batch_size", str(args.batch_size), "--trainer.max_steps", str(args.steps)]
    if args.mode == "async":
        overrides += ["--model.init_args.async_rollouts", "true"]
    recipe = replace(recipe, overrides={"grpo": overrides})
    root = Path(args.root) / args.mode
    shutil.rmtree(root, ignore_errors=True)  # a fresh run directory: its TensorBoard events are this run's only
    start = time.perf_counter()
    export = run_stage(recipe, "grpo", root, args.start, quick=False)
    wall = time.perf_counter() - start
    events = EventAccumulator(str(root / "grpo" / "run"), size_guidance={"scalars": 0})
    events.Reload()
    loss = events.Scalars("train/loss")
    steady = (len(loss) - 1) * args.batch_size / (loss[-1].wall_time - loss[0].wall_time)

    def mean(name: str) -> float | None:
        values = [e.value for e in events.Scalars(name)] if name in events.Tags()["scalars"] else []
        return sum(values) / len(values) if values else None

    figures = {"mode": args.mode, "fit_s": wall, "completions": args.steps * args.batch_size,
               "fit_rate": args.steps * args.batch_size / wall, "steady_rate": steady,
               "train_reward": mean("train/reward"), "staleness": mean("train/async/staleness"),
               "producer_busy": mean("train/async/producer_busy"), "trainer_busy": mean("train/async/trainer_busy"),
               "dropped": mean("train/async/dropped_rounds")}
    figures["accuracy"] = evaluate(recipe, str(export), root, args.mode, quick=False)["accuracy"]
    print("RESULT " + json.dumps(figures), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--start", default="runs/smollm2-words/dpo/hf_model", help="the model both runs start from")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--root", default="runs/bench-async")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.mode:
        return child(args)
    if not (ROOT / args.start).exists() and not Path(args.start).exists():
        sys.exit(f"error: {args.start} does not exist: run `make demo-real` first (its DPO export is the start)")
    results = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        results.append(run_child(cmd, args.threads, mode))
    base = results[0]
    print(f"\nGRPO stage of make demo-real, {args.steps} steps x {args.batch_size} completions, {args.threads} threads")
    print("| mode | fit s | completions/s (fit) | steady | ratio (steady) | held-out accuracy | staleness | "
          "producer busy | trainer busy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        def cell(name, fmt="{:.2f}"):
            return "-" if r.get(name) is None else fmt.format(r[name])

        print(f"| {r['mode']} | {r['fit_s']:.0f} | {r['fit_rate']:.2f} | {r['steady_rate']:.2f} | "
              f"{r['steady_rate'] / base['steady_rate']:.2f}x | {r['accuracy']:.2f} | {cell('staleness')} | "
              f"{cell('producer_busy')} | {cell('trainer_busy')} |")


if __name__ == "__main__":
    main()
