"""Every kernel, forced, equals the formula: float32 tight, bfloat16 within its tolerance;
one row, a few rows, many rows; with and without bias; on one and two threads."""

from __future__ import annotations

import itertools
import pathlib

import pytest
import torch
from kernel_helpers import (
    own_cache_fixture,  # noqa: F401 (an autouse fixture)
    thread_count,
)

import attnlab
from attnlab.functional import linear
from attnlab.kernels import KERNELS, catalog, native
from attnlab.kernels.calibration import weight_like
from attnlab.kernels.catalog import _block_count, to_layout
from attnlab.kernels.rule import DECODING_ROWS
from conftest import native_lacks

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 2e-2)}


# The native kernels whose loop only some CPUs have: without it, one case says what is missing.
_LOOPS = {"native_pairs": "pairs", "native_tiles": "tiles"}


def _cases() -> list:
    """(name, dtype, rows, with_bias, threads) for every kernel and case that it runs here
    (``available``, asked on that many threads); a kernel that runs none of them here, for
    want of a build or a CPU feature, as one case skipped saying so. What ``available``
    refuses is the rule, checked by ``test_each_kernel_is_available_by_its_rule``."""
    cases = []
    for name, kernel in KERNELS.items():
        runs = []
        for dtype, rows, with_bias, threads in itertools.product(
                (torch.float32, torch.bfloat16), (1, 5, 70), (True, False), (1, 2)):
            with thread_count(threads):
                if kernel.available(weight_like(dtype, 96, 8), dtype, rows):
                    runs.append((name, dtype, rows, with_bias, threads))
        if not runs:
            missing = (native_lacks(_LOOPS.get(name)) if name.startswith("native") else
                       "this torch build has no oneDNN linear ops (torch.ops.mkldnn)")
            runs = [pytest.param(name, torch.bfloat16, 1, True, 1,
                                 marks=pytest.mark.skip(reason=missing))]
        cases += runs
    return cases


@pytest.mark.parametrize(("name", "dtype", "rows", "with_bias", "threads"), _cases(), ids=str)
def test_kernel_equals_the_formula(name, dtype, rows, with_bias, threads) -> None:
    kernel = KERNELS[name]
    with thread_count(threads):
        g = torch.Generator().manual_seed(rows)
        w = torch.randn(96, 40, generator=g).to(dtype)
        x = torch.randn(rows, 40, generator=g).to(dtype)
        b = torch.randn(96, generator=g).to(dtype) if with_bias else None
        with torch.inference_mode():
            actual = kernel.run(x, kernel.prepare(w, w.dtype), b)
        expected = x.double() @ w.double().t() + (b.double() if with_bias else 0)
        assert actual.shape == (rows, 96) and actual.dtype == dtype
        rtol, atol = TOLERANCE[dtype]
        torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)
        torch.testing.assert_close(actual, linear(x, w, b), rtol=rtol, atol=atol)


def test_each_kernel_is_available_by_its_rule() -> None:
    """The cases above are what each kernel's ``available`` takes here; what it refuses is its
    rule: bfloat16 activations only for the widened, pair and tile kernels; the native ones up
    to their row counts, where the build has their loop (the pairs: AVX512-BF16; the tiles:
    AMX-BF16 lent by the operating system); ``blocks_gemv`` one row over two threads or more
    that divide the output rows; the others every row count of either dtype."""
    f32, bf16 = torch.float32, torch.bfloat16
    w32, w16 = weight_like(f32, 96, 8), weight_like(bf16, 96, 8)
    for name in ("widened", "native_pairs", "native_tiles"):
        assert not KERNELS[name].available(w32, f32, 1), name
    assert KERNELS["widened"].available(w16, bf16, 70)
    gemv, pairs, tiles = (KERNELS[f"native_{n}"] for n in ("gemv", "pairs", "tiles"))
    for w, dtype in ((w32, f32), (w16, bf16)):
        assert gemv.available(w, dtype, DECODING_ROWS) == native.available()
        assert not gemv.available(w, dtype, DECODING_ROWS + 1)
    assert pairs.available(w16, bf16, DECODING_ROWS) == native.pairs_available()
    assert not pairs.available(w16, bf16, DECODING_ROWS + 1)
    assert tiles.available(w16, bf16, DECODING_ROWS) == native.tiles_available()
    assert not tiles.available(w16, bf16, DECODING_ROWS + 1)
    with thread_count(1):
        assert not KERNELS["blocks_gemv"].available(w32, f32, 1)
    with thread_count(2):
        assert KERNELS["blocks_gemv"].available(w16, bf16, 1)
        assert not KERNELS["blocks_gemv"].available(w32, f32, 2)
        assert not KERNELS["blocks_gemv"].available(weight_like(f32, 95, 8), f32, 1)
    for name in ("formula", "columns", "rows_gemv"):
        assert all(KERNELS[name].available(w, d, rows) for w, d in ((w32, f32), (w16, bf16))
                   for rows in (1, 70))


@pytest.mark.parametrize(("out_features", "blocks"), [(16, 8), (12, 4), (6, 2)])
def test_blocks_gemv_takes_as_many_blocks_as_divide_the_rows(out_features, blocks) -> None:
    """4, 2 or 1 blocks per thread, as ``O`` allows; each count gives the formula's result."""
    with thread_count(2):
        assert _block_count(out_features, 2) == blocks
        g = torch.Generator().manual_seed(out_features)
        w, x = torch.randn(out_features, 40, generator=g), torch.randn(1, 40, generator=g)
        with torch.inference_mode():
            actual = KERNELS["blocks_gemv"].run(x, w, None)
        torch.testing.assert_close(actual, linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_bias", [True, False])
def test_the_widened_kernel_rounds_each_float32_sum_once_block_by_block(monkeypatch,
                                                                        with_bias) -> None:
    """Blocks of 3 output rows (the last one short): every output is the float32 product of
    the widened operands, plus the bias, rounded once to bfloat16, as the float32 formula
    rounded gives it; infinities and NaNs of x come through as the formula's."""
    monkeypatch.setattr(catalog, "_WIDEN_BYTES", 3 * 4 * 40)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(11, 40, generator=g).bfloat16()
    x = torch.randn(6, 40, generator=g).bfloat16()
    x[2, 5], x[4, 0] = float("inf"), float("nan")
    b = torch.randn(11, generator=g).bfloat16() if with_bias else None
    with torch.inference_mode():
        actual = KERNELS["widened"].run(x, w, b)
    wide = x.float() @ w.float().t() + (b.float() if with_bias else 0)
    assert actual.dtype == torch.bfloat16 and actual.shape == (6, 11)
    torch.testing.assert_close(actual, wide.bfloat16(), rtol=0, atol=0, equal_nan=True)


def test_the_formula_kernel_takes_every_dtype_the_fast_ones_only_theirs() -> None:
    assert KERNELS["formula"].available(weight_like(torch.float64, 8, 8), torch.float64, 3)
    for name, kernel in KERNELS.items():
        if name != "formula":
            assert not kernel.available(weight_like(torch.float64, 8, 8), torch.float64, 1), name
            assert not kernel.available(weight_like(torch.float16, 8, 8), torch.float16, 1), name


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_to_layout_keeps_shape_and_values_and_copies_only_when_needed(layout) -> None:
    w = torch.randn(6, 4)
    stored = to_layout(w, layout)
    assert stored.shape == (6, 4) and torch.equal(stored, w)
    assert (stored.is_contiguous() if layout == "rows" else stored.t().is_contiguous())
    assert to_layout(stored, layout) is stored
    with pytest.raises(ValueError, match=r"layout: expected one of .* got 'diagonal'"):
        to_layout(w, "diagonal")


def test_no_cpu_family_branches_left_in_the_library() -> None:
    """Speed never comes from a CPU-family constant: no code names an instruction set (the
    benchmark harness may record the CPU's capability beside its figures, not branch on it)."""
    source = pathlib.Path(attnlab.__file__).parent
    for path in source.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "AVX" not in text.upper().replace("AVX-512", ""), path
        if path.name != "harness.py":
            assert "get_cpu_capability" not in text, path


def test_no_branch_on_the_cpu_vendor_or_model() -> None:
    """The CPU's model name keys the calibration cache and the native build (and is printed);
    nothing else reads it, no code names a vendor, and the C++ kernels choose nothing at run
    time by asking the CPU (which instructions they use is the compiler's target)."""
    source = pathlib.Path(attnlab.__file__).parent
    readers = {"cache.py", "native.py", "calibrate.py"}
    for path in source.rglob("*.py"):
        if "bench" in path.relative_to(source).parts:
            continue  # benchmarks record the machine beside their figures
        code = "\n".join(line.split("#", 1)[0] for line in
                         path.read_text(encoding="utf-8").splitlines())
        for vendor in ("GenuineIntel", "AuthenticAMD", "vendor_id", "platform.processor"):
            assert vendor not in code or path.name == "cache.py", (path, vendor)
        assert "cpu_model()" not in code or path.name in readers, path
    for path in (*source.rglob("*.cpp"), *source.rglob("*.h")):
        text = path.read_text(encoding="utf-8")
        for probe in ("__builtin_cpu_is", "__builtin_cpu_supports", "cpuid"):
            assert probe not in text, (path, probe)
