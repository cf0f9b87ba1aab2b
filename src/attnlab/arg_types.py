"""Value types for ``argparse`` options, shared by every ``attnlab`` command.

Each parses an option's text and refuses a value outside its range with
``expected ..., got '...'``, which argparse prefixes with the flag (``argument --steps: ...``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "fraction",
    "non_negative_float",
    "non_negative_int",
    "number",
    "positive_float",
    "positive_int",
    "probability",
]


def number(kind: type, test: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse ``type`` that parses ``kind`` (int or float) and refuses a value that
    fails ``test``; ``expected`` says what is accepted, in the error and in ``--help``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not test(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected
    return parse


positive_int = number(int, lambda v: v >= 1, "a positive int")
non_negative_int = number(int, lambda v: v >= 0, "an int >= 0")
positive_float = number(float, lambda v: v > 0 and math.isfinite(v), "a finite number > 0")
non_negative_float = number(float, lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0")
fraction = number(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
probability = number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
