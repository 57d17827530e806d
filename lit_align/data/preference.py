"""Preference pairs: tokenization and the [chosen; rejected] batch the DPO step (``PreferenceDataModule``) and the
reward model's step (``RewardDataModule``) consume.

The row formats (standard, conversational, implicit prompt) and their checks are in ``lit_align.data.rows``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.utils.rnn import pad_sequence

from lit_align.data.base import AlignDataModule
from lit_align.data.rows import (
    check_max_length, encode_prompt_completion, keep_end, keep_start, naming_row, normalize_pair, template_kwargs,
)
from lit_align.errors import LitAlignError


def tokenize_pair(tokenizer, prompt, chosen, rejected, conversational: bool,
                  template: dict | None = None) -> dict[str, list[int]]:
    """Token ids of prompt, chosen and rejected, as TRL builds them: each side split by TRL's rule
    (``encode_prompt_completion``), the prompt cut to what the two sides share."""
    prompt_chosen, chosen_ids = encode_prompt_completion(tokenizer, prompt, chosen, conversational, template)
    prompt_rejected, rejected_ids = encode_prompt_completion(tokenizer, prompt, rejected, conversational, template)
    n = min(len(prompt_chosen), len(prompt_rejected))
    return {"prompt_ids": prompt_chosen[:n], "chosen_ids": prompt_chosen[n:] + chosen_ids,
            "rejected_ids": prompt_rejected[n:] + rejected_ids}


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
            seqs.append(torch.tensor(keep_start(ids, max_length)))
            masks.append(torch.tensor(keep_start(mask, max_length)))
    batch = {
        "input_ids": pad_sequence(seqs, batch_first=True, padding_value=pad_token_id),
        "attention_mask": pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True, padding_value=0),
        "completion_mask": pad_sequence(masks, batch_first=True, padding_value=0),
    }
    if "row" in rows[0]:
        batch["dataset_rows"] = torch.tensor([row["row"] for row in rows])
    for key in ("ref_chosen_logps", "ref_rejected_logps"):
        if key in rows[0]:
            batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
    return batch


class PreferenceDataModule(AlignDataModule):
    """Preference pairs for DPO; ``batch_size`` counts pairs per device (each step runs ``2 * batch_size`` sequences).

    Args:
        max_length: tokens of prompt + completion kept of each side (chosen, rejected), cut at collate keeping the
            start (None: no truncation).
        drop_long_prompts: drop rows whose prompt alone fills ``max_length`` (TRL drops them silently) instead of
            stopping with an error that names the first such row.
        max_prompt_length: first cut each prompt to its last this many tokens (older TRL's ``DPOConfig``
            ``max_prompt_length``, which recipe files written for it set; None, TRL 1.16's way: only ``max_length``).
        num_proc: processes for tokenization (``datasets.map``).
    """

    kind = "preference"

    def __init__(self, *args, max_length: int | None = 1024, drop_long_prompts: bool = False,
                 max_prompt_length: int | None = None, num_proc: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_length = check_max_length(max_length)
        if max_prompt_length is not None and max_prompt_length < 1:
            raise LitAlignError(f"data.max_prompt_length must be >= 1 or null, got {max_prompt_length}")
        self.drop_long_prompts, self.max_prompt_length, self.num_proc = drop_long_prompts, max_prompt_length, num_proc

    def add_reference_logps(self, annotate: Callable) -> None:
        """Give the rows set up so far the reference's ``ref_chosen_logps`` / ``ref_rejected_logps`` columns.

        ``annotate(rows, split, collate, batch_size, max_length)`` returns them (cached, or one pass of the reference:
        ``lit_align.reference.PrecomputedReference.annotate``); the model hands it over from its ``setup``
        (``precompute_ref_log_probs``), so this module never reads the model.
        """
        if self.train_data is not None:
            self.train_data = annotate(self.train_data, "train", self.collate, self.batch_size, self.max_length)
        if self.val_data is not None:
            self.val_data = annotate(self.val_data, "val", self.collate, self.val_batch_size, self.max_length)

    def process(self, rows, source: str):
        tokenizer, max_length = self.tokenizer, self.max_length
        chat_template_kwargs = self.chat_template_kwargs

        def tokenize(row, index):
            where = f"{source} row {index}"
            prompt, chosen, rejected, conversational = normalize_pair(row, where)
            template = template_kwargs(row, chat_template_kwargs, where)
            with naming_row(where):
                out = tokenize_pair(tokenizer, prompt, chosen, rejected, conversational, template)
            out["prompt_ids"] = keep_end(out["prompt_ids"], self.max_prompt_length)
            if max_length is not None and len(out["prompt_ids"]) >= max_length and not self.drop_long_prompts:
                raise LitAlignError(
                    f"{where}: the prompt alone is {len(out['prompt_ids'])} tokens, max_length is {max_length} "
                    "(raise data.max_length, or set data.drop_long_prompts: true)"
                )
            return {**out, "row": index}  # the dataset index travels with the row (numeric guard messages)

        tokenized = rows.map(
            tokenize, with_indices=True, remove_columns=[c for c in rows.column_names if not self.keeps(c)],
            num_proc=self.num_proc, desc=f"Tokenizing {source}",
        )
        if max_length is None:
            return tokenized.with_format(None)
        return self.fit_max_length(tokenized, source)

    def keeps(self, column: str) -> bool:
        """Which of the source's columns travel with the tokenized rows: precomputed reference log-probs."""
        return column.startswith("ref_") and column.endswith("_logps")

    def fit_max_length(self, tokenized, source: str):
        """Rows whose prompt alone fills ``max_length`` dropped (``drop_long_prompts``); the rest cut at collate."""
        max_length = self.max_length
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


class RewardDataModule(PreferenceDataModule):
    """Preference pairs for a reward model (TRL's ``RewardTrainer`` data): the same row formats, tokens and
    ``[chosen; rejected]`` batches as DPO's, plus an optional ``margin`` column, a number per row that the loss
    asks the reward gap to exceed (``lit_align.losses.reward``).

    A reward is read at a sequence's last token, so no row is cut: as TRL does, a pair with either side longer than
    ``max_length`` tokens (prompt + completion) is dropped, and the number dropped is reported.

    Args:
        max_length: the longest side (prompt + completion) a pair may have, in tokens (None: any).
        num_proc: processes for tokenization (``datasets.map``).
    """

    def __init__(self, *args, max_length: int | None = 1024, num_proc: int | None = None, **kwargs):
        super().__init__(*args, max_length=max_length, drop_long_prompts=True, num_proc=num_proc, **kwargs)

    def keeps(self, column: str) -> bool:
        return column == "margin"

    def process(self, rows, source: str):
        if "margin" in rows.column_names:
            for index, margin in enumerate(rows["margin"]):
                if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
                    raise LitAlignError(f"{source} row {index}: field 'margin' must be a finite number, got "
                                        f"{margin!r}")
        return super().process(rows, source)

    def fit_max_length(self, tokenized, source: str):
        """Pairs with a side longer than ``max_length`` dropped (TRL's filter), counted."""
        max_length, before = self.max_length, len(tokenized)
        tokenized = tokenized.filter(
            lambda r: len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) <= max_length)
        dropped = before - len(tokenized)
        if dropped:
            rank_zero_info(f"lit_align: {source}: {dropped} of {before} pairs dropped (a side longer than "
                           f"max_length={max_length} tokens)")
        if len(tokenized) == 0:
            raise LitAlignError(f"{source}: every pair has a side longer than data.max_length={max_length} tokens "
                                "(raise data.max_length, or set it to null)")
        self.truncation_report = {"truncated": 0, "dropped": dropped}
        return tokenized

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """``collate_pairs``' batch, uncut, plus ``margin`` ``[B]`` where the rows have one."""
        batch = collate_pairs(rows, self.tokenizer.pad_token_id, None)
        if "margin" in rows[0]:
            batch["margin"] = torch.tensor([row["margin"] for row in rows], dtype=torch.float32)
        return batch
