"""lit_align.layouts through lit_align.logps.layout_logps: every layout gives the plain padded batch's log-probs,
statistics and gradients (rule 3 of tests/numerics.py: the same formula in another order)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from torch.overrides import TorchFunctionMode

from lit_align.capabilities import supports_shared_prompt
from lit_align.data.preference import collate_pairs
from lit_align.layouts import (
    completions, packed_bins, packed_rows, packs_by_default, padded, pairs, right_aligned,
    MIN_SHARED_PREFIX, shared_prompt_completions, shared_prompt_pairs,
)
from lit_align.logps import layout_logps
from lit_align.models import load_model
from lit_align.modules.online import completion_token_logps
from numerics import TINY_TERMS, assert_rounding_close

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`


def completion_logps(model, batch, stats=(), chunk_size=None):
    """The plain ``[chosen; rejected]`` batch, padded."""
    layout = padded(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    return layout_logps(model, layout, stats, chunk_size)


class HeadRows(TorchFunctionMode):
    """Records the rows of every matmul against the LM head's weight (``nn.Linear`` or the chunked kernel's)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size, self.rows = vocab_size, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear and args[1].shape[0] == self.vocab_size:
            self.rows.append(args[0].numel() // args[0].shape[-1])
        return func(*args, **(kwargs or {}))


# -- GRPO: left-padded prompts and completions, padded or packed ------------------------------------------------------
def test_completion_logps_do_not_depend_on_left_padding(tokenizer, tiny_path):
    torch.manual_seed(0)
    model = load_model("builtin:tiny")
    prompts = [tokenizer("sort 123456:")["input_ids"], tokenizer("s")["input_ids"]]
    completions = torch.tensor([[20, 21, 2, 0], [22, 23, 24, 25]])
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batched, _ = completion_token_logps(model, ids, mask, completions, completion_mask, temperature=0.8)
    for i, p in enumerate(prompts):
        alone, _ = completion_token_logps(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long),
                                          completions[i : i + 1], completion_mask[i : i + 1], temperature=0.8)
        m = completion_mask[i].bool()
        assert_rounding_close(batched[i][m], alone[0][m], terms=TINY_TERMS)  # other padding, other kernels


def grpo_model(arch: str, attn: str, tokenizer):
    """The tiny Llama, or a tiny Qwen2 (GQA and q/k/v biases), in training mode."""
    if arch == "llama":
        model = load_model("builtin:tiny", attn_implementation=attn)
    else:
        config = AutoConfig.for_model("qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.train()


def assert_packed_equals_padded(model, prompt_ids, prompt_mask, completion_ids, completion_mask, chunk_size):
    """``completion_token_logps`` with ``padding_free`` gives the padded log-probs, entropy and gradients."""
    results = []
    for packed in (False, True):
        model.zero_grad()
        logps, entropy = completion_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7,
                                                with_entropy=True, chunk_size=chunk_size, padding_free=packed)
        (logps * completion_mask).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((logps * completion_mask, entropy * completion_mask, grads))
    (padded, padded_entropy, padded_grads), (packed, packed_entropy, packed_grads) = results
    # packed rows against padded ones: other attention shapes, the same formula (rule 3)
    assert_rounding_close(packed, padded, terms=TINY_TERMS)
    assert_rounding_close(packed_entropy, padded_entropy, terms=TINY_TERMS)
    assert len(packed_grads) == len(padded_grads) > 0
    positions = int(completion_mask.sum())
    for a, b in zip(packed_grads, padded_grads):  # each weight's gradient sums every position's products
        assert_rounding_close(a, b, terms=TINY_TERMS * positions)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch,chunk_size", [("llama", None), ("llama", 3), ("qwen2", None)])
def test_packed_log_probs_equal_the_padded_ones_with_gradients(arch, chunk_size, attn, tokenizer):
    """Packed (``right_aligned`` rows packed as wide as the longest, two sequences sharing a row),
    ``completion_token_logps`` gives the padded log-probs, entropy and gradients: left-padded prompts and completions
    of different lengths, one completion a single token."""
    model = grpo_model(arch, attn, tokenizer)
    torch.manual_seed(1)
    prompt_ids, completion_ids = torch.randint(10, 90, (4, 6)), torch.randint(10, 90, (4, 5))
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    layout = packed_rows(right_aligned(prompt_ids, prompt_mask, completion_ids, completion_mask))
    assert layout.input_ids.shape == (3, 11)  # real lengths 7, 11, 3, 7: [11], [7 + 3], [7]
    # what GRPO runs: on CPU, sdpa's attention skips what the mask hides, so all 28 tokens go in one row
    assert completions(prompt_ids, prompt_mask, completion_ids, completion_mask, True, model).input_ids.shape == (
        (1, 28) if attn == "sdpa" else (3, 11))
    assert_packed_equals_padded(model, prompt_ids, prompt_mask, completion_ids, completion_mask, chunk_size)


def repeated_prompts(seed: int = 1):
    """Six completions of three left-padded prompts (two, three and one of them, interleaved; the pad ids differ
    between copies of a prompt), completions of 1-5 tokens."""
    torch.manual_seed(seed)
    prompts, masks = torch.randint(10, 90, (3, 6)), torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1],
                                                                  [0, 0, 0, 0, 1, 1]])
    which = torch.tensor([0, 1, 0, 2, 1, 1])
    prompt_ids, prompt_mask = prompts[which].clone(), masks[which]
    prompt_ids[prompt_mask == 0] = torch.randint(10, 90, (int((prompt_mask == 0).sum()),))
    completion_ids = torch.randint(10, 90, (6, 5))
    completion_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0],
                                    [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def test_shared_prompt_completions_put_each_prompt_once_before_its_completions():
    prompt_ids, prompt_mask, completion_ids, completion_mask = repeated_prompts()
    layout = shared_prompt_completions(prompt_ids, prompt_mask, completion_ids, completion_mask)
    lengths = layout.attention_mask.sum(1).sort().values.tolist()
    assert lengths == [2 + 2, 4 + 3 + 1, 6 + 5 + 4 + 5]  # each prompt once, then each of its completions
    row = int(layout.attention_mask.sum(1).argmax())  # the prompt of rows 1, 4, 5: completions of 5, 4, 5 tokens
    assert layout.input_ids[row, :6].tolist() == prompt_ids[1].tolist()
    assert layout.input_ids[row, 6:20].tolist() == (completion_ids[1].tolist() + completion_ids[4, :4].tolist()
                                                    + completion_ids[5].tolist())
    assert layout.position_ids[row, :20].tolist() == list(range(11)) + list(range(6, 10)) + list(range(6, 11))
    allowed = layout.allowed[row, 0]
    assert allowed[12, :6].all() and allowed[12, 11:13].all()  # the second completion: the prompt and itself
    assert not allowed[12, 6:11].any() and not allowed[12, 13:].any()
    packed = completions(prompt_ids, prompt_mask, completion_ids, completion_mask, padding_free=True)
    assert packed.name == "shared_prompt_completions+padding_free"  # GRPO's padding_free packs these rows
    assert packed.input_ids.numel() < packed_rows(
        right_aligned(prompt_ids, prompt_mask, completion_ids, completion_mask)).input_ids.numel()


def test_shared_prompt_completions_refuse_other_rows():
    prompt_ids, prompt_mask, completion_ids, completion_mask = repeated_prompts()
    distinct = torch.tensor([0, 1, 3])  # no prompt twice: nothing to share
    assert shared_prompt_completions(prompt_ids[distinct], prompt_mask[distinct], completion_ids[distinct],
                                     completion_mask[distinct]) is None
    gap = completion_mask.clone()
    gap[1, 2] = 0  # a completion that is not one run
    assert shared_prompt_completions(prompt_ids, prompt_mask, completion_ids, gap) is None
    assert shared_prompt_completions(prompt_ids, prompt_mask.flip(1), completion_ids, completion_mask) is None


def prefixed_prompts(seed: int = 2, shared: int = MIN_SHARED_PREFIX + 2):
    """Six completions of four left-padded prompts (rows 4 and 5 repeat rows 0 and 1) that begin with the same
    ``shared`` tokens (a chat template's system prompt) and go on with 2-10 tokens of their own."""
    torch.manual_seed(seed)
    own = torch.tensor([5, 10, 2, 8, 5, 10])
    width = shared + int(own.max())
    prompt_ids = torch.randint(10, 90, (6, width))
    prompt_ids[:, -own.max():] = torch.randint(10, 90, (6, int(own.max())))
    prompt_mask = (torch.arange(width) >= width - (shared + own)[:, None]).long()
    prefix = torch.randint(10, 90, (shared,))
    for i in range(6):
        prompt_ids[i, width - shared - own[i]:width - own[i]] = prefix
    prompt_ids[4], prompt_ids[5] = prompt_ids[0], prompt_ids[1]
    completion_ids = torch.randint(10, 90, (6, 5))
    completion_mask = (torch.arange(5) < torch.tensor([3, 5, 1, 4, 2, 5])[:, None]).long()
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def test_shared_prefix_completions_run_the_prompts_common_start_once():
    prompt_ids, prompt_mask, completion_ids, completion_mask = prefixed_prompts()
    shared = MIN_SHARED_PREFIX + 2
    layout = shared_prompt_completions(prompt_ids, prompt_mask, completion_ids, completion_mask, prefix_width=4096)
    assert layout.name == "shared_prefix_completions" and layout.input_ids.shape[0] == 1
    # the prefix once, then each distinct prompt's own tokens (5, 10, 2, 8) and its completions (3 + 2, 5 + 5, 1, 4)
    assert layout.attention_mask.sum() == shared + (5 + 3 + 2) + (10 + 5 + 5) + (2 + 1) + (8 + 4)
    ids, positions, allowed = layout.input_ids[0], layout.position_ids[0], layout.allowed[0, 0]
    first = prompt_ids.shape[1] - shared - 5  # row 0's prompt: the prefix, 5 tokens of its own, completions 0, 4
    assert ids[:shared + 5].tolist() == prompt_ids[0, first:].tolist()
    assert ids[shared + 5:shared + 10].tolist() == completion_ids[0, :3].tolist() + completion_ids[4, :2].tolist()
    assert positions[:shared + 10].tolist() == list(range(shared + 8)) + [shared + 5, shared + 6]
    second = shared + 10  # row 1's prompt: its own 10 tokens at positions shared.., seeing the prefix and themselves
    assert ids[second:second + 10].tolist() == prompt_ids[1, -10:].tolist()
    assert positions[second:second + 10].tolist() == list(range(shared, shared + 10))
    assert allowed[second + 3, :shared].all() and allowed[second + 3, second:second + 4].all()
    assert not allowed[second + 3, shared:second].any() and not allowed[second + 3, second + 4:].any()
    completion = second + 10 + 5  # row 5's completion: the prefix, its prompt's own tokens and itself
    assert ids[completion:completion + 5].tolist() == completion_ids[5].tolist()
    assert allowed[completion + 2, :shared].all() and allowed[completion + 2, second:second + 10].all()
    assert allowed[completion + 2, completion:completion + 3].all()
    assert not allowed[completion + 2, shared:second].any()
    assert not allowed[completion + 2, second + 10:completion].any()
    # too short a prefix, or a row wider than allowed: a row per prompt, no prefix shared
    for width, shared in ((4096, MIN_SHARED_PREFIX - 1), (60, MIN_SHARED_PREFIX + 2)):
        rows = shared_prompt_completions(*prefixed_prompts(shared=shared), prefix_width=width)
        assert rows.name == "shared_prompt_completions" and rows.input_ids.shape[0] == 4


@pytest.mark.parametrize("arch,chunk_size", [("llama", None), ("llama", 3), ("qwen2", None)])
def test_shared_prefix_log_probs_equal_the_padded_ones_with_gradients(arch, chunk_size, tokenizer):
    """Prompts with a common start, ``padding_free`` under sdpa on CPU: the prefix once for all of them
    (``shared_prefix_completions``), the padded log-probs, entropy and gradients."""
    model = grpo_model(arch, "sdpa", tokenizer)
    rows = prefixed_prompts()
    assert completions(*rows, True, model).name == "shared_prefix_completions+padding_free"
    assert_packed_equals_padded(model, *rows, chunk_size)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch,chunk_size", [("llama", None), ("llama", 3), ("qwen2", None)])
def test_shared_prompt_log_probs_equal_the_padded_ones_with_gradients(arch, chunk_size, attn, tokenizer):
    """Completions of repeated prompts, ``padding_free``: one row per prompt (``shared_prompt_completions``), the
    padded log-probs, entropy and gradients."""
    assert_packed_equals_padded(grpo_model(arch, attn, tokenizer), *repeated_prompts(), chunk_size)


def test_packed_log_probs_run_the_head_on_the_predicting_positions_only(tokenizer):
    """Packed, the prompts come first: the LM head must not run on every position after the first row's prompt."""
    model = load_model("builtin:tiny")
    prompt_ids, prompt_mask = torch.randint(10, 90, (3, 20)), torch.ones(3, 20, dtype=torch.long)
    completion_ids, completion_mask = torch.randint(10, 90, (3, 4)), torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0],
                                                                                 [1, 1, 1, 1]])
    with HeadRows(model.config.vocab_size) as head:
        completion_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, padding_free=True)
    assert head.rows == [int(completion_mask.sum())]  # 7 positions, not the 67 from the first prompt's end on


# -- DPO: shared-prompt pairs --------------------------------------------------------------------------------------
TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0)


def random_pairs(seed: int = 0, pairs: int = 4) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        return torch.randint(3, 100, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    return [{"prompt_ids": ids(2, 9), "chosen_ids": ids(1, 7), "rejected_ids": ids(1, 7)} for _ in range(pairs)]


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("model_type,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"),
                                             ("mistral", "sdpa"), ("gemma2", "eager"), ("phi3", "sdpa")])
def test_shared_prompt_rows_match_plain_batch(model_type, attn, chunk_size):
    """Shared-prompt rows, both layouts packed without padding (``padding_free``), and (``chunk_size``) the chunked LM
    head on the plain layout, give the plain batch's per-token log-probs, statistics and gradients."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY), attn_implementation=attn)
    assert supports_shared_prompt(model)
    batch = collate_pairs(random_pairs(), pad_token_id=0, max_length=None)
    layout = shared_prompt_pairs(batch)
    assert layout.input_ids.numel() < batch["input_ids"].numel()  # the point: fewer positions
    stats = ("mean_logit", "log_sum_sq_probs", "entropy", "argmax")
    plain_out = completion_logps(model, batch, stats)
    plain = plain_out.tokens.sum(1)
    plain.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    plain_layout = padded(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    others = {"shared": layout_logps(model, layout, stats, chunk_size),
              "shared, padding_free": layout_logps(model, packed_rows(layout), stats, chunk_size),
              "plain, padding_free": layout_logps(model, packed_rows(plain_layout), stats, chunk_size),
              "shared, padding_free, one row": layout_logps(model, packed_rows(layout, 10**6), stats, chunk_size)}
    if chunk_size:
        others["plain, chunked"] = completion_logps(model, batch, stats, chunk_size)
    for what, out in others.items():
        terms = TINY["intermediate_size"]  # other layouts, the same formula: rule 3 of tests/numerics.py
        assert_rounding_close(out.tokens.sum(1), plain, terms=terms, msg=what)
        # the same tokens, in the same order within each completion, with the same statistics
        assert_rounding_close(out.tokens[out.mask], plain_out.tokens[plain_out.mask], terms=terms, msg=what)
        for name in ("mean_logit", "log_sum_sq_probs", "entropy"):
            assert_rounding_close(out.stats[name][out.mask], plain_out.stats[name][plain_out.mask],
                                  scale=plain_out.tokens.abs().max(), terms=terms, msg=f"{what} {name}")
        assert torch.equal((out.stats["argmax"] == out.labels)[out.mask],
                           (plain_out.stats["argmax"] == plain_out.labels)[plain_out.mask]), what
        model.zero_grad()
        out.tokens.sum().backward()
        positions = int(batch["attention_mask"].sum())
        for name, param in model.named_parameters():
            assert_rounding_close(param.grad, grads[name], terms=terms * positions, msg=f"{what} {name}")


def test_padding_free_pairs_pack_rows_and_score_completions_only():
    """Packed pairs: fewer rows, no wider than the longest pair row, about as many positions as real tokens, and the LM
    head runs on the completion tokens only (not on prompts nor padding)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY), attn_implementation="sdpa")
    rows = random_pairs(3, pairs=8)
    rows[0]["chosen_ids"] = rows[0]["chosen_ids"] * 5  # one long row, as real data has: the padded batch pays for it
    batch = collate_pairs(rows, pad_token_id=0, max_length=None)
    shared = shared_prompt_pairs(batch)
    layout = packed_rows(shared)
    real = int(shared.attention_mask.sum())
    assert layout.input_ids.shape[1] == int(shared.attention_mask.sum(1).max())
    assert len(layout.input_ids) < len(shared.input_ids)
    assert real <= layout.input_ids.numel() < shared.input_ids.numel()
    with HeadRows(model.config.vocab_size) as head:
        out = layout_logps(model, layout, (), chunk_size=None)
    assert head.rows == [int(batch["completion_mask"].sum())]  # the positions predicting a completion token
    assert len(layout.targets) == int(out.mask.sum()) == int(batch["completion_mask"].sum())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_free_pairs_go_in_one_row_where_attention_skips_the_hidden_part(attn):
    """On CPU, sdpa's attention under a packed mask computes only what it lets through (``lit_align.attention``), so
    ``pairs`` packs the step's pairs into one row with no padding; eager's cost is the row's square: rows as wide as
    the longest pair."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY), attn_implementation=attn)
    batch = collate_pairs(random_pairs(4, pairs=5), pad_token_id=0, max_length=None)
    shared = shared_prompt_pairs(batch)
    lengths = shared.attention_mask.sum(1)
    layout = pairs(batch, model, padding_free=True)
    if attn == "sdpa":
        assert layout.input_ids.shape == (1, int(lengths.sum()))
    else:
        assert layout.input_ids.shape[1] == int(lengths.max()) < int(lengths.sum())


def test_padding_free_is_on_by_default_only_where_packing_is_exact_and_cheaper():
    """``padding_free`` None: packed for a Llama-like model under sdpa on CPU (one row), padded under eager (its
    attention pays a packed row's square) or with a sliding window; an explicit value always wins."""
    torch.manual_seed(0)
    batch = collate_pairs(random_pairs(4, pairs=5), pad_token_id=0, max_length=None)
    expected = {("sdpa", None): True, ("eager", None): False, ("sdpa", 64): False}
    for (attn, window), packs in expected.items():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY), attn_implementation=attn)
        model.config.sliding_window = window
        assert packs_by_default(model, "cpu") is packs, (attn, window)
        assert pairs(batch, model).name.endswith("+padding_free") is packs, (attn, window)
        assert not pairs(batch, model, padding_free=False).name.endswith("+padding_free")
        assert not packs_by_default(model, "cuda")
        rows = [torch.ones(2, 3, dtype=torch.long)] * 4  # GRPO's: prompts, their mask, completions, their mask
        assert completions(*rows, padding_free=None, model=model).name.endswith("+padding_free") is packs


def test_packed_bins_split_the_total_evenly_within_the_width():
    for lengths, width, fills in [([750, 360], None, [750, 360]),  # None: as wide as the longest
                                  ([750, 360], 8192, [1110]),
                                  ([5000, 4000, 3000], 8192, [7000, 5000]),  # 2 x 7000: the fewest positions
                                  ([9000, 10], 8192, [9000, 10]),  # the longest row is never cut
                                  ([100] * 30, 1000, [1000, 1000, 1000])]:
        bins = packed_bins(lengths, width)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert sorted((sum(lengths[i] for i in b) for b in bins), reverse=True) == fills, (lengths, width)


def test_shared_prompt_pairs_refuse_other_batches():
    rows = random_pairs(1)
    batch = collate_pairs(rows, pad_token_id=0, max_length=None)
    other = dict(batch, input_ids=batch["input_ids"].clone())
    other["input_ids"][len(rows), 0] += 1  # rejected_1's prompt differs from chosen_1's
    assert shared_prompt_pairs(other) is None
    left = {k: v.flip(1) for k, v in batch.items()}  # left padding
    assert shared_prompt_pairs(left) is None
