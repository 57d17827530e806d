"""lit_align.generation_round: a round's step slices, their trimming, and its checkpoint form."""

from __future__ import annotations

import pytest
import torch

from lit_align.errors import LitAlignError
from lit_align.generation_round import GenerationRound, RoundShape


def make_round(old: bool = True) -> GenerationRound:
    """4 completions of 2 prompts (G = 2), 2 steps; prompts left-padded to 4, completions right-padded to 3."""
    prompt_mask = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    values = torch.arange(12, dtype=torch.float32).view(4, 3)
    return GenerationRound(
        prompt_ids=torch.arange(16).view(4, 4) * prompt_mask, prompt_mask=prompt_mask,
        completion_ids=torch.arange(12).view(4, 3) * completion_mask, completion_mask=completion_mask,
        loss_mask=completion_mask.clone(), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        old_logps=values if old else None, ref_logps=None, order=[1, 0, 3, 2], steps=2, num_tokens=3.5,
        stats={"reward": torch.tensor(0.25)}, prompts=["a", "a", "b", "b"], completions=["x", "y", "z", "w"],
        rewards=[1.0, 0.0, 0.5, 0.0], dataset_rows=[7, 7, 3, 3],
    )


def test_step_batch_takes_the_steps_slice_of_the_order_trimmed():
    r = make_round()
    first = r.step_batch(0)  # rows 1, 0: prompts of 2 real tokens, completions of at most 2
    assert first.prompt_ids.tolist() == [[6, 7], [2, 3]] and first.prompt_mask.tolist() == [[1, 1], [1, 1]]
    assert first.completion_ids.tolist() == [[3, 4], [0, 0]]
    assert first.completion_mask.tolist() == [[1, 1], [1, 0]] and first.loss_mask.tolist() == [[1, 1], [1, 0]]
    assert first.advantages.tolist() == [-1.0, 1.0]
    assert first.old_logps.tolist() == [[3.0, 4.0], [0.0, 1.0]] and first.ref_logps is None
    assert first.dataset_rows == [7, 7]
    second = r.step_batch(1)  # rows 3, 2: full prompts, completions of up to 3
    assert second.prompt_ids.shape == (2, 4) and second.completion_ids.shape == (2, 3)
    assert second.advantages.tolist() == [-0.5, 0.5] and second.dataset_rows == [3, 3]
    # a second pass over the round (num_iterations): the same slices again
    again = r.step_batch(2)
    assert torch.equal(again.completion_ids, first.completion_ids) and again.dataset_rows == first.dataset_rows
    assert make_round(old=False).step_batch(0).old_logps is None


def test_the_checkpoint_form_rebuilds_the_same_round():
    r = make_round()
    state = r.state_dict()
    assert all(v.device.type == "cpu" for v in state.values() if isinstance(v, torch.Tensor))
    rebuilt = GenerationRound(**state)
    for name, value in state.items():
        got = getattr(rebuilt, name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(got, getattr(r, name)), name
        elif name == "stats":
            assert got.keys() == r.stats.keys() and all(torch.equal(got[k], r.stats[k]) for k in got)
        else:
            assert got == getattr(r, name), name


@pytest.mark.parametrize("settings,match", [
    ((1, 1, 1), "model.num_generations must be >= 2"),
    ((2, 0, 1), "model.steps_per_generation and model.num_iterations must be >= 1"),
    ((2, 1, 0), "model.steps_per_generation and model.num_iterations must be >= 1"),
    ((2, 1, 1, 8), "model.generation_batch_size and model.steps_per_generation cannot both be set"),
    ((4, None, 1, 18), "model.generation_batch_size 18 must be a positive multiple of model.num_generations 4"),
])
def test_round_settings_are_checked_in_one_place(settings, match):
    with pytest.raises(LitAlignError, match=match):
        RoundShape(*settings)


def test_the_shape_answers_every_number_derived_from_it():
    """Prompts per round, the steps a round serves, whether old log-probs are needed, dapo's divisor: all here."""
    shape = RoundShape(num_generations=4, steps_per_generation=2, num_iterations=3)
    assert shape.steps == 6  # the data yields each round's prompts 6 times
    assert shape.prompts_per_round(batch_size=8) == 4  # 8 completions x 2 steps / 4 per prompt
    with pytest.raises(LitAlignError, match=r"data.batch_size \* model.steps_per_generation = 6 completions per round "
                                            r"must be a multiple of model.num_generations = 4"):
        shape.prompts_per_round(batch_size=3)
    assert [shape.needs_old_logps(accumulate) for accumulate in (1, 2, 6, 12)] == [True, True, False, False]
    assert shape.tokens_per_step(48.0, world_size=2) == 12.0  # 48 loss tokens on 2 ranks over 2 steps
    assert RoundShape(2).steps_per_generation == 1  # the default, unless generation_batch_size derives it


def test_generation_batch_size_is_resolved_against_the_batch_and_the_world():
    """TRL's alternative to ``steps_per_generation``: the round's completions on every device; 16 = 4 x 2 devices x
    2 steps; the resolved shape must still make whole groups on each device."""
    shape = RoundShape(num_generations=2, generation_batch_size=16)
    assert shape.resolve(batch_size=4, world_size=2) == RoundShape(2, 2)
    assert shape.resolve(batch_size=4, world_size=1) == RoundShape(2, 4)
    with pytest.raises(LitAlignError, match=r"16 must be a positive multiple of the global batch size \(data.batch_size "
                                            r"4 x 3 devices = 12\)"):
        shape.resolve(batch_size=4, world_size=3)
    with pytest.raises(LitAlignError, match="must be a multiple of model.num_generations = 4"):
        RoundShape(4, generation_batch_size=12).resolve(batch_size=3, world_size=2)  # 3 x 1 step: no whole group


def test_a_shape_without_groups_takes_one_completion_per_prompt_and_keeps_it_when_resolved():
    """Distillation compares no completions with each other (``grouped=False``): one per prompt will do, and the
    resolved shape is still one without groups."""
    shape = RoundShape(num_generations=1, generation_batch_size=8, grouped=False)
    assert shape.resolve(batch_size=4, world_size=1) == RoundShape(1, 2, grouped=False)
    with pytest.raises(LitAlignError, match="model.num_generations must be >= 1, got 0"):
        RoundShape(0, grouped=False)
