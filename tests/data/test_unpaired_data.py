"""Unpaired preference rows (KTO): checks, tokenization, unpairing of pairs, the batch and its mismatched pairs."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from lit_align.data.unpaired import UNPAIR_BLOCK, UnpairedPreferenceDataModule, collate_unpaired
from lit_align.errors import LitAlignError
from lit_align.models import CHARACTERS, SPECIAL_TOKENS, load_tokenizer

EOS = 2


def ids(text: str) -> list[int]:
    """The built-in tokenizer by hand: one id per character, after the special tokens."""
    return [len(SPECIAL_TOKENS) + CHARACTERS.index(c) for c in text]


def processed(rows: list[dict], **kw):
    dm = UnpairedPreferenceDataModule(path="unused", val_split=None, tokenizer="builtin:tiny", **kw)
    dm.tokenizer = load_tokenizer("builtin:tiny")
    return dm.process(Dataset.from_list(rows), "rows.jsonl")


def test_standard_rows_are_tokenized_with_eos_and_keep_their_label():
    out = processed([{"prompt": "sort 31:", "completion": " 13", "label": True},
                     {"prompt": "sort 52:", "completion": " 25", "label": False}])
    assert out[0] == {"prompt_ids": ids("sort 31:"), "completion_ids": ids(" 13") + [EOS], "label": True, "row": 0}
    assert out[1]["label"] is False and out[1]["row"] == 1


def test_pairs_are_unpaired_in_blocks_desirable_rows_first_as_trl_does():
    pairs = [{"prompt": f"sort {i}:", "chosen": f" c{i}", "rejected": f" r{i}"} for i in range(UNPAIR_BLOCK + 2)]
    out = processed(pairs)
    assert len(out) == 2 * len(pairs)
    n = UNPAIR_BLOCK
    assert out["label"] == [True] * n + [False] * n + [True, True, False, False]
    assert out["row"][:2] == [0, 1] and out["row"][n : n + 2] == [0, 1] and out["row"][-4:] == [n, n + 1, n, n + 1]
    assert out[n]["completion_ids"] == ids(" r0") + [EOS] and out[0]["completion_ids"] == ids(" c0") + [EOS]


def test_conversational_rows():
    with pytest.warns(UserWarning, match="every row is desirable, none undesirable"):  # one row, one side
        out = processed([{"prompt": [{"role": "user", "content": "sort 31:"}],
                          "completion": [{"role": "assistant", "content": "13"}], "label": True}])
    tokenizer = load_tokenizer("builtin:tiny")
    full = tokenizer.apply_chat_template([{"role": "user", "content": "sort 31:"},
                                          {"role": "assistant", "content": "13"}], tokenize=True)
    full = list(full["input_ids"]) if isinstance(full, dict) or hasattr(full, "keys") else list(full)
    assert out[0]["prompt_ids"] + out[0]["completion_ids"] == full
    assert tokenizer.decode(out[0]["completion_ids"]).startswith("13")


def test_collate_rotates_the_completions_for_the_mismatched_pairs():
    rows = [{"prompt_ids": [10, 11], "completion_ids": [20], "label": True, "row": 0},
            {"prompt_ids": [12], "completion_ids": [21, 22], "label": False, "row": 1},
            {"prompt_ids": [13, 14, 15], "completion_ids": [23], "label": True, "row": 2}]
    batch = collate_unpaired(rows, pad_token_id=0, max_length=4)
    assert batch["input_ids"].tolist() == [[10, 11, 20, 0], [12, 21, 22, 0], [13, 14, 15, 23]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 1, 0], [0, 0, 0, 1]]
    # row i: its prompt and row i - 1's completion (row 0: the last one's), cut at max_length
    assert batch["KL_input_ids"].tolist() == [[10, 11, 23, 0], [12, 20, 0, 0], [13, 14, 15, 21]]
    assert batch["KL_completion_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1]]
    assert batch["KL_attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert torch.equal(batch["label"], torch.tensor([True, False, True])) and batch["dataset_rows"].tolist() == [0, 1, 2]
    assert "KL_input_ids" not in collate_unpaired(rows, 0, None, kl=False)


def test_rows_whose_prompt_fills_max_length_are_dropped():
    with pytest.warns(UserWarning, match="every row is undesirable, none desirable"):  # the one row kept
        out = processed([{"prompt": "sort 123456789:", "completion": " 1", "label": True},
                         {"prompt": "s:", "completion": " 1", "label": False}], max_length=8)
    assert out["label"] == [False]
    with pytest.raises(LitAlignError, match="every row was dropped"):
        processed([{"prompt": "sort 123456789:", "completion": " 1", "label": True}], max_length=8)


@pytest.mark.parametrize("label,kind,other", [(True, "desirable", "undesirable"), (False, "undesirable", "desirable")])
def test_rows_all_of_one_label_are_kept_and_said(label, kind, other):
    """TRL trains on rows of one label; so does KTO here, but a label column gone wrong looks the same: a warning."""
    rows = [{"prompt": f"sort {i}1:", "completion": f" 1{i}", "label": label} for i in range(3)]
    with pytest.warns(UserWarning, match=rf"rows.jsonl: every row is {kind}, none {other}: KTO trains on one side "
                                         r"only .*check the 'label' column"):
        out = processed(rows)
    assert out["label"] == [label] * 3


@pytest.mark.parametrize("row,message", [
    ({"prompt": "p", "completion": "c"}, "rows.jsonl row 0: missing column 'label' (expected prompt/completion/label"),
    ({"prompt": "p", "completion": "c", "label": None}, "rows.jsonl row 0: field 'label' is missing or null"),
    ({"prompt": "p", "completion": "c", "label": "yes"}, "rows.jsonl row 0: field 'label' must be a boolean"),
    ({"prompt": "p", "completion": None, "label": True}, "rows.jsonl row 0: field 'completion' is missing or null"),
    ({"prompt": "p", "chosen": "a", "rejected": "a"}, "rows.jsonl row 0: 'chosen' and 'rejected' are identical"),
])
def test_bad_rows_are_one_line_errors_naming_the_row(row, message):
    with pytest.raises(LitAlignError) as info:
        processed([row])
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
