"""How the loss settings (``DPOLoss``, ``CPOLoss``, ``KTOLoss``, ``GRPOLoss``) refuse a value: one check per rule,
each naming the ``model.`` option and what was expected, so every recipe words the same mistake the same way.

The rules particular to one loss (a smoothing range that depends on the loss type, a pair of bounds in order) stay
with that loss's settings, whose checks they are.
"""

from __future__ import annotations

from typing import Any, Sequence

from lit_align.errors import LitAlignError


def check_choice(name: str, value: Any, allowed: Sequence) -> None:
    """Refuse ``model.<name>`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise LitAlignError(f"model.{name} {value!r}: expected one of {allowed}")


def check_positive(name: str, value: float) -> None:
    """Refuse ``model.<name>`` unless ``value`` is > 0 (a temperature or weight that scales or divides)."""
    if not value > 0:
        raise LitAlignError(f"model.{name} {value}: expected a value > 0")
