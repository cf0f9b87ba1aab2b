"""Tutorial 9, efficient attention: the exercises.

Fill in each function, then run ``attnlab exercises check 9`` (or ``pytest exercises/``).
"""

from __future__ import annotations

# --8<-- [start:imports]
from collections.abc import Callable

import torch
from torch import Tensor

# --8<-- [end:imports]

EXERCISES = {
    "9.1": "window_with_sinks",
    "9.2": "online_attention",
    "9.3": "math_limit",
    "9.4": "first_output_shift",
}


# --8<-- [start:window_with_sinks]
def window_with_sinks(L: int, w: int, g: int) -> Tensor:
    """The ``L x L`` bool mask of "causal window + global tokens": query i may attend key j
    when j <= i and (j is one of the w keys i-w+1 .. i, or j < g)."""
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return (j <= i) & ((j > i - w) | (j < g))
# --8<-- [end:window_with_sinks]


# --8<-- [start:online_attention]
def online_attention(q: Tensor, k: Tensor, v: Tensor, block: int,
                     reverse: bool = False) -> Tensor:
    """softmax(q kᵀ / √D) v computed one block of ``block`` keys at a time with the online
    softmax (a running maximum m, sum and output accumulator, rescaled when m grows), the
    blocks visited in reverse order when ``reverse``: q ``L x D``, k ``S x D``, v ``S x Dv``
    -> ``L x Dv``."""
    m = torch.full((q.shape[0], 1), float("-inf"))
    total, acc = torch.zeros(q.shape[0], 1), torch.zeros(q.shape[0], v.shape[1])
    starts = list(range(0, k.shape[0], block))
    for j0 in reversed(starts) if reverse else starts:
        s = q @ k[j0 : j0 + block].T / q.shape[1] ** 0.5
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        total = total * torch.exp(m - m_new) + p.sum(-1, keepdim=True)
        acc = acc * torch.exp(m - m_new) + p @ v[j0 : j0 + block]
        m = m_new
    return acc / total
# --8<-- [end:online_attention]


# --8<-- [start:math_limit]
def math_limit(heads: int, bytes_per: int, budget: int) -> int:
    """The smallest power-of-two length L for which one layer's ``heads x L x L`` attention
    weights (batch 1, ``bytes_per`` bytes each) take more than ``budget`` bytes."""
    L = 1
    while heads * L * L * bytes_per <= budget:
        L *= 2
    return L
# --8<-- [end:math_limit]


# --8<-- [start:first_output_shift]
def first_output_shift(attend: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor,
                       k: Tensor, v: Tensor) -> float:
    """How far the output at position 0 of ``attend(q, k, v)`` (``N.. x L x D`` each) moves,
    as the largest |difference|, when 1.0 is added to the last position's key only."""
    k2 = k.clone()
    k2[..., -1, :] += 1.0
    return (attend(q, k, v) - attend(q, k2, v))[..., 0, :].abs().max().item()
# --8<-- [end:first_output_shift]
