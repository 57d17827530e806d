"""Preference pairs: row formats, tokenization and the [chosen; rejected] batch the DPO step consumes.

Row formats, as TRL accepts them:
  - standard: ``prompt``, ``chosen``, ``rejected`` strings; EOS is appended to each completion.
  - conversational: ``prompt`` a list of ``{role, content}`` messages, ``chosen``/``rejected`` lists of assistant
    messages; rendered with the tokenizer's chat template.
  - implicit prompt: only ``chosen`` and ``rejected`` (strings or messages); the shared prefix is the prompt.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.utils.rnn import pad_sequence

from lit_align.data.base import AlignDataModule
from lit_align.errors import LitAlignError

ROLES = ("system", "user", "assistant", "tool")


def split_implicit_prompt(chosen, rejected):
    """Split two completions at their longest shared prefix: ``(prompt, chosen, rejected)`` (strings or messages)."""
    idx = 0
    while idx < min(len(chosen), len(rejected)) and chosen[idx] == rejected[idx]:
        idx += 1
    if isinstance(chosen, str) and idx > 0 and chosen[idx - 1] == " ":
        idx -= 1  # keep the space with the completion
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _check_field(value, field: str, where: str, conversational: bool) -> None:
    if value is None:  # a key absent from some rows of a JSON file reads as null
        raise LitAlignError(f"{where}: field {field!r} is missing or null")
    if conversational:
        if not isinstance(value, list) or not value:
            raise LitAlignError(f"{where}: field {field!r} must be a non-empty list of {{role, content}} messages")
        for i, message in enumerate(value):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise LitAlignError(f"{where}: {field}[{i}] must be a {{role, content}} message with string content")
            if message.get("role") not in ROLES:
                raise LitAlignError(f"{where}: {field}[{i}] has role {message.get('role')!r}, expected one of {ROLES}")
    elif not isinstance(value, str):
        raise LitAlignError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    elif not value.strip():
        raise LitAlignError(f"{where}: field {field!r} is empty")


def normalize_pair(row: dict[str, Any], where: str) -> tuple[Any, Any, Any, bool]:
    """Check one preference row; return ``(prompt, chosen, rejected, conversational)`` with the prompt made explicit."""
    for field in ("chosen", "rejected"):
        if field not in row:
            raise LitAlignError(f"{where}: missing column {field!r} (expected prompt/chosen/rejected, or chosen/rejected)")
    chosen, rejected = row["chosen"], row["rejected"]
    conversational = isinstance(chosen, list)
    implicit = row.get("prompt") is None
    if implicit:
        _check_field(chosen, "chosen", where, conversational)
        _check_field(rejected, "rejected", where, conversational)
        prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
        if not prompt:
            raise LitAlignError(f"{where}: no 'prompt' column and chosen/rejected share no prefix to use as prompt")
    else:
        prompt = row["prompt"]
        _check_field(prompt, "prompt", where, conversational)
    _check_field(chosen, "chosen", where, conversational)
    _check_field(rejected, "rejected", where, conversational)
    if chosen == rejected:
        raise LitAlignError(f"{where}: 'chosen' and 'rejected' are identical (a pair must differ)")
    return prompt, chosen, rejected, conversational


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tokenize_pair(tokenizer, prompt, chosen, rejected, conversational: bool) -> dict[str, list[int]]:
    """Token ids of prompt, chosen and rejected, as TRL builds them (the prompt ends where the tokenizations diverge)."""
    if conversational:
        def encode(messages, **kw):
            return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])

        prompt_ids = encode(prompt, add_generation_prompt=True)
        chosen_full, rejected_full = encode(prompt + chosen), encode(prompt + rejected)
    else:
        eos = tokenizer.eos_token
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        prompt_ids = tokenizer(prompt)["input_ids"]
        chosen_full, rejected_full = tokenizer(prompt + chosen)["input_ids"], tokenizer(prompt + rejected)["input_ids"]
    n = min(_common_prefix_length(prompt_ids, chosen_full), _common_prefix_length(prompt_ids, rejected_full))
    return {"prompt_ids": prompt_ids[:n], "chosen_ids": chosen_full[n:], "rejected_ids": rejected_full[n:]}


def collate_pairs(rows: list[dict[str, Any]], pad_token_id: int, max_length: int | None) -> dict[str, torch.Tensor]:
    """Stack ``B`` pairs as ``[chosen_1..B; rejected_1..B]``, right-padded, keep-start truncated to ``max_length``.

    Returns ``input_ids``, ``attention_mask`` and ``completion_mask`` (1 on completion tokens), each ``[2B, T]``,
    plus any precomputed ``ref_chosen_logps`` / ``ref_rejected_logps`` columns and the dataset ``rows`` as ``[B]``
    tensors.
    """
    seqs, masks = [], []
    for side in ("chosen_ids", "rejected_ids"):
        for row in rows:
            ids = row["prompt_ids"] + row[side]
            mask = [0] * len(row["prompt_ids"]) + [1] * len(row[side])
            seqs.append(torch.tensor(ids[:max_length]))
            masks.append(torch.tensor(mask[:max_length]))
    batch = {
        "input_ids": pad_sequence(seqs, batch_first=True, padding_value=pad_token_id),
        "attention_mask": pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True, padding_value=0),
        "completion_mask": pad_sequence(masks, batch_first=True, padding_value=0),
    }
    if "row" in rows[0]:
        batch["rows"] = torch.tensor([row["row"] for row in rows])
    for key in ("ref_chosen_logps", "ref_rejected_logps"):
        if key in rows[0]:
            batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
    return batch


class PreferenceDataModule(AlignDataModule):
    """Preference pairs for DPO; ``batch_size`` counts pairs per device (each step runs ``2 * batch_size`` sequences).

    Args:
        drop_long_prompts: drop rows whose prompt alone fills ``max_length`` (TRL drops them silently) instead of
            stopping with an error that names the first such row.
        num_proc: processes for tokenization (``datasets.map``).
    """

    kind = "preference"

    def __init__(self, *args, drop_long_prompts: bool = False, num_proc: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.drop_long_prompts, self.num_proc = drop_long_prompts, num_proc

    def process(self, rows, source: str):
        tokenizer, max_length = self.tokenizer, self.max_length

        def tokenize(row, index):
            where = f"{source} row {index}"
            prompt, chosen, rejected, conversational = normalize_pair(row, where)
            out = tokenize_pair(tokenizer, prompt, chosen, rejected, conversational)
            if max_length is not None and len(out["prompt_ids"]) >= max_length and not self.drop_long_prompts:
                raise LitAlignError(
                    f"{where}: the prompt alone is {len(out['prompt_ids'])} tokens, max_length is {max_length} "
                    "(raise data.max_length, or set data.drop_long_prompts: true)"
                )
            return {**out, "row": index}  # the dataset index travels with the row (numeric guard messages)

        keep = [c for c in rows.column_names if c.startswith("ref_") and c.endswith("_logps")]
        tokenized = rows.map(
            tokenize, with_indices=True, remove_columns=[c for c in rows.column_names if c not in keep],
            num_proc=self.num_proc, desc=f"Tokenizing {source}",
        )
        if max_length is None:
            return tokenized.with_format(None)
        before = len(tokenized)
        tokenized = tokenized.filter(lambda r: len(r["prompt_ids"]) < max_length)
        lengths = [
            len(p) + max(len(c), len(r))
            for p, c, r in zip(tokenized["prompt_ids"], tokenized["chosen_ids"], tokenized["rejected_ids"])
        ]
        truncated = sum(n > max_length for n in lengths)
        dropped = before - len(tokenized)
        if truncated or dropped:
            rank_zero_info(
                f"lit_align: {source}: {truncated} pairs truncated to max_length={max_length}, "
                f"{dropped} dropped (prompt alone >= max_length)"
            )
        if len(tokenized) == 0:
            raise LitAlignError(f"{source}: every row was dropped (prompt alone >= max_length={max_length})")
        self.truncation_report = {"truncated": truncated, "dropped": dropped}
        return tokenized

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate_pairs(rows, self.tokenizer.pad_token_id, self.max_length)
