"""The offline three-stage main jobs, measured: SFT -> DPO -> GRPO (or SFT -> reward model -> GRPO scored by it), each
stage's held-out figure before and after.

    python -m lit_align.pipeline                          # the toy job on the sort task; runs/pipeline/curves.png
    python -m lit_align.pipeline --quick                  # a few steps per stage (what CI runs)
    python -m lit_align.pipeline --recipe smollm2-words   # SmolLM2-135M-Instruct on arith word problems (make demo-real)
    python -m lit_align.pipeline --recipe smollm2         # the same on the plain arith task (make demo-real-arith)
    python -m lit_align.pipeline --recipe smollm2-words --model DIR --chat-template builtin:gemma  # another model
    python -m lit_align.pipeline --recipe learned-reward  # SFT -> reward model -> GRPO with the learned reward
    python -m lit_align.pipeline --recipe smollm2-agent   # SmolLM2 learns to call a calculator (make demo-agent)

Each stage is an ordinary ``lit-align fit -c configs/<stage>.yaml`` (run in this process through ``cli.run``) whose
model starts from the previous stage's export, or from the exports its recipe's ``inputs`` name; after each policy
stage, ``lit-align validate -c <the recipe's eval config>`` measures held-out greedy accuracy on the task's test
prompts, with the task's own score whatever reward the stage trained on. Nothing here computes anything a stage does
not: this file only chains configs, reads their logged metrics and plots them.
"""

from __future__ import annotations

import argparse
import csv
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from lit_align.cli import run as cli

STAGES = ("sft", "dpo", "grpo")


@dataclass(frozen=True)
class Recipe:
    """One main job: its stages' configs, the held-out evaluation and what the table and curves show.

    Args:
        configs: stage -> config file, run in this order.
        eval_config: the ``lit-align validate`` config measuring a model on the held-out prompts.
        columns: table column -> the eval's logged metric.
        base_model: the pretrained model SFT starts from, measured first as the ``base`` row (None: the SFT config's
            own model, from scratch, not measured).
        overrides: stage -> extra ``lit-align fit`` arguments.
        quick: extra arguments of every stage and eval under ``--quick``.
        plots: ``(stage, metric, title)`` of each curve.
        inputs: stage -> ``{argument: value}`` naming earlier stages' exports as ``{stage}`` (e.g.
            ``{"--model.init_args.reward_funcs": "[{reward}]"}``); a stage without ``--model.init_args.model`` among
            them starts from the previous stage's export.
        measured: the stages the eval config measures (None: every one; a reward model is no policy to measure).
        held_out: stage -> ``(metric, label)``: a held-out figure the stage logs itself, printed under the table.
        eval_overrides: extra ``lit-align validate`` arguments of every eval (e.g. the task, where it is not the
            eval config's).
    """

    configs: dict[str, str]
    eval_config: str
    columns: dict[str, str]
    root: str
    base_model: str | None = None
    overrides: dict[str, list[str]] = field(default_factory=dict)
    quick: list[str] = field(default_factory=list)
    plots: list[tuple[str, str, str]] = field(default_factory=list)
    inputs: dict[str, dict[str, str]] = field(default_factory=dict)
    measured: tuple[str, ...] | None = None
    held_out: dict[str, tuple[str, str]] = field(default_factory=dict)
    eval_overrides: list[str] = field(default_factory=list)


WORDS = ["--data.init_args.path", "builtin:arith-words"]
DPO_HELD_OUT = {"dpo": ("val/rewards/accuracies", "DPO held-out preference (reward) accuracy")}


def chain_plots(sft: tuple[str, str], dpo: tuple[str, str], grpo: tuple[str, str]) -> list[tuple[str, str, str]]:
    """The SFT -> DPO -> GRPO chains' curves: each stage's train loss (GRPO's reward) and one figure of its own."""
    return [("sft", "train/loss", "SFT train loss"), ("sft", *sft), ("dpo", "train/loss", "DPO train loss"),
            ("dpo", *dpo), ("grpo", "train/reward", "GRPO train reward"), ("grpo", *grpo)]


SMOLLM2 = Recipe(
    configs={stage: f"configs/{stage}_smollm2.yaml" for stage in STAGES},
    eval_config="configs/eval_smollm2.yaml",
    columns={"accuracy": "val/rewards/last_number_match/mean", "exact": "val/rewards/arith_exact/mean",
             "format": "val/rewards/arith_format/mean"},
    root="runs/smollm2",
    base_model="pretrained:smollm2-135m-instruct",  # `make pretrained` fetches it once
    quick=["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
           "--data.init_args.val_batch_size", "4"],
    plots=chain_plots(("train/mean_token_accuracy", "SFT train token accuracy"),
                      ("train/rewards/accuracies", "DPO train reward accuracy"),
                      ("train/completions/mean_length", "GRPO completion length")),
    held_out=DPO_HELD_OUT,
)

RECIPES = {
    # The built-in sort task from scratch with builtin:tiny. DPO starts from the SFT model, whose greedy answers the
    # standalone config's from-scratch learning rate (1e-3) would wreck; it adds TRL's `sft` loss on the chosen
    # completions (RPO: loss_type [sigmoid, sft]), which keeps the greedy answers from drifting while the preference
    # margin grows: plain sigmoid at 1e-4 moved held-out exact match by -1.5 points, RPO by +11.5.
    "sort": Recipe(
        configs={stage: f"configs/{stage}.yaml" for stage in STAGES},
        eval_config="configs/eval_sort.yaml",
        columns={"held-out exact": "val/rewards/sort_exact/mean", "partial credit": "val/rewards/sort_accuracy/mean"},
        root="runs/pipeline",
        overrides={"dpo": ["--model.init_args.learning_rate", "3.0e-4", "--model.init_args.loss_type",
                           "[sigmoid, sft]", "--trainer.max_steps", "300"]},
        quick=["--trainer.max_steps", "4", "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "1"],
        plots=chain_plots(("val/exact_match", "SFT held-out exact match"),
                          ("val/rewards/accuracies", "DPO held-out reward accuracy"),
                          ("val/reward", "GRPO held-out reward (greedy)")),
        held_out=DPO_HELD_OUT,
    ),
    # SmolLM2-135M-Instruct on the built-in arith task; the configs say why each setting is what it is. Measured
    # (100 held-out prompts, last-number accuracy): base 0.05 -> SFT 0.52 -> DPO 0.55 -> GRPO 0.50 (8 steps), DPO
    # held-out preference accuracy 1.0; 5.6 min on 2 quiet cores (24 min on 2 cores shared at load 5-8).
    "smollm2": SMOLLM2,
    # The same chain on builtin:arith-words (make demo-real): SFT and DPO see the bare problems ("Compute 59 + 63."),
    # GRPO and every eval the same + and * problems as word problems in ten phrasings, so which operation a story asks
    # for is the reward's to teach (on builtin:arith, whose headroom is subtraction the model only guesses, GRPO moved
    # held-out accuracy by -5 to -1 points). GRPO: 20 steps of 32 completions (8 prompts x 8 a round), lr 2e-5.
    "smollm2-words": replace(
        SMOLLM2, root="runs/smollm2-words", eval_overrides=WORDS,
        overrides={"sft": WORDS, "dpo": WORDS,
                   "grpo": WORDS + ["--data.init_args.batch_size", "32", "--trainer.max_steps", "20"]}),
    # SmolLM2-135M-Instruct learns to call a calculator (make demo-agent; docs/grpo.md, "A real model with a tool"):
    # the base model with the tool offered, SFT on builtin:calculator's demonstrations (30% call the tool, the rest
    # answer directly), then GRPO with a CalculatorEnvironment per rollout; every eval greedy with the tool offered.
    "smollm2-agent": Recipe(
        configs={"sft": "configs/sft_agent_smollm2.yaml", "grpo": "configs/grpo_agent_smollm2.yaml"},
        eval_config="configs/eval_agent_smollm2.yaml",
        columns={"accuracy": "val/rewards/last_number_match/mean", "calls": "val/tools/call_frequency",
                 "valid calls": "val/rewards/calculator_call_format/mean"},
        root="runs/agent",
        base_model="pretrained:smollm2-135m-instruct",
        quick=SMOLLM2.quick,
        plots=[("sft", "train/loss", "SFT train loss"), ("sft", "train/mean_token_accuracy", "SFT token accuracy"),
               ("grpo", "train/reward", "GRPO train reward (right product)"),
               ("grpo", "train/tools/call_frequency", "GRPO calls per completion"),
               ("grpo", "train/rewards/calculator_call_format/mean", "GRPO valid-call rate"),
               ("grpo", "train/completions/mean_length", "GRPO completion length")],
    ),
    # The built-in sort task with a learned reward: SFT from scratch, a reward model from the SFT model trained on the
    # task's preference pairs, then GRPO from the SFT model scored by that reward model alone; the task's own score
    # (held-out exact match) only measures.
    "learned-reward": Recipe(
        configs={"sft": "configs/sft.yaml", "reward": "configs/reward.yaml", "grpo": "configs/grpo.yaml"},
        eval_config="configs/eval_sort.yaml",
        columns={"held-out exact": "val/rewards/sort_exact/mean", "partial credit": "val/rewards/sort_accuracy/mean"},
        root="runs/learned-reward",
        # the task's exact match rides along at weight 0: logged at every validation, never trained on
        inputs={"grpo": {"--model.init_args.model": "{sft}",
                         "--model.init_args.reward_funcs": "[{reward}, lit_align.rewards.sort_exact]",
                         "--model.init_args.reward_weights": "[1.0, 0.0]"}},
        # 3 epochs (750 steps), validated at each epoch's end: held-out pair accuracy 0.97 (200 steps: 0.915); GRPO
        # with the KL term (beta 0.1) to the SFT model, which the learned reward alone pulls away from the task
        # (docs/reward.md)
        overrides={"reward": ["--trainer.max_steps", "750", "--trainer.val_check_interval", "250"],
                   "grpo": ["--model.init_args.beta", "0.1"]},
        measured=("sft", "grpo"),
        held_out={"reward": ("val/accuracy", "reward model held-out pair accuracy")},
        quick=["--trainer.max_steps", "4", "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "1"],
        plots=[("sft", "train/loss", "SFT train loss"),
               ("sft", "val/exact_match", "SFT held-out exact match"),
               ("reward", "train/loss", "reward model train loss"),
               ("reward", "val/accuracy", "reward model held-out pair accuracy"),
               ("grpo", "train/reward", "GRPO train reward (learned)"),
               ("grpo", "val/rewards/sort_exact/mean", "GRPO held-out exact match (greedy, not trained on)")],
    ),
}


def run_stage(recipe: Recipe, stage: str, root: Path, model: str | None, quick: bool,
              exports: dict[str, Path] | None = None, extra: list[str] = ()) -> Path:
    """``lit-align fit -c <the stage's config>`` with the model (``model``, or the export its ``inputs`` name),
    the other exports it takes, run directory and export path set, and ``extra`` arguments; returns the export."""
    export = root / stage / "hf_model"
    args = ["fit", "-c", recipe.configs[stage], "--trainer.logger.init_args.save_dir", str(root),
            "--trainer.logger.init_args.name", stage, "--trainer.logger.init_args.version", "run",
            "--trainer.enable_progress_bar", "false", "--export.path", str(export)]
    inputs = {name: value.format(**(exports or {})) for name, value in recipe.inputs.get(stage, {}).items()}
    if model is not None and "--model.init_args.model" not in inputs:
        args += ["--model.init_args.model", model]
    args += [part for pair in inputs.items() for part in pair]
    cli(args + recipe.overrides.get(stage, []) + (recipe.quick if quick else []) + list(extra))
    return export


def evaluate(recipe: Recipe, model: str, root: Path, name: str, quick: bool,
             extra: list[str] = ()) -> dict[str, float]:
    """Held-out greedy figures of ``model``: ``{column: value}`` for the recipe's table columns (``extra``: more
    ``lit-align validate`` arguments)."""
    args = ["validate", "-c", recipe.eval_config, "--model.init_args.model", model,
            "--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.name", f"eval-{name}",
            "--trainer.logger.init_args.version", "run", "--trainer.enable_progress_bar", "false"]
    metrics = cli(args + recipe.eval_overrides + (recipe.quick if quick else []) + list(extra)).trainer.callback_metrics
    # a mean over no values is not logged (the valid-call rate where no completion called): NaN in the table
    return {column: float(metrics.get(metric, float("nan"))) for column, metric in recipe.columns.items()}


def read_metrics(run: Path) -> dict[str, list[tuple[int, float]]]:
    """A run directory's logged scalars as ``{name: [(step, value), ...]}``: its TensorBoard events (the shipped
    configs' logger), or its CSVLogger ``metrics.csv``."""
    series: dict[str, list[tuple[int, float]]] = {}
    if any(run.glob("events.out.tfevents.*")):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run), size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        for name in events.Tags()["scalars"]:
            series[name] = [(e.step, e.value) for e in events.Scalars(name)]
        return series
    with (run / "metrics.csv").open() as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if value not in ("", None) and name not in ("step", "epoch"):
                    series.setdefault(name, []).append((int(row["step"]), float(value)))
    return series


def plot(root: Path, plots: list[tuple[str, str, str]] = RECIPES["sort"].plots) -> Path | None:
    """The curves as ``<root>/curves.png``; None (and one line saying how to get them) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("lit_align: curves not drawn: matplotlib is not installed (pip install 'lit_align[plots]')")
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(10, 9))
    for ax, (stage, metric, title) in zip(axes.flat, plots):
        series = read_metrics(root / stage / "run").get(metric, [])
        if series:
            steps, values = zip(*series)
            ax.plot(steps, values, marker="o" if len(series) < 20 else None)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = root / "curves.png"
    fig.savefig(out, dpi=100)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="sort", help="which main job")
    parser.add_argument("--root", help="where the stages write their runs and exports (default: the recipe's)")
    parser.add_argument("--model", help="the pretrained model SFT starts from (default: the recipe's)")
    parser.add_argument("--chat-template", help="the chat template of every stage and eval (model.chat_template: a "
                        "Jinja file or a named one, e.g. builtin:gemma), for a model without one")
    parser.add_argument("--quick", action="store_true", help="a few steps per stage (a smoke test)")
    args = parser.parse_args(argv)
    recipe = RECIPES[args.recipe]
    root = Path(args.root or recipe.root)
    model = args.model or recipe.base_model
    extra = ["--model.init_args.chat_template", args.chat_template] if args.chat_template else []
    start = time.time()
    rows = []
    if model is not None:
        t0 = time.time()
        rows.append(("base", evaluate(recipe, model, root, "base", args.quick, extra), time.time() - t0))
    exports: dict[str, Path] = {}
    for stage in recipe.configs:
        t0 = time.time()
        exports[stage] = run_stage(recipe, stage, root, model, args.quick, exports, extra)
        model = str(exports[stage])
        if recipe.measured is None or stage in recipe.measured:
            rows.append((stage, evaluate(recipe, model, root, stage, args.quick, extra), time.time() - t0))
    curves = plot(root, recipe.plots)
    print("\nstage  " + "  ".join(f"{column:>14}" for column in recipe.columns) + "  minutes")
    for stage, figures, seconds in rows:
        print(f"{stage:<6} " + "  ".join(f"{figures[c]:>14.3f}" for c in recipe.columns) + f"  {seconds / 60:>7.1f}")
    for stage, (metric, label) in recipe.held_out.items():
        points = read_metrics(root / stage / "run").get(metric, [])
        if points:
            print(f"{label}: {points[-1][1]:.3f}")
    drawn = f"curves: {curves}; " if curves else ""
    print(f"total {(time.time() - start) / 60:.1f} min; {drawn}models: {root}/<stage>/hf_model")


if __name__ == "__main__":
    main()
