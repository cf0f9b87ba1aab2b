"""Argument checks shared across the package, with DESIGN's error style (the argument's
name, what it got, what was expected): ints and numbers, tensors, token ids.

The bottom layer of the package (it imports only torch), so that models, generation and the
CLI check their inputs with one set of functions and one wording.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["ID_DTYPES", "check_positive", "check_tensor", "check_token_ids", "is_int",
           "is_number"]

# nn.Embedding indexes with these; any other dtype (bool, float, uint8, ...) is refused.
ID_DTYPES = (torch.int64, torch.int32)


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
    try:
        return not finite or math.isfinite(value)
    except OverflowError:  # an int too large for a float: infinite as soon as it is used
        return False


def check_token_ids(name: str, ids: object, vocab_size: int) -> tuple[int, int]:
    """``(B, L)`` of ``ids`` when it is a ``B x L`` (``L >= 1``) int64/int32 tensor of ids in
    ``[0, vocab_size)``; otherwise a ``TypeError`` (not a tensor) or ``ValueError`` naming
    ``name``, what was received and what was expected.

    The range check is one ``aminmax`` over ``ids`` (two numbers read back), cheap on the
    ``B x 1`` decode step.
    """
    check_tensor(name, ids, "a tensor of integer token ids of shape B x L")
    if ids.dtype not in ID_DTYPES:
        raise ValueError(f"{name}: expected integer token ids (torch.long or torch.int32) of "
                         f"shape B x L, got dtype {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"{name}: expected integer token ids of shape B x L, got shape "
                         f"{tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name}: expected at least one token (B, L >= 1), got shape "
                         f"{tuple(ids.shape)}")
    low, high = torch.stack(torch.aminmax(ids)).tolist()  # one read back
    if low < 0 or high >= vocab_size:
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        raise ValueError(f"{name}: expected ids in [0, {vocab_size}), got min {low} and max "
                         f"{high} ({bad[:5].tolist()}; the model's vocabulary has {vocab_size})")
    return ids.shape[0], ids.shape[1]


def check_tensor(name: str, value: object, what: str = "a tensor") -> Tensor:
    """``value`` when it is a tensor; else a ``TypeError`` naming ``name``, ``what`` was
    expected and the type received."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__}")
    return value
