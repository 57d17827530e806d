"""Environments for tool rollouts (TRL's ``environment_factory``): objects whose methods are the tools.

An environment class has ``reset(**row) -> str | None`` (called with the rollout's dataset row, prompt included; the
text it returns is appended to the last user message), public methods that become the rollout's tools (type hints
and a Google-style docstring, as any tool), and optionally ``get_reward() -> float``: the environment then owns a
reward, scored after the rollout and logged under its class name (weight 1), and ``reward_funcs`` may be empty.
Each rollout gets its own instance, made for it and dropped after the round (instances are not in checkpoints: a run
resumed mid-round trains on the round's saved completions and rewards, and the next round starts new instances).
``Environments`` takes one factory for every row, or a mapping of names to factories that picks one per row by its
``environment`` column; only that environment's tools appear in the row's prompt.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from lit_align.data.rows import encode_messages
from lit_align.errors import LitAlignError, one_line
from lit_align.generation.tools import ToolLoop, ToolRollout, tool_schema
from lit_align.imports import load_callable

WHERE = "model.environment_factory"


def _methods(environment_class: type) -> list[str]:
    """The public methods that become tools (read off the class: properties are not evaluated)."""
    return [name for name, _ in inspect.getmembers(environment_class, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")]


def _reward_of(environment_class: type) -> Callable:
    """A reward function (TRL's convention) scoring the rollouts whose environment is exactly ``environment_class``
    by their ``get_reward()``; None for the others."""
    def reward(environments: list, **_: Any) -> list[float | None]:
        return [e.get_reward() if type(e) is environment_class else None for e in environments]

    reward.__name__ = environment_class.__name__
    return reward


class Environments:
    """One environment factory, or several by name (``{name: factory}``: each row's ``environment`` column picks).

    Args:
        spec: a dotted path to a class (or any callable returning an instance), ``{class_path, init_args}``, or a
            mapping of names to those.
    """

    def __init__(self, spec: str | dict):
        single = isinstance(spec, str) or (isinstance(spec, dict) and "class_path" in spec)
        specs = {None: spec} if single else spec
        if not isinstance(specs, dict) or not specs:
            raise LitAlignError(f"{WHERE}: expected a class path, {{class_path, init_args}} or a mapping of names to "
                                f"those, got {spec!r}")
        self.factories: dict[str | None, Callable] = {}
        self.classes: dict[str | None, type] = {}
        for name, factory_spec in specs.items():
            factory = _factory(factory_spec)
            probe = _make(factory, WHERE)  # one instance, to read its class: its reset, tools and reward
            cls = type(probe)
            if not callable(getattr(probe, "reset", None)):
                raise LitAlignError(f"{WHERE}: {cls.__name__} has no reset method "
                                    "(expected reset(**row) -> str | None)")
            for method in _methods(cls):
                tool_schema(getattr(probe, method), where=f"{WHERE} ({cls.__name__})")
            self.factories[name], self.classes[name] = factory, cls
        self.multi = not single

    def reward_functions(self) -> list[Callable]:
        """One reward function per environment class that defines ``get_reward`` (a class named twice: once)."""
        classes = dict.fromkeys(c for c in self.classes.values() if callable(getattr(c, "get_reward", None)))
        return [_reward_of(c) for c in classes]

    def start(self, tokenizer, prompts: list[list[dict]], rows: list[dict], where: list[str],
              tools: dict[str, Callable], chat_template_kwargs: dict | None = None
              ) -> tuple[list, list[list[int]], list[dict[str, Callable]]]:
        """For each rollout: a fresh environment, reset with its row (``where`` names it in errors), and the prompt
        (the reset's text appended to its last user message) rendered with the standalone ``tools`` and the
        environment's. Returns ``(environments, prompt ids, each rollout's tools by name)``."""
        environments, prompt_ids, row_tools = [], [], []
        for prompt, row, place in zip(prompts, rows, where):
            name = row.get("environment") if self.multi else None
            if name not in self.factories:
                raise LitAlignError(f"{place}: field 'environment' is {name!r}, expected one of "
                                    f"{sorted(map(str, self.factories))} ({WHERE})")
            environment = _make(self.factories[name], f"{place} ({WHERE})")
            arguments = {k: v for k, v in row.items() if not (self.multi and k == "environment")}
            try:
                observation = environment.reset(**arguments)
            except Exception as exc:  # noqa: BLE001 - the user's environment: say which row and what it raised
                raise LitAlignError(f"{place}: {type(environment).__name__}.reset raised {type(exc).__name__}: "
                                    f"{one_line(exc, 200)} ({WHERE})") from None
            if observation is not None:
                if not isinstance(observation, str):
                    raise LitAlignError(f"{place}: {type(environment).__name__}.reset returned "
                                        f"{type(observation).__name__}, expected str or None ({WHERE})")
                prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
            own = {**tools, **{method: getattr(environment, method) for method in _methods(type(environment))}}
            template = {**(chat_template_kwargs or {}), "tools": [tool_schema(t) for t in own.values()]}
            environments.append(environment)
            prompt_ids.append(encode_messages(tokenizer, prompt, add_generation_prompt=True, template=template))
            row_tools.append(own)
        return environments, prompt_ids, row_tools

    def rollout(self, loop: ToolLoop, engine, model, batch: dict, num_samples: int, eos_token_ids: list[int],
                pad_token_id: int) -> ToolRollout:
        """``num_samples`` rollouts per prompt of ``batch`` (``PromptDataModule``'s), each in its own environment:
        their prompts rendered here (after ``reset``), so the rollout carries them (``prompt_ids``, ``prompt_mask``)."""
        prompts = [p for p in batch["prompts"] for _ in range(num_samples)]
        if not all(isinstance(p, list) for p in prompts):
            raise LitAlignError(f"{WHERE}: prompts must be conversational (a list of {{role, content}} messages)")
        columns = batch["columns"]
        rows, where = [], []
        dataset_rows = batch.get("dataset_rows")
        for i, prompt in enumerate(batch["prompts"]):
            row = {"prompt": prompt, **{k: v[i] for k, v in columns.items()}}
            place = f"dataset row {dataset_rows[i]}" if dataset_rows is not None else f"prompt {i} of the batch"
            rows += [row] * num_samples
            where += [place] * num_samples
        environments, ids, row_tools = self.start(loop.tokenizer, prompts, rows, where, loop.tools)
        width = max(map(len, ids))
        device = batch["prompt_ids"].device
        prompt_ids = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in ids], device=device)
        prompt_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids], device=device)
        rollout = loop.generate(engine, model, prompt_ids, prompt_mask, 1, eos_token_ids, pad_token_id,
                                row_tools=row_tools)
        rollout.prompt_ids, rollout.prompt_mask, rollout.environments = prompt_ids, prompt_mask, environments
        return rollout


def _make(factory: Callable, where: str):
    """A new environment from ``factory``; one that raises (wrong ``init_args``, a service down) is one error."""
    try:
        return factory()
    except Exception as exc:  # noqa: BLE001 - the user's class: say which and what it raised
        name = getattr(getattr(factory, "func", factory), "__name__", type(factory).__name__)  # a partial: its class
        raise LitAlignError(f"{where}: making an environment with {name} raised {type(exc).__name__}: "
                            f"{one_line(exc, 200)}") from None


def _factory(spec) -> Callable:
    """A factory from its spec: a callable, a class path (the class is the factory) or ``{class_path, init_args}``
    (a new instance of the class per call)."""
    if callable(spec):
        return spec
    label, expected = WHERE + ": {!r}", "a class path"
    if isinstance(spec, dict) and "class_path" in spec:
        cls, init_args = load_callable(spec["class_path"], label, expected), spec.get("init_args") or {}
        return partial(cls, **init_args)
    return load_callable(spec, label, expected)
