"""attnlab's C++ GEMV for grouped int8 weights (``native.gemv_int8_grouped``: GGUF's Q8_0,
Q5_*, Q6_K kept as they are): equal to the formula (the dequantized weight times x, in
float64) within the tolerance table for float32 and bfloat16 activations and scales, groups
of 16 and 32, with and without offsets, every row count (blocks of rows and their tails, more
than one block: the weight read in chunks), an odd number of groups; bad input refused by
name; the kernel registered for grouped int8 weights and chosen by the rule."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import built_for, grouped_int8, thread_count

from attnlab.kernels import native
from attnlab.kernels.rule import DECODING, Features, rule
from attnlab.quantization import QUANTIZED_KERNELS, QuantizedLinear
from attnlab.quantization.kernels import rule_plan

pytestmark = pytest.mark.usefixtures("native_kernels")


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    # float32: reordered float32 sums (the offsets' term a separate sum); bfloat16: the
    # result rounded to 8 bits.
    rtol, atol = (1e-4, 1e-4) if dtype == torch.float32 else (8e-3, 1e-2)
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [16, 32])
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 11, 32])
def test_grouped_int8_equals_dequantize_then_linear(dtype, scale_dtype, group_size, offsets,
                                                    rows) -> None:
    """67 outputs (not a multiple of any block); 480 inputs: 15 groups of 32 (an odd count:
    the two alternating sums end unevenly), 30 of 16; 11 rows: a block of 8 and a tail, more
    than one block, so the weight is read in chunks."""
    g = torch.Generator().manual_seed(group_size + rows)
    weight = grouped_int8(torch.randn(67, 480, generator=g), group_size, offsets=offsets,
                          scale_dtype=scale_dtype)
    x = torch.randn(rows, 480, generator=g).to(dtype)
    bias = torch.randn(67, generator=g).to(dtype)
    with thread_count(2):
        y = native.gemv_int8_grouped(x, weight.data, weight.scales, weight.zeros, group_size,
                                     bias)
    expected = x.double() @ weight.dequantize(torch.float64).t() + bias.double()
    _close(y, expected, dtype)


def test_a_long_row_read_in_chunks_equals_its_formula() -> None:
    """8,192 inputs: 32 rows of codes a chunk of 256 KiB, so 40 outputs are two chunks, each
    under the four blocks of x's 32 rows."""
    g = torch.Generator().manual_seed(1)
    weight = grouped_int8(torch.randn(40, 8192, generator=g), 32, offsets=True)
    x = torch.randn(32, 8192, generator=g)
    y = native.gemv_int8_grouped(x, weight.data, weight.scales, weight.zeros, 32)
    _close(y, x.double() @ weight.dequantize(torch.float64).t(), torch.float32)


def test_a_hand_computed_product() -> None:
    """Two groups of 16: codes 1 and 2, scales 0.5 and 3, offsets 1 and -1, x all ones:
    16 (1 * 0.5 + 1) + 16 (2 * 3 - 1) = 24 + 80."""
    q = torch.tensor([[1] * 16 + [2] * 16], dtype=torch.int8)
    scales, zeros = torch.tensor([[0.5, 3.0]]), torch.tensor([[1.0, -1.0]])
    y = native.gemv_int8_grouped(torch.ones(1, 32), q, scales, zeros, 16)
    assert y.item() == 104.0
    assert native.gemv_int8_grouped(torch.ones(1, 32), q, scales, None, 16).item() == 8 + 96


def test_bad_input_is_refused_by_name() -> None:
    x, q = torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8)
    s = torch.ones(8, 2)
    with pytest.raises(RuntimeError, match="group_size"):
        native.gemv_int8_grouped(x, q, torch.ones(8, 4), None, 24)
    with pytest.raises(RuntimeError, match="scales"):
        native.gemv_int8_grouped(x, q, torch.ones(8, 3), None, 32)
    with pytest.raises(RuntimeError, match="zeros"):
        native.gemv_int8_grouped(x, q, s, torch.ones(8, 2, dtype=torch.bfloat16), 32)
    with pytest.raises(RuntimeError, match="q: expected int8"):
        native.gemv_int8_grouped(x, q.to(torch.uint8), s, None, 32)
    with pytest.raises(RuntimeError, match="bias"):
        native.gemv_int8_grouped(x, q, s, None, 32, torch.ones(7))


def test_the_rule_runs_grouped_int8_on_the_native_kernel_for_every_decoding_bucket() -> None:
    cpu = Features(native=True, pairs=True, tiles=False, integers=True, bfloat16_gemm=True)
    bare = Features(native=False, pairs=False, tiles=False, integers=False,
                    bfloat16_gemm=False)
    for dtype in (torch.float32, torch.bfloat16):
        assert rule("int8 grouped", dtype, cpu) == {
            **dict.fromkeys(DECODING, ("int8_grouped",)), "33+": ("dequantize",)}
        assert set(rule("int8 grouped", dtype, bare).values()) == {("dequantize",)}
        weight = grouped_int8(torch.randn(8, 64), 16, offsets=False)
        assert rule_plan(weight, dtype) == {**dict.fromkeys(DECODING, "int8_grouped"),
                                            "33+": "dequantize"}
    per_row = QUANTIZED_KERNELS["int8_native"]
    assert not per_row.takes(grouped_int8(torch.randn(8, 64), 32, offsets=False),
                             torch.float32)


@pytest.mark.parametrize("offsets", [False, True])
def test_a_quantized_linear_with_a_grouped_weight_decodes_on_the_kernel(offsets,
                                                                        monkeypatch) -> None:
    """The fast module's plan (the rule's: the suite forces the formula) names the kernel
    (``print(model)`` shows it), and its output for a decoding row equals the formula's."""
    monkeypatch.delenv("ATTNLAB_KERNELS")
    torch.manual_seed(0)
    weight = grouped_int8(torch.randn(48, 96), 32, offsets=offsets)
    module = QuantizedLinear(96, 48, bias=False, bits=8, group_size=32, device="meta")
    module.set_weight(weight)
    x = torch.randn(2, 96)
    with torch.inference_mode():
        y = module(x)
    assert "1=int8_grouped" in repr(module)
    _close(y, x.double() @ weight.dequantize(torch.float64).t(), torch.float32)


@pytest.fixture(scope="module")
def build_for(tmp_path_factory: pytest.TempPathFactory):
    """``build_for(target)``: the kernels built for another CPU (``kernel_helpers.built_for``)."""
    return lambda target: built_for(target, tmp_path_factory)


@pytest.mark.parametrize("loop", ["x86-64-v2", "x86-64-v3"])
@pytest.mark.parametrize("offsets", [False, True])
def test_the_loops_of_a_cpu_without_avx512_equal_the_formula_and_are_batch_invariant(
        loop: str, offsets: bool, build_for) -> None:
    """The plain loop (x86-64-v2's build) and the 8-lane one (v3's, blocks of 4 rows): within
    the tolerance of the formula, groups of 16 and 32, 1-9 rows (blocks and their tails), and
    row 0 bit for bit the same beside 1 to 32 rows."""
    built = build_for(loop)
    g = torch.Generator().manual_seed(7)
    for group_size in (16, 32):
        weight = grouped_int8(torch.randn(67, 480, generator=g), group_size, offsets=offsets)
        args = (weight.data, weight.scales, weight.zeros, group_size, None)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(32, 480, generator=g).to(dtype)
            with thread_count(2):
                for rows in (1, 3, 4, 5, 9):
                    y = built.gemv_int8_grouped(x[:rows].contiguous(), *args)
                    _close(y, x[:rows].double() @ weight.dequantize(torch.float64).t(), dtype)
                alone = built.gemv_int8_grouped(x[:1].contiguous(), *args)
                for rows in range(2, 33):
                    beside = built.gemv_int8_grouped(x[:rows].contiguous(), *args)
                    assert torch.equal(beside[0], alone[0]), (loop, rows)
