"""Where a step's peak RSS comes from: the process's RSS in each phase of each step, and the phase of the peak.

    python bench/memory_phases.py --model M         # DPO: the real model's chat rows, as dpo_vs_trl.py --lab real
    python bench/memory_phases.py --model M --checkpointing selective --optim adamw_torch_fused
    python bench/memory_phases.py --recipe grpo --model M --checkpointing selective --optim adamw_torch_fused
    python bench/memory_phases.py --recipe grpo --model M --checkpointing selective --optim adamw_torch_fused \
        --mmap-activations
    python bench/memory_phases.py --recipe distill --model M --teacher T --optim adamw_torch_fused

One process, 1 thread. ``--recipe dpo``: ``dpo_vs_trl.py --lab real --padding-free``'s module, rows and batches (2
pairs a step, max_length 1024, 5 steps). ``--recipe grpo``: ``grpo_vs_trl.py --lab real --lit-engine native+padfree
--lr 0``'s (16 completions a round, 4 prompts x 4, 2 steps of 8, 64 new tokens, 3 rounds, beta 0: no reference).
``--recipe distill``: ``distill_vs_trl.py --lab real``'s (``--teacher``, default the student; 16 prompts a round, 2
steps of 8, one completion each, 64 new tokens, 3 rounds, lr 1e-5), lit_align's defaults otherwise.

A sampler thread (every 2 ms) records the highest RSS of each phase: ``sample`` (GRPO, distillation: the engine's
``generate``), ``round`` (the rest of the round: rewards, advantages, old log-probs where needed), ``fwd`` (the
training forward and the loss; DPO: the policy's and the reference's; distillation: the student's and the
divergence), ``teacher`` (distillation: the teacher's forward), ``bwd``, ``opt`` (clipping and the optimizer step) and
``between`` (Lightning's loop between two steps). Per step it prints each phase's peak and the RSS at its end,
glibc's own count of the bytes in use (``mallinfo2``: allocated chunks plus mmapped blocks; the rest of the RSS is
memory glibc keeps after it was freed, and the interpreter's and libraries' own pages), the step's CPU time and its
page faults (each a first write to a 4 KiB page the process did not have). Without checkpointing
it also sums the bytes autograd saved for backward (each storage once; parameters left out).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import threading
import time

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
SUB_PHASES = ("sample", "round", "teacher")  # phases inside a step's forward, each with its own peak


def rss(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":"))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def mallinfo() -> dict[str, float]:
    """glibc's counts in MiB (``mallinfo2``, every arena): ``arena`` (heap bytes taken from the system), ``in_use``
    (chunks handed out), ``free`` (free chunks kept in the heaps), ``mmapped`` (blocks mmapped one by one); empty
    without glibc."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return {"arena": info.arena / 2**20, "in_use": info.uordblks / 2**20, "free": info.fordblks / 2**20,
            "mmapped": info.hblkhd / 2**20}


def malloc_in_use() -> float:
    """MiB glibc has handed out and not had back: chunks in use in its heaps plus mmapped blocks (NaN without glibc)."""
    info = mallinfo()
    return info["in_use"] + info["mmapped"] if info else float("nan")


def tagged(phase: list, name: str, fn):
    """``fn``, its calls in the phase ``name`` (the phase before them again afterwards)."""
    def call(*a, **kw):
        before, phase[0] = phase[0], name
        try:
            return fn(*a, **kw)
        finally:
            phase[0] = before
    return call


def dpo_run(args, model_dir: str, phase: list):
    """DPO as ``dpo_vs_trl.py --lab real --padding-free``: ``(module, datamodule, steps, accumulation)``."""
    import lab
    from dpo_vs_trl import LIT_CHECKPOINTING

    from lit_align.data.preference import PreferenceDataModule
    from lit_align.modules.dpo import DPOModule

    rows = str(lab.chat_rows(model_dir) / "preference.jsonl")
    module = DPOModule(model=model_dir, beta=0.1, learning_rate=1e-5, lr_scheduler_type="constant", weight_decay=0.0,
                       optim=args.optim, attn_implementation="sdpa", dtype="float32", padding_free=True,
                       gradient_checkpointing=LIT_CHECKPOINTING[args.checkpointing],
                       mmap_activations=args.mmap_activations)
    data = PreferenceDataModule(path=rows, tokenizer=model_dir, batch_size=2, max_length=1024, val_split=None,
                                shuffle=False)
    return module, data, args.steps or 5, 1


def grpo_run(args, model_dir: str, phase: list):
    """GRPO as ``grpo_vs_trl.py --lab real --lit-engine native+padfree --lr 0``: ``(module, datamodule, steps,
    accumulation)``, the module's sampling and round tagged as phases."""
    import lab
    from grpo_vs_trl import LIT_CHECKPOINTING, REWARD

    from lit_align.data import PromptDataModule
    from lit_align.modules.grpo import GRPOModule

    module = GRPOModule(
        model=model_dir, reward_funcs=[REWARD], loss_type="dapo", beta=0.0, epsilon=0.2, scale_rewards="group",
        max_completion_length=64, temperature=1.0, top_p=1.0, top_k=0, engine="native", padding_free=True,
        learning_rate=0.0, lr_scheduler_type="constant", weight_decay=0.0, optim=args.optim, dtype="float32",
        attn_implementation="sdpa", gradient_checkpointing=LIT_CHECKPOINTING[args.checkpointing],
        mmap_activations=args.mmap_activations, disable_dropout=True, num_generations=4, steps_per_generation=2)

    make_round = module.make_round
    module.rollouts.engine.generate = tagged(phase, "sample", module.rollouts.engine.generate)
    module.make_round = tagged(phase, "round", lambda batch: make_round(batch))
    data = PromptDataModule(path=str(lab.chat_rows(model_dir) / "prompts.jsonl"), tokenizer=model_dir, batch_size=8,
                            val_split=None, shuffle=False)
    return module, data, args.steps or 6, 1


def distill_run(args, model_dir: str, phase: list):
    """Distillation as ``distill_vs_trl.py --lab real``: ``(module, datamodule, steps, accumulation)``, the
    sampling, the round and the teacher's forward tagged as phases."""
    import lab
    from dpo_vs_trl import LIT_CHECKPOINTING

    from lit_align.data import PromptDataModule
    from lit_align.modules.distill import DistillationModule

    teacher = model_dir if args.teacher is None else lab.real_model(args.teacher)
    module = DistillationModule(
        model=model_dir, teacher_model=teacher, beta=1.0, temperature=1.0, top_p=1.0, top_k=0,
        max_completion_length=64, num_generations=1, steps_per_generation=2, learning_rate=1e-5,
        lr_scheduler_type="constant", weight_decay=0.0, optim=args.optim, dtype="float32", attn_implementation="sdpa",
        **({} if args.checkpointing is None else {"gradient_checkpointing": LIT_CHECKPOINTING[args.checkpointing]}),
        **({} if args.mmap_activations is None else {"mmap_activations": args.mmap_activations}))
    make_round = module.make_round
    module.rollouts.engine.generate = tagged(phase, "sample", module.rollouts.engine.generate)
    module.make_round = tagged(phase, "round", lambda batch: make_round(batch))
    module.teacher_outputs = tagged(phase, "teacher", module.teacher_outputs)
    data = PromptDataModule(path=str(lab.chat_rows(model_dir) / "prompts.jsonl"), tokenizer=model_dir, batch_size=8,
                            val_split=None, shuffle=False)
    return module, data, args.steps or 3, 2  # a round: one optimizer step of 2 accumulated batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=["dpo", "grpo", "distill"], default="dpo")
    parser.add_argument("--model", required=True, help="a real chat model: a .gguf file or an HF directory")
    parser.add_argument("--teacher", help="distill: the teacher, a .gguf file or an HF directory (default: --model)")
    parser.add_argument("--checkpointing", choices=["none", "selective", "full"],
                        help="default: none (distill: lit_align's default, none too)")
    parser.add_argument("--optim", choices=["adamw_torch", "adamw_torch_fused"], default="adamw_torch")
    parser.add_argument("--mmap-activations", action=argparse.BooleanOptionalAction,
                        help="lit_align's model.mmap_activations (default: off; distill: lit_align's default, on)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: DPO 5, GRPO 6: 3 rounds, "
                        "distill 3: 3 rounds)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trace", help="write a timeline here (CSV, every 10 ms: phase, step, RSS, glibc's counts)")
    args = parser.parse_args()
    if args.recipe != "distill":  # distillation's own defaults where not given
        args.checkpointing, args.mmap_activations = args.checkpointing or "none", bool(args.mmap_activations)

    import lab
    import lightning as L
    import torch

    from lit_align.layouts import completions

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = lab.real_model(args.model)
    # the current phase; each phase's peak; the run's peak, where, and its anonymous, file-backed and in-use parts
    phase, step, peaks, top = ["load"], [None], {}, [0.0, "", 0.0, 0.0, 0.0]

    trace = None if args.trace is None else ["s,phase,step,rss,anon,arena,in_use,free,mmapped\n"]
    start = time.perf_counter()

    def sample():
        ticks = 0
        while True:
            ticks += 1
            if trace is not None and ticks % 5 == 0:
                info = mallinfo()
                trace.append(f"{time.perf_counter() - start:.3f},{phase[0]},{step[0]},{rss():.0f},{rss('RssAnon'):.0f},"
                            + ",".join(f"{info[k]:.0f}" for k in ("arena", "in_use", "free", "mmapped")) + "\n")
            now, name = rss(), phase[0]
            if now > peaks.get(name, 0.0):
                peaks[name] = now
            if now > top[0]:
                top[:] = [now, f"{name}, step {step[0]}", rss("RssAnon"), rss("RssFile"), malloc_in_use()]
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
        """Switches ``phase`` at each hook and prints a step's phases: peak / RSS at the end / glibc's bytes in use."""

        def enter(self, name):
            now = rss()
            if phase[0] != "load":
                self.parts.append(f"{phase[0]} {peaks.pop(phase[0], now):.0f}/{now:.0f}/{malloc_in_use():.0f}")
            peaks.pop(name, None)
            phase[0] = name

        def on_train_start(self, trainer, pl_module):
            print(f"model loaded: RSS {rss():.0f} MiB (anonymous {rss('RssAnon'):.0f}, file-backed "
                  f"{rss('RssFile'):.0f}), glibc in use {malloc_in_use():.0f}")
            print("each phase: peak / RSS at its end / glibc's bytes in use at its end, MiB", flush=True)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.parts, self.cpu, saved[0], step[0] = [], time.process_time(), 0, batch_idx
            self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            self.enter("fwd")
            for name in SUB_PHASES:
                peaks.pop(name, None)
            seen.clear()
            seen.update(p.untyped_storage().data_ptr() for p in pl_module.parameters())
            hooks.__enter__()

        def on_before_backward(self, trainer, pl_module, loss):
            hooks.__exit__(None, None, None)
            for name in SUB_PHASES:  # a round (inside the step's forward), the teacher: their own phases
                if name in peaks:
                    self.parts.append(f"{name} {peaks.pop(name):.0f}")
            self.enter("bwd")
            if saved[0]:
                self.parts.append(f"(saved {saved[0] / 2**20:.0f})")

        def on_after_backward(self, trainer, pl_module):
            self.enter("opt")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.enter("between")
            if "attention_mask" in batch:  # DPO: the pairs' tokens
                size = f"{int(batch['attention_mask'].sum())} tokens"
            else:  # GRPO: the step's prompt and completion tokens, and the positions its training forward ran
                step = outputs["step"]
                layout = completions(step.prompt_ids, step.prompt_mask, step.completion_ids, step.completion_mask,
                                     pl_module.padding_free)
                size = (f"{int(step.prompt_mask.sum() + step.completion_mask.sum())} tokens, "
                        f"{layout.input_ids.numel()} positions")
            print(f"step {batch_idx}, {size}: " + ", ".join(self.parts)
                  + f" MiB; CPU {time.process_time() - self.cpu:.1f} s, "
                  f"{(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.faults) / 1000:.0f}k page faults",
                  flush=True)

    runs = {"dpo": dpo_run, "grpo": grpo_run, "distill": distill_run}
    module, data, steps, accumulate = runs[args.recipe](args, model_dir, phase)
    trainer = L.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, accelerator="cpu", devices=1,
                        precision="32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Phases()])
    trainer.fit(module, datamodule=data)
    if trace is not None:
        with open(args.trace, "w") as f:
            f.writelines(trace)
    settings = module.hparams
    mapped = "mmap_activations, " if settings.mmap_activations else ""
    print(f"peak RSS {rss('VmHWM'):.0f} MiB (sampled {top[0]:.0f}, in {top[1]}: anonymous {top[2]:.0f}, file-backed "
          f"{top[3]:.0f}, glibc in use {top[4]:.0f}); {args.recipe}, checkpointing "
          f"{settings.gradient_checkpointing}, {args.optim}, {mapped}{args.threads} thread(s), "
          f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
