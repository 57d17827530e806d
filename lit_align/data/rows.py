"""Data rows: their formats, their checks, their token ids and how they are cut to ``max_length``.

Row formats, as TRL accepts them:
  - standard: ``prompt`` and completion(s) (``completion``, or ``chosen`` and ``rejected``) are strings; EOS is
    appended to each completion unless it already ends with it.
  - conversational: ``prompt`` is a list of ``{role, content}`` messages and each completion a list of assistant
    messages (an SFT completion may hold tool turns between them), rendered with the tokenizer's chat template
    (which closes assistant turns itself); each assistant turn's tokens are marked (``assistant_only_loss``).
  - implicit prompt (pairs): only ``chosen`` and ``rejected`` (strings or messages); their longest shared prefix is
    the prompt.
  - messages (SFT): one ``messages`` list, a whole conversation (several turns, tool calls, tool results): a
    language-modelling row, as TRL's; each assistant turn's tokens are marked (``assistant_only_loss``).
  - text (SFT): one ``text`` string (EOS appended): language modelling.
  - H4 preference rows (``prompt`` a string, ``chosen`` / ``rejected`` whole conversations repeating it): the prompt
    is what the two conversations share, as TRL's ``maybe_extract_prompt`` decides.

Messages may carry ``tool_calls`` (an assistant turn that calls tools, its ``content`` empty or null) and ``tool``
turns (a tool's result); a ``tools`` column (function schemas, or their JSON text) and the data module's
``chat_template_kwargs`` go to the chat template with every row (not the arguments lit_align passes itself). A
template that does not compile is an error naming it; one that fails on a row (its ``raise_exception(...)``, a field
it cannot read) an error naming the row.

A completion starts where the tokenized prompt and the tokenized prompt + completion diverge (TRL's rule; a chat
template or a merge across the boundary can make the two differ before the prompt's end). A pair applies it per side
and keeps the prompt the two sides share.

Truncation, per kind of row (each data module declares ``max_length`` with its default)::

    rows         data module            default  what is cut                      keeps      when
    preference   PreferenceDataModule   1024     prompt + completion, each side   the start  at collate
    completion   CompletionDataModule   1024     prompt + completion              the start  at tokenize
    prompt       PromptDataModule        512     the prompt                       the end    at tokenize

A preference or completion row whose prompt alone fills ``max_length`` is an error (or dropped, with
``drop_long_prompts``): nothing of its completion would be left. A completion row left with nothing to train on
(no completion token, or no assistant token under ``assistant_only_loss``) is dropped and counted. ``wrapped``
packing cuts no row (``lit_align.data.packing``). Prompts keep their end, as TRL's ``GRPOTrainer``
truncates them from the left: the question and the generation prompt are at the end.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jinja2

from lit_align.errors import LitAlignError
from lit_align.models import NAMED_CHAT_TEMPLATES

ROLES = ("system", "user", "assistant", "tool")
# ``apply_chat_template``'s own arguments and what it names the conversation: lit_align sets them for each render
RESERVED_TEMPLATE_KWARGS = {
    "messages": "each row's messages are rendered",
    "conversation": "each row's messages are rendered",
    "tools": "a row's tools come from its 'tools' column",
    "add_generation_prompt": "lit_align adds the generation prompt where a completion starts",
    "continue_final_message": "lit_align decides how each row is rendered",
    "chat_template": "set data.chat_template (or model.chat_template) instead",
    **{name: "lit_align tokenizes each render itself" for name in (
        "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding", "truncation",
        "max_length", "tokenizer_kwargs")},
}


# -- checks: each names the row (``where``) and the field ------------------------------------------------------------


def check_messages(value: Any, field: str, where: str) -> None:
    """``value`` must be a non-empty list of ``{role, content}`` messages with string content and a known role; an
    assistant message that calls tools (a ``tool_calls`` list) may have empty or null content."""
    if not isinstance(value, list) or not value:
        raise LitAlignError(f"{where}: field {field!r} must be a non-empty list of {{role, content}} messages")
    for i, message in enumerate(value):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if calls is not None and (not isinstance(calls, list) or message.get("role") != "assistant"):
            raise LitAlignError(f"{where}: {field}[{i}].tool_calls must be a list, on an assistant message")
        if not isinstance(message, dict) or not (isinstance(message.get("content"), str)
                                                 or (calls and message.get("content") is None)):
            raise LitAlignError(f"{where}: {field}[{i}] must be a {{role, content}} message with string content")
        if message.get("role") not in ROLES:
            raise LitAlignError(f"{where}: {field}[{i}] has role {message.get('role')!r}, expected one of {ROLES}")


def check_text(value: Any, field: str, where: str) -> None:
    """``value`` must be a string with something besides whitespace."""
    if not isinstance(value, str):
        raise LitAlignError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise LitAlignError(f"{where}: field {field!r} is empty")


def check_field(value: Any, field: str, where: str, conversational: bool) -> None:
    """A field of a row of known format: present, then messages (conversational) or a string (standard)."""
    if value is None:  # a key absent from some rows of a JSON file reads as null
        raise LitAlignError(f"{where}: field {field!r} is missing or null")
    if conversational:
        check_messages(value, field, where)
    else:
        check_text(value, field, where)


def check_completion(value: Any, field: str, where: str, conversational: bool) -> None:
    """A completion (``chosen``, ``rejected``, ``completion``): a field that must say something, as a string one does;
    messages that are all blank and call no tool are empty. (A blank conversational prompt is left alone: an
    environment's ``reset`` may fill it.)"""
    check_field(value, field, where, conversational)
    if conversational and not any((m["content"] or "").strip() or m.get("tool_calls") for m in value):
        raise LitAlignError(f"{where}: field {field!r} is empty (no message has content)")


def check_prompt(prompt: Any, where: str) -> bool:
    """A prompt decides its row's format: True if conversational (a list of messages), False if a string."""
    if isinstance(prompt, str):
        check_text(prompt, "prompt", where)
        return False
    if isinstance(prompt, list) and prompt:
        check_messages(prompt, "prompt", where)
        return True
    raise LitAlignError(f"{where}: field 'prompt' must be a string or a list of messages, got {type(prompt).__name__}")


# -- formats: each row made explicit ---------------------------------------------------------------------------------


def split_implicit_prompt(chosen, rejected):
    """Split two completions at their longest shared prefix: ``(prompt, chosen, rejected)`` (strings or messages)."""
    idx = common_prefix_length(chosen, rejected)
    if isinstance(chosen, str) and idx > 0 and chosen[idx - 1] == " ":
        idx -= 1  # keep the space with the completion
    return chosen[:idx], chosen[idx:], rejected[idx:]


def normalize_pair(row: dict[str, Any], where: str) -> tuple[Any, Any, Any, bool]:
    """Check one preference row; return ``(prompt, chosen, rejected, conversational)`` with the prompt made explicit."""
    for field in ("chosen", "rejected"):
        if field not in row:
            raise LitAlignError(f"{where}: missing column {field!r} (expected prompt/chosen/rejected, or chosen/rejected)")
    chosen, rejected = row["chosen"], row["rejected"]
    conversational = isinstance(chosen, list)
    # the H4 layout (a string prompt, whole conversations as completions): the prompt is what the two share
    implicit = row.get("prompt") is None or isinstance(row["prompt"], list) != conversational
    if implicit:
        check_field(chosen, "chosen", where, conversational)
        check_field(rejected, "rejected", where, conversational)
        prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
        if not prompt:
            raise LitAlignError(f"{where}: 'chosen' and 'rejected' share no prefix to take as the prompt "
                                f"({_why_implicit(row.get('prompt'), conversational)})")
    else:
        prompt = row["prompt"]
        check_field(prompt, "prompt", where, conversational)
    check_completion(chosen, "chosen", where, conversational)
    check_completion(rejected, "rejected", where, conversational)
    if chosen == rejected:
        raise LitAlignError(f"{where}: 'chosen' and 'rejected' are identical (a pair must differ)")
    return prompt, chosen, rejected, conversational


def _why_implicit(prompt, conversational: bool) -> str:
    """Why a pair's prompt is the prefix its two sides share (the message when they share none)."""
    if prompt is None:
        return "the row has no 'prompt'"
    kind = {str: "a string", list: "a list of messages"}.get(type(prompt), f"a {type(prompt).__name__}")
    sides = "conversations" if conversational else "strings"
    return f"its 'prompt' is {kind} but they are {sides}, so both must begin with the prompt, as in H4's layout"


def sft_row_kind(row: dict[str, Any], where: str) -> str:
    """``text``, ``messages`` or ``prompt_completion``: which SFT format a row has (checked)."""
    if row.get("text") is not None or ("text" in row and "messages" not in row and "prompt" not in row):
        check_text(row["text"], "text", where)
        return "text"
    if row.get("messages") is not None or ("messages" in row and "prompt" not in row):
        check_field(row["messages"], "messages", where, conversational=True)
        return "messages"
    return "prompt_completion"


def normalize_completion(row: dict[str, Any], where: str) -> tuple[Any, Any, bool]:
    """Check one prompt/completion SFT row; return ``(prompt, completion, conversational)``."""
    if "prompt" not in row or "completion" not in row:
        raise LitAlignError(f"{where}: missing column {'prompt' if 'prompt' not in row else 'completion'!r} "
                            "(expected prompt/completion, messages or text)")
    if row["prompt"] is None:
        raise LitAlignError(f"{where}: field 'prompt' is missing or null")
    conversational = check_prompt(row["prompt"], where)
    check_completion(row["completion"], "completion", where, conversational)
    return row["prompt"], row["completion"], conversational


# -- the chat template -----------------------------------------------------------------------------------------------


class ChatTemplateError(LitAlignError):
    """The chat template failed on a row's messages (raised by ``encode_messages``; ``naming_row`` says which row)."""


def check_template_kwargs(chat_template_kwargs: dict | None) -> dict:
    """``data.chat_template_kwargs``, refused when it sets what lit_align passes the template itself (a ``TypeError``
    from ``apply_chat_template`` otherwise, or a silent change of what is rendered)."""
    kwargs = dict(chat_template_kwargs or {})
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise LitAlignError(f"data.chat_template_kwargs: {key!r} is reserved ({RESERVED_TEMPLATE_KWARGS[key]}); "
                                "give only the template's own variables, e.g. enable_thinking")
    return kwargs


def check_chat_template(tokenizer, given: str | None) -> None:
    """Compile the tokenizer's chat template before any row is rendered, so that a Jinja syntax error is one line
    naming the template (``given``: the file or text the user set; None: the tokenizer's own)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template  # what apply_chat_template compiles with

    template = tokenizer.chat_template
    if given is None:
        name = f"of tokenizer {tokenizer.name_or_path!r}"
    else:
        name = "given as text" if "{" in given and not given.endswith((".jinja", ".j2")) else given
    for text in template.values() if isinstance(template, dict) else [template]:
        if not isinstance(text, str):
            continue
        try:
            _compile_jinja_template(text)
        except jinja2.TemplateSyntaxError as exc:
            raise LitAlignError(f"chat template {name}: line {exc.lineno}: {exc.message} (a Jinja syntax error)") from None


@contextmanager
def naming_row(where: str) -> Iterator[None]:
    """Chat template failures (``ChatTemplateError``) raised inside name the row ``where``."""
    try:
        yield
    except ChatTemplateError as exc:
        raise LitAlignError(f"{where}: {exc}") from None


# -- encoding --------------------------------------------------------------------------------------------------------


def common_prefix_length(a, b) -> int:
    """How many leading items ``a`` and ``b`` share (token ids, characters or messages)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def template_kwargs(row: dict[str, Any], chat_template_kwargs: dict | None, where: str) -> dict:
    """What the chat template gets besides the messages: ``chat_template_kwargs`` and the row's ``tools``."""
    kwargs = dict(chat_template_kwargs or {})
    tools = row.get("tools")
    if isinstance(tools, str):  # datasets often keep the schemas as JSON text
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError:
            raise LitAlignError(f"{where}: field 'tools' is not valid JSON (expected a list of function schemas)") from None
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise LitAlignError(f"{where}: field 'tools' must be a list of function schemas (objects)")
        kwargs["tools"] = tools
    return kwargs


def encode_messages(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False,
                    template: dict | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template (``template``: more keyword arguments
    for it, e.g. ``tools`` or ``enable_thinking``)."""
    if not tokenizer.chat_template:
        raise ChatTemplateError(f"the rows are conversations, but tokenizer {tokenizer.name_or_path!r} has no chat "
                                "template: set model.chat_template (a Jinja file, the template itself, or one of "
                                f"{sorted(NAMED_CHAT_TEMPLATES)})")
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            add_generation_prompt=add_generation_prompt, **(template or {}))
    except Exception as exc:  # noqa: BLE001 - the template runs the user's data through the user's Jinja code
        message = " ".join(str(exc).split())  # one line
        if type(exc) is jinja2.TemplateError:  # the template's own ``raise_exception(...)``
            raise ChatTemplateError(f"the chat template refused it: {message}") from None
        raise ChatTemplateError(f"the chat template could not render it ({type(exc).__name__}: {message})") from None
    return list(out["input_ids"])


def encode_conversation(tokenizer, messages: list[dict], template: dict | None, where: str) -> tuple[list[int], list[int]]:
    """``(input_ids, assistant_mask)`` of a whole conversation: 1 on each assistant turn's tokens, 0 elsewhere.

    Turn ``i``'s tokens are found by TRL's completion rule: those of ``messages[:i + 1]`` past their common prefix
    with ``messages[:i]`` + the generation prompt. That needs a template that renders a conversation's start the same
    whether or not more turns follow (most do; one that rewrites earlier turns is refused, naming the turn).
    """
    full = encode_messages(tokenizer, messages, template=template)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        upto = encode_messages(tokenizer, messages[: i + 1], template=template)
        if full[: len(upto)] != upto:
            raise LitAlignError(f"{where}: the chat template renders messages[:{i + 1}] differently inside the whole "
                                f"conversation, so assistant turn {i}'s tokens cannot be told apart (use a template "
                                "that leaves earlier turns as they were: model.chat_template)")
        before = encode_messages(tokenizer, messages[:i], add_generation_prompt=True, template=template) if i else []
        for t in range(common_prefix_length(before, upto), len(upto)):
            mask[t] = 1
    return full, mask


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a string."""
    return list(tokenizer(text)["input_ids"])


def with_eos(tokenizer, completion: str) -> str:
    """A standard completion ends with the EOS token's text (appended unless it is already there)."""
    eos = tokenizer.eos_token
    return completion if completion.endswith(eos) else completion + eos


def encode_prompt(tokenizer, prompt, conversational: bool, template: dict | None = None) -> list[int]:
    """Token ids of a prompt alone, as generation starts from it (a chat ends with the generation prompt)."""
    if conversational:
        return encode_messages(tokenizer, prompt, add_generation_prompt=True, template=template)
    return encode_text(tokenizer, prompt)


def encode_prompt_completion(tokenizer, prompt, completion, conversational: bool,
                             template: dict | None = None) -> tuple[list[int], list[int]]:
    """``(prompt_ids, completion_ids)``, untruncated: the tokenized prompt + completion (EOS appended to a standard
    completion), cut where it and the tokenized prompt diverge (TRL's rule)."""
    prompt_ids = encode_prompt(tokenizer, prompt, conversational, template)
    if conversational:
        full = encode_messages(tokenizer, prompt + completion, template=template)
    else:
        full = encode_text(tokenizer, prompt + with_eos(tokenizer, completion))
    n = common_prefix_length(prompt_ids, full)
    return full[:n], full[n:]


# -- truncation ------------------------------------------------------------------------------------------------------


def check_max_length(max_length: int | None) -> int | None:
    """``max_length`` as a data module takes it: at least 2 tokens, or None (no truncation)."""
    if max_length is not None and max_length < 2:
        raise LitAlignError(f"data.max_length must be >= 2 or null, got {max_length}")
    return max_length


def keep_start(ids: list, max_length: int | None) -> list:
    """The first ``max_length`` items of ``ids`` (all of them if None)."""
    return ids if max_length is None else ids[:max_length]


def keep_end(ids: list, max_length: int | None) -> list:
    """The last ``max_length`` items of ``ids`` (all of them if None)."""
    return ids if max_length is None else ids[max(len(ids) - max_length, 0):]
