"""Data rows: their formats, their checks, their token ids and how they are cut to ``max_length``.

Row formats, as TRL accepts them:
  - standard: ``prompt`` and completion(s) (``completion``, or ``chosen`` and ``rejected``) are strings; EOS is
    appended to each completion unless it already ends with it.
  - conversational: ``prompt`` is a list of ``{role, content}`` messages and each completion a list of assistant
    messages, rendered with the tokenizer's chat template (which closes assistant turns itself).
  - implicit prompt (pairs): only ``chosen`` and ``rejected`` (strings or messages); their longest shared prefix is
    the prompt.
  - messages (SFT): one ``messages`` list whose last turn is the assistant's: that turn is the completion, everything
    before it the prompt.

A completion starts where the tokenized prompt and the tokenized prompt + completion diverge (TRL's rule; a chat
template or a merge across the boundary can make the two differ before the prompt's end). A pair applies it per side
and keeps the prompt the two sides share.

Truncation, per kind of row (each data module declares ``max_length`` with its default)::

    rows         data module            default  what is cut                      keeps      when
    preference   PreferenceDataModule   1024     prompt + completion, each side   the start  at collate
    completion   CompletionDataModule   1024     prompt + completion              the start  at tokenize
    prompt       PromptDataModule        512     the prompt                       the end    at tokenize

A preference or completion row whose prompt alone fills ``max_length`` is an error (or dropped, with
``drop_long_prompts``): nothing of its completion would be left. Prompts keep their end, as TRL's ``GRPOTrainer``
truncates them from the left: the question and the generation prompt are at the end.
"""

from __future__ import annotations

from typing import Any

from lit_align.errors import LitAlignError

ROLES = ("system", "user", "assistant", "tool")


# -- checks: each names the row (``where``) and the field ------------------------------------------------------------


def check_messages(value: Any, field: str, where: str) -> None:
    """``value`` must be a non-empty list of ``{role, content}`` messages with string content and a known role."""
    if not isinstance(value, list) or not value:
        raise LitAlignError(f"{where}: field {field!r} must be a non-empty list of {{role, content}} messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
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
    implicit = row.get("prompt") is None
    if implicit:
        check_field(chosen, "chosen", where, conversational)
        check_field(rejected, "rejected", where, conversational)
        prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
        if not prompt:
            raise LitAlignError(f"{where}: no 'prompt' column and chosen/rejected share no prefix to use as prompt")
    else:
        prompt = row["prompt"]
        check_field(prompt, "prompt", where, conversational)
    check_field(chosen, "chosen", where, conversational)
    check_field(rejected, "rejected", where, conversational)
    if chosen == rejected:
        raise LitAlignError(f"{where}: 'chosen' and 'rejected' are identical (a pair must differ)")
    return prompt, chosen, rejected, conversational


def normalize_completion(row: dict[str, Any], where: str) -> tuple[Any, Any, bool]:
    """Check one SFT row; return ``(prompt, completion, conversational)``."""
    if row.get("messages") is not None or ("messages" in row and "prompt" not in row):
        messages = row["messages"]
        check_field(messages, "messages", where, conversational=True)
        if messages[-1]["role"] != "assistant":
            raise LitAlignError(f"{where}: field 'messages' must end with an assistant turn (the completion), "
                                f"got a {messages[-1]['role']!r} turn last")
        if len(messages) < 2:
            raise LitAlignError(f"{where}: field 'messages' has only the assistant turn (no prompt before it)")
        return messages[:-1], messages[-1:], True
    if "prompt" not in row or "completion" not in row:
        raise LitAlignError(f"{where}: missing column {'prompt' if 'prompt' not in row else 'completion'!r} "
                            "(expected prompt/completion, or messages)")
    if row["prompt"] is None:
        raise LitAlignError(f"{where}: field 'prompt' is missing or null")
    conversational = check_prompt(row["prompt"], where)
    check_field(row["completion"], "completion", where, conversational)
    return row["prompt"], row["completion"], conversational


# -- encoding --------------------------------------------------------------------------------------------------------


def common_prefix_length(a, b) -> int:
    """How many leading items ``a`` and ``b`` share (token ids, characters or messages)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode_messages(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"])


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a string."""
    return list(tokenizer(text)["input_ids"])


def with_eos(tokenizer, completion: str) -> str:
    """A standard completion ends with the EOS token's text (appended unless it is already there)."""
    eos = tokenizer.eos_token
    return completion if completion.endswith(eos) else completion + eos


def encode_prompt(tokenizer, prompt, conversational: bool) -> list[int]:
    """Token ids of a prompt alone, as generation starts from it (a chat ends with the generation prompt)."""
    if conversational:
        return encode_messages(tokenizer, prompt, add_generation_prompt=True)
    return encode_text(tokenizer, prompt)


def encode_prompt_completion(tokenizer, prompt, completion, conversational: bool) -> tuple[list[int], list[int]]:
    """``(prompt_ids, completion_ids)``, untruncated: the tokenized prompt + completion (EOS appended to a standard
    completion), cut where it and the tokenized prompt diverge (TRL's rule)."""
    prompt_ids = encode_prompt(tokenizer, prompt, conversational)
    if conversational:
        full = encode_messages(tokenizer, prompt + completion)
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
