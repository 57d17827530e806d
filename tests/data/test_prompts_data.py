"""Prompt-only data for the online recipes: ``RoundSampler``'s round pattern, ``PromptDataModule``'s checks, batches and errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lit_align.data.prompts import PromptDataModule, RoundSampler
from lit_align.errors import LitAlignError
from lit_align.generation_round import RoundShape


def rounds_of(sampler: RoundSampler) -> list[list[tuple[int, int]]]:
    """The sampler's yields cut into rounds (``prompts_per_round * repeats`` yields each)."""
    items = [(index, pos) for index, pos, _ in sampler]
    size = sampler.prompts_per_round * sampler.repeats
    assert len(items) % size == 0
    return [items[i : i + size] for i in range(0, len(items), size)]


# -- RoundSampler ------------------------------------------------------------------------------------------------------
def test_round_sampler_unshuffled_pattern_exactly():
    sampler = RoundSampler(list(range(7)), prompts_per_round=3, repeats=2, shuffle=False)
    # 7 prompts make 2 whole rounds of 3 (prompt 6 is left over); each round is yielded twice, tagged 0 then 1
    assert list(sampler) == [
        (0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 1, 0), (1, 1, 0), (2, 1, 0),
        (3, 0, 1), (4, 0, 1), (5, 0, 1), (3, 1, 1), (4, 1, 1), (5, 1, 1),
    ]
    assert len(sampler) == 12


@pytest.mark.parametrize("spg,iterations", [(3, 2), (4, 1), (1, 1)])
def test_round_sampler_repeats_each_round(spg, iterations):
    repeats = spg * iterations
    sampler = RoundSampler(list(range(40)), prompts_per_round=4, repeats=repeats, shuffle=True, seed=3)
    rounds = rounds_of(sampler)
    assert len(rounds) == 10 and len(sampler) == 10 * repeats * 4
    seen = []
    for items in rounds:
        first = [i for i, _ in items[:4]]
        for pos in range(repeats):
            block = items[pos * 4 : (pos + 1) * 4]
            assert [i for i, _ in block] == first  # the same prompts, in the same order
            assert [p for _, p in block] == [pos] * 4  # tagged with round_pos 0 .. R-1
        seen += first
    assert sorted(seen) == list(range(40))  # rounds drawn without replacement
    assert seen != list(range(40))  # shuffled


def test_round_sampler_two_replicas_are_disjoint_and_cover_each_round():
    data = list(range(26))
    ranks = [RoundSampler(data, prompts_per_round=3, repeats=2, num_replicas=2, rank=r, seed=5) for r in (0, 1)]
    # 26 prompts // (3 per rank * 2 ranks) = 4 rounds; 2 prompts left over
    assert [s.num_rounds for s in ranks] == [4, 4]
    assert [len(s) for s in ranks] == [4 * 2 * 3, 4 * 2 * 3]
    order = torch.randperm(26, generator=torch.Generator().manual_seed(5)).tolist()
    all_prompts = []
    for r, (mine0, mine1) in enumerate(zip(rounds_of(ranks[0]), rounds_of(ranks[1]))):
        p0, p1 = {i for i, _ in mine0}, {i for i, _ in mine1}
        assert len(p0) == len(p1) == 3
        assert not p0 & p1  # no prompt on both ranks
        assert p0 | p1 == set(order[r * 6 : (r + 1) * 6])  # together: the global round
        all_prompts += [*p0, *p1]
    assert len(set(all_prompts)) == len(all_prompts) == 24


def test_round_sampler_set_epoch_changes_order_deterministically():
    sampler = RoundSampler(list(range(30)), prompts_per_round=5, repeats=1, seed=0)
    epoch0 = list(sampler)
    assert list(sampler) == epoch0  # same epoch, same order
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch1 != epoch0
    assert sorted(i for i, _, _ in epoch1) == sorted(i for i, _, _ in epoch0)
    sampler.set_epoch(0)
    assert list(sampler) == epoch0
    other_seed = RoundSampler(list(range(30)), prompts_per_round=5, repeats=1, seed=1)
    assert list(other_seed) != epoch0


# -- PromptDataModule ----------------------------------------------------------------------------------------------------
def prompt_rows(n: int) -> list[dict]:
    return [{"prompt": f"sort {i:04d}:", "answer": f"ans{i}", "level": i % 3} for i in range(n)]


def make_dm(path, tiny_path, num_generations: int = 2, steps_per_generation: int | None = None,
            num_iterations: int = 1, **kwargs) -> PromptDataModule:
    """The data set up as a module would connect it: the round's shape is the module's."""
    dm = PromptDataModule(path=path, **{"val_split": None, "tokenizer": "builtin:tiny", "batch_size": 4, **kwargs})
    dm.connect(round_shape=RoundShape(num_generations, steps_per_generation, num_iterations))
    dm.setup("fit")
    return dm


def test_the_round_the_module_connects_is_resolved_against_the_batch_size(write_jsonl, tiny_path):
    """``connect`` answers with the shape resolved for this data: TRL's ``generation_batch_size`` over the batch size
    and the world size (16 = 4 x 2 devices x 2 steps); a round that cannot form whole groups is refused."""
    dm = PromptDataModule(path=write_jsonl(prompt_rows(40)), val_split=None, tokenizer="builtin:tiny", batch_size=4)
    dm.trainer = SimpleNamespace(world_size=2, global_rank=0)
    assert dm.connect(round_shape=RoundShape(2, generation_batch_size=16)) == RoundShape(2, 2)
    dm.setup("fit")
    assert [b["round_pos"] for b in dm.train_dataloader()][:4] == [0, 1, 0, 1]
    with pytest.raises(LitAlignError, match=r"batch_size \* model.steps_per_generation = 4 .* multiple of "
                                            r"model.num_generations = 8"):
        dm.connect(round_shape=RoundShape(8))
    assert PromptDataModule(batch_size=16).prompts_per_round == 2  # alone: RoundShape's defaults (8 per prompt)


def test_too_few_prompts_for_one_round_raises(write_jsonl, tiny_path):
    path = write_jsonl(prompt_rows(5))
    dm = make_dm(path, tiny_path, batch_size=4, steps_per_generation=3, num_generations=2)  # 6 prompts per round
    with pytest.raises(LitAlignError, match=r"rows.jsonl: 5 prompts, but one generation round needs 6"):
        dm.train_dataloader()


def test_too_few_prompts_for_one_round_over_two_ranks_raises(write_jsonl, tiny_path):
    dm = make_dm(write_jsonl(prompt_rows(3)), tiny_path, batch_size=4, num_generations=2)  # 2 prompts per rank
    assert len(dm.train_dataloader()) == 1  # one device: one round of 2
    dm.trainer = SimpleNamespace(world_size=2, global_rank=1)
    with pytest.raises(LitAlignError, match=r"3 prompts, but one generation round needs 4 .*devices"):
        dm.train_dataloader()


def test_two_ranks_get_disjoint_prompts_through_the_datamodule(write_jsonl, tiny_path):
    path = write_jsonl(prompt_rows(25))
    seen = []
    for rank in (0, 1):
        dm = make_dm(path, tiny_path, batch_size=4, num_generations=2, steps_per_generation=2)  # 4 prompts per rank
        dm.trainer = SimpleNamespace(world_size=2, global_rank=rank)
        batches = list(dm.train_dataloader())
        assert len(batches) == 3 * 2  # 25 // 8 = 3 rounds, each served twice
        assert [b["round_pos"] for b in batches] == [0, 1] * 3
        seen.append([p for b in batches[::2] for p in b["prompts"]])
    assert len(set(seen[0])) == len(set(seen[1])) == 12
    assert not set(seen[0]) & set(seen[1])


def test_train_batches_follow_the_round_pattern(write_jsonl, tiny_path, tokenizer):
    path = write_jsonl(prompt_rows(20))
    dm = make_dm(path, tiny_path, batch_size=4, num_generations=2, steps_per_generation=3, num_iterations=2)
    loader = dm.train_dataloader()
    # 6 prompts per round, 20 // 6 = 3 rounds, each served 3 * 2 = 6 times
    assert len(loader) == 3 * 6
    batches = list(loader)
    assert len(batches) == 18
    assert [b["round_pos"] for b in batches] == [0, 1, 2, 3, 4, 5] * 3
    for b in batches:
        assert len(b["prompts"]) == 6 and b["prompt_ids"].shape[0] == 6
        assert not {"num_generations", "steps_per_generation", "num_iterations"} & set(b)  # settings: not in batches
    assert (dm.round_shape.num_generations, dm.round_shape.steps_per_generation, dm.round_shape.num_iterations) == (
        2, 3, 2)
    for r in range(3):
        block = batches[r * 6 : (r + 1) * 6]
        assert all(b["prompts"] == block[0]["prompts"] for b in block)
    firsts = [p for r in range(3) for p in batches[r * 6]["prompts"]]
    assert len(set(firsts)) == 18


def test_extra_columns_reach_the_batch(write_jsonl, tiny_path, tokenizer):
    path = write_jsonl(prompt_rows(8))
    dm = make_dm(path, tiny_path, batch_size=4, num_generations=2, steps_per_generation=2)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch["columns"]) == {"answer", "level"}
    for prompt, answer, level in zip(batch["prompts"], batch["columns"]["answer"], batch["columns"]["level"]):
        i = int(prompt[5:9])
        assert answer == f"ans{i}" and level == i % 3  # aligned row for row with the prompts


def test_a_system_prompt_makes_every_prompt_a_conversation_that_opens_with_it(write_jsonl, tiny_path, tokenizer):
    """open-r1's ``system_prompt``: a text prompt becomes the user turn after the system turn, tokenized through the
    chat template, and the reward functions see the conversation; a row's own system turn stays."""
    def first_batch(rows):
        dm = PromptDataModule(path=write_jsonl(rows), val_split=None, tokenizer="builtin:tiny", batch_size=2,
                              system_prompt="be brief")
        dm.connect(round_shape=RoundShape(1, grouped=False))
        dm.setup("fit")
        return next(iter(dm.train_dataloader()))

    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "sort 12:"}]
    assert first_batch([{"prompt": own}] * 2)["prompts"] == [own, own]
    batch = first_batch([{"prompt": "sort 21:"}] * 2)
    made = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort 21:"}]
    assert batch["prompts"] == [made, made]
    expected = tokenizer(tokenizer.apply_chat_template(made, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    width = batch["prompt_ids"].shape[1]
    assert batch["prompt_ids"][0].tolist()[width - len(expected):] == list(expected)


def test_the_rows_completions_are_tokenized_as_sfts_when_the_module_asks(write_jsonl, tiny_path, tokenizer):
    """Distillation's supervised rounds: with ``dataset_completions`` each batch carries each row's ``completion``
    as SFT tokenizes it (a text completion's characters, then EOS; a conversation's assistant turn by the chat
    template), beside the raw column the reward functions read; without, no row is tokenized for it."""
    chat = [{"role": "user", "content": "sort 31:"}]
    for rows, completion in (([{"prompt": "sort 21:", "completion": "12"}] * 2, "12"),
                             ([{"prompt": chat, "completion": [{"role": "assistant", "content": "13"}]}] * 2, "13")):
        dm = PromptDataModule(path=write_jsonl(rows), val_split=None, tokenizer="builtin:tiny", batch_size=2)
        dm.connect(round_shape=RoundShape(1, grouped=False), dataset_completions=True)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))
        assert batch["completion_ids"] == [tokenizer(completion)["input_ids"] + [tokenizer.eos_token_id]] * 2
        assert batch["columns"] == {"completion": [rows[0]["completion"]] * 2}  # raw, for the reward functions
    dm.connect(round_shape=RoundShape(1, grouped=False))  # the rows are tokenized again, without
    dm.setup("fit")
    assert "completion_ids" not in next(iter(dm.train_dataloader()))


def test_prompts_are_left_padded_and_truncated_from_the_start(write_jsonl, tiny_path, tokenizer):
    rows = [{"prompt": "ab"}, {"prompt": "abcdef"}, {"prompt": "xyz"}, {"prompt": "0123456789"}]
    dm = make_dm(write_jsonl(rows), tiny_path, batch_size=4, num_generations=2, shuffle=False, max_length=4)
    batch = next(iter(dm.train_dataloader()))
    pad = tokenizer.pad_token_id
    assert batch["prompts"] == ["ab", "abcdef"]
    assert batch["prompt_ids"].tolist() == [[pad, pad] + tokenizer("ab")["input_ids"], tokenizer("cdef")["input_ids"]]
    assert batch["prompt_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_conversational_prompts_use_the_chat_template(write_jsonl, tiny_path, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort 31:"}]
    dm = make_dm(write_jsonl([{"prompt": messages}] * 4), tiny_path, batch_size=2, num_generations=2, shuffle=False)
    batch = next(iter(dm.train_dataloader()))
    text = tokenizer.decode(batch["prompt_ids"][0])
    assert text == "<|system|>be brief\n<|user|>sort 31:\n<|assistant|>"
    assert batch["prompts"][0] == messages


@pytest.mark.parametrize(
    "rows,match",
    [
        ([{"question": "sort 12:"}, {"question": "sort 3:"}], r"rows.jsonl: missing column 'prompt'"),
        ([{"prompt": "sort 12:"}, {"prompt": "   "}], r"rows.jsonl row 1: field 'prompt' is empty"),
        ([{"prompt": 12}, {"prompt": 7}], r"rows.jsonl row 0: field 'prompt' must be a string or a list of messages, got int"),
        ([{"prompt": "sort 1:"}, {"prompt": 7}], r"rows.jsonl row 1: field 'prompt' is a number"),
        ([{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": [{"role": "bot", "content": "b"}]}],
         r"rows.jsonl row 1: prompt\[0\] has role 'bot'"),
        ([{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": []}],
         r"rows.jsonl row 1: field 'prompt' must be a string or a list of messages"),
    ],
    ids=["missing-column", "empty", "non-string", "mixed-types", "unknown-role", "empty-messages"],
)
def test_bad_prompt_rows_name_file_and_row(write_jsonl, tiny_path, rows, match):
    path = write_jsonl(rows)
    with pytest.raises(LitAlignError, match=match) as info:
        make_dm(path, tiny_path, batch_size=2)
    assert "\n" not in str(info.value)


def test_round_batch_looks_ahead_at_what_the_loader_will_yield(write_jsonl, tiny_path):
    """Asynchronous rollouts sample rounds before their turn: ``round_batch(r)`` is exactly the first batch the loader
    yields for round ``r`` of the epoch (after a new epoch's ``set_epoch`` too), and None past the last round."""
    dm = make_dm(write_jsonl(prompt_rows(20)), tiny_path, batch_size=4, num_generations=2, steps_per_generation=2)
    loader = dm.train_dataloader()
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        firsts = [b for b in loader if b["round_pos"] == 0]
        assert [b["round"] for b in firsts] == [0, 1, 2, 3, 4]
        for r, batch in enumerate(firsts):
            ahead = dm.round_batch(r)
            assert ahead["dataset_rows"] == batch["dataset_rows"] and ahead["prompts"] == batch["prompts"]
            assert torch.equal(ahead["prompt_ids"], batch["prompt_ids"]) and ahead["round"] == r
    assert dm.round_batch(5) is None
