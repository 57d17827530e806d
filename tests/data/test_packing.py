"""lit_align.data.packing: best-fit decreasing bins, wrapped rows, and packed batches that give the unpacked loss and
gradients (rule 3 of tests/numerics.py: the same sums in another order)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from helpers import run_main
from lit_align import layouts
from lit_align.data import CompletionDataModule
from lit_align.data.packing import bfd_bins, collate_packed, pack
from lit_align.models import load_model
from lit_align.modules.sft import sft_token_stats
from numerics import TINY_TERMS, assert_rounding_close

FORMATS = Path(__file__).resolve().parents[1] / "fixtures" / "formats"
REPO = Path(__file__).resolve().parents[2]


def test_bfd_fills_bins_without_splitting_or_overflowing():
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(300)]
    bins = bfd_bins(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(300))  # every sequence once, none split
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= 1.05 * sum(lengths) / 64 + 1  # close to the bound
    assert bfd_bins([64, 1, 63], 64) == [[0], [2, 1]]  # best fit: the 1 goes where it fits most tightly


def test_pack_keeps_each_sequences_tokens_and_lengths():
    rows = [{"input_ids": list(range(10, 10 + n)), "completion_mask": [1] * n, "assistant_mask": []} for n in (5, 7, 3)]
    assert pack(rows, 8, "bfd") == [
        {"input_ids": list(range(10, 17)), "completion_mask": [1] * 7, "seq_lengths": [7], "rows": [1]},
        {"input_ids": [10, 11, 12, 13, 14, 10, 11, 12], "completion_mask": [1] * 8, "seq_lengths": [5, 3],
         "rows": [0, 2]},
    ]
    wrapped = pack(rows, 8, "wrapped")  # cut every 8 tokens: the second sequence goes on in the next row
    assert [r["input_ids"] for r in wrapped] == [[10, 11, 12, 13, 14, 10, 11, 12], [13, 14, 15, 16, 10, 11, 12]]
    assert [r["seq_lengths"] for r in wrapped] == [[5, 3], [4, 3]]
    assert [r["rows"] for r in wrapped] == [[0, 1], [1, 2]]  # the dataset rows in each (the numeric guard names them)
    batch = collate_packed(wrapped, pad_token_id=0)
    assert batch["dataset_rows"].tolist() == [0, 1, 1, 2]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 0]]
    assert batch["segment_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, -1]]


@pytest.mark.parametrize("fixture", ["text_corpus.jsonl", "ultrachat_200k.jsonl"])
@pytest.mark.parametrize("mode", ["bfd", "wrapped-free", "padding_free"])
def test_packed_batches_give_the_unpacked_loss_and_gradients(fixture, mode, tiny_path):
    plain = CompletionDataModule(str(FORMATS / fixture), tokenizer="builtin:tiny", val_split=None, shuffle=False,
                                 batch_size=64)
    plain.setup("fit")
    rows = list(plain.train_data)
    if mode == "bfd":
        other = collate_packed(pack(rows, 96, "bfd"), pad_token_id=plain.tokenizer.pad_token_id)
    elif mode == "padding_free":  # the module's layout choice (model.padding_free), on the padded batch
        other = plain.collate(rows)
    else:  # every sequence whole in a row: wrapped with room for the longest (the wrapped cut changes the rows)
        other = collate_packed(pack(rows, 10_000, "wrapped"), pad_token_id=plain.tokenizer.pad_token_id)
    padded = plain.collate(rows)
    model = load_model("builtin:tiny")
    results = []
    for batch, padding_free in ((padded, False), (other, mode == "padding_free")):
        model.zero_grad()
        loss, correct, count, _ = sft_token_stats(model, batch, padding_free=padding_free)
        loss.backward()
        results.append((loss.detach(), int(correct), int(count), [p.grad.clone() for p in model.parameters()]))
    (loss, correct, count, grads), (p_loss, p_correct, p_count, p_grads) = results
    assert p_count == count and p_correct == correct  # the same tokens scored, the same argmax
    assert_rounding_close(p_loss, loss, scale=float(loss), terms=TINY_TERMS)
    for a, b in zip(p_grads, grads):
        assert_rounding_close(a, b, terms=TINY_TERMS * count)
    if mode == "padding_free":  # one row, no padding at all
        layout = layouts.sft(other, other["completion_mask"], padding_free=True)
        assert layout.input_ids.shape == (1, int(padded["attention_mask"].sum()))
    else:
        assert other["input_ids"].numel() <= padded["input_ids"].numel()  # the point: no more positions


def test_sft_trains_packed_and_padding_free_through_the_cli(tmp_path, capfd):
    for flags in (["--data.init_args.packing", "true", "--data.init_args.max_length", "64"],
                  ["--model.init_args.padding_free", "true"]):
        code, _, err = run_main([
            "fit", "-c", str(REPO / "configs" / "sft.yaml"), "--data.init_args.path", str(FORMATS / "text_corpus.jsonl"),
            "--data.init_args.val_split", "null", "--data.init_args.batch_size", "2", "--trainer.max_steps", "2",
            "--trainer.val_check_interval", "1.0", "--trainer.logger", "false", "--trainer.enable_checkpointing",
            "false", "--trainer.enable_progress_bar", "false", "--export.enabled", "false",
            "--trainer.default_root_dir", str(tmp_path), *flags], capfd)
        assert code == 0, err


def test_wrapped_packing_cuts_the_stream_of_whole_rows(tmp_path, capfd, caplog, tokenizer):
    """``wrapped`` packs every row whole (TRL truncates nothing when packing) and cuts the stream every
    ``max_length`` tokens: ceil(total tokens / max_length) rows, holding every token in file order."""
    path = FORMATS / "text_corpus.jsonl"
    rows = [tokenizer(json.loads(line)["text"] + tokenizer.eos_token)["input_ids"]
            for line in path.read_text().splitlines()]
    max_length = 16
    assert min(map(len, rows)) > max_length  # each row is longer than a packed row
    expected = math.ceil(sum(map(len, rows)) / max_length)
    code, _, err = run_main([
        "fit", "-c", str(REPO / "configs" / "sft.yaml"), "--data.init_args.path", str(path),
        "--data.init_args.val_split", "null", "--data.init_args.batch_size", "2", "--trainer.max_steps", "2",
        "--trainer.val_check_interval", "1.0", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--export.enabled", "false", "--trainer.default_root_dir",
        str(tmp_path), "--data.init_args.packing", "true", "--data.init_args.packing_strategy", "wrapped",
        "--data.init_args.max_length", str(max_length)], capfd)
    assert code == 0, err
    assert f"{len(rows)} rows packed into {expected} of up to {max_length} tokens (wrapped)" in caplog.text
    dm = CompletionDataModule(str(path), tokenizer="builtin:tiny", val_split=None, packing=True,
                              packing_strategy="wrapped", max_length=max_length)
    dm.setup("fit")
    assert [t for row in dm.train_data for t in row["input_ids"]] == [t for row in rows for t in row]
    assert [len(row["input_ids"]) for row in dm.train_data][:-1] == [max_length] * (expected - 1)
