"""How the suite compares numbers: the tolerance policy, written once.

Machines differ in the CPU kernels torch picks (AVX-512, AVX2 or none; one thread or several), and fp32 results
depend on the order of the operations inside those kernels. So every comparison in ``tests/`` makes one of four
claims, and the claim decides the tolerance:

1. **The same computation.** Both sides run the same operations on the same inputs in the same order: a resumed run
   against the uninterrupted one, an export against the state dict, a seeded rerun, a gather against its source.
   Compared exactly (``torch.equal``, ``==``, ``assert_close(rtol=0, atol=0)``), on any machine.
2. **A formula.** A pure function of ``lit_align.losses`` against values computed by hand, or against TRL's own
   function: both computed in float64 and compared at ``rel=FORMULA_RTOL`` (1e-9), so that no kernel's rounding can
   decide the result. Where the function is fp32 by design (a kernel that upcasts half precision), rule 3 applies.
3. **One formula, computed in another order.** Chunked against plain log-probs, lit_align against TRL's trainer,
   packed against padded rows, shared-prompt against plain pairs, DDP against one process, one engine against
   another. The two sides differ by the rounding of reductions that run in other orders, which is bounded by
   ``rounding_tol(scale, terms)``::

       ULPS * eps(dtype) * scale * sqrt(terms)

   ``scale`` is the magnitude of the values entering the longest reduction (largest |logit|, largest |log-prob|
   summed, largest gradient entry), not of the result, which cancellation can make small (a reward is a difference
   of two log-probs of ~30 each); ``terms`` is that reduction's length (vocabulary, hidden size, tokens summed).
   Rounding errors of a reordered sum grow like a random walk (``sqrt(terms)`` units of ``eps * scale``); ``ULPS``
   is the headroom above that, checked against the worst errors measured on AVX-512, AVX2 and the generic kernels
   (``ATEN_CPU_CAPABILITY=avx2|default``) and on one and two threads. Never a bare ``1e-5`` on values of any size.
4. **Half precision** (bf16 weights or autocast against fp32): rule 3 with bf16's ``eps`` (2^-8) and ``terms=1``:
   half-precision kernels accumulate in fp32 and round each output once.

Comparisons after optimizer steps (a TRL run against a lit_align run, DDP against one process over several steps)
are rule 3 with the values' own scale: Adam turns a rounding difference in a near-zero gradient into an update of
``~lr``, so their docstrings say what bound they use and why.

Set ``LIT_ALIGN_TOL_REPORT=<file>`` to append, for every rule-3/4 comparison, the test, the observed error and its
ratio to the tolerance (how the ULPS headroom was checked; ``python tests/numerics.py <file>`` summarises it).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

FORMULA_RTOL = 1e-9
TINY_TERMS = 384  # the built-in tiny model's longest reduction (its MLP's intermediate size): run-level comparisons
ULPS = 8
EPS = {torch.float64: 2.0**-52, torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}


def rounding_tol(scale: float, terms: int = 1, dtype: torch.dtype = torch.float32) -> float:
    """The absolute tolerance for one formula computed in two orders (rule 3): ``ULPS * eps * scale * sqrt(terms)``."""
    return ULPS * EPS[dtype] * float(scale) * math.sqrt(max(terms, 1))


def _report(error: float, tol: float, what: str) -> None:
    path = os.environ.get("LIT_ALIGN_TOL_REPORT")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            f.write(f"{test}\t{what}\t{error:.3e}\t{tol:.3e}\t{error / tol if tol else math.inf:.4f}\n")


def assert_rounding_close(actual, expected, *, scale=None, terms: int = 1, dtype: torch.dtype = torch.float32,
                          msg: str = "") -> None:
    """``actual`` equals ``expected`` up to the rounding of reductions of ``terms`` values of magnitude ``scale``
    (default: the largest ``|expected|``) computed in another order. Tensors or floats (or lists of them)."""
    actual, expected = (torch.as_tensor(v, dtype=torch.float64).detach() for v in (actual, expected))
    assert actual.shape == expected.shape, f"{msg}: shapes {tuple(actual.shape)} != {tuple(expected.shape)}"
    if scale is None:
        scale = expected.abs().max().item() if expected.numel() else 0.0
    scale = float(scale.detach()) if isinstance(scale, torch.Tensor) else float(scale)
    tol = rounding_tol(scale, terms, dtype)
    error = (actual - expected).abs().max().item() if expected.numel() else 0.0
    _report(error, tol, msg)
    assert error <= tol, (f"{msg + ': ' if msg else ''}differ by {error:.3e}, more than the rounding of {terms} terms of "
                          f"magnitude {scale:.3g} in {str(dtype).removeprefix('torch.')} ({tol:.3e})")


def assert_formula(actual, expected, msg: str = "") -> None:
    """``actual`` (computed in float64) equals the formula's ``expected`` (float64) to ``FORMULA_RTOL`` (rule 2)."""
    if isinstance(actual, torch.Tensor):
        assert actual.dtype == torch.float64, f"{msg}: a formula is checked in float64, got {actual.dtype}"
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual, expected, rtol=FORMULA_RTOL, atol=FORMULA_RTOL, msg=msg or None)


def formula(expected):
    """``pytest.approx`` for rule 2: ``value == formula(expected)`` with both in float64."""
    import pytest

    return pytest.approx(expected, rel=FORMULA_RTOL, abs=FORMULA_RTOL)


def f64(values) -> torch.Tensor:
    """A float64 tensor (rule 2's inputs)."""
    return torch.tensor(values, dtype=torch.float64)


def _summarise(path: str) -> None:
    worst: dict[str, tuple[float, float, float]] = {}
    for line in open(path):
        test, _, error, tol, ratio = line.rstrip("\n").split("\t")
        key = test.split("[")[0]
        if key not in worst or float(ratio) > worst[key][2]:
            worst[key] = (float(error), float(tol), float(ratio))
    for key, (error, tol, ratio) in sorted(worst.items(), key=lambda kv: -kv[1][2]):
        print(f"{ratio:8.4f}  {error:.2e} / {tol:.2e}  {key}")


if __name__ == "__main__":
    _summarise(sys.argv[1])


def torch_bf16_attention_runs() -> bool:
    """Whether torch's own CPU attention runs a masked bf16 backward here: under an ``ATEN_CPU_CAPABILITY`` below
    AVX-512 (``default``, ``avx2``: what ``make test-numerics`` sets) on an AVX-512 CPU its flash kernel still takes
    the AVX-512 packing path and raises ``pack_vnni2 is only supported when avx512 is supported`` (torch 2.13), with
    or without lit_align. A machine that really lacks AVX-512 takes the other path; bf16 tests run at the CPU's own
    capability (``make test``) and skip under a forced lower one (``needs_torch_bf16``)."""
    import torch.nn.functional as F

    query = torch.randn(1, 2, 64, 16, dtype=torch.bfloat16, requires_grad=True)
    try:
        F.scaled_dot_product_attention(query, query, query, attn_mask=torch.ones(64, 64, dtype=torch.bool).tril()
                                       ).sum().backward()
    except RuntimeError as exc:
        if "pack_vnni2" in str(exc):
            return False
        raise
    return True


needs_torch_bf16 = pytest.mark.skipif(not torch_bf16_attention_runs(), reason="torch's own bf16 CPU attention fails "
                                      "under a forced ATEN_CPU_CAPABILITY on this AVX-512 CPU (pack_vnni2)")
