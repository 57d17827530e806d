"""DPO and GRPO for a few steps under each sharded strategy on GPUs, printing the losses: the check CPU cannot make.

    python bench/gpu_strategies.py                           # every GPU, every case below, bf16-mixed
    python bench/gpu_strategies.py --strategies vllm_colocate vllm_sleep    # only GRPO with engine vllm (ddp)
    python bench/gpu_strategies.py --strategies fsdp --steps 3 --devices 2 --chunk-size 256
    python bench/gpu_strategies.py --accelerator cpu --strategies ddp --devices 1 --precision 32  # smoke test

For each (recipe, strategy): ``lit-align fit -c configs/<recipe>.yaml -c configs/strategy/<strategy>.yaml`` on
``builtin:small`` (offline, ~10M parameters) with ``--steps`` steps, a reference model (DPO always; GRPO with
``beta: 0.04``), chunked log-probs if ``--chunk-size``, and the HF export at the end; then the exported directory is
loaded with ``from_pretrained`` and compared with the run's last checkpoint (max |difference| of the weights; the
checkpoint's ``reference.*`` keys are counted: 0 expected). A DeepSpeed strategy is skipped (said so) when
``deepspeed`` is not importable. Exit status 1 if any run failed or gave a non-finite loss.

What it exercises that tests/ (CPU) cannot: FSDP on CUDA (tests/test_strategies.py runs torch's FSDP on CPU through
a test-only subclass), DeepSpeed ZeRO-2/3 (the reference partitioned, GRPO sampling through ZeRO-3's gather hooks,
``exclude_frozen_parameters``, the ZeRO-3 export gather), bf16-mixed on GPU, QLoRA (``qlora``: a 4-bit policy through
``model_init_kwargs.quantization_config`` with LoRA adapters; bitsandbytes needs CUDA), and GRPO with
``engine: vllm`` under ``ddp`` (one colocated engine per GPU: ``vllm_colocate``; ``vllm_sleep`` with
``vllm_enable_sleep_mode``: weights and KV cache freed between rounds, pushed back before each), whose
``train/sampling/importance_sampling_ratio/mean`` (vLLM's sampling against the training forward) is printed. A case
whose package is not importable (deepspeed, bitsandbytes, vllm) is skipped, said so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from lit_align.pipeline import read_metrics

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {
    "dpo": ["--data.init_args.batch_size", "8", "--model.init_args.warmup_ratio", "0"],
    "grpo": ["--model.init_args.beta", "0.04", "--model.init_args.max_completion_length", "16",
             "--model.init_args.warmup_steps", "0", "--model.init_args.learning_rate", "1e-4",
             "--data.init_args.batch_size", "16", "--model.init_args.num_generations", "4",
             "--model.init_args.steps_per_generation", "2"],
}


# runs that are not a strategy file alone: name -> (strategy file or None, the package they need, recipes, arguments)
VLLM = ["--model.init_args.engine", "vllm", "--model.init_args.vllm_gpu_memory_utilization", "0.3"]
VARIANTS = {
    # QLoRA: the policy loaded in 4 bits (bitsandbytes), LoRA adapters trained in bf16; the reference is the policy
    # with its adapters off. The export is the adapter.
    "qlora": (None, "bitsandbytes", ("dpo", "grpo"), [
        "--model.init_args.model_init_kwargs", json.dumps({"quantization_config": {
            "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"}}),
        "--model.init_args.peft_config", json.dumps({"r": 8, "lora_alpha": 16, "target_modules": "all-linear"})]),
    "vllm_colocate": ("ddp", "vllm", ("grpo",), VLLM),  # vLLM refuses sharded policies
    "vllm_sleep": ("ddp", "vllm", ("grpo",), [*VLLM, "--model.init_args.vllm_enable_sleep_mode", "true"]),
}


def run(recipe: str, strategy: str, args, out: Path) -> dict:
    file, _, _, extra = VARIANTS.get(strategy, (strategy, None, (), []))
    setting = [*(["-c", str(ROOT / "configs" / "strategy" / f"{file}.yaml")] if file else []), *extra]
    cmd = [sys.executable, "-m", "lit_align", "fit", "-c", str(ROOT / "configs" / f"{recipe}.yaml"), *setting,
           "--model.init_args.model", "builtin:small", "--trainer.accelerator", args.accelerator,
           "--trainer.devices", args.devices, "--trainer.precision", args.precision,
           "--trainer.max_steps", str(args.steps), "--trainer.log_every_n_steps", "1",
           "--trainer.val_check_interval", "null", "--data.init_args.val_split", "null",
           "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(out),
           "--export.enabled", "true", "--export.path", str(out / "hf_model"), *RECIPES[recipe]]
    if args.chunk_size:
        cmd += ["--model.init_args.logps_chunk_size", str(args.chunk_size)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    result = {"seconds": time.perf_counter() - start, "ok": proc.returncode == 0}
    if not result["ok"]:
        result["error"] = (proc.stdout + proc.stderr)[-3000:]
        return result
    metrics = read_metrics(next(out.glob(f"{recipe}/version_*")))
    result["losses"] = [value for _, value in metrics.get("train/loss", [])]
    result["kl"] = [value for _, value in metrics.get("train/kl", [])]
    weights = [value for _, value in metrics.get("train/sampling/importance_sampling_ratio/mean", [])]
    if weights:
        result["importance_sampling_ratio"] = weights
    if (out / "hf_model" / "adapter_config.json").exists():  # a LoRA export: the adapter, no full weights to compare
        result["adapter_files"] = sorted(p.name for p in (out / "hf_model").iterdir())
    else:
        result.update(check_export(out, recipe))
    return result


def check_export(out: Path, recipe: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = max(out.glob(f"{recipe}/version_*/checkpoints/**/*.ckpt"), key=os.path.getmtime, default=None)
    exported = AutoModelForCausalLM.from_pretrained(out / "hf_model").state_dict()
    if ckpt is None or ckpt.is_dir():  # DeepSpeed writes a directory of shards: compare what loads, skip the diff
        return {"export_keys": len(exported)}
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    diff = max((exported[k[len("policy."):]].float() - v.float()).abs().max().item()
               for k, v in state.items() if k.startswith("policy."))
    return {"export_keys": len(exported), "export_vs_ckpt": diff,
            "ref_keys_in_ckpt": sum(k.startswith("reference.") for k in state)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["fsdp", "deepspeed_zero2", "deepspeed_zero3", *VARIANTS],
                        help=f"strategy files of configs/strategy, or {sorted(VARIANTS)}")
    parser.add_argument("--recipes", nargs="+", default=["dpo", "grpo"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", default="-1", help="trainer.devices (default: every GPU)")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--chunk-size", type=int, default=0, help="model.logps_chunk_size (0: off)")
    parser.add_argument("--out", default="runs/gpu_strategies")
    parser.add_argument("--accelerator", default="gpu", help="cpu: a smoke test of this script with --strategies ddp")
    args = parser.parse_args()
    failed = False
    for strategy in args.strategies:
        _, needs, recipes, _ = VARIANTS.get(strategy, (None, "deepspeed" if "deepspeed" in strategy else None,
                                                       args.recipes, []))
        if needs and importlib.util.find_spec(needs) is None:
            print(f"{strategy:<16} skipped: {needs} is not installed (pip install {needs})", flush=True)
            continue
        for recipe in [r for r in args.recipes if r in recipes]:
            out = Path(args.out).resolve() / f"{strategy}_{recipe}"
            out.mkdir(parents=True, exist_ok=True)
            result = run(recipe, strategy, args, out)
            ok = result["ok"] and all(math.isfinite(x) for x in result.get("losses", [math.nan]))
            failed |= not ok
            error = result.pop("error", None)
            print(f"{strategy:<16} {recipe:<5} {'ok ' if ok else 'FAILED'} {json.dumps(result)}", flush=True)
            if error:
                print(error, flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
