"""Argument checks shared across the package, with DESIGN's error style (the argument's
name, what it got, what was expected)."""

from __future__ import annotations

__all__ = ["check_positive"]


def check_positive(name: str, value: object) -> int:
    """``value`` when it is a positive int (a bool is not one); else a ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value
