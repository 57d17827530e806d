"""lit_align.capabilities: what a loaded model can do, for the built-in tiny Llama and random models of other kinds."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM

from lit_align import capabilities as cap
from lit_align.models import load_model


def random_model(kind: str, attn: str = "sdpa", **extra):
    config = AutoConfig.for_model(kind, vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, max_position_embeddings=64, **extra)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_tiny_llama_takes_custom_masks_and_shared_prompts(tiny_path, attn):
    model = load_model("builtin:tiny", attn_implementation=attn)
    assert cap.attention_implementation(model) == attn
    assert cap.takes_custom_mask(model) and cap.supports_shared_prompt(model)
    assert cap.full_attention_only(model) is None
    new_cache = Version(transformers.__version__) >= Version("5.20")  # the forward's keyword was renamed then
    assert cap.cache_keyword(model) == ("cache" if new_cache else "past_key_values")
    assert cap.takes_logits_to_keep(model)
    assert not cap.is_fsdp_unit(model) and not cap.is_sharded(model)


def test_an_unknown_architecture_or_attention_or_a_router_loss_has_no_shared_prompt():
    assert not cap.supports_shared_prompt(random_model("gpt_neox"))  # not a known custom-mask architecture
    assert cap.takes_custom_mask(random_model("gpt_neox"))  # though its attention would take the mask
    flash = random_model("qwen2", attn="sdpa")
    flash.config._attn_implementation = "flash_attention_2"
    assert cap.attention_implementation(flash) == "flash_attention_2" and not cap.takes_custom_mask(flash)
    assert not cap.supports_shared_prompt(flash)
    assert cap.supports_shared_prompt(random_model("qwen2"))
    assert not cap.supports_shared_prompt(random_model("qwen2_moe", output_router_logits=True, num_experts=2,
                                                       moe_intermediate_size=8, shared_expert_intermediate_size=8))
    assert not cap.supports_shared_prompt(torch.nn.Linear(2, 2))  # no config at all
    assert cap.attention_implementation(torch.nn.Linear(2, 2)) is None


def test_layer_types_other_than_full_attention_are_named():
    sliding = random_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1,
                           layer_types=["full_attention", "sliding_attention"])
    assert cap.full_attention_only(sliding) == ["full_attention", "sliding_attention"]
    assert cap.full_attention_only(random_model("qwen2")) is None
