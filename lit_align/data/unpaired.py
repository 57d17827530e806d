"""Unpaired preference rows for KTO: ``prompt`` / ``completion`` / ``label``, and the batch with its mismatched pairs.

A row is one completion of a prompt, ``label`` true (desirable) or false (undesirable). Preference pairs
(``prompt`` / ``chosen`` / ``rejected``, any format ``PreferenceDataModule`` reads) are unpaired as TRL's
``unpair_preference_dataset`` does: each pair gives a desirable row (its chosen side) and an undesirable one; in each
block of 1,000 pairs the desirable rows come first. The built-in tasks' preference rows arrive that way.

Tokenization is TRL's KTOTrainer's: prompt and prompt + completion tokenized (EOS appended to a standard completion),
the completion starting where the two diverge; a row is kept whole up to ``max_length`` tokens from its start.

The KL batch: KTO estimates its reference point from mismatched pairs, each row's prompt with another row's completion
(TRL's ``KL_completion_ids``). TRL builds them once, rotating the completions by one within each block of
``per_device_train_batch_size`` rows of the dataset, which is why it needs sequential sampling. Here ``collate``
rotates within the batch itself (row ``i`` gets row ``i - 1``'s completion, row 0 the last one's), which is the same
pairs for TRL's sequential batches and stays correct when rows are shuffled.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.nn.utils.rnn import pad_sequence

from lit_align.data.base import AlignDataModule
from lit_align.data.rows import (
    check_completion, check_max_length, check_prompt, encode_prompt_completion, keep_start, naming_row, normalize_pair,
    template_kwargs,
)
from lit_align.errors import LitAlignError

UNPAIR_BLOCK = 1000  # pairs per block when unpairing (``datasets.map``'s default batch, as in TRL)


def normalize_unpaired(row: dict[str, Any], where: str) -> tuple[Any, Any, bool, bool]:
    """Check one unpaired row; return ``(prompt, completion, label, conversational)``."""
    for field in ("prompt", "completion", "label"):
        if field not in row:
            raise LitAlignError(f"{where}: missing column {field!r} (expected prompt/completion/label rows, or "
                                "prompt/chosen/rejected pairs)")
    label = row["label"]
    if label is None:  # a key absent from some rows of a JSON file reads as null
        raise LitAlignError(f"{where}: field 'label' is missing or null (expected true or false)")
    if not isinstance(label, bool):
        raise LitAlignError(f"{where}: field 'label' must be a boolean (true: desirable, false: undesirable), got "
                            f"{label!r} ({type(label).__name__})")
    if row["prompt"] is None:
        raise LitAlignError(f"{where}: field 'prompt' is missing or null")
    conversational = check_prompt(row["prompt"], where)
    check_completion(row["completion"], "completion", where, conversational)
    return row["prompt"], row["completion"], label, conversational


def collate_unpaired(rows: list[dict[str, Any]], pad_token_id: int, max_length: int | None,
                     kl: bool = True) -> dict[str, torch.Tensor]:
    """Stack ``B`` unpaired rows, right-padded, each cut to its first ``max_length`` tokens.

    Returns ``input_ids``, ``attention_mask``, ``completion_mask`` (``[B, T]``), ``label`` (``[B]`` bool) and the
    ``dataset_rows``; with ``kl`` also ``KL_input_ids``, ``KL_attention_mask``, ``KL_completion_mask``: each row's
    prompt followed by the previous row's completion (cyclically), TRL's mismatched pairs.
    """
    completions = [row["completion_ids"] for row in rows]
    sides = {"": completions}
    if kl:
        sides["KL_"] = completions[-1:] + completions[:-1]
    batch = {}
    for prefix, answers in sides.items():
        seqs, masks = [], []
        for row, answer in zip(rows, answers):
            seqs.append(torch.tensor(keep_start(row["prompt_ids"] + answer, max_length)))
            masks.append(torch.tensor(keep_start([0] * len(row["prompt_ids"]) + [1] * len(answer), max_length)))
        batch[f"{prefix}input_ids"] = pad_sequence(seqs, batch_first=True, padding_value=pad_token_id)
        batch[f"{prefix}attention_mask"] = pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
        batch[f"{prefix}completion_mask"] = pad_sequence(masks, batch_first=True)
    batch["label"] = torch.tensor([row["label"] for row in rows], dtype=torch.bool)
    if "row" in rows[0]:
        batch["dataset_rows"] = torch.tensor([row["row"] for row in rows])
    return batch


class UnpairedPreferenceDataModule(AlignDataModule):
    """Unpaired preference rows for KTO; ``batch_size`` counts rows per device.

    Args:
        max_length: tokens of prompt + completion kept of each row, cut at collate keeping the start (None: no
            truncation). Rows whose prompt alone fills it are dropped (TRL drops them silently).
        num_proc: processes for tokenization (``datasets.map``).
    """

    kind = "preference"  # the built-in tasks' pairs, unpaired

    def __init__(self, *args, max_length: int | None = 1024, num_proc: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_length = check_max_length(max_length)
        self.num_proc = num_proc
        self.kl_pairs = True  # the mismatched pairs; the model says whether its loss reads them (``connect``)

    def connect(self, tokenizer: str | None = None, kl_pairs: bool = True) -> None:
        """The model's tokenizer, and whether its loss needs the mismatched pairs (KTO needs more than one row in a
        batch for them to be another row's completion)."""
        super().connect(tokenizer)
        if kl_pairs and self.batch_size < 2:
            raise LitAlignError(f"data.batch_size {self.batch_size}: KTO's KL estimate pairs each prompt with another "
                                "row's completion in the batch, so it needs at least 2 rows (loss_type "
                                "apo_zero_unpaired does not)")
        self.kl_pairs = kl_pairs

    def process(self, rows, source: str):
        tokenizer, chat_template_kwargs = self.tokenizer, self.chat_template_kwargs
        paired = "chosen" in rows.column_names or "rejected" in rows.column_names

        def encode(prompt, completion, conversational, row, where):
            template = template_kwargs(row, chat_template_kwargs, where)
            with naming_row(where):
                return encode_prompt_completion(tokenizer, prompt, completion, conversational, template)

        def tokenize_unpaired(row, index):
            where = f"{source} row {index}"
            prompt, completion, label, conversational = normalize_unpaired(row, where)
            prompt_ids, completion_ids = encode(prompt, completion, conversational, row, where)
            return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "label": label, "row": index}

        def unpair(block, indices):  # a block of pairs -> its desirable rows, then its undesirable ones
            out = {"prompt_ids": [], "completion_ids": [], "label": [], "row": []}
            sides = {True: [], False: []}
            for offset, index in enumerate(indices):
                row = {key: values[offset] for key, values in block.items()}
                where = f"{source} row {index}"
                prompt, chosen, rejected, conversational = normalize_pair(row, where)
                sides[True].append((encode(prompt, chosen, conversational, row, where), index))
                sides[False].append((encode(prompt, rejected, conversational, row, where), index))
            for label in (True, False):
                for (prompt_ids, completion_ids), index in sides[label]:
                    out["prompt_ids"].append(prompt_ids)
                    out["completion_ids"].append(completion_ids)
                    out["label"].append(label)
                    out["row"].append(index)
            return out

        if paired:
            tokenized = rows.map(unpair, batched=True, batch_size=UNPAIR_BLOCK, with_indices=True,
                                 remove_columns=rows.column_names, num_proc=self.num_proc, desc=f"Unpairing {source}")
        else:
            tokenized = rows.map(tokenize_unpaired, with_indices=True, remove_columns=rows.column_names,
                                 num_proc=self.num_proc, desc=f"Tokenizing {source}")
        if self.max_length is not None:
            before = len(tokenized)
            tokenized = tokenized.filter(lambda r: len(r["prompt_ids"]) < self.max_length)
            dropped = before - len(tokenized)
            if dropped:
                rank_zero_info(f"lit_align: {source}: {dropped} rows dropped (prompt alone >= "
                               f"max_length={self.max_length})")
            if len(tokenized) == 0:
                raise LitAlignError(f"{source}: every row was dropped (prompt alone >= max_length={self.max_length})")
        desirable = sum(tokenized["label"])
        rank_zero_info(f"lit_align: {source}: {desirable} desirable and {len(tokenized) - desirable} undesirable rows")
        if desirable in (0, len(tokenized)):  # TRL trains on it too; said, since a label column gone wrong looks alike
            kind, other = ("desirable", "undesirable") if desirable else ("undesirable", "desirable")
            rank_zero_warn(f"lit_align: {source}: every row is {kind}, none {other}: KTO trains on one side only (its "
                           "loss moves these completions against the KL estimate; desirable_weight and "
                           "undesirable_weight cannot balance a missing side); check the 'label' column if both were "
                           "meant")
        return tokenized

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate_unpaired(rows, self.tokenizer.pad_token_id, self.max_length, kl=self.kl_pairs)
