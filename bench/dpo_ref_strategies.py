"""DPO reference strategies side by side: frozen copy vs precomputed log-probs vs LoRA, pairs/s and peak RSS.

    python bench/dpo_ref_strategies.py       # builtin:small, 32 pairs/step, 25 steps (5 warmup), 1 thread
    python bench/dpo_ref_strategies.py --strategies frozen,precomputed --steps 60 --threads 2

Each strategy trains lit_align's ``DPOModule`` in its own fresh process (this script re-invoked with
``--engine <strategy>``), so each peak RSS (``VmHWM``) is its own. Same model (fp32, sdpa), rows, batches (no
shuffling), AdamW, constant learning rate, clipping at 1.0, CPU, ``--threads`` threads, no logger/checkpoints/export:

  - frozen:      a frozen copy of the policy runs a no-grad forward every step (TRL's default);
  - precomputed: ``precompute_ref_log_probs``: one no-grad pass over the rows before training (batch
                 ``--precompute-batch-size``, its own cache directory per run so it really runs), then no reference in
                 memory; the pass's time is reported apart (``ref pass s``), not in pairs/s;
  - lora:        ``peft_config`` (r 16, all linear layers): the reference is the policy with its adapters disabled.

Expected: a step of the frozen strategy costs policy forward + backward (~6N FLOPs per token) plus the reference
forward (~2N); without the reference forward the bound is 8N/6N = 1.33x. AdamW and gradient clipping cost the same
per step whatever the batch, so the measured gain approaches the bound as the batch grows (the sort task's rows are
short, ~19 tokens; at 8 pairs/step the optimizer is a quarter of the step and the gain about 1.2x). LoRA keeps the
reference forward (adapters off) but skips the weight gradients of the base layers (~2N of the backward's 4N) and
AdamW over the full model; it adds the adapters' small matmuls.

Throughput: wall time from the end of step ``--warmup`` to the end of the last step; CPU time per step beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from child import child_role, launch
from dpo_vs_trl import prepare, rss_mib

STRATEGIES = {
    "frozen": {},
    "precomputed": {"precompute_ref_log_probs": True},
    "lora": {"peft_config": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}},
}


def run(args, spec: dict) -> dict:
    import lightning as L
    import torch

    from lit_align.data.preference import PreferenceDataModule
    from lit_align.modules.dpo import DPOModule

    torch.set_num_threads(args.threads)

    class Clock(L.Callback):
        def __init__(self):
            self.ends: list[tuple[float, float]] = []
            self.fit_start = self.train_start = None

        def on_fit_start(self, trainer, pl_module):  # after configure_model, i.e. after the precompute pass
            self.train_start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append((time.perf_counter(), time.process_time()))

    options = dict(STRATEGIES[args.engine])
    if args.engine == "precomputed":
        options["precompute_ref_batch_size"] = args.precompute_batch_size
    module = DPOModule(model=spec["model_dir"], beta=0.1, learning_rate=args.lr, lr_scheduler_type="constant",
                       weight_decay=0.0, attn_implementation="sdpa", dtype="float32", **options)
    data = PreferenceDataModule(path=spec["rows"], tokenizer=spec["model_dir"], batch_size=args.batch_size,
                                max_length=args.max_length, val_split=None, shuffle=False)
    clock = Clock()
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, precision="32-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=1.0, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[clock],
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    trainable = sum(p.numel() for p in module.policy.parameters() if p.requires_grad)
    return {"ends": clock.ends, "setup_s": clock.train_start - start, "trainable": trainable,
            "ref_resident": bool(list(module.reference.parameters())), "loss": float(trainer.callback_metrics["train/loss"])}


def child(args) -> None:
    spec = json.loads(args.spec)
    os.environ["LIT_ALIGN_CACHE"] = tempfile.mkdtemp(prefix="ref_cache.", dir=spec["workdir"])  # a cold cache
    result = run(args, spec)
    ends = result.pop("ends")
    timed = args.steps - args.warmup
    seconds = ends[-1][0] - ends[args.warmup - 1][0]
    result.update(pairs_per_s=timed * args.batch_size / seconds, cpu_s_per_step=(ends[-1][1] - ends[args.warmup - 1][1])
                  / timed, peak_rss_mib=rss_mib("VmHWM"), load=os.getloadavg()[0])
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:small", help="model name/dir (default builtin:small, ~10M params)")
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per strategy (default 25)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (default 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="preference pairs per step (default 32)")
    parser.add_argument("--precompute-batch-size", type=int, default=128,
                        help="pairs per batch in the precompute pass (default 128)")
    parser.add_argument("--max-length", type=int, default=64, help="max tokens per sequence (default 64)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: steadier than 2 on a small machine shared with other jobs)")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate (default 1e-5)")
    parser.add_argument("--strategies", default="frozen,precomputed,lora", help="which to run, in order")
    parser.add_argument("--engine", choices=["prepare", *STRATEGIES], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1 or args.steps <= args.warmup:
        parser.error("need 1 <= --warmup < --steps")
    if child_role(args, prepare, child):
        return

    with tempfile.TemporaryDirectory(prefix="dpo_ref.") as workdir:  # the parent imports no torch
        spec = {"workdir": workdir}
        spec.update(launch(__file__, "prepare", spec, args.threads))
        results = {name: launch(__file__, name, spec, args.threads) for name in args.strategies.split(",")}

    print(f"\nDPO reference strategies, {args.model}, {args.batch_size} pairs/step, max_length {args.max_length}, "
          f"{args.steps} steps ({args.warmup} warmup), fp32, CPU, {args.threads} threads\n")
    header = (f"{'strategy':<13}{'pairs/s':>9}{'vs frozen':>10}{'CPU s/step':>11}{'peak RSS':>10}{'vs frozen':>10}"
              f"{'setup s':>9}{'trainable':>11}{'ref resident':>13}{'load':>6}")
    print(header)
    print("-" * len(header))
    base = results.get("frozen")
    for name, r in results.items():
        speed = f"{r['pairs_per_s'] / base['pairs_per_s']:.2f}x" if base else "-"
        memory = f"{r['peak_rss_mib'] / base['peak_rss_mib']:.2f}x" if base else "-"
        print(f"{name:<13}{r['pairs_per_s']:>9.2f}{speed:>10}{r['cpu_s_per_step']:>11.3f}{r['peak_rss_mib']:>10.0f}"
              f"{memory:>10}{r['setup_s']:>9.1f}{r['trainable']:>11,}{str(r['ref_resident']):>13}{r['load']:>6.1f}")
    print("\npairs/s: wall clock, steady state. CPU s/step: process CPU time per step (less sensitive to other load). "
          "peak RSS: VmHWM of the strategy's process, MiB. setup s: from fit() to the first step, including the "
          f"precompute pass over {args.steps * args.batch_size} pairs (batch {args.precompute_batch_size}). "
          "FLOP bound for precomputed vs frozen: 8N/6N = 1.33x.")
    busy = max(r["load"] for r in results.values())
    if busy > (os.cpu_count() or 1) + 0.5:
        print(f"warning: the machine was busy (1-min load up to {busy:.1f} on {os.cpu_count()} cores); wall-clock "
              "figures mostly measure the contention (the CPU-time column is less affected)")


if __name__ == "__main__":
    main()
