"""Helpers shared by the kernel tests (imported by name: pytest puts this folder on the path).

Not a conftest.py: the suite's tests import ``conftest`` by name, and a second one here would
shadow the one in tests/.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from attnlab.kernels import calibration


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
    name) for every bucket, the formula always among them as with the real one; a kernel
    with no planted timing is left out, as the real one leaves out one that cannot run."""
    return lambda d, o, i, b, kernels=None, bias=True: {
        n: timings[n] for n in ("formula", *kernels) if n in timings}


@pytest.fixture(autouse=True, name="own_cache")
def own_cache_fixture(tmp_path, monkeypatch):
    """Every kernel test (each module imports this autouse fixture) runs with a fresh cache
    folder in ``$ATTNLAB_CACHE_DIR``, no ``$ATTNLAB_KERNELS`` from the shell, and no timings
    remembered from another test. -> the cache file's path."""
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)
    monkeypatch.setattr(calibration, "_TIMINGS", {})
    return tmp_path / "cache" / "kernels.json"
