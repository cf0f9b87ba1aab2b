"""Argument checks shared across the package, with DESIGN's error style (the argument's
name, what it got, what was expected)."""

from __future__ import annotations

import math

__all__ = ["check_positive", "is_int", "is_number"]


def check_positive(name: str, value: object) -> int:
    """``value`` when it is a positive int (a bool is not one); else a ``ValueError``."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def is_int(value: object) -> bool:
    """Whether ``value`` is a Python int (a bool is not one, though Python says it is)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object, *, finite: bool = False) -> bool:
    """Whether ``value`` is an int or a float (not a bool); with ``finite``, not NaN or inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return not finite or math.isfinite(value)
