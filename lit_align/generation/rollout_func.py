"""What a ``rollout_func`` returns (TRL's: ``f(prompts, module) -> dict``, making a round's completions instead of the
engine), checked key by key and row by row, as a ``ToolRollout``.

The function is the user's code and its output feeds token ids to the model and log-probs to the loss, so nothing is
taken on trust: a row count or a length that does not match, an id outside the tokenizer, a log-probability that is
not one, an ``env_mask`` value other than 0 or 1, or a reward-function column without one value per completion is one
error naming the key and row (rather than a TypeError, a device-side assert or a silently shortened ``zip``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

from lit_align.errors import LitAlignError
from lit_align.generation.tools import RowTurns, ToolRollout, as_tool_rollout, left_pad

ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")


def rollout_from_output(output: dict, name: str, rows: int, eos_token_ids: list[int], pad_token_id: int,
                        device, vocab_size: int | None = None) -> ToolRollout:
    """What a ``rollout_func`` (TRL's: ``f(prompts, module) -> dict``) returned, as a rollout: per row, its
    ``prompt_ids``, ``completion_ids`` (token ids below ``vocab_size``) and ``logprobs`` (lists or tensors;
    ``logprobs`` may be None), an optional ``env_mask`` (0 on tokens the model did not sample: the tool mask) and any
    other keys, one value per row, which reach the reward functions. Anything else is one error naming the key and
    row."""
    where = f"model.rollout_func {name!r}"
    if not isinstance(output, dict) or set(ROLLOUT_KEYS) - set(output):
        got = sorted(output) if isinstance(output, dict) else type(output).__name__
        raise LitAlignError(f"{where} returned {got}; expected a dict with keys {list(ROLLOUT_KEYS)} (and optionally "
                            "env_mask and reward-function columns)")
    token = "a token id (an int >= 0" + ("" if vocab_size is None else f", < {vocab_size}: the tokenizer's") + ")"

    def is_id(value) -> bool:
        return _is_int(value) and 0 <= value < (vocab_size or math.inf)

    prompts = _output_rows(output["prompt_ids"], "prompt_ids", where, rows, is_id, token)
    completions = _output_rows(output["completion_ids"], "completion_ids", where, rows, is_id, token)
    for key, values in (("prompt_ids", prompts), ("completion_ids", completions)):
        empty = next((i for i, ids in enumerate(values) if not ids), None)
        if empty is not None:
            raise LitAlignError(f"{where}: {key}[{empty}] is empty")
    logps = mask = None
    if output["logprobs"] is not None:
        logps = _output_rows(output["logprobs"], "logprobs", where, rows, _is_logprob,
                             "a log-probability (finite, <= 0)", completions)
    if output.get("env_mask") is not None:
        mask = _output_rows(output["env_mask"], "env_mask", where, rows, lambda v: v in (0, 1), "0 or 1", completions)
    extra = {k: v for k, v in output.items() if k not in (*ROLLOUT_KEYS, "env_mask")}
    for key, values in extra.items():
        if not isinstance(values, (list, tuple)) or len(values) != rows:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise LitAlignError(f"{where}: {key!r} has {got} values for {rows} completions (a reward-function column: "
                                "one value per completion)")
    ends = set(eos_token_ids) | {pad_token_id}
    rows_ = [RowTurns(p, c, mask[i] if mask is not None else [1] * len(c),
                  None if logps is None else [float(v) for v in logps[i]], [])
             for i, (p, c) in enumerate(zip(prompts, completions))]
    rollout = as_tool_rollout(rows_, [c[-1] not in ends for c in completions], [0, 0], pad_token_id, device)
    rollout.prompt_ids, rollout.prompt_mask = left_pad(prompts, pad_token_id, device)
    rollout.messages = None
    if mask is None:
        rollout.tool_mask = None
    rollout.extra = extra
    return rollout


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_logprob(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value <= 0


def _output_rows(values, key: str, where: str, rows: int, valid: Callable, expected: str,
                 lengths: list[list] | None = None) -> list[list]:
    """One key of a ``rollout_func``'s output as ``rows`` lists (tensors as lists), each value ``valid`` and, given
    ``lengths`` (the completions), each row as long as its completion."""
    values = values.tolist() if hasattr(values, "tolist") else values  # a tensor or an array
    if not isinstance(values, (list, tuple)):
        raise LitAlignError(f"{where}: {key} is of type {type(values).__name__!r}, expected a list per completion")
    if len(values) != rows:
        raise LitAlignError(f"{where}: {key} has {len(values)} rows for {rows} completions")
    out = []
    for i, row in enumerate(values):
        row = row.tolist() if hasattr(row, "tolist") else row
        if not isinstance(row, (list, tuple)):
            raise LitAlignError(f"{where}: {key}[{i}] is of type {type(row).__name__!r}, expected a list")
        if lengths is not None and len(row) != len(lengths[i]):
            raise LitAlignError(f"{where}: {key}[{i}] has {len(row)} values for {len(lengths[i])} completion ids")
        bad = next((j for j, v in enumerate(row) if not valid(v)), None)
        if bad is not None:
            raise LitAlignError(f"{where}: {key}[{i}][{bad}] is {row[bad]!r}, expected {expected}")
        out.append(list(row))
    return out
