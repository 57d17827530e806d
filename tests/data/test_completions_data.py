"""SFT rows: CompletionDataModule's formats, tokenization, truncation, batches and bad input."""

from __future__ import annotations

import pytest
from helpers import TOOL_ROW, tool_row_tokens

from lit_align.data.completions import CompletionDataModule, tokenize_completion
from lit_align.errors import LitAlignError


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def datamodule(path: str, **kw) -> CompletionDataModule:
    kw.setdefault("val_split", None)
    return CompletionDataModule(path, tokenizer="builtin:tiny", **kw)


def test_standard_row_appends_eos_and_masks_the_prompt(tokenizer):
    out = tokenize_completion(tokenizer, "sort 31:", "13", conversational=False)
    prompt, completion = ids(tokenizer, "sort 31:"), ids(tokenizer, "13") + [tokenizer.eos_token_id]
    assert out["input_ids"] == prompt + completion
    assert out["completion_mask"] == [0] * len(prompt) + [1] * len(completion)
    # a completion that already ends with EOS gets no second one
    assert tokenize_completion(tokenizer, "sort 31:", "13</s>", False) == out


def test_conversational_rows_use_the_chat_template(tokenizer):
    prompt = [{"role": "user", "content": "sort 31:"}]
    completion = [{"role": "assistant", "content": "13"}]
    out = tokenize_completion(tokenizer, prompt, completion, conversational=True)
    head = tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=True, add_generation_prompt=True)
    head = list(head["input_ids"])
    assert tokenizer.decode(head) == "<|user|>sort 31:\n<|assistant|>"
    assert out["input_ids"] == head + ids(tokenizer, "13") + [tokenizer.eos_token_id]  # the template closes the turn
    assert out["completion_mask"] == [0] * len(head) + [1] * 3


def test_all_formats_through_a_file(write_jsonl, tokenizer):
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort 31:"},
                    {"role": "assistant", "content": "13"}]
    rows = [
        {"prompt": "sort 31:", "completion": "13"},
        {"prompt": conversation[:2], "completion": conversation[2:]},
    ]
    standard = datamodule(write_jsonl(rows[:1]))
    standard.setup("fit")
    conversational = datamodule(write_jsonl(rows[1:], name="chat.jsonl"))
    conversational.setup("fit")
    messages = datamodule(write_jsonl([{"messages": conversation}], name="messages.jsonl"))
    messages.setup("fit")
    assert standard.train_data[0] == {**tokenize_completion(tokenizer, "sort 31:", "13", False), "assistant_mask": [],
                                      "row": 0}
    expected = tokenize_completion(tokenizer, conversation[:2], conversation[2:], True)
    assert conversational.train_data[0] == {**expected, "assistant_mask": expected["completion_mask"], "row": 0}
    # `messages` is language modelling (TRL's): the same tokens, all of them trained; its assistant turn is marked
    assert messages.train_data[0] == {"input_ids": expected["input_ids"],
                                      "completion_mask": [1] * len(expected["input_ids"]),
                                      "assistant_mask": expected["completion_mask"], "row": 0}


def test_a_conversational_completion_marks_its_assistant_turns_not_its_tool_turns(write_jsonl, tokenizer):
    """TRL's masks for a prompt/completion row with a tool turn: ``assistant_mask`` on every assistant turn (the
    prompt's too; the loss keeps the completion's: tests/modules/test_sft_module.py), not on the tool's result."""
    dm = datamodule(write_jsonl([TOOL_ROW]), chat_template="builtin:tools", assistant_only_loss=True)
    dm.setup("fit")
    assert dm.train_data[0] == {**tool_row_tokens(tokenizer), "row": 0}


def test_collate_right_pads_and_truncation_keeps_the_start(write_jsonl, tokenizer):
    path = write_jsonl([{"prompt": "sort 31:", "completion": "13"}, {"prompt": "sort 9:", "completion": "9"},
                        {"prompt": "sort 4321:", "completion": "1234"}])
    dm = datamodule(path, max_length=11, shuffle=False, batch_size=3)
    dm.setup("fit")
    assert dm.truncation_report == {"truncated": 1, "dropped": 0}
    batch = next(iter(dm.train_dataloader()))
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    assert batch["input_ids"].tolist() == [
        ids(tokenizer, "sort 31:13") + [eos],
        ids(tokenizer, "sort 9:9") + [eos] + [pad] * 2,
        ids(tokenizer, "sort 4321:1"),  # 10 prompt tokens + the first completion token: the EOS is cut
    ]
    assert batch["attention_mask"].tolist() == [[1] * 11, [1] * 9 + [0] * 2, [1] * 11]
    assert batch["completion_mask"].tolist() == [[0] * 8 + [1] * 3, [0] * 7 + [1] * 2 + [0] * 2, [0] * 10 + [1]]


@pytest.mark.parametrize(
    "rows, match",
    [
        ([{"prompt": "sort 1:", "completion": "1"}, {"prompt": "sort 2:", "completion": None}],
         "FILE row 1: field 'completion' is missing or null"),
        ([{"prompt": "sort 1:", "completion": "1"}, {"prompt": "  ", "completion": "2"}],
         "FILE row 1: field 'prompt' is empty"),
        ([{"prompt": "sort 1:", "completion": "1"}, {"prompt": "sort 2:", "completion": ""}],
         "FILE row 1: field 'completion' is empty"),
        ([{"prompt": [{"role": "user", "content": "sort 1:"}], "completion": "1"}],
         "FILE row 0: field 'completion' must be a non-empty list of {role, content} messages"),
        ([{"prompt": [{"role": "user", "content": "sort 1:"}], "completion": [{"role": "bot", "content": "1"}]}],
         "FILE row 0: completion[0] has role 'bot'"),
        ([{"messages": [{"role": "user", "content": "sort 1:"}, {"role": "assistant", "content": "1"}]},
          {"messages": [{"role": "user", "content": "sort 1:"}, {"role": "bot", "content": "1"}]}],
         "FILE row 1: messages[1] has role 'bot'"),
        ([{"prompt": "sort 1:", "answer": "1"}],
         "FILE: columns ['answer', 'prompt']: expected 'prompt' and 'completion', 'messages' or 'text'"),
        ([{"prompt": "sort 1234567890123:", "completion": "1"}],
         "FILE row 0: the prompt alone is 19 tokens, max_length is 16"),
    ],
)
def test_bad_rows_name_file_row_and_field(write_jsonl, rows, match):
    path = write_jsonl(rows)
    with pytest.raises(LitAlignError) as info:
        datamodule(path, max_length=16).setup("fit")
    message = str(info.value).replace(path, "FILE")
    assert "\n" not in message
    assert message.startswith(match), message
