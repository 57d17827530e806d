"""The native engine: greedy decoding equal to transformers' ``generate`` token for token (Llama, Qwen2, GPT-NeoX;
sdpa and eager; left-padded batches), sampling log-probs equal to a fresh forward's, EOS handling, rows that ended
leaving the batch, sharded ranks decoding together, and GRPO training and validation with ``engine: native``.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import fit, left_padded
from tiny_models import ARCHITECTURES, PROMPTS, tiny_random

from lit_align.data import PromptDataModule
from lit_align.errors import LitAlignError
from lit_align.generation import ENGINES, HFEngine, NativeEngine, native
from lit_align.generation.cache import SlotCache
from lit_align.modules.grpo import GRPOModule
from lit_align.modules.online import completion_token_logps
from numerics import TINY_TERMS, assert_rounding_close

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`


def test_the_cache_goes_under_the_forwards_own_name(tokenizer):
    """transformers renamed the forward's ``past_key_values`` to ``cache`` (5.20); a forward given the other name
    would build a cache of its own and ignore the engine's (``make test-vllm`` runs these tests on 5.19)."""
    from lit_align.capabilities import cache_keyword, forward_parameters

    for arch in ARCHITECTURES:
        model = ARCHITECTURES[arch](tokenizer, "sdpa")
        assert cache_keyword(model) in forward_parameters(model)


# -- against transformers' generate ----------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_equals_hf_generate_token_for_token(arch, attn, tokenizer, tiny_path):
    model = ARCHITECTURES[arch](tokenizer, attn)
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    kwargs = dict(eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    hf = HFEngine(max_new_tokens=12, temperature=0.0).generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    native = NativeEngine(max_new_tokens=12, temperature=0.0).generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    assert native.completion_ids.tolist() == hf.completion_ids.tolist()
    assert native.completion_mask.tolist() == hf.completion_mask.tolist()
    assert native.truncated.tolist() == hf.truncated.tolist()
    assert native.logps is None and model.training


@pytest.mark.parametrize("penalty", [1.5, 3.0])
def test_greedy_with_a_repetition_penalty_equals_hf_generate(penalty, tokenizer):
    """The penalty over each row's prompt and generated tokens, as transformers' processor applies it. The prompts
    are unpadded: transformers' processor also counts a left-padded prompt's pad tokens (the padded input_ids),
    lit_align's only its real tokens, as vLLM does."""
    model = ARCHITECTURES["llama"](tokenizer, "sdpa")
    prompt_ids, prompt_mask = left_padded(tokenizer, [PROMPTS[0]] * 2)
    kwargs = dict(eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    settings = dict(max_new_tokens=16, temperature=0.0, repetition_penalty=penalty)
    hf = HFEngine(**settings).generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    native = NativeEngine(**settings, eos_check_every=3).generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    assert native.completion_ids.tolist() == hf.completion_ids.tolist()
    plain = HFEngine(max_new_tokens=16, temperature=0.0).generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    assert plain.completion_ids.tolist() != hf.completion_ids.tolist()  # the penalty changed the completions


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sampling_logps_equal_a_fresh_forward(arch, temperature, tokenizer, eos_heavy_model):
    """GRPO's old log-probs come from here: they must be the training forward's (fp32), top-k/top-p or not."""
    model = eos_heavy_model if arch == "llama" else tiny_random("qwen2", len(tokenizer), init=0.05,
                                                               num_key_value_heads=2)
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    torch.manual_seed(0)
    engine = NativeEngine(max_new_tokens=8, temperature=temperature, top_k=20, top_p=0.95)
    rollout = engine.generate(model, prompt_ids, prompt_mask, 4, eos_token_ids=[tokenizer.eos_token_id],
                               pad_token_id=tokenizer.pad_token_id)
    assert rollout.logps.dtype == torch.float32 and rollout.completion_ids.shape[0] == len(PROMPTS) * 4
    logps, _ = completion_token_logps(model, prompt_ids.repeat_interleave(4, 0), prompt_mask.repeat_interleave(4, 0),
                                      rollout.completion_ids, rollout.completion_mask, temperature)
    mask = rollout.completion_mask.bool()
    assert_rounding_close(rollout.logps[mask], logps[mask], terms=TINY_TERMS)  # decode steps against one forward
    assert (rollout.logps[~mask] == 0).all()
    logps.sum().backward()  # the rollout's tensors are ordinary tensors (not inference-mode ones): autograd takes them


SHARED = ["sort 31:", "sort 4159:", "sort 26:", "sort 5358979:"]  # "sort " in common (a chat template's header)


def _prefilled_tokens(model) -> list[int]:
    """Hooks the embedding: the token count of every forward through the model (the prefill's; decode steps of the
    fast path read the embedding weight directly)."""
    fed: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: fed.append(args[0].numel()))
    return fed


@pytest.mark.parametrize("num_samples", [1, 3])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_prefix_every_prompt_shares_is_prefilled_once(arch, num_samples, tokenizer):
    """Chat prompts start alike (system prompt, template header): that prefix goes through the model once, its keys
    and values copied into every row, then the prompts' own tokens packed in one row (sdpa on CPU: no padding
    computed); greedy tokens still equal ``generate``'s, sampled log-probs a fresh forward's."""
    model = ARCHITECTURES[arch](tokenizer, "sdpa")
    prompt_ids, prompt_mask = left_padded(tokenizer, SHARED)
    kwargs = dict(eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    hf = HFEngine(max_new_tokens=10, temperature=0.0).generate(model, prompt_ids, prompt_mask, num_samples, **kwargs)
    fed = _prefilled_tokens(model)
    native = NativeEngine(max_new_tokens=10, temperature=0.0)
    greedy = native.generate(model, prompt_ids, prompt_mask, num_samples, **kwargs)
    assert greedy.completion_ids.tolist() == hf.completion_ids.tolist()
    shared = len(tokenizer("sort ")["input_ids"])  # BOS (if any) and "sort "
    width = prompt_ids.shape[1]
    assert native.last_stats.shared_prefix == shared
    assert fed[:2] == [shared, int(prompt_mask.sum()) - len(SHARED) * shared]  # the prefix once, then the rest
    assert width - shared > min(len(tokenizer(p)["input_ids"]) for p in SHARED) - shared  # (there was padding)

    torch.manual_seed(0)
    rollout = NativeEngine(max_new_tokens=8).generate(model, prompt_ids, prompt_mask, num_samples, **kwargs)
    logps, _ = completion_token_logps(model, prompt_ids.repeat_interleave(num_samples, 0),
                                      prompt_mask.repeat_interleave(num_samples, 0), rollout.completion_ids,
                                      rollout.completion_mask, 1.0)
    mask = rollout.completion_mask.bool()
    assert_rounding_close(rollout.logps[mask], logps[mask], terms=TINY_TERMS)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_prompts_sharing_no_prefix_are_prefilled_in_one_forward(attn, tokenizer):
    """Packed, the real tokens only, where the attention computes only what its mask lets through (sdpa on CPU);
    padded elsewhere."""
    model = ARCHITECTURES["llama"](tokenizer, attn)
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)  # "s" is a whole prompt: nothing left to share
    fed = _prefilled_tokens(model)
    engine = NativeEngine(max_new_tokens=2, temperature=0.0)
    engine.generate(model, prompt_ids, prompt_mask, 2, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=0)
    expected = int(prompt_mask.sum()) if attn == "sdpa" else prompt_ids.numel()
    assert engine.last_stats.shared_prefix == 0 and fed == [expected] and prompt_mask.sum() < prompt_ids.numel()


@pytest.mark.parametrize("prompts", [SHARED, PROMPTS])
def test_a_packed_prefill_fills_the_cache_as_the_padded_one(prompts, monkeypatch, tokenizer):
    """The same logits after each prompt and the same keys and values in each of a prompt's rows as the padded
    prefill, up to float rounding; zeros where the padded one put its padding tokens' (never attended to)."""
    model = tiny_random("qwen2", len(tokenizer), init=0.05, num_key_value_heads=2).eval()  # GQA, biased q/k/v
    prompt_ids, prompt_mask = left_padded(tokenizer, prompts)
    runs = {}
    for packed in (True, False):
        if not packed:
            monkeypatch.setattr(native, "skips_hidden", lambda model, device: False)
        cache = SlotCache(len(prompts) * 2, prompt_ids.shape[1] + 4)
        with torch.no_grad():
            logits, cache_mask, shared = native._prefill(model, prompt_ids, prompt_mask.bool(), cache, copies=2)
        runs[packed] = logits, cache_mask, [(layer.keys[:, :, :layer.length], layer.values[:, :, :layer.length])
                                            for layer in cache.layers]
    (logits, cache_mask, layers), (padded_logits, padded_mask, padded_layers) = runs[True], runs[False]
    assert torch.equal(cache_mask, padded_mask)
    assert_rounding_close(logits, padded_logits, terms=TINY_TERMS)
    real = cache_mask.repeat_interleave(2, 0)[:, None, :, None]  # [rows, 1, columns, 1]
    for (keys, values), (padded_keys, padded_values) in zip(layers, padded_layers):
        for ours, theirs in ((keys, padded_keys), (values, padded_values)):
            assert_rounding_close(ours * real, theirs * real, terms=TINY_TERMS)
            assert (ours * ~real == 0).all()


# -- EOS and the rows that ended ---------------------------------------------------------------------------------------
def test_eos_mask_through_first_eos_pad_after_rows_ending_early(eos_heavy_model, tokenizer):
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    eos = tokenizer.eos_token_id
    torch.manual_seed(1)
    rollout = NativeEngine(max_new_tokens=10).generate(eos_heavy_model, prompt_ids, prompt_mask, 4,
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
def test_rows_that_ended_leave_the_batch_and_the_results_stay_exact(fast, eos_heavy_model, tokenizer):
    """Rows that ended are dropped from the decoded batch (with their cache rows): greedy tokens still equal HF
    ``generate``'s, and sampled log-probs still equal a fresh forward's, in the fast decode step and through the
    model's forward alike."""
    # greedy: with these EOS ids the random model's rows end after 10, 13, 2 tokens, or never (16): known by HF
    model = tiny_random("llama", len(tokenizer))
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    kwargs = dict(eos_token_ids=[20, 2], pad_token_id=tokenizer.pad_token_id)
    hf = HFEngine(max_new_tokens=16, temperature=0.0).generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    assert hf.completion_mask.sum(1).tolist() == [10, 10, 13, 13, 16, 16, 2, 2]
    greedy = NativeEngine(max_new_tokens=16, temperature=0.0, fast_decode=fast, eos_check_every=2)
    native = greedy.generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    assert native.completion_ids.tolist() == hf.completion_ids.tolist()
    assert native.truncated.tolist() == hf.truncated.tolist()
    assert greedy.last_stats.fast is fast
    widths = greedy.last_stats.rows[1:]  # rows fed to each decode step
    assert sorted(set(widths), reverse=True) == [8, 6, 4, 2]  # dropped at the checks after tokens 2, 10 and 14

    # sampled: the log-probs of what was drawn are still the model's
    torch.manual_seed(0)
    kwargs["eos_token_ids"] = [tokenizer.eos_token_id]
    engine = NativeEngine(max_new_tokens=16, fast_decode=fast, eos_check_every=2)
    rollout = engine.generate(eos_heavy_model, prompt_ids, prompt_mask, 4, **kwargs)
    assert engine.last_stats.fast is fast and min(engine.last_stats.rows[1:]) < 16
    fresh, _ = completion_token_logps(eos_heavy_model, prompt_ids.repeat_interleave(4, 0),
                                      prompt_mask.repeat_interleave(4, 0), rollout.completion_ids,
                                      rollout.completion_mask, 1.0)
    mask = rollout.completion_mask.bool()
    assert_rounding_close(rollout.logps[mask], fresh[mask], terms=TINY_TERMS)
    assert (rollout.logps[~mask] == 0).all() and (rollout.completion_ids[~mask] == tokenizer.pad_token_id).all()


def test_all_rows_ending_early_stop_the_loop_and_several_eos_ids(eos_heavy_model, tokenizer):
    """Every row has ended within a few tokens: the loop stops at its next check, the result is as wide as the
    longest row. A second EOS id ends rows too."""
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    torch.manual_seed(0)
    never = NativeEngine(max_new_tokens=40).generate(eos_heavy_model, prompt_ids, prompt_mask, 2,
                                                      eos_token_ids=[tokenizer.eos_token_id], pad_token_id=0)
    engine = NativeEngine(max_new_tokens=40)
    everything = list(range(len(tokenizer)))  # every token ends a row: each row is one token long
    rollout = engine.generate(eos_heavy_model, prompt_ids, prompt_mask, 2, eos_token_ids=everything, pad_token_id=0)
    assert rollout.completion_ids.shape == (8, 1) and rollout.completion_mask.all() and not rollout.truncated.any()
    assert engine.eos_check_every == 8  # the default
    assert engine.last_stats.steps == engine.eos_check_every  # tokens sampled up to the first check, then it stops
    assert never.completion_ids.shape[1] == never.completion_mask.sum(1).max()


def test_sharded_ranks_decode_until_every_rank_has_ended(eos_heavy_model, tokenizer):
    """Under FSDP / ZeRO-3 every forward all-gathers weights: a rank whose rows have all ended must keep decoding (its
    rows, ended, emit pad) until the other ranks have ended too, so the ranks agree at each check (by default an
    all-reduce). Here the other rank still decodes at the first two checks. Sharded weights decode through the
    model's forward (``LlamaDecodeStep`` refuses them)."""
    calls = []

    def sync(decoding: bool) -> bool:  # this rank's flag or the other rank's: decoding for two checks
        calls.append(decoding)
        return decoding or len(calls) <= 2

    widths = []
    hook = eos_heavy_model.register_forward_pre_hook(lambda m, args, kw: widths.append(len(kw["input_ids"])),
                                                     with_kwargs=True)
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    everything = list(range(len(tokenizer)))  # every row ends at its first token
    engine = NativeEngine(max_new_tokens=40, fast_decode=False, sync=sync)
    try:
        rollout = engine.generate(eos_heavy_model, prompt_ids, prompt_mask, 2, eos_token_ids=everything,
                                   pad_token_id=0)
    finally:
        hook.remove()
    assert calls == [False, False, False]  # this rank had ended at every check; the loop left at the third
    assert widths[1:] == [8] * (3 * engine.eos_check_every - 1)  # decoding on, none of its rows dropped
    assert engine.last_stats.rows == [8] * (3 * engine.eos_check_every)
    assert rollout.completion_ids.shape == (8, 1) and rollout.completion_mask.all()


def test_unsupported_models_are_refused(tokenizer):
    model = tiny_random("llama", len(tokenizer), attn="eager")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(LitAlignError, match="engine 'hf'"):
        NativeEngine().generate(model, torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long), 2, [2], 0)
    with pytest.raises(LitAlignError, match="top_p"):
        NativeEngine(top_p=0.0)


# -- in GRPO -----------------------------------------------------------------------------------------------------------
def test_grpo_trains_and_validates_with_the_native_engine(tmp_path, tiny_path):
    assert ENGINES["native"] is NativeEngine
    digits = [f"{(i * 7919) % 100000:05d}"[: 3 + i % 3] for i in range(16)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"sort {d}:", "answer": "".join(sorted(d))}) + "\n" for d in digits))
    torch.manual_seed(0)
    module = GRPOModule(model="builtin:tiny", reward_funcs=["lit_align.rewards.sort_accuracy"], max_completion_length=4,
                        learning_rate=1e-3, engine="native", num_generations=2, steps_per_generation=2)
    assert isinstance(module.rollouts.engine, NativeEngine) and isinstance(module.rollouts.greedy_engine, NativeEngine)
    data = PromptDataModule(path=str(path), val_path=str(path), val_split="train", batch_size=4, val_batch_size=8)
    trainer = fit(module, data, max_steps=4, limit_val_batches=1, val_check_interval=4)
    assert module.generation_rounds == 2
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and "val/reward" in metrics
    assert metrics["train/completions/mean_length"] <= 4


def test_auto_runs_native_where_it_decodes_the_model_else_hf(tokenizer):
    """The default engine: native for a full-attention model under sdpa on CPU (the very samples native draws),
    hf for a model with sliding-window layers and whenever generate's own keywords are given."""
    from lit_align.generation import AutoEngine

    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    kwargs = dict(eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    model = ARCHITECTURES["llama"](tokenizer, "sdpa")
    auto = AutoEngine(max_new_tokens=6)
    torch.manual_seed(3)
    ours = auto.generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    torch.manual_seed(3)
    native = NativeEngine(max_new_tokens=6).generate(model, prompt_ids, prompt_mask, 2, **kwargs)
    assert auto.chosen == "native" and torch.equal(ours.completion_ids, native.completion_ids)
    windowed = tiny_random("qwen2", len(tokenizer), num_key_value_heads=2, use_sliding_window=True, sliding_window=64,
                           max_window_layers=1)
    auto.generate(windowed, prompt_ids, prompt_mask, 1, **kwargs)
    assert auto.chosen == "hf"
    with_kwargs = AutoEngine(max_new_tokens=6, generation_kwargs={"no_repeat_ngram_size": 2})
    with_kwargs.generate(model, prompt_ids, prompt_mask, 1, **kwargs)
    assert with_kwargs.chosen == "hf" and with_kwargs.native is None
