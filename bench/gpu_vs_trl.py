"""lit_align against TRL 1.16 on one GPU, bf16: DPO pairs/s and GRPO completions/s with each side's peak GPU memory,
at real models' shapes, in one run that fits 8 minutes.

    python bench/gpu_vs_trl.py --vendor             # here (pip access), after your last commit: the wheels, ~10 s
    PYTHONUNBUFFERED=1 timeout 480 python3 bench/gpu_vs_trl.py --json gpu_vs_trl.json   # there: under 8 minutes
    python bench/gpu_vs_trl.py --accelerator cpu --smoke    # the script itself on CPU, tiny shapes (~1 minute)

The GPU machine cannot reach a package index: ``--vendor`` downloads the pure-Python wheels the benchmark's processes
import (TRL, datasets, ... at this environment's versions; ``bench/vendor.py``) into ``wheels/`` beside this script,
an untracked folder that travels with the working tree (do not commit it); there, each one the machine lacks, or
has too old for lit_align's and TRL's requirements, is unpacked and put first on the path, and the run says which.

The models: random weights (speed does not depend on them) of Qwen2.5-0.5B's shape (Qwen2: 24 layers, hidden 896,
14 heads / 2 KV heads, intermediate 4,864, tied 151,936-token vocabulary) and SmolLM2-135M's (Llama: 30 layers, hidden
576, 9 / 3 heads, intermediate 1,536, tied 49,152), built once with ``bench/lab.py``'s tokenizer of that vocabulary;
its rows (``lab.write_rows``: UltraFeedback-like pairs, GSM8K-like prompts; through the Qwen2 tokenizer ~2.3x the
tokens). ``--smoke``: a 4,096-token vocabulary, 1 layer of hidden 64, one timed step or round.

The cases, each in a fresh process (``bench/child.py``: its peak memory is its own), for each shape and recipe:
  - ``lit default``: lit_align at its defaults (on a GPU: padded rows, the HF engine, no checkpointing);
  - ``trl default``: TRL's config at its defaults (``gradient_checkpointing=True``, ``bf16=True``);
  - ``trl fast``: TRL's documented fast settings that exist here: ``gradient_checkpointing=False``, and
    ``use_liger_kernel=True`` where liger-kernel is installed (DPO's ``padding_free`` is disabled in TRL 1.16: it
    warns and pads, so it is not set);
  - GRPO ``vllm``, both sides, where vLLM is installed on a GPU (``engine: vllm`` / ``use_vllm``, colocated, 0.3 of
    the GPU; its memory is vLLM's pool, not counted in torch's peak).
Both sides: the same model directory in fp32 under bf16 autocast (lit ``bf16-mixed``, TRL ``bf16``), sdpa attention,
no Hub kernels (``USE_HUB_KERNELS=0``: none can be fetched offline; lit_align's default), fused AdamW, clipping at
1.0, the same rows in the same order; DPO ``beta`` 0.1, ``max_length`` 1024 (the lab's pairs whose prompt takes at
most half of it); GRPO ``dapo``, ``beta`` 0, temperature 1, the lab's sort-task reward, every completion sampled to
``--max-new-tokens`` on both sides (``min_new_tokens``; under vLLM none is set, since it would change the log-probs
of the importance-sampling correction: ``tok/compl`` shows any EOS sampled).

Measured: steady state after the warm-up (DPO's first ``--dpo-warmup`` steps, GRPO's first round), the device
synchronized at every mark. DPO: pairs/s, and per step the forward + backward (step start to the optimizer hook;
TRL's clipping falls in it, lit_align's in the optimizer's) and the optimizer's time. GRPO: completions/s, tokens/s,
per round the time in the engine's generate and the rest (old log-probs, rewards, forward, backward, optimizer).
Peak memory: ``torch.cuda.max_memory_allocated`` of the process (CPU: its peak RSS). The matmul bound
(``bench/bound.py``): the work of the timed steps at lit_align's token counts, at the GPU's bf16 matmul peak measured
in the preparing process; each side's fraction of it.

``--budget-s`` (default 420) caps the whole run: each case gets an equal share of what is left and stops its timed
steps (at a round's end for GRPO) once the next would pass its share, after one timed step at least; a case that
cannot start within the budget is skipped, said so. The table at the end has one line per case, ratios to TRL's
default of the same recipe, shape and backend, then the targets of issue 59 against each TRL setting with the phase
ratios that say where a shortfall comes from. ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import vendor
from child import child_role, launch
from gpu_runs import SHAPES, START, child_main, prepare  # START: the budget counts from this process's start

SIZES = {  # (GPU, --smoke): each option's default
    "dpo_batch_size": (8, 2), "max_length": (1024, 512), "dpo_steps": (12, 2), "dpo_warmup": (2, 1),
    "grpo_batch_size": (16, 4), "num_generations": (8, 2), "steps_per_generation": (4, 2), "max_new_tokens": (256, 8),
    "rounds": (3, 2),
}
TARGETS = {"dpo": (1.5, 0.7), "grpo": (1.5, None)}  # issue 59: throughput ratio at least, peak memory ratio at most


def plan(args, spec: dict) -> list[dict]:
    cases = []
    for shape in args.shapes:
        for recipe in args.recipes:
            settings = [("lit", "default")] + [("trl", s) for s in args.settings]
            if recipe == "grpo" and spec["vllm"]:
                settings += [("lit", "vllm"), ("trl", "vllm")]
            cases += [dict(recipe=recipe, shape=shape, side=side, setting=s) for side, s in settings]
    return cases


def run_cases(args, spec: dict, cases: list[dict]) -> list[dict]:
    results, shortest = [], {}
    for i, case in enumerate(cases):
        left = args.budget_s - (time.perf_counter() - START)
        name = f"{case['recipe']} {case['shape']} {case['side']} {case['setting']}"
        if left < shortest.get(case["recipe"], 0.0):
            results.append({**case, "error": f"skipped: {left:.0f} s of --budget-s left, the shortest "
                                             f"{case['recipe']} case took {shortest[case['recipe']]:.0f} s"})
            print(f"{name}: {results[-1]['error']}", flush=True)
            continue
        try:
            result = launch(__file__, case["side"], spec, args.threads, "--case", json.dumps(case),
                            "--deadline-s", f"{left / (len(cases) - i):.1f}")
            shortest[case["recipe"]] = min(shortest.get(case["recipe"], math.inf), result["wall_s"])
        except SystemExit as failure:
            result = {"error": str(failure)}
        results.append({**case, **result})
        print(f"{name}: " + (result.get("error") or f"{result['throughput']:.2f} {result['unit']}, "
                             f"{result['wall_s']:.0f} s"), flush=True)
    return results


def baseline(results: list[dict], r: dict) -> dict | None:
    """TRL's default case of ``r``'s recipe, shape and generation backend (TRL's vLLM case for a vLLM one)."""
    want = "vllm" if r["setting"] == "vllm" else "default"
    return next((b for b in results if b["side"] == "trl" and b["setting"] == want and "error" not in b
                 and (b["recipe"], b["shape"]) == (r["recipe"], r["shape"])), None)


def phases(r: dict) -> str:
    if r["recipe"] == "dpo":
        return f"fwd+bwd {r['fwd_bwd_s']:.3f} s, optim {r['optim_s']:.3f} s /step"
    return (f"gen {r['gen_s_per_round']:.2f} s, rest {r['s_per_round'] - r['gen_s_per_round']:.2f} s /round, "
            f"{r['tokens_per_s']:.0f} tok/s, {r['tokens_per_completion']:.0f} tok/compl")


def targets(results: list[dict]) -> list[dict]:
    """Issue 59's targets: each lit_align case against each TRL case of the same recipe, shape and backend, with
    the phases' speed-ups (TRL's time over lit_align's) that say where a shortfall comes from."""
    out = []
    ran = [r for r in results if "error" not in r]
    for r in (r for r in ran if r["side"] == "lit"):
        for b in ran:
            if b["side"] != "trl" or (b["recipe"], b["shape"]) != (r["recipe"], r["shape"]) \
                    or (b["setting"] == "vllm") != (r["setting"] == "vllm"):
                continue
            speed, memory = r["throughput"] / b["throughput"], r["peak_mib"] / b["peak_mib"]
            least, most = TARGETS[r["recipe"]]
            if r["recipe"] == "dpo":
                why = {"fwd+bwd": b["fwd_bwd_s"] / r["fwd_bwd_s"], "optim": b["optim_s"] / r["optim_s"]}
            else:
                rest = (b["s_per_round"] - b["gen_s_per_round"]) / (r["s_per_round"] - r["gen_s_per_round"])
                why = {"generation": b["gen_s_per_round"] / r["gen_s_per_round"], "rest": rest}
            missed = ["speed"] * (speed < least) + ["memory"] * (most is not None and memory > most)
            out.append(dict(recipe=r["recipe"], shape=r["shape"], lit=r["setting"], trl=b["setting"], speed=speed,
                            memory=memory, phase_speedups=why, missed=missed, met=not missed))
    return out


def print_setup(args, spec: dict, notes: list[str]) -> None:
    v = spec["versions"]
    print(f"\ndevice: {spec['device']}; matmul peak {spec['matmul_peak'] / 1e12:.1f} TFLOP/s ({spec['peak_dtype']})")
    print(f"torch {v['torch']}, transformers {v['transformers']}, trl {v['trl']}, lightning {v['lightning']}, "
          f"python {v['python']}; lit_align {v['lit_align']}")
    print("vendored wheels used: " + (", ".join(notes) if notes else "none (every package was here)"))
    where = "on this GPU" if args.accelerator == "gpu" else "a CPU run"
    print("generation backend: HF generate on both sides"
          + (", and vLLM (colocated) on both" if spec["vllm"] else f" (no vLLM: {where})"))
    print("liger-kernel: " + ("installed: TRL fast uses it" if spec["liger"] else
                              "not installed: TRL fast is gradient_checkpointing off alone"))
    print(f"DPO: {args.dpo_batch_size} pairs/step, max_length {args.max_length}, up to {args.dpo_steps} steps "
          f"({args.dpo_warmup} warm-up); GRPO: {args.grpo_batch_size * args.steps_per_generation} completions/round "
          f"({args.num_generations} per prompt), {args.steps_per_generation} steps of {args.grpo_batch_size}, "
          f"{args.max_new_tokens} new tokens, up to {args.rounds} rounds (1 warm-up); bf16; "
          f"{time.perf_counter() - START:.0f} s of the {args.budget_s:.0f} s budget taken\n")


def print_table(spec: dict, results: list[dict]) -> None:
    header = (f"{'recipe':<6} {'shape':<14} {'side':<4} {'setting':<8} {'throughput':>16} {'peak MiB':>9} "
              f"{'vs TRL default':>15} {'bound':>6} {'timed':>5}  phases")
    print(header)
    print("-" * len(header))
    for r in results:
        head = f"{r['recipe']:<6} {r['shape']:<14} {r['side']:<4} {r['setting']:<8}"
        if "error" in r:
            print(f"{head} {r['error']}")
            continue
        b = baseline(results, r)
        ratio = f"{r['throughput'] / b['throughput']:.2f}x / {r['peak_mib'] / b['peak_mib']:.2f}x" if b else "-"
        lit = next((x for x in results if "flops_per_unit" in x and (x["recipe"], x["shape"]) == (r["recipe"],
                                                                                                 r["shape"])), None)
        bound = f"{100 * r['throughput'] * lit['flops_per_unit'] / spec['matmul_peak']:.0f}%" if lit else "-"
        print(f"{head} {r['throughput']:>8.2f} {r['unit']:<7} {r['peak_mib']:>9.0f} {ratio:>15} {bound:>6} "
              f"{r['timed']:>5}  {phases(r)}")
    print("\nvs TRL default: throughput / peak memory over TRL's default case (same recipe, shape, generation "
          "backend); bound: the fraction of the matmul bound (the timed work at lit_align's token counts, at the "
          "peak above); timed: steps (DPO) or rounds (GRPO) measured after the warm-up")


def print_targets(checks: list[dict]) -> None:
    print("\ntargets (issue 59): DPO >= 1.5x TRL's pairs/s at <= 0.7x its peak memory; GRPO >= 1.5x TRL's "
          "completions/s, the same generation backend; phases: TRL's time over lit_align's")
    for t in checks:
        why = ", ".join(f"{k} {x:.2f}x" for k, x in t["phase_speedups"].items())
        memory = f", peak {t['memory']:.2f}x" if t["recipe"] == "dpo" else f" (peak {t['memory']:.2f}x)"
        verdict = "met" if t["met"] else "NOT met: " + " and ".join(t["missed"])
        print(f"  {t['recipe']:<5}{t['shape']:<14} lit {t['lit']} vs TRL {t['trl']:<8} {t['speed']:.2f}x{memory}: "
              f"{verdict} ({why})")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu", help="where both sides run (gpu)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and steps: a test of the script itself")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--recipes", nargs="+", choices=["dpo", "grpo"], default=["dpo", "grpo"])
    parser.add_argument("--settings", nargs="+", choices=["default", "fast"], default=["default", "fast"],
                        help="TRL's settings to run (lit_align runs at its defaults, its fast path)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="seconds for the whole run; the cases' timed steps are trimmed to fit (default 420)")
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1), help="torch CPU threads per side")
    parser.add_argument("--json", help="write every figure to this JSON file")
    for name, (gpu, smoke) in SIZES.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help=f"default {gpu} ({smoke} with --smoke)")
    parser.add_argument("--vendor", action="store_true",
                        help="download the pure-Python wheels the run needs (TRL, ...) into wheels/ beside this "
                             "script, for a GPU machine without network; then exit")
    parser.add_argument("--vendor-python", default="3.12", help="the GPU machine's Python for --vendor (3.12)")
    parser.add_argument("--engine", choices=["prepare", "imports", "lit", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--deadline-s", type=float, default=math.inf, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, (gpu, smoke) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else gpu)
        elif getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s}")
    if args.dpo_steps <= args.dpo_warmup:
        parser.error(f"--dpo-steps ({args.dpo_steps}) must exceed --dpo-warmup ({args.dpo_warmup})")
    if args.rounds < 2:
        parser.error(f"--rounds must be >= 2 (the first is the warm-up), got {args.rounds}")
    if (args.grpo_batch_size * args.steps_per_generation) % args.num_generations:
        parser.error(f"--grpo-batch-size * --steps-per-generation "
                     f"({args.grpo_batch_size * args.steps_per_generation}) must be a multiple of --num-generations "
                     f"({args.num_generations})")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if child_role(args, prepare, child_main):
        return
    if args.vendor:
        found = launch(__file__, "imports", {}, 1)["distributions"]
        wheels = vendor.download(found, args.vendor_python)
        size = sum(w.stat().st_size for w in wheels) / 2**20
        print(f"{len(wheels)} wheels, {size:.1f} MiB, in {vendor.WHEELS} (Python {args.vendor_python}): "
              + ", ".join(w.name.split("-")[0] for w in wheels))
        return
    notes = vendor.use(pinned=["trl"])  # the TRL that was vendored, 1.16, even where the machine has another
    if importlib.util.find_spec("trl") is None:
        raise SystemExit(f"error: TRL is not importable here and {vendor.WHEELS} has no wheel of it: run "
                         "`python bench/gpu_vs_trl.py --vendor` where pip can reach the index, then copy the tree")
    if args.accelerator == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"error: --accelerator gpu, but torch {torch.__version__} sees no CUDA device "
                             "(--accelerator cpu --smoke tests the script on CPU)")
    # transformers 5.x loads Hub kernels by default (and refuses without the compiled ``kernels`` package): none can be
    # fetched offline, so both sides run without them (lit_align's own default)
    os.environ["USE_HUB_KERNELS"] = "0"
    with tempfile.TemporaryDirectory(prefix="gpu_vs_trl.") as workdir:
        spec = {"workdir": workdir}
        spec.update(launch(__file__, "prepare", spec, args.threads))
        results = run_cases(args, spec, plan(args, spec))
    print_setup(args, spec, notes)
    print_table(spec, results)
    checks = targets(results)
    print_targets(checks)
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": spec, "vendored": notes, "cases": results, "targets": checks},
                                              indent=1) + "\n")
        print(f"\nwrote {args.json}")
    sys.exit(1 if any("error" in r and not r["error"].startswith("skipped") for r in results) else 0)


if __name__ == "__main__":
    main()
