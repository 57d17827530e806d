"""lit_align.errors: the user's-mistake exception and the one-line message the CLI prints (through the CLI:
tests/test_cli.py and tests/e2e/test_bad_inputs.py)."""

from __future__ import annotations

from lit_align.errors import LitAlignError, one_line


def test_one_line_joins_lines_and_cuts_at_the_limit():
    assert one_line(OSError("can't load\n  from one of:\n\tmodel.safetensors")) == (
        "can't load from one of: model.safetensors")
    assert one_line(ValueError("x" * 10), limit=8) == "xxxxx..."
    assert one_line(KeyError()) == "KeyError"  # no message: its type
    assert issubclass(LitAlignError, ValueError)
