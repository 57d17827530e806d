"""Prompt/completion rows for supervised fine-tuning (SFT), tokenized as TRL's ``SFTTrainer`` tokenizes them.

The row formats (standard, conversational, messages) and their checks are in ``lit_align.data.rows``. Each row
becomes ``input_ids`` (prompt ids, then completion ids: the completion starts where the tokenized prompt and the
tokenized prompt + completion diverge, as in TRL) and ``completion_mask`` (1 on completion tokens), cut to
``max_length`` keeping the start.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.utils.rnn import pad_sequence

from lit_align.data.base import AlignDataModule
from lit_align.data.rows import check_max_length, encode_prompt_completion, keep_start, normalize_completion
from lit_align.errors import LitAlignError


def tokenize_completion(tokenizer, prompt, completion, conversational: bool) -> dict[str, list[int]]:
    """``input_ids`` (prompt then completion, split by TRL's rule) and ``completion_mask`` for one row, untruncated."""
    prompt_ids, completion_ids = encode_prompt_completion(tokenizer, prompt, completion, conversational)
    return {"input_ids": prompt_ids + completion_ids,
            "completion_mask": [0] * len(prompt_ids) + [1] * len(completion_ids)}


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
        max_length: tokens of prompt + completion kept of each row, cut at tokenize time keeping the start (None: no
            truncation).
        drop_long_prompts: drop rows whose prompt alone fills ``max_length`` (nothing of the completion would be
            left; TRL drops them silently) instead of stopping with an error that names the first such row.
        num_proc: processes for tokenization (``datasets.map``).
    """

    kind = "completion"

    def __init__(self, *args, max_length: int | None = 1024, drop_long_prompts: bool = False,
                 num_proc: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_length = check_max_length(max_length)
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
            out["input_ids"] = keep_start(out["input_ids"], max_length)
            out["completion_mask"] = keep_start(out["completion_mask"], max_length)
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
