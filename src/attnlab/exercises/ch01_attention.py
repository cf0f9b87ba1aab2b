"""Tutorial 1, attention from scratch: the exercises.

Fill in each function, then run ``attnlab exercises check 1`` (or ``pytest exercises/``).
"""

from __future__ import annotations

# --8<-- [start:imports]
import math

import torch
from torch import Tensor

# --8<-- [end:imports]

EXERCISES = {
    "1.1": "scaled_score_variance",
    "1.2": "my_attention",
    "1.3": "tempered_softmax",
    "1.4": ["first_overflow", "stable_softmax"],
    "1.5": "identical_keys_output",
    "1.6": "max_path_length",
}


# --8<-- [start:scaled_score_variance]
def scaled_score_variance(d: int, sigma: float = 1.0, n: int = 4000, *,
                          generator: torch.Generator | None = None) -> float:
    """The variance of the scaled scores q·k / √d over ``n`` pairs of vectors q, k of length
    ``d`` whose entries are drawn from N(0, sigma²) (with ``generator``)."""
    qs = sigma * torch.randn(n, d, generator=generator)
    ks = sigma * torch.randn(n, d, generator=generator)
    scaled_scores = (qs * ks).sum(-1) / math.sqrt(d)
    return scaled_scores.var().item()
# --8<-- [end:scaled_score_variance]


# --8<-- [start:my_attention]
def my_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax(q kᵀ / √D, masked) v for any leading dims N..: q is N.. x L x D, k is
    N.. x S x D, v is N.. x S x Dv, the result N.. x L x Dv. ``mask`` (bool, True = may
    attend, broadcasting against N.. x L x S) leaves every query at least one key."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
# --8<-- [end:my_attention]


# --8<-- [start:tempered_softmax]
def tempered_softmax(x: Tensor, temperature: float) -> Tensor:
    """softmax(x / T) over the last dim, computed so that nothing overflows even when x / T
    is huge (T near 0): subtract the maximum first."""
    scaled = x / temperature
    e = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)
# --8<-- [end:tempered_softmax]


# --8<-- [start:first_overflow]
def first_overflow(dtype: torch.dtype) -> int:
    """The smallest whole number x >= 0 for which ``torch.exp(x)`` in ``dtype`` is inf."""
    return next(n for n in range(1000) if torch.isinf(torch.exp(torch.tensor(n, dtype=dtype))))


def stable_softmax(x: Tensor) -> Tensor:
    """softmax over the last dim, exp(x - max) / Σ exp(x - max): the same weights as
    exp(x) / Σ exp(x), and every exponent is at most 0, so nothing overflows; x's dtype."""
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)
# --8<-- [end:first_overflow]


# --8<-- [start:identical_keys_output]
def identical_keys_output(values: Tensor) -> Tensor:
    """What attention returns for ANY query when all S keys are the same vector: values is
    N.. x S x Dv, the result N.. x Dv (every score is equal, so every weight is 1/S)."""
    return values.mean(dim=-2)
# --8<-- [end:identical_keys_output]


# --8<-- [start:max_path_length]
def max_path_length(L: int, layer: str, kernel: int = 3) -> int:
    """The longest path a signal travels between two of L positions (the number of layer
    applications or recurrent steps that connect the first input to the last output):
    ``"recurrent"`` steps from one position to the next, ``"convolution"`` stacks layers of
    width ``kernel`` (contiguous, each reaching kernel - 1 positions further back), and
    ``"self-attention"`` connects every pair in one layer."""
    if layer == "recurrent":
        return L - 1
    if layer == "convolution":
        return math.ceil((L - 1) / (kernel - 1))
    if layer == "self-attention":
        return 1
    raise ValueError(f"layer: expected 'recurrent', 'convolution' or 'self-attention', "
                     f"got {layer!r}")
# --8<-- [end:max_path_length]
