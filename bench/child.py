"""What the side-by-side benchmarks share: run one engine in a fresh process and read back its ``RESULT`` line.

A benchmark script re-invokes itself once per engine (so each engine's peak RSS is its own); the child prints one
line ``RESULT {json}`` at the end, and ``run_child`` returns that dict with the child's wall time added.
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
