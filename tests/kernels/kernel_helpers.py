"""Helpers shared by the kernel tests (imported by name: pytest puts this folder on the path).

Not a conftest.py: the suite's tests import ``conftest`` by name, and a second one here would
shadow the one in tests/.
"""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from attnlab.kernels import calibration, native
from attnlab.quantization.formats import QuantizedWeight

_BUILDS: dict[str, object] = {}


@contextmanager
def thread_count(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` for the block, restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def built_for(target: str, tmp_path_factory: pytest.TempPathFactory) -> object:
    """attnlab's kernel sources built for ``-march=target`` (``"x86-64-v2"``: a plain CPU, its
    plain loops; ``"x86-64-v3"``: AVX2 and FMA, its 8-lane loops), what a user without
    AVX-512 or AMX compiles; built once per test run, skipped where this CPU cannot run it."""
    from torch.utils import cpp_extension

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86-64 target")
    if target == "x86-64-v3" and torch.backends.cpu.get_cpu_capability() not in ("AVX2",
                                                                                 "AVX512"):
        pytest.skip("this CPU cannot run an AVX2 build")
    if target not in _BUILDS:
        folder = tmp_path_factory.mktemp(target.replace("-", "_"))
        flags = [f for f in native._FLAGS if not f.startswith("-march")] + [f"-march={target}"]
        path = os.environ["PATH"]
        if shutil.which("ninja") is None:  # torch builds with ninja: the `ninja` wheel's copy
            os.environ["PATH"] = os.pathsep.join((native._ninja_folder(), path))
        try:
            _BUILDS[target] = cpp_extension.load(
                name=f"attnlab_plain_{folder.name}", sources=[str(p) for p in native._SOURCES],
                build_directory=str(folder), extra_cflags=flags, extra_ldflags=["-fopenmp"],
                verbose=False)
        finally:
            os.environ["PATH"] = path
    return _BUILDS[target]


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
    folder in ``$ATTNLAB_CACHE_DIR``, no ``$ATTNLAB_KERNELS`` (nor its old name
    ``$ATTNLAB_QUANTIZED_KERNELS``) from the shell, and no timings remembered from another
    test. -> the cache file's path."""
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)
    monkeypatch.delenv("ATTNLAB_QUANTIZED_KERNELS", raising=False)
    monkeypatch.setattr(calibration, "_TIMINGS", {})
    return tmp_path / "cache" / "kernels.json"


def grouped_int8(w: torch.Tensor, group_size: int, *, offsets: bool,
                 scale_dtype: torch.dtype = torch.float32) -> QuantizedWeight:
    """``w`` (``O x I``) as a grouped int8 weight, as GGUF files hold one: without
    ``offsets`` Q8_0's kind (``s = max |w| / 127`` per group, codes -127..127), with them
    Q5_1's (``s = (max - min) / 31``, ``z = min``, codes 0..31)."""
    rows, cols = w.shape
    groups = w.float().view(rows, cols // group_size, group_size)
    if offsets:
        lo, hi = groups.amin(-1), groups.amax(-1)
        scales = ((hi - lo) / 31).clamp_min(1e-8).to(scale_dtype)
        zeros = lo.to(scale_dtype)
        codes = ((groups - zeros.float()[..., None]) / scales.float()[..., None]).round()
        codes = codes.clamp_(0, 31)
    else:
        scales = (groups.abs().amax(-1) / 127).clamp_min(1e-8).to(scale_dtype)
        zeros = None
        codes = (groups / scales.float()[..., None]).round().clamp_(-127, 127)
    return QuantizedWeight(8, codes.to(torch.int8).view(rows, cols), scales, zeros)
