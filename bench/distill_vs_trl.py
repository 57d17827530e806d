"""lit_align's DistillationModule against TRL's DistillationTrainer: steady-state completions/s and peak RSS, same
student, teacher, prompts and settings.

    python bench/distill_vs_trl.py                               # builtin:small as student and teacher, 2 threads
    python bench/distill_vs_trl.py --model builtin:tiny --teacher builtin:small --threads 1   # a smaller student
    python bench/distill_vs_trl.py --lab realistic --threads 1   # llama-32k, GSM8K-like prompts
    python bench/distill_vs_trl.py --lab real --model M --lr 0   # M: SmolLM2-135M-Instruct (below), its own teacher

``--lab builtin`` (the default): ``--model`` (default ``builtin:small``) on the built-in sort task's train prompts.
``--lab realistic`` (``bench/lab.py``): the Llama-shaped 32k model (``--lab-model qwen2-152k``: the 152k one) and its
GSM8K-like prompts, 128 new tokens. ``--lab real --model M``: a real chat model (a ``.gguf``, converted once, or an
HF directory: ``lab.real_model``; after ``make pretrained``, SmolLM2-135M-Instruct is
``~/.cache/lit_align/pretrained/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf``) on GSM8K-like chat prompts
drawn from its own vocabulary (``lab.chat_rows``, ~60-140 tokens through its chat template), 64 new tokens; about 5
minutes for both sides on 2 quiet cores with SmolLM2-135M. The realistic and real labs default to 8 prompts a step, 2 steps a round (16 completions), 6 rounds:
5 timed rounds of 16 sampled completions each (with 2, the sides' completion lengths differed by up to 6% by chance,
and compl/s with them).
``--teacher T`` (resolved as ``--model`` is) sets the teacher; by default it is the student's model, which costs
what any teacher of that shape costs, but then the divergence starts at zero and so does the gradient: give another
teacher of the same vocabulary to see the student move.

Each engine runs in a fresh process (this script re-invoked with ``--engine lit`` / ``--engine trl``, ``child.py``),
so its peak RSS (``ru_maxrss``, and ``VmHWM`` beside it) is its own; the parent imports no torch.

What both sides get, so that they do the same work:
  - the same student and teacher model directories, both loaded in fp32 with ``sdpa`` attention (checked: a
    warning otherwise); the teacher frozen, in eval mode, its forward without gradients;
  - the same prompts in file order (no shuffling on either side), one completion per prompt, the student's samples
    only (TRL's trainer is always on-policy; lit_align's ``lmbda`` 1.0, its default);
  - TRL's generation batch: ``--batch-size`` prompts per step times ``--steps-per-generation`` steps, sampled at once
    and trained on in that many accumulated micro-batches, one optimizer step a round (TRL:
    ``per_device_train_batch_size`` and ``gradient_accumulation_steps``; lit_align: ``data.batch_size``,
    ``steps_per_generation`` and ``accumulate_grad_batches``);
  - sampling at temperature 1.0, top-k 0, top-p 1.0 (no min-p, no repetition penalty), ``--max-new-tokens``;
    the loss the reverse KL (``beta`` 1.0, TRL's default) at temperature 1.0, the per-token mean over the optimizer
    step's completion tokens;
  - AdamW (``--optim``, default ``adamw_torch_fused``: both sides' default), constant learning rate ``--lr`` (0 holds
    the student, so completion lengths stay alike on both sides), no weight decay, clipping at 1.0; no gradient
    checkpointing (TRL's default, on, is turned off), no mixed precision (TRL's ``bf16`` default is turned off),
    dropout as both sides' ``disable_dropout`` default (false) leaves it: the models' own rates (0 in these);
    CPU, ``torch.set_num_threads(--threads)``; no logger, checkpoints, evaluation or progress bar.
lit_align runs at its defaults otherwise: engine ``auto`` (the native engine on CPU), ``padding_free`` auto (packed
rows under sdpa on CPU), both printed. That, and computing both models' outputs at the completion tokens only, is
what is measured against TRL's ``generate`` and padded rows.

TRL's trainer on CPU needs nothing special: ``use_cpu=True`` (both models then load with ``device_map=None``), no
vLLM (``use_vllm`` false, its default), the teacher passed as a path. But its ``teacher_model_init_kwargs`` must name
the dtype: without one, TRL hands ``dtype=None`` on to ``from_pretrained`` and the teacher loads in the checkpoint's
dtype (a bf16 checkpoint: bf16), while the student gets TRL's float32 default; so both get ``dtype: float32``,
``attn_implementation: sdpa`` here (``model_init_kwargs``, ``teacher_model_init_kwargs``). Its chunked divergence
kernel (``trl.kernels.chunked_divergence``) runs on CPU as it is: without Triton it projects every position of the
padded completions through both heads and masks afterwards.

The table (``child.print_rates``): ``compl/s`` and ``tok/s`` over the rounds after the first (the warm-up), from the
end of the warm-up round's last step to the end of the last one (each side's own step-end callback);
``compl/CPU-s`` the same over the process's CPU time (on a loaded machine, look at it too); ``gen s/round`` and
``gen CPU-s/round`` the time inside the sampling call (lit_align: the engine's ``generate``; TRL:
``_generate_single_turn``); ``tok/compl`` the mean completion tokens sampled (EOS included), on both sides, so a
difference in lengths shows. Ratios lit/TRL (for the sampling time TRL/lit, its speed-up; for peak RSS lit/TRL).
Below it: lit_align's round against its matmul bound (``bench/bound.py``: sampling, the student's forward + backward
and the teacher's forward, on the real tokens) and its phases in wall seconds, the timed rounds' mean (sampling, the
teacher's forward, the student's, the divergence through both heads, backward, clipping and the optimizer step, the
rest), and per side the last logged loss and how many parameter tensors moved, which says each side trained (with
``--lr 0``, none should).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from child import GenTimer, check_trl_sampling, child_role, launch, print_rates, round_rates

MODEL_INIT_KWARGS = {"dtype": "float32", "attn_implementation": "sdpa"}  # TRL's student and teacher loading
# lit_align's round, as the table below the rates shows it (the rest: Lightning's loop, the round's bookkeeping)
PHASES = ("sampling", "teacher forward", "student forward", "divergence", "backward", "clipping + optimizer")


def model_dir(lab_name: str, name: str) -> str:
    """The model directory of ``name`` in the lab: the real lab converts a ``.gguf`` once (``lab.real_model``), the
    realistic lab builds its named models (``lab.model``), anything else as ``lit_align.models.resolve`` has it."""
    import lab

    from lit_align.models import resolve

    if lab_name == "real":
        return lab.real_model(name)
    if lab_name == "realistic" and name in lab.LAB_MODELS:
        return lab.model(name)
    return resolve(name)


def prepare(args, workdir: Path) -> dict:
    """Resolve the student and the teacher (built once, outside the measured processes) and write the prompts both
    engines read."""
    from datasets import load_dataset

    from lit_align.data.tasks import SortTask

    student = model_dir(args.lab, args.model)
    teacher = student if args.teacher is None else model_dir(args.lab, args.teacher)
    if args.lab == "realistic":
        import lab

        rows = load_dataset("json", data_files=lab.prompt_rows(), split="train")
    elif args.lab == "real":
        import lab

        rows = load_dataset("json", data_files=str(lab.chat_rows(student) / "prompts.jsonl"), split="train")
    else:
        rows = SortTask().prompt_rows("train")
    rows = rows.select(range(args.rounds * args.batch_size * args.steps_per_generation))
    path = workdir / "prompts.jsonl"
    rows.to_json(path)
    return {"student": student, "teacher": teacher, "prompts": str(path)}


def parameter_sample(model) -> list:
    """A strided sample (~4k values) of each parameter tensor, to tell afterwards whether training moved it."""
    return [p.detach().flatten()[:: max(1, p.numel() // 4096)].clone() for p in model.parameters()]


def parameters_moved(model, before: list) -> dict:
    """How many of ``model``'s parameter tensors differ from ``before`` (``parameter_sample``), and by how much."""
    after = parameter_sample(model)
    deltas = [float((a - b).abs().max()) for a, b in zip(after, before)]
    return {"moved": sum(d > 0 for d in deltas), "tensors": len(deltas), "max_delta": max(deltas)}


def one_setting(student: str, teacher: str) -> str:
    """``student`` (e.g. its attention), or ``student/teacher`` where they differ (``print_rates`` then warns)."""
    return student if student == teacher else f"{student}/{teacher}"


def run_lit(args, spec: dict) -> dict:
    import lightning as L
    import torch

    from bound import distill_round_flops, matmul_peak
    from lit_align.data import PromptDataModule
    from lit_align.layouts import resolve_padding_free
    from lit_align.modules.distill import DistillationModule

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    class Clock(L.Callback):
        """Each micro-batch's end; and the round's phases after sampling (``PHASES``; sampling is ``GenTimer``'s,
        one call a round): wall seconds per round, each call or hook pair timed and counted in the round (the
        optimizer step) it ran in."""

        def __init__(self):
            self.ends: list[tuple[float, float]] = []
            self.threads, self.before = None, None
            self.phases: dict[str, list[float]] = {name: [0.0] * args.rounds for name in PHASES[1:]}
            self.started: dict[str, float] = {}

        def add(self, name: str, start: float, round: int | None = None) -> None:
            self.phases[name][self.round if round is None else round] += time.perf_counter() - start

        def timed(self, fn, name: str, counts=lambda *a: True):
            def call(*a, **kw):
                start = time.perf_counter()
                out = fn(*a, **kw)
                if counts(*a):
                    self.add(name, start)
                return out
            return call

        def on_train_start(self, trainer, pl_module):
            self.before, self.trainer = parameter_sample(pl_module.policy), trainer

        @property
        def round(self) -> int:
            return self.trainer.global_step

        def on_before_backward(self, trainer, pl_module, loss):
            self.started["backward"] = time.perf_counter()

        def on_after_backward(self, trainer, pl_module):
            self.add("backward", self.started.pop("backward"))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.started["optimizer"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if "optimizer" in self.started:  # clipping, the step and zeroing the gradients: the round just ended
                self.add("clipping + optimizer", self.started.pop("optimizer"), self.round - 1)
            self.ends.append((time.perf_counter(), time.process_time()))
            self.threads = torch.get_num_threads()

    module = DistillationModule(
        model=spec["student"], teacher_model=spec["teacher"], beta=1.0, temperature=1.0, top_p=1.0, top_k=0,
        max_completion_length=args.max_new_tokens, num_generations=1, steps_per_generation=args.steps_per_generation,
        learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0, optim=args.optim, dtype="float32",
        attn_implementation="sdpa",
    )
    timer = GenTimer(module.rollouts.engine.generate, lambda rollout: int(rollout.completion_mask.sum()))
    clock = Clock()
    module.rollouts.engine.generate = timer
    module.teacher_outputs = clock.timed(module.teacher_outputs, "teacher forward")
    module.outputs = clock.timed(module.outputs, "student forward", lambda network, *_: network is module.network)
    module.token_divergence = clock.timed(module.token_divergence, "divergence")
    data = PromptDataModule(path=spec["prompts"], tokenizer=spec["student"], batch_size=args.batch_size,
                            val_split=None, shuffle=False)
    trainer = L.Trainer(
        max_steps=args.rounds, accumulate_grad_batches=args.steps_per_generation, accelerator="cpu", devices=1,
        precision="32-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=1.0, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[clock],
    )
    trainer.fit(module, datamodule=data)

    # the timed rounds' prompts (tokenized as the data module does) and their mean completion length
    per_round = args.batch_size * args.steps_per_generation
    prompt_lengths = [len(data.train_data[i]["prompt_ids"]) for i in range(per_round, args.rounds * per_round)]
    completion = round(sum(timer.tokens[1:]) / len(prompt_lengths))
    student, teacher = module.policy, module.teacher.model
    flops = distill_round_flops(student.config, teacher.config, [(p, completion) for p in prompt_lengths])
    return {"ends": clock.ends, "threads": clock.threads, "gen_s": timer.seconds, "gen_cpu_s": timer.cpu_seconds,
            "gen_tokens": timer.tokens,
            "phases": {name: sum(seconds[1:]) / (args.rounds - 1)
                       for name, seconds in {"sampling": timer.seconds, **clock.phases}.items()},
            "flops_per_round": flops / (args.rounds - 1), "matmul_peak": matmul_peak(),
            "attn": one_setting(student.config._attn_implementation, teacher.config._attn_implementation),
            "dtype": one_setting(str(student.dtype), str(teacher.dtype)),
            "loss": float(trainer.callback_metrics["train/loss"]), **parameters_moved(student, clock.before),
            "engine": module.rollouts.engine.chosen or module.rollouts.engine_name,
            "padding_free": resolve_padding_free(module.padding_free, student, module.device),
            "eos": [module.tokenizer.eos_token_id]}


def run_trl(args, spec: dict) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends: list[tuple[float, float]] = []
            self.threads = None

        def on_step_end(self, targs, state, control, **kwargs):  # after each optimizer step: one per round
            self.ends.append((time.perf_counter(), time.process_time()))
            self.threads = torch.get_num_threads()

    config = DistillationConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.steps_per_generation, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, beta=1.0, max_steps=args.rounds,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim=args.optim,
        max_grad_norm=1.0, bf16=False, use_cpu=True, use_vllm=False, gradient_checkpointing=False,
        shuffle_dataset=False, report_to="none", save_strategy="no", eval_strategy="no", logging_steps=args.rounds,
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0, seed=0,
        model_init_kwargs=dict(MODEL_INIT_KWARGS), teacher_model_init_kwargs=dict(MODEL_INIT_KWARGS),
    )
    prompts = load_dataset("json", data_files=spec["prompts"], split="train")
    clock = Clock()
    tokenizer = AutoTokenizer.from_pretrained(spec["student"])
    trainer = DistillationTrainer(model=spec["student"], teacher_model=spec["teacher"], args=config,
                                  train_dataset=prompts, processing_class=tokenizer, callbacks=[clock])
    check_trl_sampling(trainer.generation_config, args.max_new_tokens)
    timer = GenTimer(trainer._generate_single_turn, lambda completions: sum(len(ids) for ids in completions))
    trainer._generate_single_turn = timer
    before = parameter_sample(trainer.model)
    trainer.train()
    student, teacher = trainer.model, trainer.teacher_model
    return {"ends": clock.ends, "threads": clock.threads, "gen_s": timer.seconds, "gen_cpu_s": timer.cpu_seconds,
            "gen_tokens": timer.tokens,
            "attn": one_setting(student.config._attn_implementation, teacher.config._attn_implementation),
            "dtype": one_setting(str(student.dtype), str(teacher.dtype)),
            "loss": next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None),
            **parameters_moved(student, before), "eos": trainer.eos_token_ids}


def child(args) -> None:
    spec = json.loads(args.spec)
    result = (run_lit if args.engine == "lit" else run_trl)(args, spec)
    ends, steps = result.pop("ends"), args.steps_per_generation
    round_ends = ends[steps - 1 :: steps] if args.engine == "lit" else ends  # lit: every micro-batch; TRL: rounds
    if len(round_ends) != args.rounds or len(result["gen_s"]) != args.rounds:
        raise SystemExit(f"{args.engine}: {len(round_ends)} rounds trained and {len(result['gen_s'])} sampled, "
                         f"expected {args.rounds}")
    result.update(round_rates(round_ends, result["gen_s"], result.pop("gen_cpu_s"), result["gen_tokens"],
                              args.batch_size * steps))
    print("RESULT " + json.dumps(result), flush=True)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lab", choices=["builtin", "realistic", "real"], default="builtin",
                        help="builtin: --model on the built-in sort task; realistic: bench/lab.py's model and prompts; "
                             "real: --model (a real chat model, .gguf or HF directory) on chat prompts")
    parser.add_argument("--lab-model", choices=["llama-32k", "qwen2-152k"], default="llama-32k")
    parser.add_argument("--model", default="builtin:small", help="the student (default builtin:small, ~10M params)")
    parser.add_argument("--teacher", help="the teacher, resolved as --model (default: the student's model)")
    parser.add_argument("--rounds", type=int, default=4, help="generation rounds, the first one warm-up (default 4)")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts (= completions) per step (default 16)")
    parser.add_argument("--steps-per-generation", type=int, default=2,
                        help="accumulated steps a round feeds, one optimizer step (TRL: gradient_accumulation_steps; "
                             "default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="max completion tokens (default 32)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides (default 2)")
    parser.add_argument("--lr", type=float, default=1e-5, help="constant learning rate (default 1e-5; 0 holds the "
                                                              "student, so completion lengths stay comparable)")
    parser.add_argument("--optim", choices=["adamw_torch", "adamw_torch_fused"], default="adamw_torch_fused",
                        help="both sides' optimizer, by TRL's name (default adamw_torch_fused, both sides' default)")
    parser.add_argument("--engines", default="lit,trl", help="which to run, in order (default lit,trl)")
    parser.add_argument("--engine", choices=["lit", "trl", "prepare"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lab in ("realistic", "real"):  # the realistic defaults, where not given
        given = " ".join(sys.argv)
        args.model = args.lab_model if args.lab == "realistic" else args.model
        for option, value in (("--batch-size", 8), ("--steps-per-generation", 2), ("--rounds", 6),
                              ("--max-new-tokens", 128 if args.lab == "realistic" else 64)):
            if option not in given:
                setattr(args, option[2:].replace("-", "_"), value)
    if args.rounds < 2:
        parser.error("need --rounds >= 2 (the first round is the warm-up)")
    return args


def main() -> None:
    args = parse_args()
    if child_role(args, prepare, child):
        return

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="distill_vs_trl.") as workdir:
        spec = {"workdir": workdir}
        spec.update(launch(__file__, "prepare", spec, args.threads))
        results = {engine: launch(__file__, engine, spec, args.threads) for engine in args.engines.split(",")}
    load_after = os.getloadavg()

    per_round = args.batch_size * args.steps_per_generation
    settings = {k: v for k, v in vars(args).items() if k not in ("engine", "spec")}
    print("\nsettings: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items()))
    lit = results.get("lit", {})
    print(f"Distillation (on-policy, reverse KL), student {spec['student']}, teacher {spec['teacher']}; "
          f"{per_round} completions a round ({args.steps_per_generation} steps of {args.batch_size} prompts, one "
          f"optimizer step), max {args.max_new_tokens} new tokens, {args.rounds} rounds (1 warm-up), fp32, CPU, "
          f"{args.threads} threads, {args.optim}, lr {args.lr} constant; TRL gradient_checkpointing off, bf16 off; "
          f"lit_align engine {lit.get('engine', '-')}, padding_free {lit.get('padding_free', '-')}; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    print_rates(results)
    from bound import report

    if "flops_per_round" in lit:
        print(report("lit, one round (matmul bound)", lit["flops_per_round"], lit["s_per_round"], lit["matmul_peak"]))
        phases = {**lit["phases"], "the rest": lit["s_per_round"] - sum(lit["phases"].values())}
        print("lit, a timed round's phases (s): " + ", ".join(f"{name} {s:.2f}" for name, s in phases.items()))
    if spec["teacher"] == spec["student"]:
        print("teacher = student: the divergence and its gradient start at zero (give --teacher to see training)")
    for engine, r in results.items():
        finite = r["loss"] is not None and math.isfinite(r["loss"])
        loss = f"{r['loss']:.4f}" if finite else f"{r['loss']} (NOT FINITE)"
        print(f"{engine}: last logged loss {loss}; {r['moved']}/{r['tensors']} "
              f"parameter tensors moved (max |change| {r['max_delta']:.2e}); EOS ids {r['eos']}")


if __name__ == "__main__":
    main()
