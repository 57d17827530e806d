"""SFT tokens/s: padded batches against packed rows (bfd) and padding-free batches, same rows, same model.

Rows are text of spread lengths (uniform in [--min-len, --max-len] characters; the built-in tokenizer is one token per
character), so a padded batch pays for its longest row. Each mode runs forward + backward of the SFT loss
(``lit_align.modules.sft.sft_token_stats``) over every row once, after one warm-up batch, and reports real (non-pad)
tokens per second and the positions it computed.

    python bench/sft_packing.py                      # builtin:small, 256 rows of 16-400 tokens
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per padded / padding-free batch")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from lit_align.data.packing import collate_packed, pack
    from lit_align.data.completions import collate_completions
    from lit_align.models import load_model, load_tokenizer
    from lit_align.modules.sft import sft_token_stats

    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model).train()
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    rows = []
    for _ in range(args.rows):
        ids = tokenizer("".join(rng.choice(letters) for _ in range(rng.randint(args.min_len, args.max_len))))["input_ids"]
        rows.append({"input_ids": ids + [tokenizer.eos_token_id], "completion_mask": [1] * (len(ids) + 1),
                     "assistant_mask": []})
    real = sum(len(r["input_ids"]) for r in rows)
    pad = tokenizer.pad_token_id
    chunks = [rows[i : i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
    packed = pack(rows, args.max_len + 1, "bfd")
    per_batch = max(1, round(len(packed) / len(chunks)))
    modes = {
        "padded": [collate_completions(c, pad) for c in chunks],
        "packed (bfd)": [collate_packed(packed[i : i + per_batch], pad) for i in range(0, len(packed), per_batch)],
        "padding-free": [collate_completions(c, pad) for c in chunks],  # made one row by the layout
    }
    print(f"{args.model}, {args.rows} rows of {args.min_len}-{args.max_len} tokens ({real} real), "
          f"{args.threads} threads; fwd+bwd of the SFT loss over every row once")
    print(f"{'mode':<14} {'batches':>7} {'positions':>9} {'tok/s':>8} {'vs padded':>9}")
    base = None
    for name, batches in modes.items():
        free = name == "padding-free"  # model.padding_free: the layout makes each padded batch one row
        loss = sft_token_stats(model, batches[0], padding_free=free).loss  # warm-up
        loss.backward()
        model.zero_grad()
        start = time.perf_counter()
        for batch in batches:
            loss = sft_token_stats(model, batch, padding_free=free).loss
            loss.backward()
            model.zero_grad()
        rate = real / (time.perf_counter() - start)
        base = base or rate
        positions = sum(int(b["attention_mask"].sum()) if free else int(b["input_ids"].numel()) for b in batches)
        print(f"{name:<14} {len(batches):>7} {positions:>9} {rate:>8.0f} {rate / base:>8.2f}x")


if __name__ == "__main__":
    main()
