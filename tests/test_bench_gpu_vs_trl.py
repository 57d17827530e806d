"""bench/gpu_vs_trl.py on CPU (``--accelerator cpu --smoke``): both sides of each case run in their own process and
report finite, positive figures; every GRPO completion runs to its full length on both sides; bad input is one
error line. What it measures on a GPU is the script's business there (docs/scaling.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_vs_trl.py"
FIGURES = {"dpo": ("throughput", "peak_mib", "s_per_step", "fwd_bwd_s", "optim_s"),
           "grpo": ("throughput", "peak_mib", "s_per_round", "gen_s_per_round", "tokens_per_s", "optim_s")}


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)


def smoke(tmp_path: Path, shapes: list[str], settings: list[str]) -> dict:
    out = tmp_path / "report.json"
    proc = run(tmp_path, "--accelerator", "cpu", "--smoke", "--threads", "1", "--shapes", *shapes,
               "--settings", *settings, "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    cases = report["cases"]
    expected = {(recipe, shape, side, setting) for recipe in FIGURES for shape in shapes
                for side, setting in [("lit", "default"), *(("trl", s) for s in settings)]}
    assert {(c["recipe"], c["shape"], c["side"], c["setting"]) for c in cases} == expected
    for c in cases:
        assert "error" not in c, c
        for name in FIGURES[c["recipe"]]:
            assert math.isfinite(c[name]) and c[name] > 0, (c["recipe"], c["side"], c["setting"], name, c[name])
        assert c["timed"] >= 1 and c["precision"].startswith("bf16")
        if c["recipe"] == "grpo":  # min_new_tokens on both sides: no completion ended early
            assert c["tokens_per_completion"] == 8 and c["engine"] == "hf"
        if c["side"] == "lit":
            assert c["flops_per_unit"] > 0
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"{c['recipe']:<6} {c['shape']:<14} "
                                                                         f"{c['side']:<4} {c['setting']:<8}"))
        assert c["unit"] in line
    assert {(t["recipe"], t["trl"]) for t in report["targets"]} == {(r, s) for r in FIGURES for s in settings}
    assert all(math.isfinite(t["speed"]) and t["speed"] > 0 for t in report["targets"])
    versions = report["spec"]["versions"]
    assert versions["trl"] == "1.16.0" and versions["torch"] and versions["lit_align"]
    assert "targets (issue 59)" in proc.stdout and "device: CPU" in proc.stdout
    return report


@pytest.mark.slow  # five processes, each loading torch and transformers: ~30 s of CPU even at smoke size
def test_smoke_runs_every_case(tmp_path):
    smoke(tmp_path, ["qwen2.5-0.5b", "smollm2-135m"], ["default", "fast"])


@pytest.mark.parametrize("args, message", [
    (["--budget-s", "0"], "error: --budget-s must be > 0, got 0.0"),
    (["--rounds", "1"], "error: --rounds must be >= 2 (the first is the warm-up), got 1"),
    (["--grpo-batch-size", "3"], "must be a multiple of --num-generations (8)"),
    (["--accelerator", "gpu"], "error: --accelerator gpu, but torch"),
])
def test_bad_input_is_one_error_line(tmp_path, args, message):
    if args == ["--accelerator", "gpu"]:
        torch = pytest.importorskip("torch")
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    proc = run(tmp_path, *args)
    assert proc.returncode != 0 and not proc.stdout
    assert message in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert "Traceback" not in proc.stderr
