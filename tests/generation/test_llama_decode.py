"""The fused decode step of Llama-like models against decoding through the model's forward."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded
from tiny_models import ARCHITECTURES, PROMPTS

from lit_align.generation import NativeEngine
from lit_align.generation.llama_decode import LlamaDecodeStep, PackedLinear
from numerics import TINY_TERMS, assert_rounding_close

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_llama_decode_step_equals_decoding_through_the_forward(arch, tokenizer):
    """The fast decode step (Llama-like models) samples the same tokens with the same log-probs as decoding through
    the model's forward; other architectures always decode through the forward."""
    model = ARCHITECTURES[arch](tokenizer, "sdpa")
    assert LlamaDecodeStep.supports(model) == (arch != "gpt_neox")
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    kwargs = dict(eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    rollouts = {}
    for fast in (True, False):
        engine = NativeEngine(max_new_tokens=10, fast_decode=fast)
        torch.manual_seed(0)
        rollouts[fast] = engine.generate(model, prompt_ids, prompt_mask, 3, **kwargs)
        assert engine.last_stats.fast == (fast and arch != "gpt_neox")
    assert rollouts[True].completion_ids.tolist() == rollouts[False].completion_ids.tolist()
    assert_rounding_close(rollouts[True].logps, rollouts[False].logps, terms=TINY_TERMS)


@pytest.mark.parametrize("bias", [False, True])
def test_decode_linear_is_f_linear_prepacked_on_cpu(bias):
    """The decode step's ``PackedLinear``: in fp32 on CPU the weight prepacked (oneDNN), F.linear's values at any
    row count (the layout is chosen for 8 rows); in other dtypes F.linear itself."""
    torch.manual_seed(0)
    weight, b = torch.randn(96, 48), torch.randn(96) if bias else None
    linear = PackedLinear(weight, b, rows=8)
    assert linear.packed == torch.backends.mkldnn.is_available()
    for rows in (1, 5, 8, 40):
        x = torch.randn(rows, 48)
        assert_rounding_close(linear(x), torch.nn.functional.linear(x, weight, b), terms=48)
    half = PackedLinear(weight.bfloat16(), None if b is None else b.bfloat16(), rows=8)
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    assert not half.packed
    assert torch.equal(half(x), torch.nn.functional.linear(x, weight.bfloat16(), None if b is None else b.bfloat16()))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what bf16-mixed training samples under
        mixed = PackedLinear(weight, b, rows=8)
        x = torch.randn(3, 48)
        assert not mixed.packed
        assert torch.equal(mixed(x), torch.nn.functional.linear(x, weight, b))
