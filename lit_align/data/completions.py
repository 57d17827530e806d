"""Rows for supervised fine-tuning (SFT), tokenized as TRL's ``SFTTrainer`` tokenizes them.

The row formats and their checks are in ``lit_align.data.rows``. Each row becomes ``input_ids``, ``completion_mask``
and ``assistant_mask``, cut to ``max_length`` keeping the start:

- prompt/completion rows: prompt ids, then completion ids (the completion starts where the tokenized prompt and the
  tokenized prompt + completion diverge, as in TRL); ``completion_mask`` is 1 on the completion; when the rows are
  conversational, ``assistant_mask`` is 1 on each assistant turn (of the prompt too), not on ``tool`` turns;
- ``messages`` rows (whole conversations) and ``text`` rows: language modelling, as TRL's: ``completion_mask`` is 1
  everywhere; ``assistant_mask`` is 1 on every assistant turn of a conversation (empty for text).

``SFTModule`` trains on ``completion_mask`` (``completion_only_loss``), ``assistant_mask``
(``assistant_only_loss``), or both: the assistant turns of the completion, as TRL's ``SFTTrainer`` combines them.
"""

from __future__ import annotations

from typing import Any

import datasets
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.utils.rnn import pad_sequence

from lit_align.data.base import AlignDataModule
from lit_align.data.packing import PACKING_STRATEGIES, collate_packed, pack, present_keys
from lit_align.data.rows import (
    check_max_length, encode_conversation, encode_prompt_completion, encode_text, keep_start, naming_row,
    normalize_completion, sft_row_kind, template_kwargs, with_eos,
)
from lit_align.errors import LitAlignError


def tokenize_completion(tokenizer, prompt, completion, conversational: bool,
                        template: dict | None = None) -> dict[str, list[int]]:
    """``input_ids`` (prompt then completion, split by TRL's rule) and ``completion_mask`` for one row, untruncated."""
    prompt_ids, completion_ids = encode_prompt_completion(tokenizer, prompt, completion, conversational, template)
    return {"input_ids": prompt_ids + completion_ids,
            "completion_mask": [0] * len(prompt_ids) + [1] * len(completion_ids)}


def tokenize_sft_row(tokenizer, row: dict[str, Any], where: str, chat_template_kwargs: dict | None = None) -> dict:
    """One SFT row of any format: ``input_ids``, ``completion_mask``, ``assistant_mask`` (``[]``: not a chat), and
    ``prompt_length`` (tokens before the first trained one), untruncated."""
    kind = sft_row_kind(row, where)
    if kind == "text":
        ids = encode_text(tokenizer, with_eos(tokenizer, row["text"]))
        return {"input_ids": ids, "completion_mask": [1] * len(ids), "assistant_mask": [], "prompt_length": 0}
    template = template_kwargs(row, chat_template_kwargs, where)
    if kind == "messages":
        ids, assistant = encode_conversation(tokenizer, row["messages"], template, where)
        return {"input_ids": ids, "completion_mask": [1] * len(ids), "assistant_mask": assistant, "prompt_length": 0}
    prompt, completion, conversational = normalize_completion(row, where)
    out = tokenize_completion(tokenizer, prompt, completion, conversational, template)
    mask = out["completion_mask"]
    # the assistant turns of the whole conversation, the prompt's too (TRL's mask; the loss keeps those of the
    # completion under completion_only_loss): a completion's tool turns are not the model's to learn
    assistant = encode_conversation(tokenizer, prompt + completion, template, where)[1] if conversational else []
    return {**out, "assistant_mask": assistant, "prompt_length": mask.index(1) if 1 in mask else len(mask)}


def collate_completions(rows: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``completion_mask``, each ``[B, T]``, and
    ``assistant_mask`` when every row is a chat."""
    seqs = [torch.tensor(r["input_ids"]) for r in rows]

    def padded(key: str) -> torch.Tensor:
        return pad_sequence([torch.tensor(r[key]) for r in rows], batch_first=True, padding_value=0)

    batch = {
        "input_ids": pad_sequence(seqs, batch_first=True, padding_value=pad_token_id),
        "attention_mask": pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True, padding_value=0),
        "completion_mask": padded("completion_mask"),
    }
    if "assistant_mask" in present_keys(rows):
        batch["assistant_mask"] = padded("assistant_mask")
    if "row" in rows[0]:
        batch["dataset_rows"] = torch.tensor([r["row"] for r in rows])
    return batch


class CompletionDataModule(AlignDataModule):
    """SFT rows (prompt/completion, ``messages`` conversations, ``text``); ``batch_size`` counts sequences per device.

    Args:
        max_length: tokens of prompt + completion kept of each row, cut at tokenize time keeping the start (None: no
            truncation); with ``packing``, the length of a packed row (``wrapped`` packs rows whole).
        drop_long_prompts: drop rows whose prompt alone fills ``max_length`` (nothing of the completion would be
            left; TRL drops them silently) instead of stopping with an error that names the first such row.
        num_proc: processes for tokenization (``datasets.map``).
        packing: pack several rows into each row of ``max_length`` tokens, without attention between them
            (TRL's ``packing``; ``lit_align.data.packing``); ``batch_size`` then counts packed rows.
        packing_strategy: ``bfd`` (best-fit decreasing; no row split, TRL's default) or ``wrapped`` (cut every
            ``max_length`` tokens).
        assistant_only_loss: rows are trained on their assistant tokens only, so a row whose cut leaves none is
            dropped; ``lit-align`` sets it from ``model.assistant_only_loss``.
        eos_token: the token that ends each text row and standard completion instead of the tokenizer's EOS;
            ``lit-align`` sets it from ``model.eos_token``.
    """

    kind = "completion"

    def __init__(self, *args, max_length: int | None = 1024, drop_long_prompts: bool = False,
                 num_proc: int | None = None, packing: bool = False, packing_strategy: str = "bfd",
                 assistant_only_loss: bool = False, eos_token: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.eos_token = eos_token
        self.max_length = check_max_length(max_length)
        self.drop_long_prompts, self.num_proc = drop_long_prompts, num_proc
        if packing_strategy not in PACKING_STRATEGIES:
            raise LitAlignError(f"data.packing_strategy {packing_strategy!r}: expected one of {PACKING_STRATEGIES}")
        if packing and max_length is None:
            raise LitAlignError("data.packing needs data.max_length (the length of a packed row)")
        self.packing, self.packing_strategy = packing, packing_strategy
        self.assistant_only_loss = assistant_only_loss

    def process(self, rows, source: str):
        columns = set(rows.column_names)
        if not {"messages", "text"} & columns and not {"prompt", "completion"} <= columns:
            raise LitAlignError(f"{source}: columns {sorted(columns)}: expected 'prompt' and 'completion', 'messages' "
                                "or 'text'")
        tokenizer, drop = self.tokenizer, self.drop_long_prompts
        # wrapped packing cuts the stream of whole rows (TRL truncates nothing when packing); otherwise rows are cut
        max_length = None if self.packing and self.packing_strategy == "wrapped" else self.max_length
        chat_template_kwargs = self.chat_template_kwargs

        def tokenize(row, index):
            where = f"{source} row {index}"
            with naming_row(where):
                out = tokenize_sft_row(tokenizer, row, where, chat_template_kwargs)
            prompt_length = out.pop("prompt_length")
            out["truncated"] = max_length is not None and len(out["input_ids"]) > max_length
            if max_length is not None and prompt_length >= max_length and not drop:
                raise LitAlignError(
                    f"{where}: the prompt alone is {prompt_length} tokens, max_length is {max_length} "
                    "(raise data.max_length, or set data.drop_long_prompts: true)"
                )
            for key in ("input_ids", "completion_mask", "assistant_mask"):
                out[key] = keep_start(out[key], max_length)
            return {**out, "row": index}  # the dataset index travels with the row (numeric guard messages)

        tokenized = rows.map(tokenize, with_indices=True, remove_columns=rows.column_names, num_proc=self.num_proc,
                             desc=f"Tokenizing {source}")
        tokenized, truncated, dropped = self._drop_untrained(tokenized, source, max_length)
        self.truncation_report = {"truncated": truncated, "dropped": dropped}
        tokenized = tokenized.remove_columns("truncated")
        if not self.packing:
            return tokenized
        packed = pack(list(tokenized), self.max_length, self.packing_strategy)
        rank_zero_info(f"lit_align: {source}: {len(tokenized)} rows packed into {len(packed)} of up to "
                       f"{self.max_length} tokens ({self.packing_strategy})")
        return datasets.Dataset.from_list(packed)

    def _drop_untrained(self, tokenized, source: str, max_length: int | None):
        """Drop the rows left with no token to train on (``completion_mask``, or ``assistant_mask`` under
        ``assistant_only_loss``: a cut can leave a conversation none of its assistant turns); say how many, refuse
        when none is left. Returns the rows, how many were truncated and how many dropped."""
        trained = "assistant" if self.assistant_only_loss else "completion"
        # text rows have no assistant mask: kept, for the module to refuse them with assistant_only_loss
        before = len(tokenized)
        tokenized = tokenized.filter(lambda r: 1 in (r[f"{trained}_mask"] or r["completion_mask"]))
        truncated, dropped = sum(tokenized["truncated"]), before - len(tokenized)
        if truncated or dropped:
            rank_zero_info(f"lit_align: {source}: {truncated} rows truncated to max_length={max_length}, "
                           f"{dropped} dropped (no {trained} token left)")
        if len(tokenized) == 0:
            raise LitAlignError(f"{source}: every row was dropped (no {trained} token within max_length={max_length})")
        return tokenized, truncated, dropped

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "seq_lengths" in rows[0]:
            return collate_packed(rows, self.tokenizer.pad_token_id)
        return collate_completions(rows, self.tokenizer.pad_token_id)
