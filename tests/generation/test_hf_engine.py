"""The Hugging Face engine: completion masks, left-padded prompts, and sampling log-probs equal to a fresh forward's."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded
from tiny_models import PROMPTS

from lit_align.generation import HFEngine
from lit_align.models import load_model
from lit_align.modules.online import completion_token_logps
from numerics import TINY_TERMS, assert_rounding_close

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model("builtin:tiny").train()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logps_equal_a_fresh_forward(eos_heavy_model, tokenizer, temperature):
    """What GRPO's old log-probs come from: the engine's own log-probs must be the training forward's (fp32)."""
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    torch.manual_seed(0)
    engine = HFEngine(max_new_tokens=6, temperature=temperature)
    rollout = engine.generate(eos_heavy_model, prompt_ids, prompt_mask, 4, eos_token_ids=[tokenizer.eos_token_id],
                               pad_token_id=tokenizer.pad_token_id)
    n = len(PROMPTS) * 4
    assert rollout.completion_ids.shape[0] == n and rollout.logps.dtype == torch.float32
    assert rollout.truncated.any() and not rollout.truncated.all()  # both kinds of rows are exercised
    assert (rollout.completion_mask.sum(1) < rollout.completion_ids.shape[1]).any()

    # rows are num_samples consecutive samples per prompt: the prompts repeat_interleave'd line up with them
    logps, entropy = completion_token_logps(
        eos_heavy_model, prompt_ids.repeat_interleave(4, 0), prompt_mask.repeat_interleave(4, 0),
        rollout.completion_ids, rollout.completion_mask, temperature, with_entropy=True)
    mask = rollout.completion_mask.bool()
    assert_rounding_close(rollout.logps[mask], logps[mask], terms=TINY_TERMS)  # decode steps against one forward
    assert (rollout.logps[~mask] == 0).all()
    assert (entropy[mask] > 0).all()
    assert eos_heavy_model.training  # generate() put it in eval mode and back


def test_completions_are_masked_and_padded_after_eos(eos_heavy_model, tokenizer):
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    torch.manual_seed(1)
    rollout = HFEngine(max_new_tokens=6).generate(eos_heavy_model, prompt_ids, prompt_mask, 3,
                                                   eos_token_ids=[tokenizer.eos_token_id], pad_token_id=0)
    eos = tokenizer.eos_token_id
    for ids, mask, truncated in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist(),
                                    rollout.truncated.tolist()):
        length = sum(mask)
        assert mask == [1] * length + [0] * (len(mask) - length)
        if truncated:
            assert eos not in ids and length == len(ids)
        else:
            assert ids[length - 1] == eos and eos not in ids[: length - 1]
            assert ids[length:] == [0] * (len(ids) - length)  # pad after the EOS


def test_greedy_padded_batch_equals_each_prompt_alone(model, tokenizer):
    """Left padding must not change what the model generates (attention mask and positions handled)."""
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    greedy = HFEngine(max_new_tokens=5, temperature=0.0)
    kwargs = dict(eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    batch = greedy.generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    assert batch.logps is None  # greedy: no sampling distribution
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        alone = greedy.generate(model, ids, torch.ones_like(ids), 1, **kwargs)
        width = alone.completion_ids.shape[1]
        for row in (2 * i, 2 * i + 1):  # both samples of prompt i, identical under greedy decoding
            got = batch.completion_ids[row]
            assert got[:width].tolist() == alone.completion_ids[0].tolist()
            assert (got[width:] == tokenizer.pad_token_id).all()


def test_top_k_one_sampling_is_greedy(model, tokenizer):
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    kwargs = dict(eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    greedy = HFEngine(max_new_tokens=5, temperature=0.0).generate(model, prompt_ids, prompt_mask, 1, **kwargs)
    torch.manual_seed(0)
    top1 = HFEngine(max_new_tokens=5, temperature=1.5, top_k=1).generate(model, prompt_ids, prompt_mask, 1, **kwargs)
    assert top1.completion_ids.tolist() == greedy.completion_ids.tolist()
    torch.manual_seed(0)
    free = HFEngine(max_new_tokens=5, temperature=1.5).generate(model, prompt_ids, prompt_mask, 1, **kwargs)
    assert free.completion_ids.tolist() != greedy.completion_ids.tolist()  # sampling really samples


def test_generation_kwargs_reach_generate_and_override_the_settings(model, tokenizer):
    """TRL's ``generation_kwargs``: ``top_k: 1`` over a free sampler makes it greedy; ``suppress_tokens`` (a generate
    keyword lit_align has no option for) keeps a token out of every completion."""
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    kwargs = dict(eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    greedy = HFEngine(max_new_tokens=5, temperature=0.0).generate(model, prompt_ids, prompt_mask, 1, **kwargs)
    torch.manual_seed(0)
    top1 = HFEngine(max_new_tokens=5, temperature=1.5, generation_kwargs={"top_k": 1}).generate(
        model, prompt_ids, prompt_mask, 1, **kwargs)
    assert top1.completion_ids.tolist() == greedy.completion_ids.tolist()
    first = int(greedy.completion_ids[0, 0])
    suppressed = HFEngine(max_new_tokens=5, temperature=0.0, generation_kwargs={"suppress_tokens": [first]}).generate(
        model, prompt_ids, prompt_mask, 1, **kwargs)
    assert first not in suppressed.completion_ids[suppressed.completion_mask.bool()].tolist()
