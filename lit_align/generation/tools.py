"""Multi-turn rollouts with tools: sample, run the tool calls, append their results, sample on (TRL's tool loop).

``ToolLoop.generate`` runs on top of any ``Engine``. Each sampled completion is parsed for tool calls with
transformers' response parsing (``tokenizer.parse_response`` and a ``response_template``: the tokenizer's own, or
one of ``RESPONSE_TEMPLATES`` for the chat templates lit_align knows); each call runs (sync, or ``async`` ones
together), its result, or ``{"error": ...}`` when it raises or names no known tool, becomes a ``tool`` turn, and the
rows that called a tool continue from prompt + completion + tool turns, one sample each, up to
``max_tool_calling_iterations`` times, within ``max_completion_length`` tokens in all.

Token in, token out: a completion's ids are exactly the sampled ids and the tool turns' ids as the chat template
renders them (what follows an assistant turn that called a tool, up to the next assistant turn's header), never the
decoded text tokenized again. ``tool_mask`` is 0 on the tool turns' ids: what the model did not sample stays out of
the loss. A tool turn that would take the completion past ``max_completion_length`` (or the model past its context)
is rolled back: the row ends with the completion it had, as in TRL; the last turn sampled is cut to fit.

What a chat template needs (``check_tool_template``): to render a whole tool-calling exchange (user -> assistant with
``tool_calls`` -> tool), to render a conversation's start the same whether or not turns follow (the tool turns' ids
are read off a rendering), and a response template for its tool-call format. The built-in models' is
``builtin:tools`` (``lit_align.models.TOOL_CHAT_TEMPLATE``: Qwen's ``<tool_call>`` JSON in characters).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lit_align.errors import LitAlignError, one_line
from lit_align.generation.base import Rollout
from lit_align.imports import callable_name, load_callable


def _tool_call_fields(end_pattern: str) -> dict:
    """The fields of a response template for ``<tool_call>{json}</tool_call>`` calls (Qwen2.5 / Qwen3 style)."""
    return {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": end_pattern, "content": "text"},
    }


# transformers' response templates for the tool-call formats lit_align knows, by what marks the assistant's turn
RESPONSE_TEMPLATES = {
    "builtin": {"defaults": {"role": "assistant"}, "start_anchor": "<|assistant|>",
                "fields": _tool_call_fields(r"</s>\s*")},
    "chatml": {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
               "fields": _tool_call_fields(r"<\|im_end\|>\s*")},
}


def response_template(tokenizer) -> dict:
    """The response template that parses ``tokenizer``'s tool calls: its own, else the one for its chat template."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return own
    from lit_align.models import TOOL_CHAT_TEMPLATE

    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if template == TOOL_CHAT_TEMPLATE:
        return RESPONSE_TEMPLATES["builtin"]
    if "<tool_call>" in template and "<|im_start|>" in template:
        return RESPONSE_TEMPLATES["chatml"]
    raise LitAlignError("model.tools: no response template parses this chat template's tool calls (lit_align knows "
                        "builtin:tools and ChatML templates with Qwen's <tool_call> JSON); use one of those as "
                        "model.chat_template, or a tokenizer that ships a response_template")


def check_tool_template(tokenizer, name: str) -> dict:
    """Refuse a chat template that cannot run a tool loop (one line naming the tokenizer ``name``); return the
    response template that parses its tool calls."""
    secret = {"tool": "tool_name_7f3a", "key": "arg_key_91c2", "value": "arg_value_4d8e", "result": "result_b6e1"}
    call = {"type": "function", "function": {"name": secret["tool"], "arguments": {secret["key"]: secret["value"]}}}
    exchange = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": secret["tool"], "content": secret["result"]}]
    fix = "set model.chat_template to one that can (builtin:tools for the built-in models)"
    try:
        rendered = tokenizer.apply_chat_template(exchange, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - the template is the user's Jinja code
        raise LitAlignError(f"model.tools: the chat template of {name!r} cannot render a tool-calling conversation "
                            f"({one_line(exc, 120)}); {fix}") from None
    lost = [part for part, text in secret.items() if text not in rendered]
    if lost:
        raise LitAlignError(f"model.tools: the chat template of {name!r} cannot render a tool-calling conversation "
                            f"(user -> assistant with tool_calls -> tool): it drops the {', '.join(lost)}; {fix}")
    start = tokenizer.apply_chat_template(exchange[:2], tokenize=True, return_dict=False)
    whole = tokenizer.apply_chat_template(exchange, tokenize=True, return_dict=False, add_generation_prompt=True)
    if whole[: len(start)] != start:
        raise LitAlignError(f"model.tools: the chat template of {name!r} renders an assistant turn differently once a "
                            f"tool turn follows, so the tool turns' tokens cannot be appended to what was sampled; "
                            f"{fix}")
    return response_template(tokenizer)


# -- the tools ----------------------------------------------------------------------------------------------------


def load_tool(spec: str | dict | Callable, where: str = "model.tools") -> Callable:
    """A tool from a config: a callable, a dotted path to a function, or ``{class_path, init_args}`` (an object whose
    ``__call__`` is the tool; its name is the class's)."""
    return spec if callable(spec) else load_callable(spec, where + ": {!r}", "a dotted path to a function")


def tool_schema(tool: Callable, where: str = "model.tools") -> dict:
    """The JSON schema the chat template shows the model (transformers' ``get_json_schema``: type hints and a
    Google-style docstring); a function it cannot describe is refused, naming it."""
    from transformers.utils import get_json_schema

    function = tool if inspect.isfunction(tool) or inspect.ismethod(tool) else type(tool).__call__
    name = callable_name(tool)
    try:
        schema = get_json_schema(function)
    except Exception as exc:  # noqa: BLE001 - transformers raises its own types for each missing piece
        raise LitAlignError(f"{where}: tool {name!r}: {one_line(exc, 200)} (a tool needs type hints and a "
                            "Google-style docstring with an Args: section)") from None
    schema["function"]["name"] = name
    return schema


def call_tools(calls: list[dict], tools: dict[str, Callable]) -> tuple[list[tuple[str, Any]], int]:
    """``([(name, result)], failures)`` of one turn's tool calls, in order. A call that raises, names no tool in
    ``tools`` or is not a function call gives ``{"error": message}``; the ``async`` tools run together."""
    results: list[Any] = []
    waiting: dict[int, Any] = {}  # position -> coroutine
    names = []
    for call in calls:
        function = call.get("function") if call.get("type", "function") == "function" else None
        name = function.get("name", "unknown") if isinstance(function, dict) else call.get("name", "unknown")
        names.append(name)
        try:
            if function is None:
                raise ValueError(f"Unsupported tool call type: {call.get('type')}")
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            arguments = function.get("arguments") or {}
            if not isinstance(arguments, dict):
                raise TypeError(f"arguments must be an object, got {arguments!r}")
            result = tools[name](**arguments)
            if inspect.isawaitable(result):
                waiting[len(results)] = result
            results.append(result)
        except Exception as exc:  # noqa: BLE001 - the model's call or the user's tool: the error goes back as a turn
            results.append({"error": str(exc)})
    if waiting:
        async def gather():
            return await asyncio.gather(*waiting.values(), return_exceptions=True)

        for position, value in zip(waiting, asyncio.run(gather())):
            results[position] = {"error": str(value)} if isinstance(value, Exception) else value
    failures = sum(isinstance(r, dict) and set(r) == {"error"} for r in results)
    return list(zip(names, results)), failures


def tool_content(result: Any) -> Any:
    """A tool's result as its turn's content: content blocks (a list of ``{"type": ...}`` dicts, TRL's multimodal
    results) as they are, anything else as its text (``str``: a list of numbers is ``"[1, 2]"``)."""
    blocks = isinstance(result, list) and result and all(isinstance(b, dict) and "type" in b for b in result)
    return result if blocks else str(result)


def tool_turn_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """The ids a chat template renders after an assistant turn that called tools: the tool turns and the next
    assistant turn's header. Read off a rendering with and without them, the assistant turn cut after its EOS
    (templates such as Qwen3's put a newline after it that belongs to what follows)."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    start = tokenizer.apply_chat_template(before, tokenize=True, return_dict=False)
    whole = tokenizer.apply_chat_template(before + tool_messages, tokenize=True, return_dict=False,
                                          add_generation_prompt=True)
    eos = [i for i, t in enumerate(start) if t == tokenizer.eos_token_id]
    if eos:
        start = start[: eos[-1] + 1]
    if whole[: len(start)] != start:  # check_tool_template refuses such templates up front
        raise LitAlignError("model.tools: the chat template renders an assistant turn differently once tool turns "
                            "follow")
    return whole[len(start):]


def turns_text(messages: list[dict]) -> str:
    """A multi-turn completion as one text for tables: each call as ``name(arguments)``, each result as
    ``-> result``, one turn a line."""
    lines = []
    for message in messages:
        if message["role"] == "tool":
            lines.append(f"-> {message['content']}")
            continue
        calls = [c.get("function", c) for c in message.get("tool_calls") or []]
        lines.append(" ".join([message.get("content") or ""] + [
            f"{c.get('name')}({json.dumps(c.get('arguments'))})" for c in calls]).strip())
    return "\n".join(lines)


# -- the loop ----------------------------------------------------------------------------------------------------


@dataclass
class ToolRollout(Rollout):
    """A ``Rollout`` whose completions may hold tool turns. ``completion_mask`` is 1 on every real token (sampled or
    a tool's: the training forward reads them all); ``tool_mask`` is 0 on the tool turns' tokens."""

    tool_mask: torch.Tensor | None = None  # [N, C]
    messages: list[list[dict]] | None = None  # per row: the completion's turns (assistant, tool, assistant, ...)
    tool_calls: int = 0  # calls made in all rows
    tool_failures: int = 0  # of which failed (raised, unknown tool, not a function call)
    prompt_ids: torch.Tensor | None = None  # [N, P] each row's prompt, where rows have their own (environments)
    prompt_mask: torch.Tensor | None = None
    environments: list | None = None  # each row's environment (``lit_align.generation.environments``)
    extra: dict[str, list] | None = None  # per row: what a rollout_func returned besides the ids (reward kwargs)


@dataclass
class RowTurns:
    """One completion as the loop grows it: plain lists, sampled turns and tool turns appended."""

    prompt: list[int]
    ids: list[int]
    tool_mask: list[int]
    logps: list[float] | None
    messages: list[dict]


class ToolLoop:
    """Sample with an engine, run the tools the completions call, sample on (TRL's ``_tool_call_loop``).

    Args:
        tools: the tools as callables; their names are what the model calls.
        tokenizer: the policy's (its chat template renders the tool turns; ``check_tool_template`` first).
        max_completion_length: tokens of a completion in all, tool turns included.
        max_tool_calling_iterations: rounds of tool calls at most (None: until no row calls one).
        max_model_length: the model's context (prompt + completion); None: no limit.
    """

    def __init__(self, tools: list[Callable], tokenizer, max_completion_length: int,
                 max_tool_calling_iterations: int | None = None, max_model_length: int | None = None):
        if max_tool_calling_iterations is not None and max_tool_calling_iterations < 0:
            raise LitAlignError(f"model.max_tool_calling_iterations must be >= 0 or null, got "
                                f"{max_tool_calling_iterations}")
        self.tools = {callable_name(t): t for t in tools}
        self.schemas = [tool_schema(t) for t in tools]
        self.tokenizer = tokenizer
        self.response_template = check_tool_template(tokenizer, tokenizer.name_or_path)
        self.max_completion_length, self.max_model_length = max_completion_length, max_model_length
        self.max_iterations = max_tool_calling_iterations

    def parse(self, ids: list[int], prefix: list[int], schemas: list[dict]) -> dict:
        """One sampled turn as an assistant message (``tool_calls`` when it calls tools). Unparsable output (a
        malformed call) is the turn's text, as TRL does: no call is made."""
        tokenizer = self.tokenizer
        try:
            message = tokenizer.parse_response(ids, self.response_template, prefix=prefix, tools=schemas)
            if not _named_calls(message.get("tool_calls")):
                raise ValueError("a tool call without a name")
        except (ValueError, TypeError, AttributeError):
            return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        content = message.get("content") or ""
        message["content"] = content.removesuffix(tokenizer.eos_token or "")
        return message

    def answer_calls(self, row: RowTurns, tools: dict[str, Callable], counts: list[int]) -> bool:
        """Run the tools ``row``'s last turn calls and append their results as tool turns (tokens out of the loss,
        log-probs 0), counting calls and failures in ``counts``. False, the row left as it was, when the results
        would not fit in ``max_completion_length`` / ``max_model_length``: the row then ends."""
        results, failures = call_tools(row.messages[-1]["tool_calls"], tools)
        counts[0] += len(results)
        counts[1] += failures
        turns = [{"role": "tool", "name": name, "content": tool_content(result)} for name, result in results]
        try:
            suffix = tool_turn_ids(self.tokenizer, turns)
        except LitAlignError:
            raise
        except Exception as exc:  # noqa: BLE001 - the template is the user's Jinja code, given the tools' results
            names = ", ".join(sorted({repr(name) for name, _ in results}))
            raise LitAlignError(f"model.tools: the chat template cannot render the result of tool {names} "
                                f"({type(exc).__name__}: {one_line(exc, 120)}); a tool returns a string, or content "
                                "blocks the template renders") from None
        length = len(row.ids) + len(suffix)
        if length > self.max_completion_length or (
                self.max_model_length is not None and len(row.prompt) + length >= self.max_model_length):
            return False  # rolled back: the row ends as it was
        row.messages += turns
        row.ids += suffix
        row.tool_mask += [0] * len(suffix)
        if row.logps is not None:
            row.logps += [0.0] * len(suffix)
        return True

    def generate(self, engine, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int,
                 eos_token_ids: list[int], pad_token_id: int,
                 row_tools: list[dict[str, Callable]] | None = None) -> ToolRollout:
        """``num_samples`` multi-turn completions per left-padded prompt. ``row_tools``: each row's tools by name
        (one per completion; environments give each rollout its own), else every row has ``tools``."""
        first = engine.generate(model, prompt_ids, prompt_mask, num_samples, eos_token_ids, pad_token_id)
        prompts = [p[m.bool()].tolist() for p, m in zip(prompt_ids, prompt_mask)]
        rows = []
        for i, (ids, mask) in enumerate(zip(first.completion_ids, first.completion_mask)):
            sampled = ids[mask.bool()].tolist()
            logps = None if first.logps is None else first.logps[i][mask.bool()].tolist()
            rows.append(RowTurns(prompts[i // num_samples], sampled, [1] * len(sampled), logps, []))
        tools = row_tools or [self.tools] * len(rows)
        schemas = [self.schemas if row_tools is None else [tool_schema(t) for t in r.values()] for r in tools]
        calling = []  # rows whose last turn called tools
        for i, row in enumerate(rows):
            row.messages.append(self.parse(row.ids, row.prompt, schemas[i]))
            if row.messages[-1].get("tool_calls"):
                calling.append(i)
        counts = [0, 0]  # calls, failures
        iteration = 0
        while calling and (self.max_iterations is None or iteration < self.max_iterations):
            continuing, contexts = [], []
            for i in calling:
                if self.answer_calls(rows[i], tools[i], counts):
                    continuing.append(i)
                    contexts.append(rows[i].prompt + rows[i].ids)
            if not continuing:
                break
            ids, mask = left_pad(contexts, pad_token_id, prompt_ids.device)
            turn = engine.generate(model, ids, mask, 1, eos_token_ids, pad_token_id)
            calling = []
            for k, i in enumerate(continuing):
                row, real = rows[i], turn.completion_mask[k].bool()
                room = self.max_completion_length - len(row.ids)
                sampled = turn.completion_ids[k][real].tolist()[:room]
                if sampled:
                    row.messages.append(self.parse(sampled, contexts[k], schemas[i]))
                row.ids += sampled
                row.tool_mask += [1] * len(sampled)
                if row.logps is not None and turn.logps is not None:
                    row.logps += turn.logps[k][real].tolist()[: len(sampled)]
                if sampled and row.messages[-1].get("tool_calls"):
                    calling.append(i)
            iteration += 1
        ends = set(eos_token_ids) | {pad_token_id}  # TRL's rule: a completion not ending in EOS was cut
        truncated = [not row.ids or row.ids[-1] not in ends for row in rows]
        return as_tool_rollout(rows, truncated, counts, pad_token_id, prompt_ids.device)


def _named_calls(calls) -> bool:
    """Whether parsed ``tool_calls`` are absent or each a dict naming its function (TRL's check of a parse)."""
    if calls is None:
        return True
    if not isinstance(calls, list):
        return False
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return False
    return True


def left_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def as_tool_rollout(rows: list[RowTurns], truncated: list[bool], counts: list[int], pad: int, device) -> ToolRollout:
    width = max(1, max(len(r.ids) for r in rows))

    def right_pad(values: list[list], fill) -> torch.Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values], device=device)

    logps = None
    if all(r.logps is not None and len(r.logps) == len(r.ids) for r in rows):
        logps = right_pad([r.logps for r in rows], 0.0).float()
    return ToolRollout(
        completion_ids=right_pad([r.ids for r in rows], pad),
        completion_mask=right_pad([[1] * len(r.ids) for r in rows], 0),
        truncated=torch.tensor(truncated, device=device),
        logps=logps,
        tool_mask=right_pad([r.tool_mask for r in rows], 0),
        messages=[r.messages for r in rows],
        tool_calls=counts[0],
        tool_failures=counts[1],
    )
