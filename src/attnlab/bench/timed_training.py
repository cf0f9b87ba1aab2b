"""Training for a bounded time on a shared machine: ``train_for`` plans the run from real
steps timed on a copy of the model, so that its learning-rate schedule ends where the time
does, and stops it at the deadline anyway when the machine slows down meanwhile.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import statistics
import time
from dataclasses import dataclass, replace

from torch import nn

from attnlab._checks import check_positive, is_number
from attnlab.training.trainer import TrainConfig, Trainer

__all__ = ["Training", "train_for"]

_PROBE_STEPS = 5


@dataclass(frozen=True)
class Training:
    """How a model was trained: ``steps`` done of the ``planned`` ones, in ``seconds``."""

    steps: int
    planned: int
    seconds: float


def train_for(model: nn.Module, task: object, config: TrainConfig, seconds: float,
              most: int | None = None) -> Training:
    """Train ``model`` for about ``seconds``.

    The run is planned as the steps that fit at the seconds per step of a few real steps on
    a copy (at most ``most``), so that its schedule ends where the time does; on a shared
    machine that slows down meanwhile, it stops at the deadline anyway, after the step that
    crosses it. Evaluates only at the end; saves nothing.
    """
    if not is_number(seconds, finite=True) or seconds <= 0:
        raise ValueError(f"seconds: expected a finite number > 0, got {seconds!r}")
    if most is not None:
        check_positive("most", most)
    start = time.perf_counter()
    deadline = start + seconds
    per_step = _seconds_per_step(model, task, config, deadline)
    steps = max(1, int((deadline - time.perf_counter()) / per_step))
    steps = steps if most is None else min(steps, most)
    config = replace(config, steps=steps, warmup=min(config.warmup, steps // 10),
                     eval_every=steps, checkpoint_every=steps, log_every=steps)

    def stop_at_deadline(step: int, loss: float) -> None:
        if time.perf_counter() > deadline and step < steps:
            raise _StopTrainingError

    trainer = Trainer(model, task, config, progress=False, on_step=stop_at_deadline)
    with contextlib.suppress(_StopTrainingError):
        trainer.fit()
    return Training(trainer.step, steps, time.perf_counter() - start)


class _StopTrainingError(Exception):
    """Raised by a training callback to end ``Trainer.fit`` after the current step."""


def _seconds_per_step(model: nn.Module, task: object, config: TrainConfig,
                      deadline: float) -> float:
    """Median seconds of the real steps 2 to 5 (the first warms up) trained on a copy of
    ``model`` with ``config``, fewer if ``deadline`` comes first."""
    times: list[float] = []

    def record(step: int, loss: float) -> None:
        times.append(time.perf_counter())
        if step >= _PROBE_STEPS or (len(times) >= 2 and time.perf_counter() > deadline):
            raise _StopTrainingError

    probe = replace(config, steps=_PROBE_STEPS + 1, warmup=0)
    with contextlib.suppress(_StopTrainingError):
        Trainer(copy.deepcopy(model), task, probe, progress=False, on_step=record).fit()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return max(statistics.median(gaps), 1e-6) if gaps else math.inf
