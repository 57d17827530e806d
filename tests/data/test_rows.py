"""lit_align.data.rows: the checks and their messages, TRL's prompt/completion rule, EOS, and keep_start/keep_end."""

from __future__ import annotations

import inspect

import pytest

from lit_align.data import CompletionDataModule, PreferenceDataModule, PromptDataModule
from lit_align.data.preference import tokenize_pair
from lit_align.data.rows import (
    ROLES,
    check_completion,
    check_field,
    check_max_length,
    check_messages,
    check_prompt,
    check_text,
    common_prefix_length,
    encode_messages,
    encode_prompt,
    encode_prompt_completion,
    encode_text,
    keep_end,
    keep_start,
    split_implicit_prompt,
    with_eos,
)
from lit_align.errors import LitAlignError


class MergingTokenizer:
    """Longest match over a fixed vocabulary in which ``"ab"`` is one token: ``"xa"`` and ``"xab"`` disagree on
    their second token, as a BPE merge across the prompt/completion boundary makes them."""

    eos_token = "</s>"
    vocab = {"</s>": 0, "ab": 1, "a": 2, "b": 3, "c": 4, "x": 5}

    def __call__(self, text: str) -> dict[str, list[int]]:
        ids = []
        while text:
            piece = next(p for p in sorted(self.vocab, key=len, reverse=True) if text.startswith(p))
            ids.append(self.vocab[piece])
            text = text[len(piece):]
        return {"input_ids": ids}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# -- the checks: one message each, naming the row and the field -------------------------------------------------------


def message_of(check, *args) -> str:
    with pytest.raises(LitAlignError) as info:
        check(*args)
    return str(info.value)


def test_roles():
    assert ROLES == ("system", "user", "assistant", "tool")


def test_check_messages():
    check_messages([user("hi"), assistant("ho")], "chosen", "w")
    for value in ([], "hi", None):
        assert message_of(check_messages, value, "chosen", "w") == (
            "w: field 'chosen' must be a non-empty list of {role, content} messages"
        )
    assert message_of(check_messages, [user("hi"), {"role": "user", "text": "x"}], "chosen", "w") == (
        "w: chosen[1] must be a {role, content} message with string content"
    )
    assert message_of(check_messages, ["hi"], "chosen", "w") == (
        "w: chosen[0] must be a {role, content} message with string content"
    )
    assert message_of(check_messages, [{"role": "bot", "content": "x"}], "chosen", "w") == (
        "w: chosen[0] has role 'bot', expected one of ('system', 'user', 'assistant', 'tool')"
    )


def test_a_completion_of_blank_messages_is_empty_as_a_blank_string_is():
    """A conversational completion whose every message is blank says nothing, as an empty string one: refused. A turn
    that only calls tools has content; a blank conversational prompt is left alone (an environment may fill it)."""
    for value in ([assistant("")], [assistant(" \n"), assistant("")]):
        assert message_of(check_completion, value, "rejected", "w", True) == (
            "w: field 'rejected' is empty (no message has content)")
    assert message_of(check_completion, " ", "chosen", "w", False) == "w: field 'chosen' is empty"
    call = {"type": "function", "function": {"name": "add", "arguments": {}}}
    check_completion([{"role": "assistant", "content": None, "tool_calls": [call]}], "completion", "w", True)
    assert check_prompt([user("")], "w") is True


def test_check_text():
    check_text("13", "chosen", "w")
    assert message_of(check_text, 13, "chosen", "w") == "w: field 'chosen' must be a string, got int"
    assert message_of(check_text, " \n", "chosen", "w") == "w: field 'chosen' is empty"


def test_check_field():
    assert message_of(check_field, None, "rejected", "w", False) == "w: field 'rejected' is missing or null"
    assert message_of(check_field, None, "rejected", "w", True) == "w: field 'rejected' is missing or null"
    assert message_of(check_field, [user("a")], "rejected", "w", False) == (
        "w: field 'rejected' must be a string, got list"
    )
    assert message_of(check_field, "a", "rejected", "w", True) == (
        "w: field 'rejected' must be a non-empty list of {role, content} messages"
    )


def test_check_prompt():
    assert check_prompt("sort 31:", "w") is False
    assert check_prompt([user("sort 31:")], "w") is True
    assert message_of(check_prompt, "  ", "w") == "w: field 'prompt' is empty"
    assert message_of(check_prompt, [{"role": "narrator", "content": "x"}], "w") == (
        "w: prompt[0] has role 'narrator', expected one of ('system', 'user', 'assistant', 'tool')"
    )
    assert message_of(check_prompt, [{"role": "user"}], "w") == (
        "w: prompt[0] must be a {role, content} message with string content"
    )
    for value, kind in ((None, "NoneType"), ([], "list"), (3, "int")):
        assert message_of(check_prompt, value, "w") == (
            f"w: field 'prompt' must be a string or a list of messages, got {kind}"
        )


# -- formats --------------------------------------------------------------------------------------------------------


def test_split_implicit_prompt():
    assert common_prefix_length("Q: 2+2? A: 4", "Q: 2+2? A: 5") == 11
    assert split_implicit_prompt("Q: 2+2? A: 4", "Q: 2+2? A: 5") == ("Q: 2+2? A:", " 4", " 5")  # the space stays
    assert split_implicit_prompt("ab", "ac") == ("a", "b", "c")
    assert split_implicit_prompt("yes", "no") == ("", "yes", "no")
    chosen, rejected = [user("hi"), assistant("ab")], [user("hi"), assistant("ba")]
    assert split_implicit_prompt(chosen, rejected) == ([user("hi")], [assistant("ab")], [assistant("ba")])


# -- encoding: TRL's rule and the EOS of standard rows -----------------------------------------------------------------


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([7], [1]) == 0


def test_with_eos_appends_once(tokenizer):
    assert with_eos(tokenizer, "13") == "13</s>"
    assert with_eos(tokenizer, "13</s>") == "13</s>"
    eos = tokenizer.eos_token_id
    assert encode_prompt_completion(tokenizer, "sort 31:", "13", False) == (
        encode_text(tokenizer, "sort 31:"), encode_text(tokenizer, "13") + [eos])
    assert encode_prompt_completion(tokenizer, "sort 31:", "13</s>", False)[1] == encode_text(tokenizer, "13") + [eos]


def test_encode_messages_and_prompt(tokenizer):
    chat = [user("sort 31:")]
    expected = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, add_generation_prompt=True)
    assert encode_messages(tokenizer, chat, add_generation_prompt=True) == list(expected["input_ids"])
    assert tokenizer.decode(encode_prompt(tokenizer, chat, True)) == "<|user|>sort 31:\n<|assistant|>"
    assert tokenizer.decode(encode_messages(tokenizer, chat)) == "<|user|>sort 31:\n"
    assert encode_prompt(tokenizer, "sort 31:", False) == encode_text(tokenizer, "sort 31:")


def test_conversational_completion_is_closed_by_the_template(tokenizer):
    chat = [user("sort 31:")]
    prompt_ids, completion_ids = encode_prompt_completion(tokenizer, chat, [assistant("13")], True)
    assert prompt_ids == encode_prompt(tokenizer, chat, True)
    assert completion_ids == encode_text(tokenizer, "13") + [tokenizer.eos_token_id]


def test_the_completion_starts_where_the_tokenizations_diverge():
    tok = MergingTokenizer()
    assert tok("xa")["input_ids"] == [5, 2] and tok("xab</s>")["input_ids"] == [5, 1, 0]
    # "xa" + "b": the merged "ab" belongs to the completion, the prompt keeps only "x"
    assert encode_prompt_completion(tok, "xa", "b", False) == ([5], [1, 0])
    # no merge across the boundary: the whole prompt stays the prompt
    assert encode_prompt_completion(tok, "xa", "c", False) == ([5, 2], [4, 0])


def test_a_pair_applies_the_rule_per_side_and_keeps_the_shared_prompt():
    tok = MergingTokenizer()
    # chosen diverges after 1 token, rejected after 2: the prompt is the 1 token both keep, and the rejected side
    # gets the prompt token its own split left out
    assert tokenize_pair(tok, "xa", "b", "c", False) == {"prompt_ids": [5], "chosen_ids": [1, 0],
                                                          "rejected_ids": [2, 4, 0]}


# -- truncation ----------------------------------------------------------------------------------------------------


def test_keep_start_and_keep_end():
    ids = [1, 2, 3, 4, 5]
    assert keep_start(ids, 3) == [1, 2, 3]
    assert keep_end(ids, 3) == [3, 4, 5]
    for keep in (keep_start, keep_end):
        assert keep(ids, None) == ids
        assert keep(ids, 5) == ids
        assert keep(ids, 9) == ids
        assert keep([], 2) == []


def test_check_max_length():
    assert check_max_length(None) is None
    assert check_max_length(2) == 2
    for bad in (1, 0, -3):
        assert message_of(check_max_length, bad) == f"data.max_length must be >= 2 or null, got {bad}"


@pytest.mark.parametrize("cls,default", [(PreferenceDataModule, 1024), (CompletionDataModule, 1024),
                                         (PromptDataModule, 512)])
def test_each_data_module_declares_its_max_length(cls, default):
    """The table of the module docstring: each module's own default, in its signature (what LightningCLI reads)."""
    assert inspect.signature(cls.__init__).parameters["max_length"].default == default
    assert cls().max_length == default
    assert cls(max_length=None).max_length is None
    with pytest.raises(LitAlignError, match="data.max_length must be >= 2 or null, got 1"):
        cls(max_length=1)
