"""The vllm engine against the reference: greedy completions equal HF ``generate``'s on the same weights (before and
after optimizer steps, which are pushed into the engine once per weights version), sampling log-probs equal the
training forward's, LoRA adapters are merged for generation, and what vLLM cannot run is one clear error."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import left_padded, prefer_token

from lit_align.errors import LitAlignError
from lit_align.generation import HFEngine, VLLMEngine
from lit_align.models import load_model
from lit_align.modules.online import completion_token_logps

pytestmark = pytest.mark.vllm

PROMPTS = ["<|user|>sort: 3 1 2\n<|assistant|>", "<|user|>hello\n<|assistant|>", "<|user|>9 8\n<|assistant|>"]


def generate(engine, model, tokenizer, num_samples: int = 2):
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    return engine.generate(model, prompt_ids, prompt_mask, num_samples, [tokenizer.eos_token_id],
                            tokenizer.pad_token_id)


def assert_same_rollout(a, b):
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.truncated, b.truncated)


def test_greedy_equals_hf_generate_and_follows_optimizer_steps(tiny_path, tokenizer):
    """The engine starts from the model's directory; the policy's weights are pushed when their version changes:
    after SGD steps its greedy completions are the trained policy's, not the checkpoint's."""
    model = load_model("builtin:tiny").train()
    version = 0
    vllm = VLLMEngine(max_new_tokens=12, temperature=0.0, weights_version=lambda: version)
    hf = HFEngine(max_new_tokens=12, temperature=0.0)
    before = generate(vllm, model, tokenizer)
    assert_same_rollout(before, generate(hf, model, tokenizer))
    pushes = vllm.engine.pushes
    generate(vllm, model, tokenizer)
    assert vllm.engine.pushes == pushes, "same weights version: nothing pushed"

    target = prefer_token(model, tokenizer, PROMPTS, "7")  # the digit 7 after each prompt
    version = 3
    after = generate(vllm, model, tokenizer)
    assert vllm.engine.pushes == pushes + 1
    assert_same_rollout(after, generate(hf, model, tokenizer))
    assert not torch.equal(after.completion_ids, before.completion_ids)
    assert (after.completion_ids[:, 0] == target).all()


def test_sampling_logps_are_the_training_forwards(tiny_path, tokenizer):
    """Temperature-scaled log-probs of the sampled tokens, as the training forward computes them (up to kernels);
    EOS kept and masked after; the same torch seed gives the same completions."""
    model = load_model("builtin:tiny").train()
    engine = VLLMEngine(max_new_tokens=16, temperature=0.7)
    torch.manual_seed(0)
    rollout = generate(engine, model, tokenizer, num_samples=16)
    torch.manual_seed(0)
    assert_same_rollout(rollout, generate(engine, model, tokenizer, num_samples=16))
    assert rollout.completion_ids.shape[0] == 48
    assert rollout.truncated.any() and not rollout.truncated.all(), "some rows end at EOS, others run to the cap"
    lengths = rollout.completion_mask.sum(1)
    ended = (~rollout.truncated).nonzero().flatten()
    assert (rollout.completion_ids[ended, lengths[ended] - 1] == tokenizer.eos_token_id).all()
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    forward, _ = completion_token_logps(model, prompt_ids.repeat_interleave(16, 0),
                                        prompt_mask.repeat_interleave(16, 0), rollout.completion_ids,
                                        rollout.completion_mask, temperature=0.7)
    torch.testing.assert_close(rollout.logps, forward.detach(), atol=1e-4, rtol=0)
    assert (rollout.logps[rollout.completion_mask == 0] == 0).all()


def test_top_p_returns_no_logps(tiny_path, tokenizer):
    """vLLM's log-probs are of the filtered distribution; the trainer's are not: none are returned."""
    rollout = generate(VLLMEngine(max_new_tokens=4, top_p=0.9), load_model("builtin:tiny"), tokenizer)
    assert rollout.logps is None and rollout.completion_ids.shape[0] == 6


def test_lora_is_merged_for_generation(tiny_path, tokenizer):
    """A PeftModel's greedy completions in vLLM are the adapted model's; the policy's weights are left as they were."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    policy = get_peft_model(load_model("builtin:tiny"), config)
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    vllm = VLLMEngine(max_new_tokens=12, temperature=0.0)
    rollout = generate(vllm, policy, tokenizer)
    assert_same_rollout(rollout, generate(HFEngine(max_new_tokens=12, temperature=0.0), policy, tokenizer))
    with policy.disable_adapter():
        base = generate(HFEngine(max_new_tokens=12, temperature=0.0), policy, tokenizer)
    assert not torch.equal(rollout.completion_ids, base.completion_ids), "the adapters change the completions"
    assert all(torch.equal(v, state[k]) for k, v in policy.state_dict().items())


def test_what_vllm_cannot_run_is_one_error(tiny_path, tokenizer):
    """vLLM's own refusal (sleep mode needs a GPU) comes back as one LitAlignError line naming the engine."""
    engine = VLLMEngine(max_new_tokens=4, enable_sleep_mode=True)
    with pytest.raises(LitAlignError, match=r"model.engine 'vllm' could not start on .*tiny") as info:
        generate(engine, load_model("builtin:tiny"), tokenizer)
    assert "\n" not in str(info.value)


def test_structured_outputs_regex_and_sampling_options_reach_vllm(tiny_path, tokenizer):
    """``vllm_structured_outputs_regex`` constrains every completion; min_p / repetition_penalty are accepted by
    vLLM's SamplingParams (and switch the trainer's log-probs off: they are no longer the training distribution's)."""
    model = load_model("builtin:tiny").train()
    digits = VLLMEngine(max_new_tokens=6, temperature=1.0, structured_outputs_regex=r"[0-9]{3}")
    rollout = generate(digits, model, tokenizer)
    texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    assert all(len(t.strip()) == 3 and t.strip().isdigit() for t in texts), texts
    penalized = VLLMEngine(max_new_tokens=6, temperature=1.0, min_p=0.05, repetition_penalty=1.3)
    assert generate(penalized, model, tokenizer).logps is None


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def test_engines_of_one_process_leave_the_launcher_variables_alone(tiny_path, tokenizer, monkeypatch):
    """vLLM's first engine makes a process group of one; a second engine (other settings) must not read it as a
    trainer's and export LOCAL_RANK: a DDP run started from this process would take itself for externally launched
    and wait for ranks it never starts."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    model = load_model("builtin:tiny").eval()
    first = generate(VLLMEngine(max_new_tokens=4, temperature=0.0), model, tokenizer)
    second = generate(VLLMEngine(max_new_tokens=4, temperature=0.0, max_model_length=64), model, tokenizer)
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
    assert_same_rollout(first, second)
    assert {name: os.environ.get(name) for name in LAUNCHER_VARIABLES} == dict.fromkeys(LAUNCHER_VARIABLES)
