"""Reward functions, with TRL's calling convention.

A reward function is any Python callable ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``
(one value per completion; None where the function does not apply). ``columns`` are the dataset's extra columns,
one value per completion (e.g. ``answer``). Configs name them by dotted path: ``lit_align.rewards.sort_accuracy`` or
``my_package.my_module.my_reward``. Completions are strings, or ``[{"role": "assistant", "content": ...}]`` for
conversational prompts.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Any, Callable

from lit_align.data.tasks import SortTask
from lit_align.errors import LitAlignError


def _text(completion: Any) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def sort_accuracy(completions: list, answer: list[str], **_: Any) -> list[float]:
    """The built-in sort task's score: 1.0 for the exact answer, partial credit (up to 0.5) for digits in place."""
    return [SortTask.score(_text(c), a) for c, a in zip(completions, answer)]


def sort_exact(completions: list, answer: list[str], **_: Any) -> list[float]:
    """1.0 for the exact answer, else 0.0 (the task's held-out accuracy)."""
    return [float(_text(c).strip() == a) for c, a in zip(completions, answer)]


def last_number_match(completions: list, answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion's last number equals the answer's last number (GSM8K-style ``... #### 42``), else 0."""
    def last_number(text: str) -> str | None:
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
        return numbers[-1].replace(",", "") if numbers else None

    return [float(last_number(_text(c)) is not None and last_number(_text(c)) == last_number(a))
            for c, a in zip(completions, answer)]


def import_reward(path: str) -> Callable:
    """Resolve ``package.module.function`` to the callable."""
    module_name, _, attr = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError) as exc:
        raise LitAlignError(f"reward function {path!r}: cannot import it ({exc})") from None
    if not callable(fn):
        raise LitAlignError(f"reward function {path!r}: expected a dotted path to a callable like 'pkg.module.fn'")
    return fn


def reward_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def score(fn: Callable, prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list]) -> list[float]:
    """Call one reward function and check what it returns; None becomes NaN (not applicable)."""
    name = reward_name(fn)
    try:
        values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    except Exception as exc:  # noqa: BLE001 - the user's function; say whose and what
        raise LitAlignError(f"reward function {name!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise LitAlignError(f"reward function {name!r} returned {got} values for {len(completions)} completions "
                            "(expected a list of floats, one per completion)")
    out = []
    for i, value in enumerate(values):
        if value is None:
            out.append(math.nan)
            continue
        try:
            if isinstance(value, (str, bytes)):  # float("1.0") would pass: a number was meant, not text
                raise TypeError
            value = float(value)
        except (TypeError, ValueError):
            raise LitAlignError(f"reward function {name!r} returned {value!r} for completion {i} (expected a float)") from None
        if math.isnan(value) or math.isinf(value):
            raise LitAlignError(f"reward function {name!r} returned {value} for completion {i} (use None to skip)")
        out.append(value)
    return out
