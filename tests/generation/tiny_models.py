"""Models and prompts the engine tests share: the built-in tiny Llama and two-layer random models of other
architectures, and left-padded prompts of different lengths."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_align.models import load_model

PROMPTS = ["sort 1:", "sort 123456:", "sort 42:", "s"]  # different lengths: the batch is left-padded


def tiny_random(kind: str, vocab_size: int, attn: str = "sdpa", init: float = 0.2, **extra):
    """A two-layer random model of another architecture, built from a config (saved nowhere). A larger init than the
    default makes the logits peaked, so greedy decoding has no near-ties for float noise to flip."""
    config = AutoConfig.for_model(kind, vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=init, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    return model.train()


ARCHITECTURES = {
    "llama": lambda tok, attn: load_model("builtin:tiny", attn_implementation=attn).train(),
    "qwen2": lambda tok, attn: tiny_random("qwen2", len(tok), attn, num_key_value_heads=2),  # GQA, qkv bias
    "gpt_neox": lambda tok, attn: tiny_random("gpt_neox", len(tok), attn, rotary_pct=0.5),  # partial rotary
}
