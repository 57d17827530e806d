"""Peak memory of one log-prob forward + backward at a large vocabulary: plain vs chunked (``lit_align.logps``), CPU.

    python bench/logps_memory.py                                   # V=128256, T=1024, H=512, fp32 and bf16
    python bench/logps_memory.py --vocab 151936 --tokens 2048 --chunk-size 512 --dtypes bfloat16
    python bench/logps_memory.py --lab realistic       # bench/lab.py's qwen2-152k head: V=151936, H=256, T=1024

What is measured is what a recipe does after the decoder: hidden states ``[1, T, H]`` through the LM head to
per-token log-probs of ``T`` labels, summed, and backward to the hidden states and the head's weight.
``plain``: ``token_logps(lm_head(hidden), labels)``, which keeps the ``[T, V]`` logits (and in bf16 their fp32 copy
per row) for backward. ``chunked``: ``chunked_token_logps`` with ``--chunk-size`` rows at a time.

Each (engine, dtype) runs in a fresh process (``bench/child.py``), so its peak RSS is its own: the figure is the
peak RSS during forward + backward minus the RSS just before (inputs and the weight already allocated). The values
of the two engines are checked to agree (max |difference| of the log-probs and of the weight's gradient).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import run_child  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child(args) -> None:
    import torch
    import torch.nn.functional as F

    from lit_align.logps import chunked_token_logps
    from lit_align.logps import token_logps

    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, args.tokens, args.hidden, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
    before = rss_mb()
    start = time.perf_counter()
    if args.engine == "plain":
        logps = token_logps(F.linear(hidden, weight), labels)
    else:
        logps, _ = chunked_token_logps(hidden, weight, labels, chunk_size=args.chunk_size)
    logps.sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print("RESULT " + json.dumps({"peak_mb": peak - before, "seconds": seconds, "logps": logps.detach()[0, :64].tolist(),
                                  "grad_w": weight.grad.float()[:64, :8].flatten().tolist()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=128256, help="V (Llama 3's vocabulary by default)")
    parser.add_argument("--tokens", type=int, default=1024, help="T: positions with a label")
    parser.add_argument("--hidden", type=int, default=512, help="H (small: the head's logits dominate anyway)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lab", choices=["builtin", "realistic"], default="builtin",
                        help="realistic: the head of bench/lab.py's qwen2-152k (V=151936, H=256)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lab == "realistic":  # the shape of bench/lab.py's qwen2-152k head (no weights needed: random ones)
        from lab import LAB_MODELS

        args.vocab, args.hidden = LAB_MODELS["qwen2-152k"]["vocab_size"], LAB_MODELS["qwen2-152k"]["hidden_size"]
    if args.engine:
        return child(args)

    logits_mb = args.tokens * args.vocab * 4 / 2**20
    print(f"V={args.vocab} T={args.tokens} H={args.hidden} chunk={args.chunk_size} threads={args.threads}; "
          f"one fp32 [T, V] logits tensor = {logits_mb:.0f} MB")
    print(f"{'dtype':<10} {'plain MB':>10} {'chunked MB':>11} {'ratio':>7} {'plain s':>8} {'chunked s':>10} "
          f"{'max|dlogp|':>11} {'max|dgrad_w|':>13}")
    for dtype in args.dtypes:
        results = {}
        for engine in ("plain", "chunked"):
            cmd = [sys.executable, __file__, "--engine", engine, "--dtype", dtype, "--vocab", str(args.vocab),
                   "--tokens", str(args.tokens), "--hidden", str(args.hidden), "--chunk-size", str(args.chunk_size)]
            results[engine] = run_child(cmd, args.threads, engine)
        plain, chunked = results["plain"], results["chunked"]
        dlogp = max(abs(a - b) for a, b in zip(plain["logps"], chunked["logps"]))
        dgrad = max(abs(a - b) for a, b in zip(plain["grad_w"], chunked["grad_w"]))
        print(f"{dtype:<10} {plain['peak_mb']:>10.0f} {chunked['peak_mb']:>11.0f} "
              f"{plain['peak_mb'] / max(chunked['peak_mb'], 1):>6.1f}x {plain['seconds']:>8.2f} "
              f"{chunked['seconds']:>10.2f} {dlogp:>11.2e} {dgrad:>13.2e}")


if __name__ == "__main__":
    main()
