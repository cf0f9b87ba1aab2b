"""Each quantized kernel equal to its formula (dequantize, then ``linear``), forced one by
one; the measured plan that ``attnlab calibrate`` writes, and its cache (the rule: in
tests/kernels/test_rule.py)."""

from __future__ import annotations

import json

import pytest
import torch

from attnlab.kernels import calibration, native
from attnlab.quantization import QUANTIZED_KERNELS, QuantizedLinear, quantize
from attnlab.quantization import kernels as qkernels
from attnlab.quantization.formats import QuantizedWeight
from conftest import native_lacks


def _linear(rows: int = 128, cols: int = 256, bias: bool = True,
            dtype: torch.dtype = torch.float32) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(cols, rows, bias=bias).to(dtype)


CASES = [("int8_mm", 8), ("int4_mm", 4), ("int8_native", 8), ("int8_tiles", 8),
         ("int8_integers", 8), ("int4_integers", 4), ("int4_native", 4),
         ("int4_native_pairs", 4), ("native_dequantize", 8), ("native_dequantize", 4),
         ("native_widened", 8), ("native_widened", 4), ("dequantize", 8), ("dequantize", 4)]
# The kernels that take bfloat16 activations only (test_bfloat16_only_kernels_refuse_float32),
# by the native loop that each needs (None: the build alone).
BFLOAT16_ONLY = {"int8_tiles": "tiles", "int8_integers": "integers",
                 "int4_integers": "integers", "int4_native_pairs": "pairs",
                 "native_widened": None}


def _weight(kernel: str, bits: int, dtype: torch.dtype, bias: bool = True):
    """The module of the cases below (128 x 256, groups of 64), ``kernel`` forced."""
    return QuantizedLinear.from_linear(_linear(bias=bias, dtype=dtype), bits=bits,
                                       group_size=64, kernel=kernel)


def _why_not(kernel: str, bits: int) -> str:
    """Why ``kernel`` runs no case here: the native build or its CPU-specific loop missing,
    or the private op of this torch build that it calls."""
    if kernel == "int8_mm":
        return "this torch build has no _weight_int8pack_mm"
    if kernel == "int4_mm":
        return ("this torch build has no int4 CPU kernel that reads attnlab's blocked layout "
                "(_weight_int4pack_mm_for_cpu)")
    return native_lacks(BFLOAT16_ONLY.get(kernel)) or f"{kernel} takes no int{bits} weight here"


def _cases() -> list:
    """(kernel, bits, dtype, rows, bias) for every case that runs here (``available``): a
    bfloat16-only kernel in bfloat16 alone; a kernel that runs neither dtype here as one
    case, skipped saying why. What ``available`` refuses is the rule, checked by
    ``test_each_kernel_is_available_by_its_rule``."""
    cases = []
    for kernel, bits in CASES:
        dtypes = [torch.bfloat16] if kernel in BFLOAT16_ONLY else [torch.float32,
                                                                   torch.bfloat16]
        runs = [(kernel, bits, d, rows, bias) for d in dtypes
                if QUANTIZED_KERNELS[kernel].takes(
                    _weight(kernel, bits, d).weight_format.with_layout("blocked"), d)
                for rows in (1, 3, 70) for bias in (True, False)]
        cases += runs or [pytest.param(kernel, bits, torch.bfloat16, 1, True,
                                       marks=pytest.mark.skip(reason=_why_not(kernel, bits)))]
    return cases


@pytest.mark.parametrize(("kernel", "bits", "dtype", "rows", "bias"), _cases(), ids=str)
def test_each_kernel_equals_the_formula(kernel: str, bits: int, dtype: torch.dtype, rows: int,
                                        bias: bool) -> None:
    module = _weight(kernel, bits, dtype, bias)
    most = QUANTIZED_KERNELS[kernel].max_rows
    assert {b: k.name for b, k in module.plan(dtype).items()} == {
        b: kernel if most is None or most >= top else "dequantize"
        for b, top in (("1", 1), ("2-8", 8), ("9-32", 16), ("33+", 512))}
    x = torch.randn(2, rows, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        y = module(x)
    expected = torch.nn.functional.linear(x.double(), module.dequantize(torch.float64),
                                          None if module.bias is None else module.bias.double())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol * 10)
    assert y.dtype == dtype and y.shape == (2, rows, 128)


def test_each_kernel_is_available_by_its_rule() -> None:
    """The cases above are what each kernel's ``available`` takes here; what it refuses is
    its rule: bfloat16 activations only for the integer-product, pair, tile and widened
    kernels; the native ones where the build has them and their loop (the pairs:
    AVX512-BF16; the integers: AVX512-VNNI, int4 in groups of a multiple of 64; the tiles:
    AMX-BF16 lent by the operating system), each on its own width of codes."""
    int8, int4 = quantize(torch.randn(128, 256), 8), quantize(torch.randn(128, 256), 4, 64)
    f32, bf16 = torch.float32, torch.bfloat16
    for kernel, bits in CASES:
        weight = int8 if bits == 8 else int4
        assert QUANTIZED_KERNELS[kernel].takes(weight, f32) == (
            kernel not in BFLOAT16_ONLY and QUANTIZED_KERNELS[kernel].takes(weight, bf16)
        ), kernel
    built = native.available()
    for kernel, weight, has_loop in (
            ("int8_native", int8, built), ("int4_native", int4, built),
            ("native_dequantize", int8, built), ("native_dequantize", int4, built),
            ("native_widened", int8, built), ("native_widened", int4, built),
            ("int8_tiles", int8, native.tiles_available()),
            ("int8_integers", int8, native.integers_available()),
            ("int4_integers", int4, native.integers_available()),
            ("int4_native_pairs", int4, native.pairs_available())):
        assert QUANTIZED_KERNELS[kernel].takes(weight, bf16) == has_loop, kernel
    for kernel, weight in (("int8_native", int4), ("int8_tiles", int4), ("int4_native", int8),
                           ("int8_integers", int4), ("int4_native_pairs", int8),
                           ("int4_integers", quantize(torch.randn(128, 256), 4, 32))):
        assert not QUANTIZED_KERNELS[kernel].takes(weight, bf16), kernel


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_native_widened_makes_the_weight_a_block_of_rows_at_a_time(
        bits: int, bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """24 output rows of float32 a block: 128 rows are 5 blocks and 8 rows left over, each
    block's sums (and bias) in its own columns; float32 x is left to native_dequantize."""
    from attnlab.kernels import catalog

    monkeypatch.setattr(catalog, "_WIDEN_BYTES", 4 * 256 * 24)
    module = QuantizedLinear.from_linear(_linear(bias=bias, dtype=torch.bfloat16), bits=bits,
                                         group_size=64, kernel="native_widened")
    assert not QUANTIZED_KERNELS["native_widened"].takes(module.weight_format,
                                                             torch.float32)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        y = module(x)
    expected = torch.nn.functional.linear(x.double(), module.dequantize(torch.float64),
                                          None if module.bias is None else module.bias.double())
    # float32 sums of the float32 W', rounded once to bfloat16: within bfloat16's 2^-8.
    torch.testing.assert_close(y.double(), expected, rtol=2**-8, atol=1e-2)

def test_measured_plan_is_cached_per_scheme(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path) -> None:
    """What ``attnlab calibrate`` measures goes into the one cache file, keyed by scheme
    before the float keys' parts, and is read back, not measured again."""
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)  # the conftest forces the formula
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_TIMINGS", {})
    monkeypatch.setattr(qkernels, "cold_copies", lambda bytes_each: 2)
    weight = quantize(torch.randn(64, 128), 4, 32)
    assert qkernels.plan(weight, torch.bfloat16) == qkernels.rule_plan(weight, torch.bfloat16)
    assert not (tmp_path / "kernels.json").exists()  # a plan without measure_now times nothing
    picks = qkernels.plan(weight, torch.bfloat16, measure_now=True)
    assert set(picks) == {"1", "2-8", "9-32", "33+"}
    assert set(picks.values()) <= set(QUANTIZED_KERNELS)
    entries = json.loads((tmp_path / "kernels.json").read_text())["entries"]
    keys = [k for k in entries if k.startswith("int4 g32 | ")]
    assert len(keys) == len(entries) == 4
    assert all("64x128" in k and "bfloat16" in k for k in keys)
    assert all("dequantize" in entries[k] for k in keys)
    # read back, not measured again
    monkeypatch.setattr(calibration, "_TIMINGS", {})
    monkeypatch.setattr(qkernels, "_time_kernels", lambda *a, **k: pytest.fail("measured again"))
    assert qkernels.plan(weight, torch.bfloat16) == picks


def test_a_grouped_int8_weight_is_measured_on_random_weights_of_its_own_format(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Grouped int8 (a GGUF's Q8_0, Q5_* and Q6_K blocks; with offsets or not): ``attnlab
    calibrate`` times the formula and ``int8_grouped`` (where built) on random weights of the
    same shape, groups, dtypes and offsets (``quantize`` makes only the per-row kind), and
    plans by the timings."""
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_TIMINGS", {})
    monkeypatch.setattr(qkernels, "cold_copies", lambda size: 2)
    seen = []

    def timed(prepared, x, bias, expected, tolerance):
        for name, (kernel, states) in prepared.items():
            seen.append(name)
            assert len(states) == 2
            for state in states:  # each copy's run equals the formula on the same x
                torch.testing.assert_close(kernel.run(x, state, bias), expected, rtol=3e-2,
                                           atol=3e-2)
        return {name: 10.0 if name == "dequantize" else 1.0 for name in prepared}

    monkeypatch.setattr(calibration, "time_kernels", timed)
    codes = torch.randint(0, 32, (64, 128), dtype=torch.int8)
    kernel = "int8_grouped" if native.available() else "dequantize"
    for zeros in (None, torch.rand(64, 4)):
        weight = QuantizedWeight(8, codes, torch.rand(64, 4), zeros)
        for dtype in (torch.float32, torch.bfloat16):
            picks = qkernels.plan(weight, dtype, measure_now=True)
            assert picks == {**dict.fromkeys(("1", "2-8", "9-32"), kernel), "33+": "dequantize"}
    assert set(seen) == {"dequantize", kernel}
    assert (tmp_path / "kernels.json").exists()


def test_forced_kernel_is_checked_and_falls_back_to_the_formula(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ATTNLAB_KERNELS forces float and quantized kernels alike; the old quantized-only
    variable still works where it is not set, with a warning."""
    weight = quantize(torch.randn(64, 128), 8)
    assert set(qkernels.plan(weight, torch.float32, kernel="int4_mm").values()) == {"dequantize"}
    with pytest.raises(ValueError, match="kernel: expected one of dequantize, int8_mm"):
        qkernels.plan(weight, torch.float32, kernel="fast")
    monkeypatch.setenv("ATTNLAB_KERNELS", "int8_mm")
    assert set(qkernels.plan(weight, torch.float32).values()) == {"int8_mm"}
    monkeypatch.setenv("ATTNLAB_KERNELS", "formula")  # the float formula: dequantize here
    assert set(qkernels.plan(weight, torch.float32).values()) == {"dequantize"}
    monkeypatch.setenv("ATTNLAB_KERNELS", "columns")  # a float kernel: the rule here
    assert qkernels.plan(weight, torch.float32) == qkernels.rule_plan(weight, torch.float32)
    monkeypatch.setenv("ATTNLAB_KERNELS", "nope")
    with pytest.raises(ValueError, match=r"ATTNLAB_KERNELS: expected one of formula, .*, "
                                         r"dequantize, int8_mm"):
        qkernels.plan(weight, torch.float32)
    monkeypatch.delenv("ATTNLAB_KERNELS")
    monkeypatch.setenv("ATTNLAB_QUANTIZED_KERNELS", "int8_mm")
    with pytest.warns(FutureWarning, match="ATTNLAB_QUANTIZED_KERNELS is an old name of "
                                           "ATTNLAB_KERNELS"):
        assert set(qkernels.plan(weight, torch.float32).values()) == {"int8_mm"}
    monkeypatch.setenv("ATTNLAB_QUANTIZED_KERNELS", "nope")
    with pytest.warns(FutureWarning), pytest.raises(
            ValueError, match="ATTNLAB_QUANTIZED_KERNELS: expected one of"):
        qkernels.plan(weight, torch.float32)


def test_int4_kernel_needs_rows_in_blocks_of_64() -> None:
    odd = quantize(torch.randn(96, 64), 4, 32)
    assert not QUANTIZED_KERNELS["int4_mm"].takes(odd, torch.bfloat16)
    module = QuantizedLinear.from_linear(torch.nn.Linear(64, 96), bits=4, group_size=32,
                                         kernel="int4_mm")
    assert module.layout == "plain"
    x = torch.randn(1, 64)
    with torch.inference_mode():
        torch.testing.assert_close(module(x), torch.nn.functional.linear(
            x, module.dequantize(), module.bias))


@pytest.mark.parametrize(("native_one_row", "expected"), [
    (10.0, {"1": "int4_native", "2-8": "int4_native"}),  # plain wins overall
    (25.0, {"1": "int4_mm", "2-8": "int4_mm"}),  # blocked wins by more than the margin
])
def test_the_plan_keeps_the_codes_in_one_layout(monkeypatch: pytest.MonkeyPatch,
                                                native_one_row: float, expected: dict) -> None:
    """int4_native reads the plain layout, int4_mm the blocked one: a plan never mixes them
    (a module keeps one copy of the codes), choosing the layout that loses least overall."""
    import dataclasses

    timings = {"1": {"dequantize": 100.0, "int4_native": native_one_row, "int4_mm": 30.0},
               "2-8": {"dequantize": 100.0, "int4_native": 50.0, "int4_mm": 20.0},
               "9-32": {"dequantize": 100.0, "int4_mm": 150.0},
               "33+": {"dequantize": 100.0, "int4_mm": 300.0}}
    every = {n: dataclasses.replace(k, takes=lambda w, d: True)
             for n, k in QUANTIZED_KERNELS.items()}
    monkeypatch.setattr(qkernels, "QUANTIZED_KERNELS", every)
    monkeypatch.setattr(qkernels, "cached", lambda w, d, b, names, bias=True: {
        n: timings[b][n] for n in names if n in timings[b]})
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)  # the conftest forces the formula
    picks = qkernels.plan(quantize(torch.randn(128, 256), 4, 64), torch.bfloat16)
    assert picks == {**expected, "9-32": "dequantize", "33+": "dequantize"}


def test_one_row_decoding_keeps_the_pair_kernel_when_it_loses_only_at_16_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One layout is kept for every bucket. Timings (microseconds) shaped on those measured
    for the 151936 x 896 int4 table on a 2-core EPYC: PyTorch's blocked-layout kernel is 2x
    slower for one row but 1.4x faster at 16 rows; the pair kernel must be offered at 16 rows
    for the plain layout (and it, for decoding) to win - offered up to 8 rows, the formula
    alone stood for the plain layout there, 3.9x slower, and pulled the weight to the blocked
    layout."""
    weight = quantize(torch.randn(128, 256), 4, 64, torch.bfloat16)
    if not QUANTIZED_KERNELS["int4_native_pairs"].takes(weight, torch.bfloat16):
        pytest.skip(native_lacks("pairs"))
    measured = {
        "1": {"dequantize": 300_000, "int4_mm": 6_981, "int4_native": 6_816,
              "int4_native_pairs": 3_305, "native_dequantize": 98_867},
        "2-8": {"dequantize": 310_000, "int4_mm": 40_000, "int4_native": 95_000,
                "int4_native_pairs": 19_484, "native_dequantize": 100_000},
        "9-32": {"dequantize": 279_044, "int4_mm": 26_935, "int4_native": 70_000,
                 "int4_native_pairs": 38_400, "native_dequantize": 104_049},
        "33+": {"dequantize": 650_000, "int4_mm": 13_000_000, "native_dequantize": 560_000},
    }
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)  # the conftest forces the formula
    monkeypatch.setattr(qkernels, "cached", lambda w, d, bucket, names, bias=True: {
        n: t for n, t in measured[bucket].items() if n in names})
    assert qkernels.plan(weight, torch.bfloat16) == {
        "1": "int4_native_pairs", "2-8": "int4_native_pairs", "9-32": "int4_native_pairs",
        "33+": "native_dequantize"}


@pytest.mark.usefixtures("native_kernels")  # the plan offers only kernels that run here
def test_an_exact_kernel_needs_no_margin_over_the_formula(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """``native_dequantize`` gives the formula's numbers bit for bit, so 5% faster is reason
    enough to run it (the formula's two passes cost a quantized prefill ~2 ms a forward);
    a kernel with other roundings must still win by the margin."""
    weight = quantize(torch.randn(128, 256), 8)
    for bucket_times, expected in (
            ({"dequantize": 1000, "native_dequantize": 950, "int8_native": 990},
             "native_dequantize"),
            ({"dequantize": 1000, "native_dequantize": 1010, "int8_native": 950}, "dequantize")):
        monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)  # the conftest forces the formula
        monkeypatch.setattr(qkernels, "cached",
                            lambda w, d, bucket, names, t=bucket_times, bias=True: {
                                n: us for n, us in t.items() if n in names})
        assert set(qkernels.plan(weight, torch.bfloat16).values()) == {expected}
    assert [n for n, k in QUANTIZED_KERNELS.items() if k.exact] == ["native_dequantize"]
