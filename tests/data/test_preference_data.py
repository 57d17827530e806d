"""Preference rows: the three formats, tokenization, the [chosen; rejected] batch, truncation, and bad input; the
reward model's pairs (RewardDataModule): uncut, long ones dropped, a margin column."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

from lit_align.data.preference import PreferenceDataModule, RewardDataModule, collate_pairs, tokenize_pair
from lit_align.data.rows import normalize_pair
from lit_align.errors import LitAlignError
from lit_align.models import CHARACTERS, SPECIAL_TOKENS, load_tokenizer

PAD, EOS, USER, ASSISTANT = 0, 2, 5, 6


def ids(text: str) -> list[int]:
    """The built-in tokenizer by hand: one id per character, after the special tokens."""
    return [len(SPECIAL_TOKENS) + CHARACTERS.index(c) for c in text]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def module(path, **kw) -> PreferenceDataModule:
    kw = {"val_split": None, "tokenizer": "builtin:tiny", "max_length": 64, **kw}
    return PreferenceDataModule(path=path, **kw)


def processed(rows: list[dict], **kw) -> PreferenceDataModule:
    """A data module whose ``processed`` attribute holds ``rows`` after ``process`` (no file involved)."""
    dm = module("unused", **kw)
    dm.tokenizer = load_tokenizer("builtin:tiny")
    dm.processed = dm.process(Dataset.from_list(rows), "rows")
    return dm


# -- the three row formats -----------------------------------------------------------------------------------------


def test_ids_helper_matches_tokenizer(tokenizer):
    assert ids("sort 31:") == [35, 31, 34, 36, 101, 10, 8, 84] == tokenizer("sort 31:")["input_ids"]


def test_standard_row(tokenizer):
    row = {"prompt": "sort 31:", "chosen": "13", "rejected": "31"}
    prompt, chosen, rejected, conversational = normalize_pair(row, "w")
    assert (prompt, chosen, rejected, conversational) == ("sort 31:", "13", "31", False)
    out = tokenize_pair(tokenizer, prompt, chosen, rejected, conversational)
    assert out == {
        "prompt_ids": [35, 31, 34, 36, 101, 10, 8, 84],
        "chosen_ids": [8, 10, EOS],  # "13" + EOS
        "rejected_ids": [10, 8, EOS],
    }
    # a completion that already ends with EOS does not get a second one
    assert tokenize_pair(tokenizer, "sort 31:", "13</s>", "31", False)["chosen_ids"] == [8, 10, EOS]


def test_conversational_row_uses_chat_template(tokenizer):
    row = {"prompt": [user("hi")], "chosen": [assistant("ab")], "rejected": [assistant("ba")]}
    prompt, chosen, rejected, conversational = normalize_pair(row, "w")
    assert conversational
    out = tokenize_pair(tokenizer, prompt, chosen, rejected, conversational)
    # "<|user|>hi\n<|assistant|>" then "ab</s>" (the template closes assistant turns with EOS)
    assert out == {
        "prompt_ids": [USER, *ids("hi\n"), ASSISTANT],
        "chosen_ids": [*ids("ab"), EOS],
        "rejected_ids": [*ids("ba"), EOS],
    }
    assert out["prompt_ids"] == [5, 24, 25, 103, 6]


def test_implicit_prompt_strings(tokenizer):
    row = {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"}
    prompt, chosen, rejected, conversational = normalize_pair(row, "w")
    assert (prompt, chosen, rejected, conversational) == ("Q: 2+2? A:", " 4", " 5", False)  # the space stays
    out = tokenize_pair(tokenizer, prompt, chosen, rejected, conversational)
    assert out == {"prompt_ids": ids("Q: 2+2? A:"), "chosen_ids": [101, 11, EOS], "rejected_ids": [101, 12, EOS]}
    # an explicit null prompt is treated as absent
    assert normalize_pair({**row, "prompt": None}, "w")[0] == "Q: 2+2? A:"


def test_implicit_prompt_messages(tokenizer):
    row = {"chosen": [user("hi"), assistant("ab")], "rejected": [user("hi"), assistant("ba")]}
    prompt, chosen, rejected, conversational = normalize_pair(row, "w")
    assert (prompt, chosen, rejected, conversational) == ([user("hi")], [assistant("ab")], [assistant("ba")], True)
    out = tokenize_pair(tokenizer, prompt, chosen, rejected, conversational)
    assert out == {"prompt_ids": [5, 24, 25, 103, 6], "chosen_ids": [17, 18, EOS], "rejected_ids": [18, 17, EOS]}


def test_all_formats_through_a_file(write_jsonl):
    """Each format from a JSONL file, through setup(): the same ids as tokenize_pair gives."""
    for rows, expected in [
        (
            [{"prompt": "sort 31:", "chosen": "13", "rejected": "31"}],
            (ids("sort 31:"), ids("13") + [EOS], ids("31") + [EOS]),
        ),
        (
            [{"prompt": [user("hi")], "chosen": [assistant("ab")], "rejected": [assistant("ba")]}],
            ([5, 24, 25, 103, 6], [17, 18, EOS], [18, 17, EOS]),
        ),
        ([{"chosen": "Q: A: yes", "rejected": "Q: A: no"}], (ids("Q: A:"), ids(" yes") + [EOS], ids(" no") + [EOS])),
    ]:
        dm = module(write_jsonl(rows, name=f"rows{len(expected[0])}.jsonl"))
        dm.setup("fit")
        row = dm.train_data[0]
        assert (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]) == expected
        assert set(dm.train_data.column_names) == {"prompt_ids", "chosen_ids", "rejected_ids", "row"}


def test_csv_keeps_digit_strings(tmp_path):
    """pandas reads a column of digits as integers ("0012" -> 12); text columns must stay text."""
    path = tmp_path / "pairs.csv"
    path.write_text("prompt,chosen,rejected\nsort 2100:,0012,0102\nsort 31:,13,31\n")
    dm = module(str(path))
    dm.setup("fit")
    assert dm.train_data[0]["chosen_ids"] == ids("0012") + [EOS]
    assert dm.train_data[1]["rejected_ids"] == ids("31") + [EOS]


# -- batches ---------------------------------------------------------------------------------------------------------


def test_collate_pairs_layout():
    rows = [
        {"prompt_ids": [11, 12], "chosen_ids": [21, 2], "rejected_ids": [31, 32, 33, 2]},
        {"prompt_ids": [13, 14, 15], "chosen_ids": [22, 23, 2], "rejected_ids": [34, 2]},
    ]
    batch = collate_pairs(rows, pad_token_id=PAD, max_length=None)
    assert set(batch) == {"input_ids", "attention_mask", "completion_mask"}
    assert batch["input_ids"].tolist() == [
        [11, 12, 21, 2, 0, 0],  # chosen 1
        [13, 14, 15, 22, 23, 2],  # chosen 2
        [11, 12, 31, 32, 33, 2],  # rejected 1
        [13, 14, 15, 34, 2, 0],  # rejected 2
    ]
    assert batch["attention_mask"].tolist() == [
        [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0],
    ]
    assert batch["completion_mask"].tolist() == [
        [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0],
    ]


def test_collate_pairs_keep_start_truncation_and_ref_columns():
    rows = [
        {"prompt_ids": [11, 12, 13], "chosen_ids": [21, 22, 23, 2], "rejected_ids": [31, 2],
         "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.5},
        {"prompt_ids": [14], "chosen_ids": [24, 2], "rejected_ids": [32, 33, 34, 35, 36, 2],
         "ref_chosen_logps": -3.0, "ref_rejected_logps": -4.0},
    ]
    batch = collate_pairs(rows, pad_token_id=PAD, max_length=5)
    assert batch["input_ids"].tolist() == [
        [11, 12, 13, 21, 22],  # the start is kept, the end (and its EOS) cut
        [14, 24, 2, 0, 0],
        [11, 12, 13, 31, 2],
        [14, 32, 33, 34, 35],
    ]
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0], [1] * 5, [1] * 5]
    assert batch["ref_chosen_logps"].tolist() == [-1.5, -3.0]
    assert batch["ref_rejected_logps"].tolist() == [-2.5, -4.0]
    assert batch["ref_chosen_logps"].dtype == torch.float32


def test_add_reference_logps_hands_each_split_to_the_model_with_the_datas_settings(tmp_path):
    """Model -> data: the function the model hands over (``PrecomputedReference.annotate`` in a run) gets each split
    the data holds with the data's collate, batch size and ``max_length``, and its rows replace the split's."""
    rows = [{"prompt": "ab", "chosen": "c", "rejected": "d"}] * 3
    Dataset.from_list(rows).to_json(tmp_path / "pairs.jsonl")
    dm = module(str(tmp_path / "pairs.jsonl"), val_fraction=1 / 3, batch_size=2, val_batch_size=5, max_length=16)
    dm.setup("fit")
    calls = []

    def annotate(split_rows, split, collate, batch_size, max_length):
        calls.append((split, len(split_rows), batch_size, max_length, collate == dm.collate))
        return split_rows.add_column("ref_chosen_logps", [-1.0] * len(split_rows))

    dm.add_reference_logps(annotate)
    assert calls == [("train", 2, 2, 16, True), ("val", 1, 5, 16, True)]
    assert "ref_chosen_logps" in dm.train_data.column_names and "ref_chosen_logps" in dm.val_data.column_names


def test_truncated_and_dropped_counts():
    rows = [
        {"prompt": "abc", "chosen": "de", "rejected": "f"},  # 3 + 3 tokens: fits in 6
        {"prompt": "abc", "chosen": "defg", "rejected": "h"},  # 3 + 5: truncated
        {"prompt": "abcde", "chosen": "f", "rejected": "g"},  # prompt 5 < 6: kept, truncated to 1 completion token
        {"prompt": "abcdef", "chosen": "g", "rejected": "h"},  # prompt 6 >= 6: dropped
        {"prompt": "abcdefghij", "chosen": "k", "rejected": "l"},  # dropped
    ]
    dm = processed(rows, max_length=6, drop_long_prompts=True)
    assert dm.truncation_report == {"truncated": 2, "dropped": 2}
    assert len(dm.processed) == 3
    assert [r["prompt_ids"] for r in dm.processed] == [ids("abc"), ids("abc"), ids("abcde")]
    batch = dm.collate([dm.processed[i] for i in range(3)])
    assert batch["input_ids"].shape == (6, 6)
    assert batch["input_ids"][2].tolist() == ids("abcdef")  # chosen of row 3: prompt + "f", EOS cut
    assert batch["completion_mask"][2].tolist() == [0, 0, 0, 0, 0, 1]


def test_max_prompt_length_keeps_the_end_of_each_prompt_as_older_trl():
    """Older TRL's DPO cut the prompt to its last max_prompt_length tokens before the row's max_length (recipe
    files written for it set both); the completions stay whole."""
    dm = processed([{"prompt": "abcdefghij", "chosen": "k", "rejected": "lm"}], max_length=None,
                   max_prompt_length=4)
    row = dm.processed[0]
    assert row["prompt_ids"] == ids("ghij") and len(row["rejected_ids"]) == 3  # "lm" + EOS
    with pytest.raises(LitAlignError, match="data.max_prompt_length must be >= 1 or null, got 0"):
        PreferenceDataModule(max_prompt_length=0)


def test_no_truncation_when_max_length_is_none():
    dm = processed([{"prompt": "abcdefghij", "chosen": "k", "rejected": "lm"}], max_length=None)
    row = dm.processed[0]
    assert len(row["prompt_ids"]) + len(row["rejected_ids"]) == 13
    assert dm.collate([row])["input_ids"].shape == (2, 13)


def test_builtin_sort_datamodule():
    dm = PreferenceDataModule(path="builtin:sort", tokenizer="builtin:tiny", batch_size=4, max_length=64, shuffle=False)
    dm.setup("fit")
    assert (len(dm.train_data), len(dm.val_data)) == (4000, 200)
    assert dm.truncation_report == {"truncated": 0, "dropped": 0}
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 8
    # unshuffled: the first batch holds the first rows, chosen first; every chosen completion is sorted digits + EOS
    first = dm.train_data[0]
    n = len(first["prompt_ids"]) + len(first["chosen_ids"])
    assert batch["input_ids"][0, :n].tolist() == first["prompt_ids"] + first["chosen_ids"]
    assert batch["input_ids"][4, : len(first["prompt_ids"]) + len(first["rejected_ids"])].tolist() == (
        first["prompt_ids"] + first["rejected_ids"]
    )
    for row in (dm.train_data[i] for i in range(50)):
        digits = "".join(CHARACTERS[i - len(SPECIAL_TOKENS)] for i in row["chosen_ids"][:-1])
        assert digits == "".join(sorted(digits)) and row["chosen_ids"][-1] == EOS
        assert row["chosen_ids"] != row["rejected_ids"]


def test_val_fraction_holds_out_rows(write_jsonl):
    rows = [{"prompt": f"p{i}:", "chosen": "a", "rejected": "b"} for i in range(20)]
    dm = module(write_jsonl(rows), val_fraction=0.25)
    dm.setup("fit")
    assert (len(dm.train_data), len(dm.val_data)) == (15, 5)
    prompts = lambda data: {tuple(r["prompt_ids"]) for r in data}  # noqa: E731
    assert not prompts(dm.train_data) & prompts(dm.val_data)


# -- bad input: one LitAlignError, one line, naming the file and the row / field -------------------------------------

GOOD = {"prompt": "sort 31:", "chosen": "13", "rejected": "31"}


def error_of(path, **kw) -> str:
    path = str(path)
    with pytest.raises(LitAlignError) as info:
        module(path, **kw).setup("fit")
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    return message.replace(str(path), "FILE")


def test_missing_column(write_jsonl):
    path = write_jsonl([{"prompt": "a", "chosen": "b"}, {"prompt": "c", "chosen": "d"}])
    assert error_of(path).startswith("FILE row 0: missing column 'rejected'")


def test_missing_key_in_one_row(write_jsonl):
    path = write_jsonl([GOOD, {"prompt": "a", "chosen": "b"}])
    assert error_of(path) == "FILE row 1: field 'rejected' is missing or null"


def test_empty_field(write_jsonl):
    path = write_jsonl([GOOD, GOOD, {"prompt": "a", "chosen": "  ", "rejected": "c"}])
    assert error_of(path) == "FILE row 2: field 'chosen' is empty"


def test_an_empty_conversational_side_is_refused_as_an_empty_string_is(write_jsonl):
    """What CPO, ORPO and the reward model read (``normalize_pair``): an assistant message with no content is an empty
    side, as ``""`` is, not a completion of the template's end-of-turn token alone."""
    conversation = {"prompt": [user("sort 31:")], "chosen": [assistant("13")], "rejected": [assistant("31")]}
    path = write_jsonl([conversation, {**conversation, "rejected": [assistant(" ")]}], name="conv.jsonl")
    assert error_of(path) == "FILE row 1: field 'rejected' is empty (no message has content)"


def test_non_string_field(write_jsonl):
    path = write_jsonl([{"prompt": "a", "chosen": 13, "rejected": "c"}], name="ints.jsonl")
    assert error_of(path) == "FILE row 0: field 'chosen' must be a string, got int"


def test_non_string_field_in_a_later_row(write_jsonl):
    """A column with strings and a number: the row with the number is named (datasets would silently turn the
    string "13" of row 0 into the number 13 and the error would point at row 0)."""
    path = write_jsonl([GOOD, GOOD, {"prompt": "a", "chosen": 5, "rejected": "c"}], name="mixed.jsonl")
    assert error_of(path) == (
        "FILE row 2: field 'chosen' is a number, but row 0's is a string (a column must have one type)"
    )


def test_non_string_field_in_a_json_array_file(tmp_path):
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([GOOD, {"prompt": "a", "chosen": "b", "rejected": ["c"]}]))
    assert error_of(path) == (
        "FILE row 1: field 'rejected' is a list, but row 0's is a string (a column must have one type)"
    )


def test_mixed_standard_and_conversational_rows(write_jsonl):
    path = write_jsonl([GOOD, {"prompt": [user("a")], "chosen": [assistant("b")], "rejected": [assistant("c")]}])
    assert error_of(path).startswith("FILE row 1: field 'prompt' is a list, but row 0's is a string")


def test_unreadable_file(tmp_path):
    path = tmp_path / "garbage.jsonl"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x00binary")
    assert error_of(path) == "FILE line 1: not valid UTF-8 (byte 0x89); save the file as UTF-8"
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": \n')
    assert error_of(path).startswith("FILE: could not read as json: line 2: Expecting value (column ")
    rows = [json.dumps(GOOD)] * 20
    rows[10] = rows[10][:-5]  # one line cut short in the middle of a file
    path.write_text("\n".join(rows) + "\n")
    assert error_of(path).startswith("FILE: could not read as json: line 11: ")


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    assert error_of(path) == "FILE: the file is empty"


def test_missing_and_unsupported_files(tmp_path):
    assert error_of(tmp_path / "nope.jsonl") == "FILE: no such file"
    path = tmp_path / "pairs.txt"
    path.write_text("hello\n")
    assert error_of(path).startswith("FILE: unsupported file type")


def test_a_single_file_has_one_split_train(write_jsonl):
    """Its rows train, with no validation where ``val_split`` names another split; as the training split, another
    name is one line naming the setting."""
    path = write_jsonl([GOOD])
    data = module(str(path), val_split="test")
    data.setup("fit")
    assert len(data.train_data) == 1 and data.val_data is None
    assert error_of(path, train_split="test") == ("FILE: a single file has one split, 'train', not 'test' "
                                                  "(data.train_split is 'test'); set data.train_split to a split it has")


def test_chosen_equals_rejected(write_jsonl):
    path = write_jsonl([GOOD, {"prompt": "a", "chosen": "same", "rejected": "same"}])
    assert error_of(path) == "FILE row 1: 'chosen' and 'rejected' are identical (a pair must differ)"


def test_prompt_longer_than_max_length(write_jsonl):
    path = write_jsonl([GOOD, {"prompt": "x" * 20, "chosen": "a", "rejected": "b"}, GOOD])
    assert error_of(path, max_length=16) == (
        "FILE row 1: the prompt alone is 20 tokens, max_length is 16 (raise data.max_length, or set "
        "data.drop_long_prompts: true)"
    )
    dm = module(path, max_length=16, drop_long_prompts=True)
    dm.setup("fit")
    assert len(dm.train_data) == 2
    assert dm.truncation_report == {"truncated": 0, "dropped": 1}
    # every row too long: nothing left to train on
    assert error_of(write_jsonl([{"prompt": "x" * 20, "chosen": "a", "rejected": "b"}], name="all_long.jsonl"),
                    max_length=16, drop_long_prompts=True).startswith("FILE: every row was dropped")


def test_unknown_role(write_jsonl):
    bot = {"role": "bot", "content": "b"}
    path = write_jsonl([{"prompt": [user("hi")], "chosen": [assistant("a")], "rejected": [bot]}])
    assert error_of(path) == (
        "FILE row 0: rejected[0] has role 'bot', expected one of ('system', 'user', 'assistant', 'tool')"
    )


def test_message_without_content(write_jsonl):
    no_content = {"role": "user", "text": "hi"}
    path = write_jsonl([{"prompt": [no_content], "chosen": [assistant("a")], "rejected": [assistant("b")]}])
    assert error_of(path) == "FILE row 0: prompt[0] must be a {role, content} message with string content"


def test_implicit_prompt_without_shared_prefix(write_jsonl):
    path = write_jsonl([{"chosen": "yes", "rejected": "no"}])
    assert error_of(path) == ("FILE row 0: 'chosen' and 'rejected' share no prefix to take as the prompt (the row "
                              "has no 'prompt')")


def test_validation_rows_are_checked_too(write_jsonl):
    train = write_jsonl([GOOD], name="train.jsonl")
    val = write_jsonl([GOOD, {"prompt": "a", "chosen": "b", "rejected": ""}], name="val.jsonl")
    with pytest.raises(LitAlignError) as info:
        module(train, val_path=val, val_split="validation").setup("fit")
    assert str(info.value) == f"{val} row 1: field 'rejected' is empty"


def test_settings_errors():
    with pytest.raises(LitAlignError, match="data.batch_size must be >= 1, got 0"):
        PreferenceDataModule(batch_size=0)
    with pytest.raises(LitAlignError, match=r"data.val_fraction must be in \[0, 1\) or a whole number of rows, got 1.5"):
        PreferenceDataModule(val_fraction=1.5)
    with pytest.raises(LitAlignError, match="data.max_length must be >= 2 or null, got 1"):
        PreferenceDataModule(max_length=1)
    with pytest.raises(LitAlignError, match=r"unknown built-in task 'builtin:nope'"):
        module("builtin:nope").setup("fit")
    with pytest.raises(LitAlignError, match="data.tokenizer is not set and the model does not name one"):
        PreferenceDataModule(path="builtin:sort").setup("fit")


# -- RewardDataModule: the same pairs, never cut, an optional margin -------------------------------------------------


def reward_processed(rows: list[dict], **kw) -> RewardDataModule:
    dm = RewardDataModule(path="unused", val_split=None, tokenizer="builtin:tiny", **{"max_length": 64, **kw})
    dm.tokenizer = load_tokenizer("builtin:tiny")
    dm.processed = dm.process(Dataset.from_list(rows), "rows")
    return dm


def test_reward_pairs_are_the_whole_sequences_trl_tokenizes_with_their_margin():
    """TRL's RewardTrainer tokenizes prompt + chosen + EOS whole: the batch's rows are exactly that, uncut."""
    dm = reward_processed([{"prompt": "sort 31:", "chosen": "13", "rejected": "31", "margin": 0.5},
                           {"prompt": "sort 502:", "chosen": "025", "rejected": "52", "margin": 2}])
    batch = dm.collate(list(dm.processed))
    assert batch["input_ids"].tolist() == [ids("sort 31:13") + [EOS, PAD, PAD], ids("sort 502:025") + [EOS],
                                           ids("sort 31:31") + [EOS, PAD, PAD], ids("sort 502:52") + [EOS, PAD]]
    assert batch["attention_mask"].sum(1).tolist() == [11, 13, 11, 12]
    assert batch["margin"].tolist() == [0.5, 2.0] and batch["margin"].dtype == torch.float32
    plain = reward_processed([{"prompt": "sort 31:", "chosen": "13", "rejected": "31", "other": 1}])
    assert plain.processed.column_names == ["prompt_ids", "chosen_ids", "rejected_ids", "row"]
    assert "margin" not in plain.collate(list(plain.processed))


def test_reward_pairs_with_a_side_longer_than_max_length_are_dropped_not_cut():
    rows = [{"prompt": "sort 31:", "chosen": "13", "rejected": "31"},  # 11 tokens a side
            {"prompt": "sort 31:", "chosen": "13", "rejected": "31 and more"},  # rejected: 20 tokens
            {"prompt": "sort 5021:", "chosen": "0125", "rejected": "5210"}]  # 15 tokens a side
    dm = reward_processed(rows, max_length=15)
    assert [r["row"] for r in dm.processed] == [0, 2] and dm.truncation_report == {"truncated": 0, "dropped": 1}
    assert dm.collate(list(dm.processed))["attention_mask"].sum(1).tolist() == [11, 15, 11, 15]  # nothing cut
    with pytest.raises(LitAlignError, match=r"rows: every pair has a side longer than data.max_length=10 tokens"):
        reward_processed(rows, max_length=10)


@pytest.mark.parametrize("margin", ["1.0", None, float("nan"), True])
def test_a_margin_that_is_not_a_finite_number_names_the_row(margin):
    rows = [{"prompt": "sort 31:", "chosen": "13", "rejected": "31", "margin": 1.0},
            {"prompt": "sort 52:", "chosen": "25", "rejected": "52", "margin": margin}]
    if margin is None or isinstance(margin, float):  # a column of numbers with a null or NaN in it
        with pytest.raises(LitAlignError, match=r"^rows row 1: field 'margin' must be a finite number, got (None|nan)"):
            reward_processed(rows)
    else:  # a column of mixed types does not load as one: every value given as text
        rows = [{**row, "margin": str(row["margin"])} for row in rows]
        with pytest.raises(LitAlignError, match=r"^rows row 0: field 'margin' must be a finite number, got '1.0'$"):
            reward_processed(rows)
