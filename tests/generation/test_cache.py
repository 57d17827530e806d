"""lit_align.generation.cache: ``SlotCache`` holds what transformers' ``DynamicCache`` holds, each prompt's prefill
copied into its samples' rows, each step written in place, and rows dropped on request."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from lit_align.capabilities import cache_keyword
from lit_align.generation.cache import SlotCache
from lit_align.models import load_model

G, STEPS = 3, 2


def forward(model, ids, cache):
    return model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache}).logits[:, -1]


def test_slot_cache_equals_a_dynamic_cache_of_the_repeated_prompts_after_prefill_append_and_drop(tiny_path):
    model = load_model("builtin:tiny").eval()
    prompts = torch.tensor([[5, 9, 11, 7], [8, 6, 12, 10]])  # B=2 prompts, no padding
    slots, dynamic = SlotCache(len(prompts) * G, prompts.shape[1] + STEPS), DynamicCache()  # sized in rows
    with torch.no_grad():
        prefill = forward(model, prompts, slots)  # the B prompts run once
        expected = forward(model, prompts.repeat_interleave(G, 0), dynamic)  # what it stands for: B * G rows
        assert torch.allclose(prefill.repeat_interleave(G, 0), expected, atol=1e-5)
        layer = slots.layers[0]
        assert layer.keys.shape[:1] + layer.keys.shape[2:3] == (2 * G, prompts.shape[1] + STEPS)
        assert slots.get_seq_length() == prompts.shape[1] and slots.get_max_length() == prompts.shape[1] + STEPS
        for mine, theirs in zip(slots.layers, dynamic.layers):
            assert torch.allclose(mine.keys[:, :, :4], theirs.keys, atol=1e-6)
            assert torch.allclose(mine.values[:, :, :4], theirs.values, atol=1e-6)

        step = torch.arange(3, 3 + 2 * G).unsqueeze(1)  # a different next token in every row
        assert torch.allclose(forward(model, step, slots), forward(model, step, dynamic), atol=1e-5)
        assert slots.get_seq_length() == 5
        for mine, theirs in zip(slots.layers, dynamic.layers):
            assert torch.allclose(mine.keys[:, :, :5], theirs.keys, atol=1e-6)

        keep = torch.tensor([4, 0])  # rows still decoding, in this order
        slots.keep_rows(keep)
        dynamic.reorder_cache(keep)
        assert slots.layers[0].keys.shape[0] == 2
        step = torch.tensor([[13], [14]])
        assert torch.allclose(forward(model, step, slots), forward(model, step, dynamic), atol=1e-5)
        assert slots.get_seq_length() == 6 == slots.get_max_length()
