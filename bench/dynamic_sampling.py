"""GRPO with and without dynamic sampling (DAPO), side by side: same start model, seed, config and step budget.

Each run is an ordinary ``lit-align fit -c <config>`` (in this process, ``lit_align.cli.run``) with
``model.dynamic_sampling`` false, then true; the table gives the held-out ``val/reward`` at each validation, the mean
``train/frac_reward_zero_std`` (groups that scored alike: no signal), the groups each round kept, and the wall time.
The curves go to ``<out>/dynamic_sampling.png`` when matplotlib is installed.

    make demo                                    # the toy job once: its DPO export is the default start model
    python bench/dynamic_sampling.py             # configs/grpo.yaml from runs/pipeline/dpo/hf_model, 300 steps
    python bench/dynamic_sampling.py --config configs/grpo_smollm2.yaml --model runs/smollm2/dpo/hf_model \\
        --steps 8 --val-every 4                 # the real-model job's GRPO stage
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lit_align.cli import run
from lit_align.pipeline import read_metrics


def fit(args, dynamic: bool) -> tuple[Path, float]:
    root = Path(args.out) / ("dynamic" if dynamic else "plain")
    start = time.perf_counter()
    cli = run(["fit", "-c", args.config, "--model.init_args.model", args.model, "--seed_everything", str(args.seed),
               "--model.init_args.dynamic_sampling", str(dynamic).lower(),
               "--model.init_args.max_num_gen_batches", str(args.max_num_gen_batches),
               "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(args.val_every),
               "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root),
               "--trainer.callbacks", "[]", "--export.enabled", "false", *args.extra])
    return Path(cli.trainer.log_dir), time.perf_counter() - start


def mean(points: list[tuple[int, float]]) -> float:
    return sum(v for _, v in points) / max(len(points), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/grpo.yaml")
    parser.add_argument("--model", default="runs/pipeline/dpo/hf_model", help="the start model (an HF directory)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--max-num-gen-batches", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench_dynamic_sampling")
    parser.add_argument("extra", nargs="*", help="more lit-align fit arguments, after --")
    args = parser.parse_args()
    if not Path(args.model).exists():
        raise SystemExit(f"{args.model}: no such model directory (run `make demo` first, or pass --model)")

    runs = {name: fit(args, dynamic) for name, dynamic in (("plain", False), ("dynamic", True))}
    series = {name: read_metrics(log_dir) for name, (log_dir, _) in runs.items()}
    val_steps = sorted({s for m in series.values() for s, _ in m.get("val/reward", [])})
    print(f"\n{args.config} from {args.model}, {args.steps} steps, seed {args.seed}, max_num_gen_batches "
          f"{args.max_num_gen_batches}")
    print("| step | " + " | ".join(f"val/reward {n}" for n in series) + " |")
    print("|---|" + "---|" * len(series))
    for step in val_steps:
        values = [dict(m.get("val/reward", [])).get(step) for m in series.values()]
        print(f"| {step} | " + " | ".join("" if v is None else f"{v:.3f}" for v in values) + " |")
    for name, m in series.items():
        kept = m.get("train/dynamic_sampling/gen_batches")
        print(f"{name}: frac_reward_zero_std {mean(m.get('train/frac_reward_zero_std', [])):.3f} (mean over steps)"
              + (f", generation batches per round {mean(kept):.2f}" if kept else "")
              + f", wall {runs[name][1] / 60:.1f} min")
    plot(series, Path(args.out) / "dynamic_sampling.png")


def plot(series: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no curves (pip install 'lit_align[plots]')")
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, metric in zip(axes, ("val/reward", "train/reward", "train/frac_reward_zero_std")):
        for name, m in series.items():
            points = m.get(metric, [])
            ax.plot([s for s, _ in points], [v for _, v in points], label=name)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"curves: {path}")


if __name__ == "__main__":
    main()
