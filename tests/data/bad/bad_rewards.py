"""Reward functions that misbehave (the bad-input corpus: tests/test_bad_inputs.py)."""


def raises(completions, **_):
    raise ValueError("no answer key")


def returns_nan(completions, **_):
    return [float("nan")] * len(completions)


def wrong_length(completions, **_):
    return [1.0] * (len(completions) - 1)
