"""Reward functions, with TRL's calling convention.

A reward function is any Python callable ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``
(one value per completion; None where the function does not apply). ``columns`` are the dataset's extra columns,
one value per completion (e.g. ``answer``). Configs name them by dotted path: ``lit_align.rewards.sort_accuracy`` or
``my_package.my_module.my_reward``, or as ``{class_path, init_args}`` for a parametrised reward (an object whose
``__call__`` is the reward). As TRL, functions also get ``trainer_state`` (``RewardState``: global_step, max_steps,
epoch), ``log_metric(name, value)`` (logged as ``train/<name>``, averaged over the round) and
``log_extra(column, values)`` (a column of the completions table); ``async def`` functions run concurrently.
Completions are strings, or ``[{"role": "assistant", "content": ...}]`` for conversational prompts. A reward model
(a sequence classifier scoring ``prompt + completion``) is named by its hub name or directory (``RewardModel``).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lit_align.data.rows import with_eos
from lit_align.data.tasks import ArithmeticTask, CalculatorTask, SortTask
from lit_align.errors import LitAlignError
from lit_align.imports import callable_name, load_callable


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


def arith_format(completions: list, **_: Any) -> list[float]:
    """1.0 when the completion is one equation ``a op b = c`` (the built-in arith task's answer format), else 0."""
    return [float(ArithmeticTask.is_equation(_text(c))) for c in completions]


def arith_exact(completions: list, answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion is one equation whose result is the answer (format and correctness), else 0."""
    return [float(ArithmeticTask.is_equation(_text(c)) and _text(c).strip().rsplit("=", 1)[1].strip() == a)
            for c, a in zip(completions, answer)]


def calculator_call_format(completions: list, **_: Any) -> list[float | None]:
    """The built-in calculator task's call format: 1.0 when every tool call of the completion is a ``calculator``
    call whose ``expression`` the tool evaluates, 0.0 when one is not, None (not counted) without calls. Logged at
    weight 0 beside the answer's reward: the valid-call rate."""
    def valid(call: dict) -> bool:
        function = call.get("function", call)
        arguments = function.get("arguments")
        try:
            CalculatorTask.evaluate(arguments.get("expression") if isinstance(arguments, dict) else None)
        except ValueError:
            return False
        return function.get("name") == "calculator"

    out: list[float | None] = []
    for completion in completions:
        turns = completion if isinstance(completion, list) else []
        calls = [c for m in turns if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
        out.append(float(all(valid(c) for c in calls)) if calls else None)
    return out


def pass_at_k(solved: torch.Tensor, k: int) -> torch.Tensor:
    """pass@k per prompt, the unbiased estimator (Chen et al. 2021): ``solved`` is ``[P, n]`` (each prompt's ``n``
    samples, True where solved), the value ``1 - C(n - c, k) / C(n, k)`` with ``c`` solved samples: the chance that
    ``k`` samples drawn without replacement from the ``n`` hold a solved one. A product of ``k`` ratios, so no
    binomial coefficient overflows."""
    n = solved.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n samples per prompt, got k={k}, n={n}")
    c = solved.sum(1, dtype=torch.float64)
    # C(n - c, k) / C(n, k) = prod over i in (n - k, n] of (i - c) / i: one factor is 0 when c > n - k
    i = torch.arange(n - k + 1, n + 1, dtype=torch.float64, device=solved.device)
    return 1 - (1 - c.unsqueeze(1) / i).clamp(min=0).prod(1)


@dataclass
class RewardState:
    """What a reward function gets as ``trainer_state`` (TRL passes its ``TrainerState``): training progress, for
    rewards shaped by it."""

    global_step: int
    max_steps: int
    epoch: int


class RewardModel:
    """A sequence classifier as a reward function (TRL's reward model given by name): the completion's reward is the
    model's single logit on ``prompt + completion``.

    Text prompts are joined to their completions, each completion ending with the reward model's EOS token (appended
    unless it is there): the text a reward model trained on standard rows saw (TRL's ``RewardTrainer`` and
    ``lit_align.modules.RewardModule`` append it), whose reward is read at that EOS. TRL's ``GRPOTrainer`` scores
    ``prompt + completion`` without it; a reward model trained on the built-in sort task ranks 200 held-out pairs
    79% right with the EOS and 56% without it (docs/reward.md). Conversations are rendered with the
    reward model's own chat template, which closes the assistant turn itself (its tokenizer is its own, not the
    policy's). Rows are scored ``batch_size`` at a time, right-padded,
    without added special tokens (the text is what the policy saw), on the policy's device. ``load`` runs in the
    module's ``configure_model`` with the policy's ``dtype``, ``trust_remote_code`` and ``model_init_kwargs``; the
    model is not a submodule of the LightningModule: never trained, not in checkpoints.

    Args:
        model: a hub name (``org/name``) or a local Hugging Face directory of a model with a sequence-classification
            head and one label, the head's weights in its checkpoint (a causal LM is refused, not given a random head).
        batch_size: rows per forward.
    """

    def __init__(self, model: str, batch_size: int = 32):
        if batch_size < 1:
            raise LitAlignError(f"reward model {model!r}: batch_size must be >= 1, got {batch_size}")
        from lit_align.models import check_loadable

        check_loadable(model, "reward model")  # a local path that is not there: now, not when the run starts
        self.model_name, self.batch_size = model, batch_size
        self.__name__ = model.rstrip("/").split("/")[-1]  # as TRL names it: the model id's last part
        self.network = self.tokenizer = None

    def load(self, dtype: str = "float32", trust_remote_code: bool = False, model_init_kwargs: dict | None = None):
        from transformers import AutoModelForSequenceClassification

        from lit_align.models import load_model, load_tokenizer

        if self.network is not None:
            return self
        self.tokenizer = load_tokenizer(self.model_name, trust_remote_code=trust_remote_code)
        network, info = load_model(self.model_name, dtype=dtype, attn_implementation=None,
                                   trust_remote_code=trust_remote_code,
                                   model_init_kwargs={**(model_init_kwargs or {}), "num_labels": 1,
                                                      "output_loading_info": True},
                                   auto_class=AutoModelForSequenceClassification)
        # a causal LM loads too: transformers starts the head it lacks from random weights and only logs "MISSING"
        if info["missing_keys"]:
            raise LitAlignError(f"reward model {self.model_name!r}: its checkpoint has no weights for "
                                f"{sorted(info['missing_keys'])}, which would start from random values: not a reward "
                                "model (expected a sequence classifier trained with one label, e.g. by TRL's "
                                "RewardTrainer)")
        self.network = network.eval().requires_grad_(False)
        self.network.config.pad_token_id = self.tokenizer.pad_token_id  # the score is read at the last real token
        return self

    def to(self, device) -> RewardModel:
        self.load().network.to(device)
        return self

    def texts(self, prompts: list, completions: list) -> list[str]:
        if not isinstance(prompts[0], list):
            if self.tokenizer.eos_token is None:
                return [p + c for p, c in zip(prompts, completions)]
            return [p + with_eos(self.tokenizer, c) for p, c in zip(prompts, completions)]
        if not self.tokenizer.chat_template:
            raise LitAlignError(f"reward model {self.model_name!r}: conversational prompts need a chat template, "
                                "and its tokenizer has none")
        return [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **_: Any) -> list[float]:
        self.load()
        texts, device, scores = self.texts(prompts, completions), self.network.device, []
        for i in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(texts[i : i + self.batch_size], return_tensors="pt", padding=True,
                                    padding_side="right", add_special_tokens=False).to(device)
            scores += self.network(**inputs).logits[:, 0].float().tolist()
        return scores


def is_model_name(spec: str) -> bool:
    """A reward given as a model (a local directory, or ``org/name``), not as a dotted path (which has no ``/``)."""
    return "/" in spec or Path(spec).expanduser().is_dir()


def load_reward(spec: str | dict | Callable) -> Callable:
    """A reward: a callable (from Python, as TRL takes it); from a config, a dotted path to a callable, a reward
    model's hub name or directory (``RewardModel``), or ``{class_path, init_args}`` for a parametrised one (an object
    whose ``__call__`` is the reward)."""
    if callable(spec):
        return spec
    if isinstance(spec, str) and is_model_name(spec):
        return RewardModel(spec)
    return load_callable(spec, "reward function {!r}", "a dotted path to a callable like 'pkg.module.fn', or a "
                                                       "reward model's hub name ('org/name') or directory")


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def score_all(fns: list[Callable], prompts: list, completions: list, completion_ids: list[list[int]],
              columns: dict[str, list], extra: dict | None = None) -> list[list[float]]:
    """Every reward function's checked values (``score``), the async ones run concurrently (``asyncio.gather``).
    ``extra``: TRL's further keyword arguments (``trainer_state``, ``log_metric``, ``log_extra``)."""
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns,
              **(extra or {})}
    waiting = {i: fn for i, fn in enumerate(fns) if _is_async(fn)}
    results: dict[int, Any] = {}
    if waiting:
        async def gather():
            return await asyncio.gather(*(fn(**kwargs) for fn in waiting.values()), return_exceptions=True)

        results = dict(zip(waiting, asyncio.run(gather())))
    values = [score(fn, prompts, completions, completion_ids, columns, extra, returned=results.get(i, _NOT_RUN))
              for i, fn in enumerate(fns)]
    warn_unscorable(values, prompts, completions, columns)
    return values


def warn_unscorable(values: list[list[float]], prompts: list, completions: list, columns: dict[str, list]) -> None:
    """TRL's warning when every reward function returned None for a completion (its reward is then NaN and its
    advantage 0: it teaches nothing): the first such completion's arguments. Every rank warns of its own rows."""
    unscorable = [i for i in range(len(completions)) if all(math.isnan(v[i]) for v in values)]
    if not unscorable:
        return
    i = unscorable[0]
    row = {**{k: v[i] for k, v in columns.items()}, "prompt": prompts[i], "completion": completions[i]}
    warnings.warn(f"All reward functions returned None for the following kwargs: {row}; please ensure that at least "
                  f"one reward function returns a valid reward ({len(unscorable)} of {len(completions)} completions "
                  "unscored)")


_NOT_RUN = object()


def score(fn: Callable, prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], extra: dict | None = None, returned: Any = _NOT_RUN) -> list[float]:
    """Call one reward function (or take what it ``returned``) and check it; None becomes NaN (not applicable)."""
    name = callable_name(fn)
    try:
        if returned is _NOT_RUN:
            returned = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                          **(extra or {}))
        if isinstance(returned, BaseException):
            raise returned
        values = returned
    except Exception as exc:  # noqa: BLE001 - the user's function; say whose and what
        raise LitAlignError(f"reward function {name!r} raised {type(exc).__name__}: {exc}") from exc
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a tensor or an array, as TRL iterates it
        values = values.tolist()
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
