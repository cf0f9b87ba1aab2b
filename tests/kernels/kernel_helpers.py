"""Helpers shared by the kernel tests (imported by name: pytest puts this folder on the path)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def thread_count(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` for the block, restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def column_major(w: torch.Tensor) -> torch.Tensor:
    """The same values as ``w``, stored column-major (the "columns" layout)."""
    return w.t().contiguous().t()


def planted(timings: dict[str, float]):
    """A stand-in for ``calibration.measure`` reporting ``timings`` (microseconds by kernel
    name) for every bucket, the formula always among them as with the real one."""
    return lambda d, o, i, b, kernels=None: {n: timings[n] for n in ("formula", *kernels)}
