"""Learning-rate schedules as pure functions of the step (``lr_at(step)``).

- Noam (Vaswani et al. 2017): ``lr(s) = factor * d_model^-0.5 * min(s^-0.5, s * warmup^-1.5)``
  with ``s = step + 1``: linear warmup to the peak at ``s = warmup``, then ``1/sqrt(s)`` decay.
- Warmup + cosine: ``lr(s) = peak * s / warmup`` for ``s < warmup``, then
  ``min_lr + (peak - min_lr) * (1 + cos(pi * t)) / 2`` with ``t = (s - warmup) / (total - warmup)``
  (clamped to 1 after ``total``).
- Constant with linear warmup.

``as_lambda`` turns one into a ``LambdaLR`` multiplier for an optimizer whose base lr is 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ConstantSchedule", "NoamSchedule", "Schedule", "WarmupCosineSchedule", "make_schedule"]


@dataclass(frozen=True)
class NoamSchedule:
    """The paper's inverse-square-root schedule with warmup."""

    d_model: int
    warmup: int = 4000
    factor: float = 1.0

    def lr_at(self, step: int) -> float:
        s = step + 1
        return self.factor * self.d_model**-0.5 * min(s**-0.5, s * self.warmup**-1.5)


@dataclass(frozen=True)
class WarmupCosineSchedule:
    """Linear warmup to ``peak_lr``, then cosine decay to ``min_lr`` at ``total_steps``."""

    peak_lr: float
    warmup: int
    total_steps: int
    min_lr: float = 0.0

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        span = max(1, self.total_steps - self.warmup)
        t = min(1.0, (step - self.warmup) / span)
        return self.min_lr + (self.peak_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


@dataclass(frozen=True)
class ConstantSchedule:
    """Linear warmup to ``peak_lr``, then constant."""

    peak_lr: float
    warmup: int = 0

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        return self.peak_lr


Schedule = NoamSchedule | WarmupCosineSchedule | ConstantSchedule


def make_schedule(name: str, *, lr: float, warmup: int, total_steps: int, d_model: int) -> Schedule:
    """A schedule by name: ``"noam"`` (``lr`` is its factor), ``"cosine"``, ``"constant"``."""
    if warmup < 0:
        raise ValueError(f"warmup: expected >= 0, got {warmup}")
    if name == "noam":
        return NoamSchedule(d_model=d_model, warmup=max(1, warmup), factor=lr)
    if name == "cosine":
        return WarmupCosineSchedule(
            peak_lr=lr, warmup=warmup, total_steps=total_steps, min_lr=lr * 0.01
        )
    if name == "constant":
        return ConstantSchedule(peak_lr=lr, warmup=warmup)
    raise ValueError(f"schedule: expected 'noam', 'cosine' or 'constant', got {name!r}")


def as_lambda(schedule: Schedule) -> Callable[[int], float]:
    """``LambdaLR`` multiplier: use with an optimizer whose base lr is 1.0."""
    return schedule.lr_at
