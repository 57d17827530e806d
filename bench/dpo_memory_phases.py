"""Where a DPO step's peak RSS comes from: the process's RSS at each phase of each step, and the phase of the peak.

    python bench/dpo_memory_phases.py --model M      # the real model's chat rows, as dpo_vs_trl.py --lab real
    python bench/dpo_memory_phases.py --model M --checkpointing selective --optim adamw_torch_fused

One process, ``dpo_vs_trl.py --lab real --padding-free``'s module, rows and batches (2 pairs a step, max_length 1024,
5 steps), 1 thread. Per step it prints the RSS when the step starts, before and after backward and when it ends, and
the step's CPU time; a sampler thread (every 2 ms) records the highest RSS and the phase it fell in (``fwd``: the
policy's and the reference's forward and the loss; ``bwd``; ``opt``: clipping and the optimizer step). With
``--checkpointing none`` it also sums the bytes autograd saved for backward (each storage once; parameters left out).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def rss(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a real chat model: a .gguf file or an HF directory")
    parser.add_argument("--checkpointing", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--optim", choices=["adamw_torch", "adamw_torch_fused"], default="adamw_torch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import lab
    import lightning as L
    from dpo_vs_trl import LIT_CHECKPOINTING
    import torch

    from lit_align.data.preference import PreferenceDataModule
    from lit_align.modules.dpo import DPOModule

    torch.set_num_threads(args.threads)
    model_dir = lab.real_model(args.model)
    rows = str(lab.chat_rows(model_dir) / "preference.jsonl")
    phase, peak = ["load"], [0.0, ""]

    def sample():
        while True:
            now = rss()
            if now > peak[0]:
                peak[:] = [now, phase[0]]
            time.sleep(0.002)

    threading.Thread(target=sample, daemon=True).start()
    saved, seen = [0], set()

    def pack(t):
        if t.untyped_storage().data_ptr() not in seen:  # (parameters and their views are in ``seen`` from the start)
            seen.add(t.untyped_storage().data_ptr())
            saved[0] += t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    class Phases(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            phase[0], saved[0], self.cpu = f"fwd {batch_idx}", 0, time.process_time()
            seen.clear()
            seen.update(p.untyped_storage().data_ptr() for p in pl_module.parameters())
            hooks.__enter__()
            self.line = f"step {batch_idx}: {int(batch['attention_mask'].sum())} tokens, start {rss():.0f}"

        def on_before_backward(self, trainer, pl_module, loss):
            hooks.__exit__(None, None, None)
            phase[0] = phase[0].replace("fwd", "bwd")
            self.line += f", before backward {rss():.0f}" + (f" (saved {saved[0] / 2**20:.0f})" if saved[0] else "")

        def on_after_backward(self, trainer, pl_module):
            phase[0] = phase[0].replace("bwd", "opt")
            self.line += f", after {rss():.0f}"

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            phase[0] = "between"
            print(f"{self.line}, end {rss():.0f} MiB; CPU {time.process_time() - self.cpu:.1f} s", flush=True)

    module = DPOModule(model=model_dir, beta=0.1, learning_rate=1e-5, lr_scheduler_type="constant", weight_decay=0.0,
                       optim=args.optim, attn_implementation="sdpa", dtype="float32", padding_free=True,
                       gradient_checkpointing=LIT_CHECKPOINTING[args.checkpointing])
    data = PreferenceDataModule(path=rows, tokenizer=model_dir, batch_size=2, max_length=1024, val_split=None,
                                shuffle=False)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, precision="32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Phases()])
    trainer.fit(module, datamodule=data)
    print(f"peak RSS {rss('VmHWM'):.0f} MiB (sampled {peak[0]:.0f}, in {peak[1]}); checkpointing {args.checkpointing}, "
          f"{args.optim}, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
