"""The native sampler: the top-k/top-p filter by hand, greedy decoding equal to transformers' ``generate`` token for
token (Llama, Qwen2, GPT-NeoX; sdpa and eager; left-padded batches), sampling log-probs equal to a fresh forward's, EOS
handling, and GRPO training and validation with ``engine: native``.
"""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from helpers import left_padded
from transformers import AutoConfig, AutoModelForCausalLM

from lit_align import generation
from lit_align.data import PromptDataModule
from lit_align.errors import LitAlignError
from lit_align.generation import HFSampler, NativeSampler, filter_logits, sample_next
from lit_align.models import load_model
from lit_align.modules.grpo import SAMPLERS, GRPOModule, completion_token_logps
from numerics import TINY_TERMS, assert_rounding_close

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

PROMPTS = ["sort 1:", "sort 123456:", "sort 42:", "s"]  # different lengths: the batch is left-padded
NEG = float("-inf")


def tiny_random(kind: str, vocab_size: int, attn: str = "sdpa", init: float = 0.2, **extra):
    """A two-layer random model of another architecture, built from a config (saved nowhere). A larger init than the
    default makes the logits peaked, so greedy decoding has no near-ties for float noise to flip."""
    config = AutoConfig.for_model(kind, vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=init, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    return model.train()


ARCHITECTURES = {
    "llama": lambda tok, attn: load_model("builtin:tiny", attn_implementation=attn).train(),
    "qwen2": lambda tok, attn: tiny_random("qwen2", len(tok), attn, num_key_value_heads=2),  # GQA, qkv bias
    "gpt_neox": lambda tok, attn: tiny_random("gpt_neox", len(tok), attn, rotary_pct=0.5),  # partial rotary
}


# -- the filter, by hand -------------------------------------------------------------------------------------------
def test_filter_logits_top_k_by_hand():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [5.0, 5.0, 1.0, 5.0]])
    before = logits.clone()
    assert filter_logits(logits, top_k=2).tolist() == [[NEG, 3.0, 2.0, NEG], [5.0, 5.0, NEG, 5.0]]  # ties kept
    assert filter_logits(logits, top_k=1).tolist() == [[NEG, 3.0, NEG, NEG], [5.0, 5.0, NEG, 5.0]]
    assert filter_logits(logits, top_k=0).tolist() == logits.tolist()  # off
    assert filter_logits(logits, top_k=9).tolist() == logits.tolist()  # more than the vocabulary: off
    assert torch.equal(logits, before)  # pure


def test_filter_logits_top_p_by_hand():
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1]])
    logits = probs.log()
    keep = lambda **kw: (filter_logits(logits, **kw) > NEG).int().tolist()[0]  # noqa: E731
    # (no top_p exactly at a cumulative probability: there the softmax's last bit, which depends on the CPU's kernels,
    # would decide)
    assert keep(top_p=0.45) == [0, 1, 0, 0]  # the top token alone holds 0.5
    assert keep(top_p=0.55) == [0, 1, 1, 0]  # 0.5 < 0.55: the next one is needed
    assert keep(top_p=0.85) == [0, 1, 1, 1] or keep(top_p=0.85) == [1, 1, 1, 0]  # 0.8 < 0.85: one of the 0.1 ties
    assert keep(top_p=0.01) == [0, 1, 0, 0]  # the most likely token is always kept
    assert keep(top_p=1.0) == [1, 1, 1, 1]
    # top-k first, then top-p on what top-k kept: renormalized [0.5, 0.3] / 0.8 = [0.625, 0.375]
    assert keep(top_k=2, top_p=0.6) == [0, 1, 0, 0]
    assert keep(top_k=2, top_p=0.7) == [0, 1, 1, 0]
    kept = filter_logits(logits, top_p=0.55)  # the kept logits themselves are untouched
    assert kept[0, 1] == logits[0, 1] and kept[0, 2] == logits[0, 2]


def test_filter_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    for top_k, top_p in [(5, 1.0), (0, 0.9), (10, 0.5), (0, 0.3)]:
        expected = logits
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(None, expected)
        assert torch.equal(filter_logits(logits, top_k, top_p) > NEG, expected > NEG), (top_k, top_p)


def test_sampling_stays_in_the_allowed_set_with_the_right_frequencies():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).expand(20000, 5)
    tokens, logps = sample_next(logits, 1.0, top_k=2)
    assert set(tokens.tolist()) == {0, 1}
    assert abs((tokens == 0).float().mean().item() - math.e / (math.e + 1)) < 0.02  # softmax over the kept two
    # log-probs are those of the unfiltered distribution (HFSampler's definition), whatever the filter
    torch.testing.assert_close(logps, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens, _ = sample_next(probs.log().expand(20000, 4), 0.5, top_p=0.9)  # T=0.5: [.69, .25, .06, .01]
    assert set(tokens.tolist()) == {0, 1}  # 0.69 + 0.25 >= 0.9
    sharp = (probs.log() / 0.5).softmax(-1)[:2]
    assert abs((tokens == 0).float().mean().item() - (sharp[0] / sharp.sum()).item()) < 0.02

    tokens, logps = sample_next(torch.tensor([[0.0, 3.0, 1.0]]), 0.0)
    assert tokens.tolist() == [1] and logps is None  # greedy


# -- against transformers' generate ----------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_equals_hf_generate_token_for_token(arch, attn, tokenizer, tiny_path):
    model = ARCHITECTURES[arch](tokenizer, attn)
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    kwargs = dict(eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    hf = HFSampler(max_new_tokens=12, temperature=0.0).generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    native = NativeSampler(max_new_tokens=12, temperature=0.0).generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    assert native.completion_ids.tolist() == hf.completion_ids.tolist()
    assert native.completion_mask.tolist() == hf.completion_mask.tolist()
    assert native.truncated.tolist() == hf.truncated.tolist()
    assert native.logps is None and model.training


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sampling_logps_equal_a_fresh_forward(arch, temperature, tokenizer, eos_heavy_model):
    """GRPO's old log-probs come from here: they must be the training forward's (fp32), top-k/top-p or not."""
    model = eos_heavy_model if arch == "llama" else tiny_random("qwen2", len(tokenizer), init=0.05,
                                                               num_key_value_heads=2)
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    torch.manual_seed(0)
    sampler = NativeSampler(max_new_tokens=8, temperature=temperature, top_k=20, top_p=0.95)
    rollout = sampler.generate(model, prompt_ids, prompt_mask, 4, eos_token_ids=[tokenizer.eos_token_id],
                               pad_token_id=tokenizer.pad_token_id)
    assert rollout.logps.dtype == torch.float32 and rollout.completion_ids.shape[0] == len(PROMPTS) * 4
    logps, _ = completion_token_logps(model, prompt_ids.repeat_interleave(4, 0), prompt_mask.repeat_interleave(4, 0),
                                      rollout.completion_ids, rollout.completion_mask, temperature)
    mask = rollout.completion_mask.bool()
    assert_rounding_close(rollout.logps[mask], logps[mask], terms=TINY_TERMS)  # decode steps against one forward
    assert (rollout.logps[~mask] == 0).all()
    logps.sum().backward()  # the rollout's tensors are ordinary tensors (not inference-mode ones): autograd takes them


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_llama_decode_step_equals_decoding_through_the_forward(arch, tokenizer, monkeypatch):
    """The fast decode step (Llama-like models) samples the same tokens with the same log-probs as decoding through
    the model's forward; other architectures always decode through the forward."""
    model = ARCHITECTURES[arch](tokenizer, "sdpa")
    assert generation._LlamaDecodeStep.supports(model) == (arch != "gpt_neox")
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    kwargs = dict(eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    rollouts = {}
    for fast in (True, False):
        monkeypatch.setattr(NativeSampler, "FAST_DECODE", fast)
        torch.manual_seed(0)
        rollouts[fast] = NativeSampler(max_new_tokens=10).generate(model, prompt_ids, prompt_mask, 3, **kwargs)
    assert rollouts[True].completion_ids.tolist() == rollouts[False].completion_ids.tolist()
    assert_rounding_close(rollouts[True].logps, rollouts[False].logps, terms=TINY_TERMS)


def test_eos_mask_through_first_eos_pad_after_rows_ending_early(eos_heavy_model, tokenizer):
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    eos = tokenizer.eos_token_id
    torch.manual_seed(1)
    rollout = NativeSampler(max_new_tokens=10).generate(eos_heavy_model, prompt_ids, prompt_mask, 4,
                                                        eos_token_ids=[eos], pad_token_id=0)
    lengths = rollout.completion_mask.sum(1).tolist()
    assert min(lengths) < max(lengths)  # rows end at different steps
    for ids, mask, truncated, logps in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist(),
                                           rollout.truncated.tolist(), rollout.logps.tolist()):
        length = sum(mask)
        assert mask == [1] * length + [0] * (len(mask) - length)
        assert all(lp < 0 for lp in logps[:length]) and all(lp == 0 for lp in logps[length:])
        if truncated:
            assert eos not in ids and length == len(ids) == 10
        else:
            assert ids[length - 1] == eos and eos not in ids[: length - 1]
            assert ids[length:] == [0] * (len(ids) - length)  # pad after the EOS


@pytest.mark.parametrize("fast", [True, False])
def test_rows_that_ended_leave_the_batch_and_the_results_stay_exact(fast, eos_heavy_model, tokenizer, monkeypatch):
    """Rows that ended are dropped from the decoded batch (with their cache rows): greedy tokens still equal HF
    ``generate``'s, and sampled log-probs still equal a fresh forward's, in the fast decode step and through the
    model's forward alike."""
    monkeypatch.setattr(NativeSampler, "FAST_DECODE", fast)
    monkeypatch.setattr(NativeSampler, "EOS_CHECK_EVERY", 2)
    widths = []  # rows fed to each decode step

    def spy(model):
        if fast:
            step = generation._LlamaDecodeStep.__call__
            monkeypatch.setattr(generation._LlamaDecodeStep, "__call__",
                                lambda self, tokens, *a: widths.append(len(tokens)) or step(self, tokens, *a))
        else:  # the prefill is recorded too
            model.register_forward_pre_hook(lambda m, args, kw: widths.append(len(kw["input_ids"])), with_kwargs=True)
        return model

    # greedy: with these EOS ids the random model's rows end after 10, 13, 2 tokens, or never (16): known by HF
    model = spy(tiny_random("llama", len(tokenizer)))
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    kwargs = dict(eos_token_ids=[20, 2], pad_token_id=tokenizer.pad_token_id)
    hf = HFSampler(max_new_tokens=16, temperature=0.0).generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    assert hf.completion_mask.sum(1).tolist() == [10, 10, 13, 13, 16, 16, 2, 2]
    native = NativeSampler(max_new_tokens=16, temperature=0.0).generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    assert native.completion_ids.tolist() == hf.completion_ids.tolist()
    assert native.truncated.tolist() == hf.truncated.tolist()
    widths = widths[1:] if not fast else widths
    assert sorted(set(widths), reverse=True) == [8, 6, 4, 2]  # dropped at the checks after tokens 2, 10 and 14

    # sampled: the log-probs of what was drawn are still the model's
    widths.clear()
    spy(eos_heavy_model)
    torch.manual_seed(0)
    kwargs["eos_token_ids"] = [tokenizer.eos_token_id]
    rollout = NativeSampler(max_new_tokens=16).generate(eos_heavy_model, prompt_ids, prompt_mask, 4, **kwargs)
    assert min(widths) < 16
    fresh, _ = completion_token_logps(eos_heavy_model, prompt_ids.repeat_interleave(4, 0),
                                      prompt_mask.repeat_interleave(4, 0), rollout.completion_ids,
                                      rollout.completion_mask, 1.0)
    mask = rollout.completion_mask.bool()
    assert_rounding_close(rollout.logps[mask], fresh[mask], terms=TINY_TERMS)
    assert (rollout.logps[~mask] == 0).all() and (rollout.completion_ids[~mask] == tokenizer.pad_token_id).all()


def test_all_rows_ending_early_stop_the_loop_and_several_eos_ids(eos_heavy_model, tokenizer, monkeypatch):
    """Every row has ended within a few tokens: the loop stops at its next check, the result is as wide as the
    longest row. A second EOS id ends rows too."""
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    torch.manual_seed(0)
    never = NativeSampler(max_new_tokens=40).generate(eos_heavy_model, prompt_ids, prompt_mask, 2,
                                                      eos_token_ids=[tokenizer.eos_token_id], pad_token_id=0)
    steps = []
    sample_next = generation.sample_next
    monkeypatch.setattr(generation, "sample_next", lambda *args, **kwargs: steps.append(1) or sample_next(*args, **kwargs))
    everything = list(range(len(tokenizer)))  # every token ends a row: each row is one token long
    rollout = NativeSampler(max_new_tokens=40).generate(eos_heavy_model, prompt_ids, prompt_mask, 2,
                                                        eos_token_ids=everything, pad_token_id=0)
    assert rollout.completion_ids.shape == (8, 1) and rollout.completion_mask.all() and not rollout.truncated.any()
    assert len(steps) == NativeSampler.EOS_CHECK_EVERY  # tokens sampled up to the first check, then the loop stops
    assert never.completion_ids.shape[1] == never.completion_mask.sum(1).max()


def test_unsupported_models_are_refused(tokenizer):
    model = tiny_random("llama", len(tokenizer), attn="eager")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(LitAlignError, match="engine 'hf'"):
        NativeSampler().generate(model, torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long), 2, [2], 0)
    with pytest.raises(LitAlignError, match="top_p"):
        NativeSampler(top_p=0.0)


# -- in GRPO -----------------------------------------------------------------------------------------------------------
def test_grpo_trains_and_validates_with_the_native_engine(tmp_path, tiny_path):
    assert SAMPLERS["native"] is NativeSampler
    digits = [f"{(i * 7919) % 100000:05d}"[: 3 + i % 3] for i in range(16)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"sort {d}:", "answer": "".join(sorted(d))}) + "\n" for d in digits))
    torch.manual_seed(0)
    module = GRPOModule(model="builtin:tiny", max_completion_length=4, learning_rate=1e-3, engine="native")
    assert isinstance(module.sampler, NativeSampler) and isinstance(module.greedy, NativeSampler)
    data = PromptDataModule(path=str(path), val_path=str(path), val_split="train", batch_size=4, num_generations=2,
                            steps_per_generation=2, val_batch_size=8)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                        val_check_interval=4, num_sanity_val_steps=0)
    trainer.fit(module, data)
    assert module.generation_rounds == 2
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and "val/reward" in metrics
    assert metrics["train/completions/mean_length"] <= 4


def test_a_zero_uniform_draw_cannot_pick_a_filtered_token(monkeypatch):
    """``torch.rand`` returns exactly 0 about once in 2**24 draws: with a single token kept (top-k 1, or top-p on a
    peaked step) that draw must still give the kept token, not a filtered one."""
    monkeypatch.setattr(torch, "rand_like", lambda x: torch.zeros_like(x))
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    for kwargs in ({"top_k": 1}, {"top_p": 0.5}):
        tokens, logps = sample_next(logits, 1.0, **kwargs)
        assert tokens.tolist() == [2]
        assert_rounding_close(logps, logits.log_softmax(-1)[:, 2], scale=5.0, terms=4)


def test_sharded_ranks_decode_until_every_rank_has_ended(eos_heavy_model, tokenizer, monkeypatch):
    """Under FSDP / ZeRO-3 every forward all-gathers weights: a rank whose rows have all ended must keep decoding (its
    rows, ended, emit pad) until the other ranks have ended too, so the ranks agree at each check by an all-reduce.
    Here the other rank still decodes at the first two checks."""
    calls = []

    def all_reduce(flag):  # this rank's flag plus the other rank's: decoding for two checks
        calls.append(float(flag))
        flag += 1.0 if len(calls) <= 2 else 0.0

    monkeypatch.setattr(generation, "_sharded", lambda model: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    widths = []
    eos_heavy_model.register_forward_pre_hook(lambda m, args, kw: widths.append(len(kw["input_ids"])), with_kwargs=True)
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    everything = list(range(len(tokenizer)))  # every row ends at its first token
    rollout = NativeSampler(max_new_tokens=40).generate(eos_heavy_model, prompt_ids, prompt_mask, 2,
                                                        eos_token_ids=everything, pad_token_id=0)
    assert calls == [0.0, 0.0, 0.0]  # this rank had ended at every check; the loop left at the third
    assert widths[1:] == [8] * (3 * NativeSampler.EOS_CHECK_EVERY - 1)  # decoding on, none of its rows dropped
    assert rollout.completion_ids.shape == (8, 1) and rollout.completion_mask.all()
