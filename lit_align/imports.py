"""What a config names by Python path: reward functions, tools, environment factories, rollout functions, modules.

A config names a callable by dotted path (``pkg.module.attr``: the attribute itself) or as ``{class_path,
init_args}`` (an instance of the class, built with ``init_args``: its ``__call__`` is what runs). ``load_callable``
is the one loader; each caller says how its errors name the spec and what a path should name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from lit_align.errors import LitAlignError


def import_object(path: str) -> Any:
    """What ``pkg.module.attr`` names; None for a name without a dot (no module to look in). ImportError or
    AttributeError when the module or the attribute is not there."""
    module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr) if module_name else None


def load_callable(spec: str | dict, label: str, expected: str) -> Callable:
    """The callable a config names: the object at a dotted path, or an instance for ``{class_path, init_args}``.

    Args:
        spec: a dotted path, or ``{class_path, init_args}``.
        label: how an error names the spec, a format string for its path (``"reward function {!r}"``).
        expected: what a path should name, for the error when it names nothing callable (``"a dotted path to a
            function"``).
    """
    path = spec if isinstance(spec, str) else spec.get("class_path") if isinstance(spec, dict) else None
    if not isinstance(path, str):
        raise LitAlignError(f"{label.format(spec)}: expected {expected}, or {{class_path, init_args}}")
    name = label.format(path)
    try:
        target = import_object(path)
    except (ImportError, AttributeError) as exc:
        raise LitAlignError(f"{name}: cannot import it ({exc})") from None
    if not callable(target):
        raise LitAlignError(f"{name}: expected {expected}")
    if isinstance(spec, dict):
        try:
            target = target(**(spec.get("init_args") or {}))
        except TypeError as exc:
            raise LitAlignError(f"{name}: {exc}") from None
        if not callable(target):
            raise LitAlignError(f"{name} is not callable (expected a function, or a class with __call__)")
    return target


def callable_name(fn: Callable) -> str:
    """How logs and tool schemas name a callable: a function's name, else its class's (a ``{class_path}`` one)."""
    return getattr(fn, "__name__", type(fn).__name__)
