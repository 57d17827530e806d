"""What the side-by-side benchmarks share: run one engine in a fresh process and read back its ``RESULT`` line.

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
