"""The matmul bound: the FLOPs of the work a step must do, at the matmul peak measured in the same process.

    bound seconds = FLOPs / peak;   fraction = bound seconds / measured seconds

FLOPs of one forward over real (unpadded) tokens, for a decoder of ``L`` layers with ``P`` linear weights per layer
(q, k, v, o, gate, up, down), ``A = heads * head_dim``, hidden ``H`` and vocabulary ``V``::

    forward = 2 * L * P * tokens  +  4 * L * A * attended  +  2 * V * H * scored

``tokens``: the positions that must go through the layers (a DPO pair's prompt once, then chosen and rejected);
``attended``: the sum over those tokens of how many keys each attends to (causal: its position + 1); ``scored``:
the tokens whose log-prob is needed (the LM head runs there only). Backward costs twice the forward, so a DPO step is
``3 * forward`` (policy) ``+ forward`` (reference), a GRPO step ``3 * forward`` (no reference at ``beta=0``), a
distillation step ``3 * forward`` (student) ``+ forward`` (teacher) and a
decode step ``2 * L * P + 4 * L * A * context + 2 * V * H`` per sampled token. Norms, rotary, softmax, the
optimizer and sampling are left out: the bound is a ceiling no engine reaches.

The peak: the best of several ``[n, n] @ [n, n]`` fp32 products (n = 2048) at the bench's thread count, through MKL's
GEMM (``a @ b``, what torch's CPU matmuls run) and through oneDNN with the weight prepacked (what lit_align's native
decode step runs: 1.2-1.3x MKL's rate here), whichever is faster. On a GPU (``bench/gpu_vs_trl.py``):
``cuda_matmul_peak``, the best of ten bf16 ``[8192, 8192]`` products through cuBLAS.
"""

from __future__ import annotations

import time


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the fastest of ``repeats`` fp32 ``[n, n] @ [n, n]`` products on this process's torch threads, MKL's
    GEMM or oneDNN's prepacked product (where torch has it)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    products = [lambda: a @ b]
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        packed = torch.ops.mkldnn._reorder_linear_weight(b.T.contiguous(), n)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    for product in products:
        product()
        for _ in range(repeats):
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def cuda_matmul_peak(n: int = 8192, repeats: int = 10, dtype: str = "bfloat16") -> float:
    """FLOP/s of the fastest of ``repeats`` ``[n, n] @ [n, n]`` products in ``dtype`` on the current CUDA device (the
    GPU's matmul peak, as cuBLAS reaches it on random data), after three warm-ups."""
    import torch

    a, b = (torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype)) for _ in range(2))
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def shape(config) -> dict:
    """``L``, ``P``, ``A``, ``H``, ``V`` of a Llama/Qwen2-like config."""
    h, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    per_layer = h * heads * head_dim * 2 + h * kv * head_dim * 2 + 3 * h * config.intermediate_size
    return {"L": config.num_hidden_layers, "P": per_layer, "A": heads * head_dim, "H": h, "V": config.vocab_size}


def forward_flops(config, tokens: int, attended: int, scored: int) -> float:
    s = shape(config)
    return 2 * s["L"] * s["P"] * tokens + 4 * s["L"] * s["A"] * attended + 2 * s["V"] * s["H"] * scored


def causal(start: int, stop: int) -> int:
    """Keys attended by the tokens at positions ``start .. stop - 1`` of a causal sequence."""
    return (stop * (stop + 1) - start * (start + 1)) // 2


def dpo_step_flops(config, pairs: list[tuple[int, int, int]]) -> float:
    """One DPO step on ``(prompt, chosen, rejected)`` token counts: policy forward + backward, reference forward."""
    tokens = sum(p + c + r for p, c, r in pairs)
    attended = sum(causal(0, p + c) + causal(p, p + r) for p, c, r in pairs)
    scored = sum(c + r for p, c, r in pairs)
    return 4 * forward_flops(config, tokens, attended, scored)


def grpo_round_flops(config, rows: list[tuple[int, int]], steps_per_row: int = 1) -> float:
    """One GRPO round on ``(prompt, completion)`` token counts: sampling (prefill of each row's prompt, then one decode
    step per completion token) and the training forward + backward (no reference)."""
    sample = sum(forward_flops(config, p, causal(0, p), 0) + forward_flops(config, c, causal(p, p + c), c)
                 for p, c in rows)
    train = sum(3 * forward_flops(config, p + c, causal(0, p + c), c) for p, c in rows) * steps_per_row
    return sample + train


def distill_round_flops(student, teacher, rows: list[tuple[int, int]]) -> float:
    """One on-policy distillation round on ``(prompt, completion)`` token counts: the student's sampling and training
    forward + backward (``grpo_round_flops``) and the teacher's forward over the same tokens (``student`` and
    ``teacher``: the two configs; the divergence projects both heads at the completion tokens)."""
    teacher_forward = sum(forward_flops(teacher, p + c, causal(0, p + c), c) for p, c in rows)
    return grpo_round_flops(student, rows) + teacher_forward


def generation_flops(config, prompt_lengths: list[int], num_samples: int, new_tokens: int) -> float:
    """Sampling ``num_samples`` completions of ``new_tokens`` for each prompt: each prompt's prefill once (its logits
    at its last token), then one decode step per sampled token but the last (whose logits come from the step before)."""
    prefill = sum(forward_flops(config, p, causal(0, p), 1) for p in prompt_lengths)
    decode = sum(forward_flops(config, new_tokens - 1, causal(p, p + new_tokens - 1), new_tokens - 1)
                 for p in prompt_lengths) * num_samples
    return prefill + decode


def report(label: str, flops: float, seconds: float, peak: float) -> str:
    bound = flops / peak
    return (f"{label}: {flops / 1e9:.1f} GFLOP of required work, matmul peak {peak / 1e9:.1f} GFLOP/s -> bound "
            f"{bound:.3f} s; measured {seconds:.3f} s: {100 * bound / seconds:.0f}% of the bound")
