"""What each child process of ``bench/gpu_vs_trl.py`` runs: ``prepare`` (the models, built once, the rows, the
matmul peak, the versions), one side of one case (``dpo_child``, ``grpo_child``: lit_align or TRL, timed step by step
in ``Steps``), and for ``--vendor`` the list of distributions the children import (``imports``). Each prints one
``RESULT`` line (``bench/child.py``)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()  # this process's start: a child's --deadline-s counts from it

import vendor  # noqa: E402
from child import GenTimer, check_trl_sampling, peak_rss_mib, round_rates  # noqa: E402
from grpo_vs_trl import REWARD  # noqa: E402

SHAPES = {  # the dimensions that decide speed and memory; bench/lab.py's build_model adds the rest
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True),
}
SMOKE = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1)
LR = 1e-6
CHILD_IMPORTS = ["lightning", "lit_align.modules.dpo", "lit_align.modules.grpo", "lit_align.data", "lit_align.rewards",
                 "trl", "trl.trainer.dpo_trainer", "trl.trainer.grpo_trainer", "datasets", "lab", "bound", "packaging"]


def prepare(args, workdir: Path) -> dict:
    """Build the models (once, under the lab's cache), write the rows, measure the matmul peak, read the versions."""
    import lightning
    import torch
    import transformers
    import trl

    import bound
    import lab

    models = {}
    for name in args.shapes:
        shape = {**SHAPES[name], **(SMOKE if args.smoke else {})}
        key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]
        path = lab.lab_dir().parent / "lab-gpu" / f"{name}{'-smoke' * args.smoke}-{key}"
        if not (path / "config.json").exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=path.parent))
            lab.build_model(name, tmp, shape=shape)
            try:
                os.rename(tmp, path)
            except OSError:  # another process built it meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
        models[name] = str(path)
    write_rows(args, workdir, models)
    cuda = args.accelerator == "gpu"
    found = {n: importlib.util.find_spec(n) is not None for n in ("vllm", "liger_kernel")}
    return {"models": models, "preference": str(workdir / "preference.jsonl"),
            "prompts": str(workdir / "prompts.jsonl"),
            "device": torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)",
            "matmul_peak": bound.cuda_matmul_peak() if cuda else bound.matmul_peak(),
            "peak_dtype": "bf16" if cuda else "fp32",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                         "lightning": lightning.__version__, "lit_align": vendor.lit_align_version(),
                         "python": sys.version.split()[0]},
            "vllm": found["vllm"] and cuda, "liger": found["liger_kernel"]}


def write_rows(args, workdir: Path, models: dict[str, str]) -> None:
    """``lab.write_rows``' pairs and prompts, as many as the longest case reads; the pairs only those whose prompt
    takes at most half of ``--max-length`` through every model's tokenizer (lit_align refuses a prompt that fills
    ``max_length``, TRL keeps it and cuts the completions: either way no pair worth timing)."""
    from transformers import AutoTokenizer

    import lab

    pairs = args.dpo_steps * args.dpo_batch_size
    lab.write_rows(workdir, rows=max(4 * pairs, args.rounds * args.grpo_batch_size * args.steps_per_generation
                                     // args.num_generations))
    path = workdir / "preference.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for model_dir in models.values():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        lengths = [len(ids) for ids in tokenizer([r["prompt"] for r in rows])["input_ids"]]
        rows = [r for r, n in zip(rows, lengths) if n <= args.max_length // 2]
    if len(rows) < pairs:
        raise SystemExit(f"error: {len(rows)} of the lab's pairs have a prompt of at most --max-length / 2 = "
                         f"{args.max_length // 2} tokens, {pairs} needed: raise --max-length")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:pairs]))


class Steps:
    """Each step's wall-clock marks, the device synchronized first: ``begin``, ``optim`` (the optimizer hook),
    ``end`` (and ``end_cpu``, the process's CPU time there); and when to stop: at a multiple of ``every`` steps,
    after ``warmup`` steps and one timed unit, once ``steps`` are done or another unit would pass ``deadline``."""

    def __init__(self, cuda: bool, warmup: int, steps: int, every: int, deadline: float):
        self.cuda, self.warmup, self.steps, self.every, self.deadline = cuda, warmup, steps, every, deadline
        self.marks: dict[str, list[float]] = {"begin": [], "optim": [], "end": []}
        self.end_cpu: list[float] = []

    def mark(self, which: str) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.marks[which].append(time.perf_counter())
        if which == "end":
            self.end_cpu.append(time.process_time())

    def stop(self) -> bool:
        end = self.marks["end"]
        n = len(end)
        if n % self.every or n < self.warmup + self.every:
            return n >= self.steps
        unit = (end[-1] - end[self.warmup - 1]) * self.every / (n - self.warmup)
        return n >= self.steps or time.perf_counter() + unit > self.deadline

    @property
    def done(self) -> int:
        return len(self.marks["end"])

    def seconds(self) -> float:
        """From the end of the warm-up to the end of the last step."""
        return self.marks["end"][-1] - self.marks["end"][self.warmup - 1]

    def phase(self, start: str, stop: str) -> float:
        """Seconds from the ``start`` to the ``stop`` mark, summed over the timed steps."""
        return sum(self.marks[stop][i] - self.marks[start][i] for i in range(self.warmup, self.done))


def synced(fn, cuda: bool):
    """``fn`` with the device synchronized before and after (its wall time is then its own work)."""
    if not cuda:
        return fn
    import torch

    def call(*a, **k):
        torch.cuda.synchronize()
        out = fn(*a, **k)
        torch.cuda.synchronize()
        return out

    return call


def lit_run(args, module, data, steps: Steps, max_steps: int) -> None:
    import lightning as L

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            steps.mark("begin")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            steps.mark("optim")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.mark("end")
            if steps.stop():
                trainer.should_stop = True

    trainer = L.Trainer(max_steps=max_steps, accelerator=args.accelerator, devices=1, precision="bf16-mixed",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[Clock()])
    trainer.fit(module, datamodule=data)


def trl_clock(steps: Steps):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kwargs):
            steps.mark("begin")

        def on_pre_optimizer_step(self, targs, state, control, **kwargs):
            steps.mark("optim")

        def on_step_end(self, targs, state, control, **kwargs):
            steps.mark("end")
            if steps.stop():
                control.should_training_stop = True

    return Clock()


def trl_settings(args, spec: dict, case: dict, max_steps: int) -> dict:
    """What TRL's config gets in every case, and the case's settings (``fast``: its documented fast ones here)."""
    settings = dict(output_dir=str(Path(spec["workdir"]) / "trl"), max_steps=max_steps, learning_rate=LR,
                    use_cpu=args.accelerator == "cpu", report_to="none", save_strategy="no", eval_strategy="no",
                    logging_steps=max_steps, disable_tqdm=True, dataloader_num_workers=0,
                    model_init_kwargs={"dtype": "float32"})
    if case["setting"] == "fast":
        settings.update(gradient_checkpointing=False, **({"use_liger_kernel": True} if spec["liger"] else {}))
    return settings


def dpo_child(args, spec: dict, case: dict, steps: Steps) -> dict:
    model_dir = spec["models"][case["shape"]]
    if case["side"] == "lit":
        from lit_align.data.preference import PreferenceDataModule
        from lit_align.modules.dpo import DPOModule

        module = DPOModule(model=model_dir, beta=0.1, learning_rate=LR)
        data = PreferenceDataModule(path=spec["preference"], tokenizer=model_dir, batch_size=args.dpo_batch_size,
                                    max_length=args.max_length, val_split=None, shuffle=False)
        lit_run(args, module, data, steps, args.dpo_steps)
        from bound import dpo_step_flops

        def side(row, name):  # completion tokens kept at max_length (keep-start truncation)
            return min(len(row["prompt_ids"]) + len(row[name]), args.max_length) - len(row["prompt_ids"])

        rows = [data.train_data[i] for i in range(args.dpo_warmup * args.dpo_batch_size,
                                                  steps.done * args.dpo_batch_size)]
        flops = dpo_step_flops(module.policy.config, [(len(r["prompt_ids"]), side(r, "chosen_ids"),
                                                       side(r, "rejected_ids")) for r in rows]) / len(rows)
        out = {"flops_per_unit": flops, "attn": module.policy.config._attn_implementation,
               "dtype": str(module.policy.dtype), "precision": "bf16-mixed"}
    else:
        from datasets import load_dataset
        from transformers import AutoTokenizer
        from trl import DPOConfig, DPOTrainer

        config = DPOConfig(beta=0.1, max_length=args.max_length, per_device_train_batch_size=args.dpo_batch_size,
                           train_sampling_strategy="sequential", **trl_settings(args, spec, case, args.dpo_steps))
        trainer = DPOTrainer(model=model_dir, args=config,
                             train_dataset=load_dataset("json", data_files=spec["preference"], split="train"),
                             processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[trl_clock(steps)])
        trainer.train()
        out = {"attn": trainer.model.config._attn_implementation, "dtype": str(trainer.model.dtype),
               "precision": "bf16" if config.bf16 else "fp32", "gradient_checkpointing": config.gradient_checkpointing}
    timed, seconds = steps.done - args.dpo_warmup, steps.seconds()
    return {**out, "throughput": timed * args.dpo_batch_size / seconds, "unit": "pairs/s", "timed": timed,
            "fwd_bwd_s": steps.phase("begin", "optim") / timed, "optim_s": steps.phase("optim", "end") / timed,
            "s_per_step": seconds / timed}


def grpo_child(args, spec: dict, case: dict, steps: Steps) -> dict:
    model_dir, cuda, spg = spec["models"][case["shape"]], args.accelerator == "gpu", args.steps_per_generation
    vllm = case["setting"] == "vllm"
    # no completion ends early (HF generate's min_new_tokens on both sides; under vLLM none: a min_tokens would change
    # the log-probs its importance-sampling correction needs, and the table's tok/compl shows any EOS sampled)
    full_length = None if vllm else {"min_new_tokens": args.max_new_tokens}
    max_steps = args.rounds * spg
    if case["side"] == "lit":
        from lit_align.data import PromptDataModule
        from lit_align.modules.grpo import GRPOModule

        module = GRPOModule(model=model_dir, reward_funcs=[REWARD], loss_type="dapo", beta=0.0, temperature=1.0,
                            max_completion_length=args.max_new_tokens, num_generations=args.num_generations,
                            steps_per_generation=spg, learning_rate=LR, generation_kwargs=full_length,
                            **({"engine": "vllm", "vllm_gpu_memory_utilization": 0.3} if vllm else {}))
        engine = module.rollouts.engine
        timer = engine.generate = GenTimer(synced(engine.generate, cuda), lambda r: int(r.completion_mask.sum()))
        data = PromptDataModule(path=spec["prompts"], tokenizer=model_dir, batch_size=args.grpo_batch_size,
                                val_split=None, shuffle=False)
        lit_run(args, module, data, steps, max_steps)
        out = {"attn": module.policy.config._attn_implementation, "dtype": str(module.policy.dtype),
               "precision": "bf16-mixed", "engine": getattr(engine, "chosen", None) or ("vllm" if vllm else "hf")}
        model_config, prompt_ids = module.policy.config, [r["prompt_ids"] for r in data.train_data]
    else:
        from datasets import load_dataset
        from transformers import AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        from lit_align.rewards import load_reward

        if vllm:  # TRL's colocated vLLM joins a torch.distributed group of one, which a plain process must name
            for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                    MASTER_PORT="29531").items():
                os.environ.setdefault(name, value)
        config = GRPOConfig(per_device_train_batch_size=args.grpo_batch_size, num_generations=args.num_generations,
                            steps_per_generation=spg, max_completion_length=args.max_new_tokens, temperature=1.0,
                            beta=0.0, loss_type="dapo", generation_kwargs=full_length, shuffle_dataset=False,
                            log_completions=False, seed=0, **trl_settings(args, spec, case, max_steps),
                            **({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}
                               if vllm else {}))
        trainer = GRPOTrainer(model=model_dir, reward_funcs=[load_reward(REWARD)], args=config,
                              train_dataset=load_dataset("json", data_files=spec["prompts"], split="train"),
                              processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[trl_clock(steps)])
        if not vllm:
            check_trl_sampling(trainer.generation_config, args.max_new_tokens, args.max_new_tokens)
        timer = trainer._generate_single_turn = GenTimer(synced(trainer._generate_single_turn, cuda),
                                                         lambda out: sum(len(ids) for ids in out[0]))
        trainer.train()
        out = {"attn": trainer.model.config._attn_implementation, "dtype": str(trainer.model.dtype),
               "precision": "bf16" if config.bf16 else "fp32", "gradient_checkpointing": config.gradient_checkpointing,
               "engine": "vllm" if vllm else "hf"}
        model_config = prompt_ids = None
    rounds = steps.done // spg
    if steps.done % spg or len(timer.seconds) != rounds:
        raise SystemExit(f"{case}: {steps.done} steps and {len(timer.seconds)} generation rounds recorded, "
                         f"expected whole rounds of {spg} steps, one generation each")
    per_round = args.grpo_batch_size * spg
    round_ends = list(zip(steps.marks["end"], steps.end_cpu))[spg - 1 :: spg]
    rates = round_rates(round_ends, timer.seconds, timer.cpu_seconds, timer.tokens, per_round)
    if model_config is not None:  # the bound at lit_align's token counts: the timed rounds' prompts, mean completion
        from bound import grpo_round_flops

        prompts = prompt_ids[per_round // args.num_generations : rounds * per_round // args.num_generations]
        rows = [(len(p), round(rates["tokens_per_completion"])) for p in prompts for _ in range(args.num_generations)]
        out["flops_per_unit"] = grpo_round_flops(model_config, rows) / len(rows)
    return {**out, **rates, "throughput": rates["completions_per_s"], "unit": "compl/s", "timed": rounds - 1,
            "optim_s": steps.phase("optim", "end") / (rounds - 1)}


def child_main(args) -> None:
    if args.engine == "imports":  # --vendor: the distributions the children import
        import importlib.metadata as metadata

        for name in CHILD_IMPORTS:
            importlib.import_module(name)
        owners = metadata.packages_distributions()
        dists = {d for m in list(sys.modules) for d in owners.get(m.split(".")[0], [])}
        print("RESULT " + json.dumps({"distributions": sorted(dists)}), flush=True)
        return
    import torch

    spec, case = json.loads(args.spec), json.loads(args.case)
    cuda = args.accelerator == "gpu"
    torch.manual_seed(0)
    warmup, every, total = ((args.dpo_warmup, 1, args.dpo_steps) if case["recipe"] == "dpo" else
                            (args.steps_per_generation, args.steps_per_generation,
                             args.rounds * args.steps_per_generation))
    steps = Steps(cuda, warmup, total, every, START + args.deadline_s)
    result = (dpo_child if case["recipe"] == "dpo" else grpo_child)(args, spec, case, steps)
    if cuda:
        result.update(peak_mib=torch.cuda.max_memory_allocated() / 2**20, memory="cuda allocated",
                      reserved_mib=torch.cuda.max_memory_reserved() / 2**20)
    else:
        rusage, hwm = peak_rss_mib()
        result.update(peak_mib=hwm if math.isfinite(hwm) else rusage, memory="RSS")
    print("RESULT " + json.dumps(result), flush=True)


