"""The fused decode step of Llama-like models against decoding through the model's forward."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded
from tiny_models import ARCHITECTURES, PROMPTS

from lit_align.generation import NativeEngine
from lit_align.generation.llama_decode import MKL_PACKED_ROWS, LlamaDecodeStep, PackedLinear
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
    """The decode step's ``PackedLinear``: in fp32 on CPU the weight prepacked, MKL's packed GEMM from
    ``MKL_PACKED_ROWS`` rows (fewer rows padded to the packed count), oneDNN's below (any row count): F.linear's
    values; in other dtypes F.linear itself."""
    torch.manual_seed(0)
    weight, b = torch.randn(96, 48), torch.randn(96) if bias else None
    small, large = PackedLinear(weight, b, rows=8), PackedLinear(weight, b, rows=MKL_PACKED_ROWS)
    assert (small.kind, large.kind) == ("onednn", "mkl")  # this CPU build of torch has both
    for linear, counts in ((small, (1, 5, 8, 40)), (large, (MKL_PACKED_ROWS, MKL_PACKED_ROWS - 3, 1))):
        for rows in counts:
            x = torch.randn(rows, 48)
            assert_rounding_close(linear(x), torch.nn.functional.linear(x, weight, b), terms=48)
    with pytest.raises(ValueError, match=f"PackedLinear: {MKL_PACKED_ROWS + 1} rows, packed for at most"):
        large(torch.randn(MKL_PACKED_ROWS + 1, 48))
    half = PackedLinear(weight.bfloat16(), None if b is None else b.bfloat16(), rows=MKL_PACKED_ROWS)
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    assert half.kind is None
    assert torch.equal(half(x), torch.nn.functional.linear(x, weight.bfloat16(), None if b is None else b.bfloat16()))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what bf16-mixed training samples under
        mixed = PackedLinear(weight, b, rows=MKL_PACKED_ROWS)
        x = torch.randn(3, 48)
        assert mixed.kind is None
        assert torch.equal(mixed(x), torch.nn.functional.linear(x, weight, b))


def test_a_shrinking_batch_is_packed_again(tokenizer):
    """A batch decoded with MKL's packs (``MKL_PACKED_ROWS`` rows and more) that loses rows as they end: its weights
    are packed again for oneDNN at its first drop, and the tokens and log-probs equal decoding through the model's
    forward all along."""
    model = ARCHITECTURES["llama"](tokenizer, "sdpa")
    prompt_ids, prompt_mask = left_padded(tokenizer, PROMPTS)
    samples = -(-2 * MKL_PACKED_ROWS // len(PROMPTS))  # rows: at least twice MKL_PACKED_ROWS
    kinds = []
    keep_rows = LlamaDecodeStep.keep_rows

    def record(step, rows):
        keep_rows(step, rows)
        kinds.append((len(rows), step.head.kind, step.head.rows))

    rollouts = {}
    for fast in (True, False):
        engine = NativeEngine(max_new_tokens=40, fast_decode=fast, eos_check_every=2)
        torch.manual_seed(0)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(LlamaDecodeStep, "keep_rows", record)
            # an EOS the untrained model samples often: rows end all along
            rollouts[fast] = engine.generate(model, prompt_ids, prompt_mask, samples, eos_token_ids=[5, 6, 7, 8],
                                             pad_token_id=tokenizer.pad_token_id)
    assert len(kinds) > 1 and kinds[0][0] >= MKL_PACKED_ROWS, kinds  # several drops, the first to MKL's sizes
    assert all((kind, packed) == ("onednn", kinds[0][0]) for _, kind, packed in kinds), kinds  # packed once, oneDNN
    assert rollouts[True].completion_ids.tolist() == rollouts[False].completion_ids.tolist()
    assert_rounding_close(rollouts[True].logps, rollouts[False].logps, terms=TINY_TERMS)
