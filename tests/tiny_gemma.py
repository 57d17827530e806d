"""A tiny random Gemma 3 built offline: another model family than the built-in Llama, as Gemma 3 270M is (sliding-window
attention in five of every six layers, ``gelu`` MLPs, a scaled embedding, ``model`` as the assistant's role), with
Gemma's special tokens at Gemma's ids (pad 0, eos 1, bos 2, unk 3, ``<start_of_turn>``, ``<end_of_turn>``) and no chat
template, as the base Gemma models ship. Its tokenizer is a byte-level BPE trained here on the arith tasks' text (a
few hundred tokens, so the tasks' prompts are tens of tokens, not hundreds of characters); its window (8 tokens) is
shorter than those prompts, so the sliding layers really slide."""

from __future__ import annotations

from pathlib import Path

import torch

from lit_align.pretrained import save_hf

SLIDING_WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def task_texts() -> list[str]:
    """Every message of the built-in arith tasks' prompts and completions (what the tokenizer learns merges from)."""
    from lit_align.data.sources import load_rows

    texts = []
    for task in ("builtin:arith", "builtin:arith-words"):
        for row in load_rows(task, "train", "completion").to_list() + load_rows(task, "train", "prompt").to_list():
            texts += [message["content"] for message in row["prompt"] + row.get("completion", [])]
    return texts


def build_gemma_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(task_texts(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def build_tiny_gemma3(path: Path, seed: int = 0) -> Path:
    """Write the model and its tokenizer (no chat template) as a Hugging Face directory at ``path``."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = build_gemma_tokenizer()
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=SLIDING_WINDOW, layer_types=LAYER_TYPES, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3ForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    save_hf(model, tokenizer, path)
    return path
