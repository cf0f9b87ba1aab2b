"""attnlab's C++ decoding kernels (``attnlab.kernels.native``), each equal to its formula in
float64: float32/bfloat16 GEMV, int8 with per-row scales, int4 in groups; every row count
(blocks of 8 and 4 rows and their tails), input sizes that are not a multiple of the vector
width, one and two threads; bad input refused by name. ``attnlab build`` compiled them before
the session, else these tests skip saying so (test_native_build: how they are built)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_helpers import built_for, thread_count

from attnlab.kernels import native
from attnlab.quantization import quantize
from conftest import native_lacks, parametrize_where

pytestmark = pytest.mark.usefixtures("native_kernels")


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
           float32_tol: float = 1e-5) -> None:
    assert actual.dtype == dtype
    # float32: a reordered float32 sum; bfloat16: the result rounded to 8 bits.
    rtol, atol = (float32_tol,) * 2 if dtype == torch.float32 else (8e-3, 1e-2)
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


# (dtype, pairs): the pair products take bfloat16 only, and run where the build has their
# loop (test_the_pair_products_run_where_the_build_has_them: the rule itself).
GEMV_CASES = [(torch.float32, False), (torch.bfloat16, False),
              *([(torch.bfloat16, True)] if native.pairs_available() else [])]
# The tile and integer-product tests: every case where this machine runs them, else one
# skipped case that names what it lacks.
TILES = native_lacks("tiles")
INTEGERS = native_lacks("integers")


def test_the_pair_products_run_where_the_build_has_them() -> None:
    """``pairs=True`` takes bfloat16 x in a build with the pair loop (AVX512-BF16), and is
    refused by name otherwise: float32 x everywhere, any x in a build without the loop."""
    w, x = torch.randn(8, 64).bfloat16(), torch.randn(2, 64).bfloat16()
    weight = quantize(torch.randn(8, 64), 4, 32)
    with pytest.raises(RuntimeError, match="pairs: expected bfloat16"):
        native.gemv(x.float(), w.float(), pairs=True)
    with pytest.raises(RuntimeError, match="pairs: expected bfloat16 x"):
        native.gemv_int4(x.float(), weight.data, weight.scales, weight.zeros, 32, pairs=True)
    if native.pairs_available():
        _close(native.gemv(x, w, pairs=True), x.double() @ w.double().t(), torch.bfloat16)
        return
    with pytest.raises(RuntimeError, match="a build with AVX512-BF16"):
        native.gemv(x, w, pairs=True)
    with pytest.raises(RuntimeError, match="a build with AVX512-BF16"):
        native.gemv_int4(x, weight.data, weight.scales, weight.zeros, 32, pairs=True)


@pytest.mark.parametrize(("dtype", "pairs"), GEMV_CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 70), (130, 64), (5, 33),
                                                            (9, 160)])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_equals_the_formula(dtype, pairs, rows, out_features, in_features,
                                 threads) -> None:
    g = torch.Generator().manual_seed(rows * out_features)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    with thread_count(threads):
        y = native.gemv(x, w, pairs=pairs)
    _close(y, x.double() @ w.double().t(), dtype)


# rows: one and two B tiles (16 each) and a second pass past 32; out_features: whole blocks of
# 32 weight rows and a zero-padded last block; in_features: whole tiles of 32 and a tail.
@parametrize_where(TILES, "rows, out_features, in_features, bias, threads",
                   [1, 5, 16, 17, 32, 33], [(64, 64), (37, 70), (96, 160), (5, 33), (9, 31)],
                   [False, True], [1, 2])
def test_gemv_tiles_equals_the_formula(rows, out_features, in_features, bias, threads) -> None:
    g = torch.Generator().manual_seed(rows * out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if bias else None
    with thread_count(threads):
        y = native.gemv_tiles(x, w, b)
    expected = x.double() @ w.double().t() + (b.double() if bias else 0)
    _close(y, expected, torch.bfloat16)


@parametrize_where(TILES, "scale_dtype, rows, out_features, in_features, threads",
                   [torch.float32, torch.bfloat16], [1, 16, 17, 33],
                   [(64, 64), (37, 70), (9, 31)], [1, 2])
def test_int8_tiles_equal_dequantize_then_linear(scale_dtype, rows, out_features, in_features,
                                                 threads) -> None:
    g = torch.Generator().manual_seed(rows + out_features)
    weight = quantize(torch.randn(out_features, in_features, generator=g), 8,
                      scale_dtype=scale_dtype)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16)
    with thread_count(threads):
        y = native.gemv_int8_tiles(x, weight.data, weight.scales, b)
    expected = x.double() @ weight.dequantize(torch.float64).t() + b.double()
    _close(y, expected, torch.bfloat16)


def test_gemv_tiles_refuses_what_it_cannot_run() -> None:
    """Without tiles (no AMX-BF16, or none lent to this process) the tile kernels are refused
    by name; with them, what they cannot take is."""
    if not native.tiles_available():
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
            native.gemv_tiles(torch.randn(1, 64).bfloat16(), torch.randn(8, 64).bfloat16())
        with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
            native.gemv_int8_tiles(torch.randn(1, 64).bfloat16(),
                                   torch.zeros(8, 64, dtype=torch.int8), torch.ones(8))
        return
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    with pytest.raises(RuntimeError, match="x: expected a contiguous 2-D bfloat16"):
        native.gemv_tiles(x.float(), w)
    with pytest.raises(RuntimeError, match="x: expected a contiguous 2-D bfloat16"):
        native.gemv_tiles(x[0], w)  # a 1-D x is named, not the weight
    with pytest.raises(RuntimeError, match="weight: expected a contiguous bfloat16 O x 64"):
        native.gemv_tiles(x, w[:, :32])
    with pytest.raises(RuntimeError, match="bias: expected 8 contiguous bfloat16"):
        native.gemv_tiles(x, w, torch.ones(8))
    q = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="q: expected contiguous int8 codes O x 64"):
        native.gemv_int8_tiles(x, q.float(), torch.ones(8))
    with pytest.raises(RuntimeError, match="scales: expected 8 float32 or bfloat16"):
        native.gemv_int8_tiles(x, q, torch.ones(7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 9])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_equals_dequantize_then_linear(dtype, scale_dtype, rows, threads) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = quantize(torch.randn(69, 200, generator=g), 8, scale_dtype=scale_dtype)
    x = torch.randn(rows, 200, generator=g).to(dtype)
    with thread_count(threads):
        y = native.gemv_int8(x, weight.data, weight.scales)
    _close(y, x.double() @ weight.dequantize(torch.float64).t(), dtype)


def _integers_formula(x: torch.Tensor, w: torch.Tensor, block: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x' W^T`` in float64 with x rounded as the integer kernels round it: per row and
    block, ``e = floor(log2 max|x|) - 14``, ``x' = round(x 2^-e) 2^e`` (half to even); and
    the bound on its distance from ``x W^T``: ``sum_k |W[o, k]| 2^(e-1)``."""
    y = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    bound = torch.zeros_like(y)
    for k0 in range(0, x.shape[1], block):
        xb, wb = x[:, k0:k0 + block].double(), w[:, k0:k0 + block].double()
        top = xb.abs().amax(1, keepdim=True)
        e = torch.frexp(top).exponent - 15  # frexp: top = f 2^p, f in [0.5, 1)
        c = torch.round(torch.ldexp(xb, -e))
        assert bool((c.abs() <= 32640).all())
        unit = torch.where(top > 0, torch.ldexp(torch.ones_like(top), e), 0.0)
        y += (c * unit) @ wb.t()
        bound += unit / 2 * wb.abs().sum(1)
    return y, bound


@parametrize_where(INTEGERS, "scale_dtype, rows, in_features, threads",
                   [torch.float32, torch.bfloat16], [1, 2, 3, 8, 9, 17],
                   [64, 70, 200, 256, 300, 600], [1, 2])
def test_int8_integers_equal_their_formula(scale_dtype, rows, in_features, threads) -> None:
    """The integer products: within one bfloat16 rounding of their own formula (exact
    integers; only the float32 sum of the block sums is reordered), and that formula within
    its bound of dequantize + linear. 70, 200, 300: a block's last 32 inputs ragged; 600: two
    whole blocks of 256 and a third of 88; rows of x two at a time and past a block of 8."""
    g = torch.Generator().manual_seed(rows * in_features)
    weight = quantize(torch.randn(69, in_features, generator=g), 8, scale_dtype=scale_dtype)
    x = torch.randn(rows, in_features, generator=g)
    x[0, :64] *= 1e-3  # a quiet block next to loud ones
    x[-1, -3:] *= 300
    x = x.to(torch.bfloat16)
    with thread_count(threads):
        y = native.gemv_int8(x, weight.data, weight.scales, integers=True)
    assert y.dtype == torch.bfloat16
    dense = weight.dequantize(torch.float64)
    exact, bound = _integers_formula(x, dense, 256)
    assert bool(((y.double() - exact).abs() <= exact.abs() * 2.0**-8 * 1.01 + 1e-30).all())
    assert bool(((exact - x.double() @ dense.t()).abs() <= bound * (1 + 1e-9)).all())


def test_int8_integers_take_any_scale_of_x() -> None:
    """Blocks of zeros, of subnormal and of huge bfloat16 numbers scale by powers of two
    exactly; an infinity or NaN in x gives what the float32 loop gives."""
    if not native.integers_available():
        with pytest.raises(RuntimeError, match="integers: expected a bfloat16 x and a build"):
            native.gemv_int8(torch.ones(1, 32).bfloat16(), torch.ones(2, 32, dtype=torch.int8),
                             torch.ones(2), integers=True)
        return
    g = torch.Generator().manual_seed(0)
    weight = quantize(torch.randn(40, 768, generator=g), 8)
    x = torch.randn(3, 768, generator=g)
    x[0, :256] = 0
    x[0, 256:512] *= 1e-39  # subnormal float32 (and bfloat16)
    x[1, :256] *= 1e30
    x[2, 512:] *= 2.0**-120
    x = x.to(torch.bfloat16)
    y = native.gemv_int8(x, weight.data, weight.scales, integers=True)
    exact, _ = _integers_formula(x, weight.dequantize(torch.float64), 256)
    assert bool(((y.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-38).all())
    x[1, 7], x[2, 700] = float("inf"), float("nan")
    torch.testing.assert_close(native.gemv_int8(x, weight.data, weight.scales, integers=True),
                               native.gemv_int8(x, weight.data, weight.scales), rtol=0, atol=0,
                               equal_nan=True)
    with pytest.raises(RuntimeError, match="integers: expected a bfloat16 x"):
        native.gemv_int8(x.float(), weight.data, weight.scales, integers=True)


@pytest.mark.parametrize(("dtype", "pairs"), GEMV_CASES)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group_size", "in_features"), [(32, 512), (64, 512), (128, 512),
                                                         (256, 512), (32, 1088), (64, 1088),
                                                         (128, 1152)])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 8, 11])
def test_int4_equals_dequantize_then_linear(dtype, pairs, scale_dtype, group_size,
                                            in_features, rows) -> None:
    """1088 / 32 = 34 groups: more than the 16 whose scales the pair loop reads at once;
    1088 = 8 x 128 + 64: the pair loop's last block is 64 codes (its blocks are 128)."""
    g = torch.Generator().manual_seed(group_size + rows)
    weight = quantize(torch.randn(67, in_features, generator=g), 4, group_size, scale_dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    with thread_count(2):
        y = native.gemv_int4(x, weight.data, weight.scales, weight.zeros, group_size,
                             pairs=pairs)
    # s (q . x - 8 sum x) + z sum x: the difference of two float32 sums cancels a little.
    _close(y, x.double() @ weight.dequantize(torch.float64).t(), dtype, float32_tol=1e-4)


@parametrize_where(INTEGERS, "scale_dtype, group_size, in_features, rows",
                   [torch.float32, torch.bfloat16],
                   [(64, 512), (128, 512), (256, 512), (64, 1088), (64, 2112), (128, 1152)],
                   [1, 3, 8, 11])
def test_int4_integers_equal_their_formula(scale_dtype, group_size, in_features, rows) -> None:
    """The formula on x rounded to integers a row (within bfloat16 rounding: the float32 sums
    of the 128-code blocks and the shift term are reordered), and that formula within its
    bound of dequantize + linear. 1088 and 2112: a last block of 64 codes, 2112 / 64 = 33
    groups past two windows of 16."""
    g = torch.Generator().manual_seed(group_size + rows + in_features)
    weight = quantize(torch.randn(67, in_features, generator=g), 4, group_size, scale_dtype)
    x = torch.randn(rows, in_features, generator=g)
    x[-1, 5] = 40.0  # one loud input: the row's scale
    x = x.to(torch.bfloat16)
    with thread_count(2):
        y = native.gemv_int4(x, weight.data, weight.scales, weight.zeros, group_size,
                             integers=True)
    dense = weight.dequantize(torch.float64)
    exact, bound = _integers_formula(x, dense, in_features)
    _close(y, exact, torch.bfloat16)
    assert bool(((exact - x.double() @ dense.t()).abs() <= bound * (1 + 1e-9)).all())
    x[0, 3] = float("nan")
    torch.testing.assert_close(
        native.gemv_int4(x, weight.data, weight.scales, weight.zeros, group_size, integers=True),
        native.gemv_int4(x, weight.data, weight.scales, weight.zeros, group_size), rtol=0,
        atol=0, equal_nan=True)


def test_int4_integers_refuse_what_they_cannot_run() -> None:
    weight = quantize(torch.randn(8, 128), 4, 32)
    x = torch.randn(1, 128).bfloat16()
    with pytest.raises(ValueError, match="pairs, integers: expected at most one"):
        native.gemv_int4(x, weight.data, weight.scales, weight.zeros, 32, pairs=True,
                         integers=True)
    with pytest.raises(RuntimeError, match="integers: expected bfloat16 x, groups of a "
                                           "multiple of 64"):
        native.gemv_int4(x, weight.data, weight.scales, weight.zeros, 32, integers=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["float", "int8", "int4"])
def test_the_bias_is_added_before_the_one_rounding(dtype, kind) -> None:
    """``x W^T + b`` comes back in x's dtype, the bias added to the float32 sum: equal to
    the float64 result rounded once (within one rounding of a float32 sum)."""
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(70, 128, generator=g)
    x = torch.randn(3, 128, generator=g).to(dtype)
    bias = (100 * torch.randn(70, generator=g)).to(dtype)  # large: a second rounding shows
    if kind == "float":
        w = dense.to(dtype)
        y, exact = native.gemv(x, w, bias), x.double() @ w.double().t()
    elif kind == "int8":
        q = quantize(dense, 8)
        y = native.gemv_int8(x, q.data, q.scales, bias)
        exact = x.double() @ q.dequantize(torch.float64).t()
    else:
        q = quantize(dense, 4, 64)
        y = native.gemv_int4(x, q.data, q.scales, q.zeros, 64, bias)
        exact = x.double() @ q.dequantize(torch.float64).t()
    exact = exact + bias.double()
    assert y.dtype == dtype
    torch.testing.assert_close(y, exact.to(dtype), rtol=1e-5 if dtype == torch.float32 else 0,
                               atol=1e-4 if dtype == torch.float32 else 0.5)
    if dtype == torch.bfloat16:  # one rounding: at most one bfloat16 step from the exact sum
        step = exact.abs() * 2.0**-7
        assert bool(((y.double() - exact).abs() <= step).all())
    with pytest.raises(RuntimeError, match="bias: expected 70 contiguous values"):
        native.gemv(x, dense.to(dtype), bias[:5]) if kind == "float" else \
            native.gemv_int8(x, quantize(dense, 8).data, quantize(dense, 8).scales, bias[:5])


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_equals_the_formula_exactly(scale_dtype, dtype, group_size) -> None:
    """The same float32 arithmetic and one rounding as ``QuantizedWeight.dequantize``, so the
    same numbers, bit for bit."""
    g = torch.Generator().manual_seed(group_size)
    dense = torch.randn(67, 256, generator=g)
    int4 = quantize(dense, 4, group_size, scale_dtype)
    with thread_count(2):
        got = native.dequantize_int4(int4.data, int4.scales, int4.zeros, group_size, dtype)
    assert torch.equal(got, int4.dequantize(dtype))
    int8 = quantize(dense, 8, scale_dtype=scale_dtype)
    assert torch.equal(native.dequantize_int8(int8.data, int8.scales, dtype),
                       int8.dequantize(dtype))
    with pytest.raises(ValueError, match=r"dtype: expected torch\.float32 or torch\.bfloat16"):
        native.dequantize_int8(int8.data, int8.scales, torch.float16)
    with pytest.raises(RuntimeError, match="scales: expected 67 contiguous"):
        native.dequantize_int8(int8.data, int8.scales[:3], dtype)


def test_int4_reads_the_low_nibble_as_the_even_input() -> None:
    """One code set at a time: input 2j reads byte j's low nibble, input 2j+1 its high one."""
    packed = torch.full((1, 32), 8 | (8 << 4), dtype=torch.uint8)  # every code 8: W' = z = 0
    packed[0, 3] = 9 | (8 << 4)  # code of input 6 is 9: W'[0, 6] = s
    scales, zeros = torch.full((1, 2), 2.0), torch.zeros(1, 2)
    x = torch.arange(64, dtype=torch.float32)[None]
    assert native.gemv_int4(x, packed, scales, zeros, 32).item() == 2.0 * 6


def test_bad_input_is_refused_naming_it() -> None:
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="weight: expected x's dtype"):
        native.gemv(x, w.double())
    with pytest.raises(RuntimeError, match="weight: expected 64 stored columns"):
        native.gemv(x, torch.randn(8, 63))
    with pytest.raises(RuntimeError, match="x: expected a contiguous 2-D"):
        native.gemv(x.t(), w)
    with pytest.raises(RuntimeError, match="scales: expected 8 values"):
        native.gemv_int8(x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(7))
    with pytest.raises(RuntimeError, match="pairs: expected bfloat16"):
        native.gemv(x, w, pairs=True)
    with pytest.raises(RuntimeError, match="group_size: expected a multiple of 32"):
        native.gemv_int4(x, torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 4),
                         torch.ones(8, 4), 16)


@pytest.fixture(scope="module")
def build_for(tmp_path_factory: pytest.TempPathFactory):
    """``build_for(target)``: the kernels built for another CPU (``kernel_helpers.built_for``)."""
    return lambda target: built_for(target, tmp_path_factory)


@pytest.mark.parametrize("target", ["x86-64-v2", "x86-64-v3"])
def test_the_sources_build_for_a_cpu_without_avx512_or_amx(target: str, build_for) -> None:
    """The AVX-512, bfloat16-pair and AMX loops are compiled only where the target has them:
    a build for a CPU without them still builds, says it has neither, and computes the GEMVs by
    its other loops (float32, bfloat16 and int8 weights; 1-9 rows, the row groups and the rows
    left over) and the activations (a vector loop for x86-64-v3, the plain one for v2)."""
    built = build_for(target)
    assert not built.has_pairs() and not built.has_tiles()
    w = torch.randn(37, 70)
    weight = quantize(w, 8)
    for rows in (1, 2, 3, 5, 8, 9):
        x = torch.randn(rows, 70)
        _close(built.gemv(x, w, None, False), x.double() @ w.double().t(), torch.float32)
        xb, wb = x.bfloat16(), w.bfloat16()
        _close(built.gemv(xb, wb, None, False), xb.double() @ wb.double().t(), torch.bfloat16)
        _close(built.gemv_int8(x, weight.data, weight.scales, None, False),
               x.double() @ weight.dequantize(torch.float64).t(), torch.float32)
    with pytest.raises(RuntimeError, match="no AMX-BF16 tiles"):
        built.gemv_tiles(x.bfloat16(), w.bfloat16(), None)
    assert built.has_vector_activation() == (target == "x86-64-v3")
    g, up = torch.randn(5, 33), torch.randn(5, 33)
    for name in native.ACTIVATIONS:  # the same formula, either loop
        kind = int(getattr(built.Activation, name))
        _close(built.activation(g, up, kind), _ACTS[name](g.double()) * up.double(),
               torch.float32)


def test_a_native_build_has_every_loop_this_cpu_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pair and integer tests are left out where the build lacks those loops, so a build
    that silently left them out would pass: on a CPU whose flags list them, a -march=native build
    must have them."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
        pytest.skip("reads the CPU's flags from /proc/cpuinfo: x86-64 Linux only")
    if "-march=native" not in native.build_flags():
        pytest.skip("the native build targets another CPU ($ATTNLAB_NATIVE_MARCH), not this one")
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert native.available()
    if "avx512_bf16" in flags:
        assert native.pairs_available()
    if "avx512_vnni" in flags:  # (the tiles also need the kernel's permission: not asked)
        assert native.integers_available()


_ACTS = {"silu": torch.nn.functional.silu,
         "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}
_SPECIAL = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, -100.0, 100.0, 1e-30]


def _stable(name: str, g: torch.Tensor) -> torch.Tensor:
    a = g if name == "silu" else 2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)
    return torch.where(g == float("-inf"), float("nan"), g / (1 + torch.exp(-a)))


_LOOPS = ["native", "x86-64-v2", "x86-64-v3"]


def _activation(loop: str, build_for):
    """``activation(g, up, name)`` of this machine's build, or of a build for another target
    (v2: the plain loop, v3: the 8-lane one)."""
    if loop == "native":
        if not native.activation_available():
            pytest.skip("no vector activation loop in this build")
        return native.activation
    built = build_for(loop)
    return lambda g, up, name: built.activation(g, up, int(getattr(built.Activation, name)))


@pytest.mark.parametrize("loop", _LOOPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group_size", "in_features"), [(32, 1088), (64, 512), (128, 1152)])
def test_int4_widened_loop_equals_dequantize_then_linear_on_each_build(
        loop: str, dtype, scale_dtype, group_size: int, in_features: int, build_for) -> None:
    """The widened 4-bit loop (no pairs, no integers) is the one a CPU without AVX-512 runs:
    16 lanes on this machine's build, 8 on x86-64-v3's, the plain loop on v2's. 1-9 rows: the
    row blocks of 4 and the rows left over; 67 rows of W over two threads."""
    if loop == "native":
        run = native.gemv_int4
    else:
        built = build_for(loop)

        def run(*args):  # the extension's own call: bias, pairs, integers by position
            return built.gemv_int4(*args, None, False, False)
    g = torch.Generator().manual_seed(group_size + in_features)
    weight = quantize(torch.randn(67, in_features, generator=g), 4, group_size, scale_dtype)
    for rows in (1, 3, 4, 5, 9):
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        with thread_count(2):
            y = run(x, weight.data, weight.scales, weight.zeros, group_size)
        _close(y, x.double() @ weight.dequantize(torch.float64).t(), dtype, float32_tol=1e-4)


@pytest.mark.parametrize("loop", _LOOPS)
@pytest.mark.parametrize("name", list(native.ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_equals_its_formula(name: str, dtype: torch.dtype, loop: str,
                                       build_for) -> None:
    """Within 2e-6 of the formula in float64 (written ``g / (1 + exp(-2a))``: PyTorch's
    ``1 + tanh`` cancels for negative inputs, within 2e-4 in float32), 1e-9 absolute where it
    is ~0; in bfloat16, the float64 value rounded, bar one unit in the last place (at most 1%
    of them); the special values as PyTorch
    gives them (-inf: silu and GELU are NaN, as -inf * 0). Odd sizes: the masked tail and
    chunks that start mid-vector. The same for the loops of a build for another CPU."""
    activation = _activation(loop, build_for)
    g = torch.randn(3, 1001, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4
    g.view(-1)[:len(_SPECIAL)] = torch.tensor(_SPECIAL, dtype=torch.float64)
    x = g.to(dtype)
    with thread_count(2):
        got = activation(x, None, name)
    expected = _stable(name, x.double())
    finite = expected.isfinite()
    assert torch.equal(got.isnan(), _ACTS[name](x).isnan())
    assert torch.equal(got[~finite & ~got.isnan()], expected[~finite & ~expected.isnan()].to(dtype))
    if dtype == torch.float32:
        torch.testing.assert_close(got.double()[finite], expected[finite], rtol=2e-6, atol=1e-9)
    else:
        ulp = expected[finite].to(dtype).double().abs() * 2**-7
        assert ((got.double()[finite] - expected[finite]).abs() <= ulp + 1e-9).all()
        assert (got == expected.to(dtype)).float().mean() > 0.99


@pytest.mark.parametrize("loop", _LOOPS)
def test_silu_keeps_its_relative_accuracy_where_exp_nears_overflow(loop: str, build_for) -> None:
    """silu(g) for g from -80 to -88.7 is g / exp(-g), tiny (down to ~1e-37): within 2e-6 of
    it relatively, not just absolutely (2^n for n up to 128 is past one float exponent; a
    loop that overflowed it would give -0 here)."""
    activation = _activation(loop, build_for)
    g = -torch.linspace(80, 88.7, 67)
    got = activation(g, None, "silu")
    torch.testing.assert_close(got.double(), _stable("silu", g.double()), rtol=2e-6, atol=0)


@pytest.mark.parametrize("loop", _LOOPS)
@pytest.mark.parametrize("name", list(native.ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_product_rounds_as_act_then_times_up(name: str, dtype: torch.dtype, loop: str,
                                                       build_for) -> None:
    """``act(g) * up`` in one pass equals the two steps in ``dtype``: act rounded, then the
    product rounded, bit for bit (NaN and inf included, 0x7FC0 for every bfloat16 NaN)."""
    activation = _activation(loop, build_for)
    gen = torch.Generator().manual_seed(1)
    g, up = (torch.randn(2, 7, 300, generator=gen).to(dtype) for _ in range(2))
    g.view(-1)[:len(_SPECIAL)] = torch.tensor(_SPECIAL).to(dtype)
    up.view(-1)[len(_SPECIAL):2 * len(_SPECIAL)] = torch.tensor(_SPECIAL).to(dtype)
    got, two_steps = activation(g, up, name), activation(g, None, name) * up
    assert torch.equal(got.isnan(), two_steps.isnan())
    assert torch.equal(got.nan_to_num(), two_steps.nan_to_num())
    if dtype == torch.bfloat16:
        bits = got.view(torch.int16)[got.isnan()]
        assert bits.numel() > 0 and (bits == 0x7FC0).all()


def test_activation_refuses_bad_input_by_name() -> None:
    g = torch.randn(4, 8)
    with pytest.raises(ValueError, match="name: expected one of"):
        native.activation(g, None, "gelu")
    with pytest.raises(RuntimeError, match="up: expected a contiguous tensor of gate's shape"):
        native.activation(g, torch.randn(4, 9), "silu")
    with pytest.raises(RuntimeError, match="up: expected"):
        native.activation(g, torch.randn(4, 8).bfloat16(), "silu")
    with pytest.raises(RuntimeError, match="gate: expected a contiguous CPU float32 or bfloat16"):
        native.activation(g.t(), None, "silu")
    with pytest.raises(RuntimeError, match="gate: expected"):
        native.activation(g.double(), None, "silu")
