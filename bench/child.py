"""What the side-by-side benchmarks share: run one engine in a fresh process and read back its ``RESULT`` line; for
the online ones (GRPO, distillation), time its generation rounds and print the table of rates.

A benchmark script re-invokes itself once per engine (so each engine's peak RSS is its own) with its own command line
plus ``--engine NAME --spec JSON`` (``launch``); the child prints one line ``RESULT {json}`` at the end, and
``run_child`` returns that dict with the child's wall time added. ``child_role`` is the child's side of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_child(cmd: list[str], threads: int, engine: str) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{engine} run failed (exit {proc.returncode})")
    result = json.loads(lines[-1][len("RESULT ") :])
    result["wall_s"] = time.perf_counter() - start
    return result


def launch(script: str, engine: str, spec: dict, threads: int, *extra: str) -> dict:
    """Run ``script`` again with this process's options, ``extra`` and ``--engine engine --spec spec``."""
    cmd = [sys.executable, script, *sys.argv[1:], *extra, "--engine", engine, "--spec", json.dumps(spec)]
    return run_child(cmd, threads, engine)


def child_role(args, prepare, child) -> bool:
    """In a child (``args.engine`` set): run ``prepare(args, workdir)`` (engine ``prepare``, its dict printed as the
    RESULT line) or ``child(args)``, and return True; in the parent, return False."""
    if args.engine == "prepare":
        print("RESULT " + json.dumps(prepare(args, Path(json.loads(args.spec)["workdir"]))), flush=True)
        return True
    if args.engine:
        child(args)
        return True
    return False


# -- what the online benches (grpo_vs_trl, distill_vs_trl) share: timing a run's generation rounds -------------------
def peak_rss_mib() -> tuple[float, float]:
    """This process's peak resident set in MiB: ``(getrusage ru_maxrss, /proc VmHWM)``."""
    import resource

    rusage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    hwm = float("nan")
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) / 1024
    except OSError:
        pass
    return rusage, hwm


class GenTimer:
    """Wraps an engine call: wall time, CPU time and generated tokens per call."""

    def __init__(self, fn, count_tokens):
        self.fn, self.count_tokens = fn, count_tokens
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.tokens: list[int] = []

    def __call__(self, *args, **kwargs):
        start, cpu_start = time.perf_counter(), time.process_time()
        out = self.fn(*args, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        self.cpu_seconds.append(time.process_time() - cpu_start)
        self.tokens.append(self.count_tokens(out))
        return out


def check_trl_sampling(generation, max_new_tokens: int, min_new_tokens: int | None = None) -> None:
    """Refuse a TRL trainer whose ``generation_config`` samples otherwise than the bench's settings: temperature 1.0,
    top-k 0, top-p 1.0, ``max_new_tokens``, nothing else that stops or shapes the sampling (``min_new_tokens`` only
    where given: a bench that runs every completion to its full length)."""
    expected = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": max_new_tokens}
    unset = ["min_p", "stop_strings"]
    if min_new_tokens is None:
        unset.append("min_new_tokens")
    else:
        expected["min_new_tokens"] = min_new_tokens
    for name, value in expected.items():
        if getattr(generation, name) != value:
            raise SystemExit(f"TRL generation config {name}={getattr(generation, name)!r}, expected {value!r}")
    for name in unset:
        if getattr(generation, name, None):
            raise SystemExit(f"TRL generation config sets {name}={getattr(generation, name)!r}")


def round_rates(round_ends: list[tuple[float, float]], gen_s: list[float], gen_cpu_s: list[float],
                gen_tokens: list[int], completions_per_round: int) -> dict:
    """Steady-state rates over the rounds after the first (the warm-up): ``round_ends`` holds each round's
    ``(perf_counter, process_time)`` at the end of its last step; ``gen_*`` the engine's time, CPU time and tokens
    per round. Adds this process's peak RSS."""
    timed = len(round_ends) - 1
    seconds = round_ends[-1][0] - round_ends[0][0]
    cpu_seconds = round_ends[-1][1] - round_ends[0][1]
    gen, gen_cpu, tokens = sum(gen_s[1:]), sum(gen_cpu_s[1:]), sum(gen_tokens[1:])
    rusage, hwm = peak_rss_mib()
    return dict(completions_per_s=timed * completions_per_round / seconds, s_per_round=seconds / timed,
                completions_per_cpu_s=timed * completions_per_round / cpu_seconds,
                gen_s_per_round=gen / timed, gen_cpu_s_per_round=gen_cpu / timed, gen_tokens_per_s=tokens / gen,
                tokens_per_s=tokens / seconds, tokens_per_completion=tokens / (timed * completions_per_round),
                peak_rss_mib=rusage, vm_hwm_mib=hwm)


def print_rates(results: dict[str, dict]) -> None:
    """The table of ``round_rates`` per engine, then each engine's ratios to ``trl`` (throughput lit/TRL; the
    engine's time TRL/lit, its speed-up; peak RSS lit/TRL), then a warning for a run not in sdpa / fp32 and a note
    where VmHWM and ru_maxrss disagree."""
    header = (f"{'engine':<12}{'compl/s':>9}{'tok/s':>8}{'compl/CPU-s':>13}{'gen s/round':>13}{'gen CPU-s/round':>17}"
              f"{'tok/compl':>11}{'peak RSS MiB':>14}{'threads':>9}{'wall s':>8}")
    print(header)
    print("-" * len(header))
    for engine, r in results.items():
        print(f"{engine:<12}{r['completions_per_s']:>9.2f}{r['tokens_per_s']:>8.0f}{r['completions_per_cpu_s']:>13.2f}"
              f"{r['gen_s_per_round']:>13.2f}{r['gen_cpu_s_per_round']:>17.2f}{r['tokens_per_completion']:>11.1f}"
              f"{r['peak_rss_mib']:>14.0f}{r['threads']:>9}{r['wall_s']:>8.1f}")
    if "trl" in results:
        ref = results["trl"]
        print("-" * len(header))
        for engine, r in results.items():
            if engine != "trl":
                print(f"{engine + '/TRL':<12}{r['completions_per_s'] / ref['completions_per_s']:>8.2f}x"
                      f"{r['tokens_per_s'] / ref['tokens_per_s']:>7.2f}x"
                      f"{r['completions_per_cpu_s'] / ref['completions_per_cpu_s']:>12.2f}x"
                      f"{ref['gen_s_per_round'] / r['gen_s_per_round']:>12.2f}x"
                      f"{ref['gen_cpu_s_per_round'] / r['gen_cpu_s_per_round']:>16.2f}x{'':>11}"
                      f"{r['peak_rss_mib'] / ref['peak_rss_mib']:>13.2f}x")
    for engine, r in results.items():
        if r["attn"] != "sdpa" or r["dtype"] != "torch.float32":
            print(f"warning: {engine} ran {r['attn']} attention in {r['dtype']}")
        if abs(r["vm_hwm_mib"] - r["peak_rss_mib"]) > 0.05 * r["peak_rss_mib"]:
            print(f"note: {engine} VmHWM {r['vm_hwm_mib']:.0f} MiB differs from ru_maxrss {r['peak_rss_mib']:.0f} MiB")
