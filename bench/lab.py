"""The realistic lab, built offline: models and rows at the shapes users train, for every ``bench/`` script's
``--lab realistic``.

The built-in models (a ~100-token character vocabulary, ~30-token rows) hide what decides speed and memory for real
models: the LM head at a 32k-152k vocabulary, and rows whose lengths vary from tens to hundreds of tokens. This lab
writes, under ``$LIT_ALIGN_CACHE/lab`` (once; later calls read it back):

- ``llama-32k``: Llama-shaped (GQA, SwiGLU, RMSNorm, rotary, untied head), vocabulary 32,000, hidden 512,
  intermediate 1,408, 4 layers, 8 heads / 4 KV heads (head dim 64): 11.8M decoder + 2 x 16.4M embedding/head.
- ``qwen2-152k``: Qwen2-shaped (q/k/v biases, GQA, tied embedding as in Qwen2-0.5B/1.5B), vocabulary 151,936,
  hidden 256, intermediate 1,024, 4 layers, 4 heads / 2 KV heads (head dim 64): 3.7M decoder + 38.9M embedding=head.
- Random weights (speed does not depend on them), fp32, sdpa attention.
- A word-level tokenizer of exactly that vocabulary (``tokenizers`` ``WordLevel`` over generated words, one token per
  whitespace-separated word), with BOS/EOS/pad and a ChatML chat template. transformers 5 loads a ``qwen2`` model
  directory's tokenizer as its own ``Qwen2Tokenizer`` (byte-level pre-tokenization; with no merges in the lab's
  vocabulary, about one token per letter), so ``qwen2-152k``'s rows come out ~2.3x as many tokens as ``llama-32k``'s:
  both are kept as they load, as every bench (and TRL) sees them.
- ``preference.jsonl``: prompt / chosen / rejected strings with UltraFeedback-like length spreads: log-normal
  word counts (prompt median 60, completions median 110), so the ``[prompt, chosen, rejected]`` rows span 156 / 332 /
  618 tokens at p5 / p50 / p95 for ``llama-32k``, 359 / 772 / 1437 for ``qwen2-152k`` (``python bench/lab.py``
  prints the percentiles, each model's tokenizer as loaded).
- ``prompts.jsonl``: GSM8K-like prompts (``llama-32k``: median 55 tokens, 25-200; ``qwen2-152k``: median 127) with an
  ``answer`` column.

The words are drawn Zipf-like from the vocabulary, so rows use the whole of it (through the word-level tokenizer), as
real text does.

    python bench/lab.py              # build (if needed) and print the shapes and row lengths
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

LAB_MODELS = {
    "llama-32k": dict(model_type="llama", vocab_size=32000, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
    "qwen2-152k": dict(model_type="qwen2", vocab_size=151936, hidden_size=256, intermediate_size=1024,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
# (median tokens, log-normal sigma, min, max)
PROMPT_LENGTHS, COMPLETION_LENGTHS, QUESTION_LENGTHS = (60, 0.8, 8, 300), (110, 0.7, 4, 400), (55, 0.4, 25, 200)


def lab_dir() -> Path:
    return Path(os.environ.get("LIT_ALIGN_CACHE", Path.home() / ".cache" / "lit_align")) / "lab"


def words(vocab_size: int) -> list[str]:
    """``vocab_size - len(SPECIAL)`` distinct lower-case words (base-26 numerals spelt in letters, ``role`` words
    first so the chat template's roles are single tokens)."""
    out = ["user", "assistant", "system"]
    n = 0
    while len(out) < vocab_size - len(SPECIAL):
        word, k = "", n
        while True:
            word = chr(97 + k % 26) + word
            k = k // 26 - 1
            if k < 0:
                break
        n += 1
        if word not in ("user", "assistant", "system"):
            out.append(word)
    return out


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + words(vocab_size))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == vocab_size, len(tokenizer)
    return tokenizer


def build_model(name: str, path: Path, seed: int = 0) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(LAB_MODELS[name])
    tokenizer = build_tokenizer(shape["vocab_size"])
    config = AutoConfig.for_model(shape.pop("model_type"), max_position_embeddings=2048, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def lengths(rng, spec: tuple, n: int):
    import numpy as np

    median, sigma, lo, hi = spec
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int)


def text(rng, n: int, vocab: int) -> str:
    """``n`` words drawn Zipf-like over the lab's vocabulary (1.1: a long tail that reaches the rare ids)."""
    ids = (rng.zipf(1.1, n) - 1) % (vocab - len(SPECIAL) - 3)
    return " ".join(WORDS[3 + i] for i in ids)


WORDS: list[str] = []


def write_rows(path: Path, rows: int = 4096, seed: int = 0) -> None:
    import numpy as np

    WORDS[:] = words(32000)  # ids valid in both vocabularies: the same rows for both models
    rng = np.random.default_rng(seed)
    vocab = 32000
    p, c, r = (lengths(rng, PROMPT_LENGTHS, rows), lengths(rng, COMPLETION_LENGTHS, rows),
               lengths(rng, COMPLETION_LENGTHS, rows))
    with open(path / "preference.jsonl", "w") as f:
        for i in range(rows):
            f.write(json.dumps({"prompt": text(rng, p[i], vocab), "chosen": text(rng, c[i], vocab),
                                "rejected": text(rng, r[i], vocab)}) + "\n")
    q = lengths(rng, QUESTION_LENGTHS, rows)
    with open(path / "prompts.jsonl", "w") as f:
        for i in range(rows):
            f.write(json.dumps({"prompt": text(rng, q[i], vocab), "answer": str(int(rng.integers(0, 1000)))}) + "\n")


def build() -> Path:
    """Build the lab once (atomically); return its directory."""
    target = lab_dir()
    if (target / "prompts.jsonl").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".lab-", dir=target.parent))
    try:
        for name in LAB_MODELS:
            build_model(name, tmp / name)
        write_rows(tmp)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def model(name: str) -> str:
    return str(build() / name)


def preference_rows() -> str:
    return str(build() / "preference.jsonl")


def prompt_rows() -> str:
    return str(build() / "prompts.jsonl")


def main() -> None:
    import numpy as np
    from transformers import AutoTokenizer

    root = build()
    print(f"lab: {root}")
    rows = [json.loads(line) for line in open(root / "preference.jsonl")]
    prompts = [json.loads(line)["prompt"] for line in open(root / "prompts.jsonl")]
    for name, shape in LAB_MODELS.items():
        tokenizer = AutoTokenizer.from_pretrained(model(name))  # as every bench loads it
        print(f"  {name}: {shape}; tokenizer {type(tokenizer).__name__}")
        n = {k: np.array([len(ids) for ids in tokenizer([r[k] for r in rows], add_special_tokens=False)["input_ids"]])
             for k in ("prompt", "chosen", "rejected")}
        n["[prompt, chosen, rejected]"] = n["prompt"] + n["chosen"] + n["rejected"]
        question_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        n["GSM8K-like prompt"] = np.array([len(ids) for ids in question_ids])
        for what, values in n.items():
            print(f"    {what:<28} tokens p5/p50/p95/max: {np.percentile(values, [5, 50, 95]).astype(int)} "
                  f"{values.max()}")


if __name__ == "__main__":
    main()
