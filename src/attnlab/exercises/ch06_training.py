"""Tutorial 6, training the date translator: the exercises.

Fill in each function, then run ``attnlab exercises check 6`` (or ``pytest exercises/``).
"""

from __future__ import annotations

# --8<-- [start:imports]
import math

import torch
from torch import Tensor

# --8<-- [end:imports]

EXERCISES = {
    "6.1": "smoothed_optimum",
    "6.2": "noam_peak",
    "6.3": "compare_decoders",
}


# --8<-- [start:smoothed_optimum]
def smoothed_optimum(V: int, y: int, eps: float) -> tuple[Tensor, float]:
    """The prediction that minimises the label-smoothed loss for the correct token ``y`` of
    ``V``: the distribution q (``V``, float32) with q_y = 1 - eps + eps/V and eps/V elsewhere,
    and the logit gap between y and any other token that gives it,
    ln((1 - eps + eps/V) / (eps/V)) (``math.inf`` without smoothing)."""
    q = torch.full((V,), eps / V)
    q[y] += 1 - eps
    gap = math.inf if eps == 0 else math.log((1 - eps + eps / V) / (eps / V))
    return q, gap
# --8<-- [end:smoothed_optimum]


# --8<-- [start:noam_peak]
def noam_peak(d_model: int, warmup: int, factor: float = 1.0) -> tuple[int, float]:
    """The step (counted from 0, as ``NoamSchedule.lr_at``) where the Noam schedule
    lr(s) = factor E^-0.5 min(s^-0.5, s w^-1.5), with s = step + 1, peaks, and the peak
    learning rate factor / sqrt(E w)."""
    return warmup - 1, factor / math.sqrt(d_model * warmup)
# --8<-- [end:noam_peak]


# --8<-- [start:compare_decoders]
def compare_decoders(targets: list[str], greedy: list[str],
                     beam: list[str]) -> tuple[int, int, int]:
    """Given the true outputs and the greedy and beam-search outputs of the same inputs:
    (how many greedy gets wrong, how many of those beam search gets right, how many greedy
    gets right that beam search gets wrong)."""
    wrong = [(t, b) for t, g, b in zip(targets, greedy, beam) if g != t]
    fixed = sum(b == t for t, b in wrong)
    broken = sum(g == t and b != t for t, g, b in zip(targets, greedy, beam))
    return len(wrong), fixed, broken
# --8<-- [end:compare_decoders]
