"""A rollout_func's output (lit_align.generation.rollout_func): each key checked per row, one error naming the key and
row for whatever does not fit; tensors and a missing ``logprobs`` are fine. Through GRPO: tests/modules/
test_grpo_tools_module.py."""

from __future__ import annotations

import pytest
import torch

from lit_align.errors import LitAlignError
from lit_align.generation.rollout_func import rollout_from_output

# what a rollout_func returns for 2 completions (TRL's keys), and its mistakes: key -> value, the error after "'f': "
OUTPUT = {"prompt_ids": [[5, 6], [5, 6]], "completion_ids": [[7, 2], [8, 9, 2]], "logprobs": [[-1, -1], [-1, -1, -1]]}
OUTPUT_MISTAKES = [
    ({"completion_ids": [[7, 2]]}, "completion_ids has 1 rows for 2 completions"),
    ({"completion_ids": [[7, 2]] * 3}, "completion_ids has 3 rows for 2 completions"),
    ({"completion_ids": 7}, "completion_ids is of type 'int', expected a list per completion"),
    ({"completion_ids": ["72", "892"]}, "completion_ids[0] is of type 'str', expected a list"),
    ({"completion_ids": [[7, 2], []]}, "completion_ids[1] is empty"),
    ({"prompt_ids": [[], [5]]}, "prompt_ids[0] is empty"),
    ({"completion_ids": [[7.0, 2], [8, 9, 2]]}, "completion_ids[0][0] is 7.0, expected a token id (an int >= 0, < 100: "
                                                "the tokenizer's)"),
    ({"completion_ids": [[7, 2], [8, 100, 2]]}, "completion_ids[1][1] is 100, expected a token id (an int >= 0, < 100: "
                                                "the tokenizer's)"),
    ({"prompt_ids": [[5, -1], [5, 6]]}, "prompt_ids[0][1] is -1, expected a token id (an int >= 0, < 100: the "
                                        "tokenizer's)"),
    ({"logprobs": [[-1], [-1, -1, -1]]}, "logprobs[0] has 1 values for 2 completion ids"),
    ({"logprobs": [None, [-1, -1, -1]]}, "logprobs[0] is of type 'NoneType', expected a list"),
    ({"logprobs": [[float("nan"), -1], [-1, -1, -1]]},
     "logprobs[0][0] is nan, expected a log-probability (finite, <= 0)"),
    ({"logprobs": [[0.9, 0.5], [-1, -1, -1]]}, "logprobs[0][0] is 0.9, expected a log-probability (finite, <= 0)"),
    ({"env_mask": [[1, 2], [1, 1, 1]]}, "env_mask[0][1] is 2, expected 0 or 1"),
    ({"env_mask": [[1], [1, 1, 1]]}, "env_mask[0] has 1 values for 2 completion ids"),
    ({"score": [1.0]}, "'score' has 1 values for 2 completions (a reward-function column: one value per completion)"),
]


@pytest.mark.parametrize("change,message", OUTPUT_MISTAKES, ids=[m for _, m in OUTPUT_MISTAKES])
def test_a_rollout_func_output_that_does_not_fit_is_one_error_naming_the_key_and_row(change, message):
    with pytest.raises(LitAlignError) as info:
        rollout_from_output({**OUTPUT, **change}, "f", 2, [2], 0, "cpu", vocab_size=100)
    assert str(info.value) == f"model.rollout_func 'f': {message}"


def test_a_rollout_func_may_return_tensors_and_no_logprobs():
    rollout = rollout_from_output({**OUTPUT, "completion_ids": torch.tensor([[7, 2], [8, 2]]), "logprobs": None,
                                   "score": [0.5, 1.0]}, "f", 2, [2], 0, "cpu", vocab_size=100)
    assert rollout.completion_ids.tolist() == [[7, 2], [8, 2]] and rollout.logps is None
    assert rollout.extra == {"score": [0.5, 1.0]} and not rollout.truncated.any()
