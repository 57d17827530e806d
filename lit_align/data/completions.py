"""Prompt/completion rows for supervised fine-tuning (SFT), tokenized as TRL's ``SFTTrainer`` tokenizes them.

Row formats:
  - standard: ``prompt`` and ``completion`` strings; EOS is appended to the completion (unless it already ends so).
  - conversational: ``prompt`` a list of ``{role, content}`` messages and ``completion`` a list of assistant
    messages, rendered with the tokenizer's chat template (which closes assistant turns itself);
  - or a single ``messages`` list whose last turn is the assistant's: that turn is the completion, everything
    before it the prompt.

Each row becomes ``input_ids`` (prompt ids, then completion ids: the completion starts where the tokenized prompt and
the tokenized prompt + completion diverge, as in TRL) and ``completion_mask`` (1 on completion tokens), cut to
``max_length`` keeping the start.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.utils.rnn import pad_sequence

from lit_align.data.base import AlignDataModule
from lit_align.data.preference import _check_field
from lit_align.data.prompts import check_prompt
from lit_align.errors import LitAlignError


def normalize_completion(row: dict[str, Any], where: str) -> tuple[Any, Any, bool]:
    """Check one SFT row; return ``(prompt, completion, conversational)``."""
    if row.get("messages") is not None or ("messages" in row and "prompt" not in row):
        messages = row["messages"]
        _check_field(messages, "messages", where, conversational=True)
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
    _check_field(row["completion"], "completion", where, conversational)
    return row["prompt"], row["completion"], conversational


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tokenize_completion(tokenizer, prompt, completion, conversational: bool) -> dict[str, list[int]]:
    """``input_ids`` (prompt then completion) and ``completion_mask`` for one row, untruncated."""
    if conversational:
        def encode(messages, **kw):
            return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])

        prompt_ids = encode(prompt, add_generation_prompt=True)
        full = encode(prompt + completion)
    else:
        eos = tokenizer.eos_token
        completion = completion if completion.endswith(eos) else completion + eos
        prompt_ids = tokenizer(prompt)["input_ids"]
        full = tokenizer(prompt + completion)["input_ids"]
    n = _common_prefix_length(prompt_ids, full)
    return {"input_ids": full, "completion_mask": [0] * n + [1] * (len(full) - n)}


def collate_completions(rows: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``completion_mask``, each ``[B, T]``."""
    seqs = [torch.tensor(r["input_ids"]) for r in rows]
    return {
        "input_ids": pad_sequence(seqs, batch_first=True, padding_value=pad_token_id),
        "attention_mask": pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True, padding_value=0),
        "completion_mask": pad_sequence([torch.tensor(r["completion_mask"]) for r in rows], batch_first=True,
                                        padding_value=0),
    }


class CompletionDataModule(AlignDataModule):
    """Prompt/completion rows for SFT; ``batch_size`` counts sequences per device.

    Args:
        drop_long_prompts: drop rows whose prompt alone fills ``max_length`` (nothing of the completion would be
            left; TRL drops them silently) instead of stopping with an error that names the first such row.
        num_proc: processes for tokenization (``datasets.map``).
    """

    kind = "completion"

    def __init__(self, *args, drop_long_prompts: bool = False, num_proc: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.drop_long_prompts, self.num_proc = drop_long_prompts, num_proc

    def process(self, rows, source: str):
        columns = set(rows.column_names)
        if "messages" not in columns and not {"prompt", "completion"} <= columns:
            raise LitAlignError(f"{source}: columns {sorted(columns)}: expected 'prompt' and 'completion', or 'messages'")
        tokenizer, max_length, drop = self.tokenizer, self.max_length, self.drop_long_prompts

        def tokenize(row, index):
            where = f"{source} row {index}"
            out = tokenize_completion(tokenizer, *normalize_completion(row, where))
            prompt_length = out["completion_mask"].index(1) if 1 in out["completion_mask"] else len(out["input_ids"])
            out["truncated"] = max_length is not None and len(out["input_ids"]) > max_length
            if max_length is not None and prompt_length >= max_length and not drop:
                raise LitAlignError(
                    f"{where}: the prompt alone is {prompt_length} tokens, max_length is {max_length} "
                    "(raise data.max_length, or set data.drop_long_prompts: true)"
                )
            if max_length is not None:
                out = {k: v[:max_length] if isinstance(v, list) else v for k, v in out.items()}
            return out

        tokenized = rows.map(tokenize, with_indices=True, remove_columns=rows.column_names, num_proc=self.num_proc,
                             desc=f"Tokenizing {source}")
        before = len(tokenized)
        tokenized = tokenized.filter(lambda r: 1 in r["completion_mask"])
        truncated, dropped = sum(tokenized["truncated"]), before - len(tokenized)
        if truncated or dropped:
            rank_zero_info(f"lit_align: {source}: {truncated} rows truncated to max_length={max_length}, "
                           f"{dropped} dropped (no completion token left)")
        if len(tokenized) == 0:
            raise LitAlignError(f"{source}: every row was dropped (prompt alone >= max_length={max_length})")
        self.truncation_report = {"truncated": truncated, "dropped": dropped}
        return tokenized.remove_columns("truncated")

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate_completions(rows, self.tokenizer.pad_token_id)
