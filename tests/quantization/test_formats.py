"""The int8/int4 formats against their formulas: round-trip bounds, exactness on the grid,
the nibble order, and the blocked layout equal to PyTorch's own int4 CPU packing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.kernels import native
from attnlab.quantization.formats import (
    QuantizedWeight,
    blocked_int4,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize,
    quantize_int4,
    quantize_int8,
    unblocked_int4,
    unpack_int4,
)


def _weight(rows: int = 64, cols: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def test_int8_is_the_symmetric_per_row_formula() -> None:
    w = _weight()
    q, s = quantize_int8(w)
    expected_s = w.abs().amax(1) / 127
    torch.testing.assert_close(s, expected_s)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    torch.testing.assert_close(q, torch.round(w / expected_s[:, None]).to(torch.int8))
    err = (dequantize_int8(q, s) - w).abs()
    assert (err <= s[:, None] / 2 + 1e-6).all()
    # the largest weight of each row is kept exactly (up to float rounding)
    row_max = w.abs().argmax(1)
    torch.testing.assert_close(dequantize_int8(q, s).gather(1, row_max[:, None]),
                               w.gather(1, row_max[:, None]))


def test_int8_zero_row_and_grid_values_are_exact() -> None:
    w = torch.zeros(3, 8)
    w[1] = 1.0
    w[2] = torch.tensor([-127, -3, 0, 5, 127, 1, 2, 64.0]) * 0.5
    q, s = quantize_int8(w)
    assert s[0] == 1 and (q[0] == 0).all()
    torch.testing.assert_close(dequantize_int8(q[1:], s[1:]), w[1:])


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_within_half_a_step(group_size: int) -> None:
    w = _weight(cols=256)
    packed, s, z = quantize_int4(w, group_size)
    assert packed.shape == (64, 128) and packed.dtype == torch.uint8
    assert s.shape == z.shape == (64, 256 // group_size)
    codes = unpack_int4(packed)
    groups = w.view(64, -1, group_size)
    torch.testing.assert_close(s, (groups.amax(-1) - groups.amin(-1)) / 15)
    torch.testing.assert_close(z, groups.amin(-1) + 8 * s)
    back = dequantize_int4(codes, s, z)
    step = s.repeat_interleave(group_size, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-5).all()
    # the formula, written out
    torch.testing.assert_close(back, ((codes.float() - 8).view(64, -1, group_size)
                                      * s[..., None] + z[..., None]).view(64, 256))


def test_int4_scales_in_bfloat16_still_bound_the_error() -> None:
    w = _weight(cols=128)
    packed, s, z = quantize_int4(w, 64, torch.bfloat16)
    assert s.dtype == z.dtype == torch.bfloat16
    back = dequantize_int4(unpack_int4(packed), s, z, torch.float32)
    assert ((back - w).abs() <= s.float().repeat_interleave(64, 1) * 0.6 + 1e-2).all()


def test_int4_constant_group_and_grid_values_are_exact() -> None:
    w = torch.full((2, 64), 0.3)
    k = torch.randint(0, 16, (64,), generator=torch.Generator().manual_seed(0)).float()
    k[0], k[1], k[32], k[33] = 0, 15, 0, 15  # each group spans all 16 codes
    w[1, :32], w[1, 32:] = -1 + 0.25 * k[:32], 2 + 0.5 * k[32:]
    packed, s, z = quantize_int4(w, 32)
    torch.testing.assert_close(dequantize_int4(unpack_int4(packed), s, z), w)


def test_nibble_order_is_low_then_high() -> None:
    assert pack_int4(torch.tensor([[1, 2, 15, 0]])).tolist() == [[0x21, 0x0F]]
    assert unpack_int4(torch.tensor([[0x21, 0x0F]], dtype=torch.uint8)).tolist() == [[1, 2, 15, 0]]


@settings(max_examples=30, deadline=None)
@given(rows=st.sampled_from([64, 128, 192]), half=st.integers(1, 20), seed=st.integers(0, 99))
def test_blocked_layout_is_a_permutation_of_the_codes(rows: int, half: int, seed: int) -> None:
    codes = torch.randint(0, 16, (rows, 2 * half), generator=torch.Generator().manual_seed(seed),
                          dtype=torch.uint8)
    blocked = blocked_int4(codes)
    assert blocked.shape == (rows, half) and blocked.is_contiguous()
    assert torch.equal(unblocked_int4(blocked), codes)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"),
                    reason="this torch build has no int4 CPU packing")
def test_blocked_layout_is_torchs_int4_cpu_packing() -> None:
    codes = torch.randint(0, 16, (192, 96), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(1))
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(theirs, blocked_int4(codes))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("layout", ["plain", "blocked"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernels", ["native", "formula"])
def test_rows_equal_the_dequantized_table(monkeypatch, bits: int, layout: str,
                                          scale_dtype: torch.dtype, kernels: str) -> None:
    if kernels == "formula":
        monkeypatch.setattr(native, "takes", lambda *tensors: False)
    weight = quantize(_weight(128, 64), bits, 32 if bits == 4 else None,
                      scale_dtype).with_layout(layout)
    assert weight.layout == (layout if bits == 4 else "plain")
    ids = torch.tensor([[0, 127, 64], [31, 32, 63]])
    for dtype in (None, torch.float32, torch.bfloat16):
        rows = weight.rows(ids, dtype)
        assert rows.dtype == (dtype or scale_dtype)
        assert torch.equal(rows, weight.dequantize(dtype)[ids])
    assert weight.shape == (128, 64)
    assert weight.group_size == (64 if bits == 8 else 32)


def test_layouts_dequantize_alike() -> None:
    plain = quantize(_weight(128, 64), 4, 64)
    blocked = plain.with_layout("blocked")
    assert isinstance(blocked, QuantizedWeight) and blocked.layout == "blocked"
    assert torch.equal(blocked.dequantize(), plain.dequantize())
    assert torch.equal(blocked.with_layout("plain").data, plain.data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_dequantize_in_a_16_bit_dtype_is_the_float32_formula_rounded_once(
        dtype: torch.dtype) -> None:
    q, s = quantize_int8(_weight(64, 256), dtype)
    fast = dequantize_int8(q, s)  # computed in the 16-bit dtype
    assert fast.dtype == dtype
    assert torch.equal(fast, (q.float() * s.float()[:, None]).to(dtype))


def test_int4_dequantize_by_blocks_of_rows_is_the_whole_formula() -> None:
    packed, s, z = quantize_int4(_weight(600, 128), 32, torch.bfloat16)
    codes = unpack_int4(packed)
    whole = ((codes.float() - 8).view(600, 4, 32) * s.float()[..., None]
             + z.float()[..., None]).view(600, 128).to(torch.bfloat16)
    assert torch.equal(dequantize_int4(codes, s, z), whole)


@pytest.mark.parametrize(("args", "message"), [
    ((torch.randn(4, 64), 3, 64), r"bits: expected 8 or 4, got 3"),
    ((torch.randn(4, 64), 4, None), r"group_size: expected one of \(32, 64, 128, 256\) "
                                    r"dividing the weight's 64 inputs, got None"),
    ((torch.randn(4, 96), 4, 64), r"dividing the weight's 96 inputs, got 64"),
    ((torch.randn(4, 64), 4, 48), r"got 48"),
    ((torch.randn(4, 64), 4, 64.0), r"got 64.0"),
    ((torch.randn(4, 64), 4, True), r"got True"),
    ((torch.randn(4, 64), 8, 64.0), r"int8 has one scale per row.*got 64.0"),
    ((torch.randn(4, 64), 8, 32), r"int8 has one scale per row, so None or the weight's 64"),
    ((torch.randn(64), 8, None), r"weight: expected a 2-d floating-point tensor O x I, got "
                                 r"torch.float32 of shape \(64,\)"),
    ((torch.ones(4, 64, dtype=torch.int32), 8, None), r"got torch.int32"),
    (([[1.0]], 8, None), r"got list"),
])
def test_quantize_refuses_bad_arguments(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quantize(*args)


def test_int8_group_size_may_name_the_row() -> None:
    w = torch.randn(4, 64)
    assert torch.equal(quantize(w, 8, 64).dequantize(), quantize(w, 8).dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_int8_with_offsets_is_q_s_plus_z_rounded_once(dtype: torch.dtype) -> None:
    # 600 rows: more than one block of rows; codes 0..31 as GGUF's Q5_1/Q5_K keep them
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 32, (600, 128), dtype=torch.int8, generator=g)
    s = (torch.rand(600, 4, generator=g) * 1e-2).to(dtype)
    z = (-torch.rand(600, 4, generator=g) * 0.1).to(dtype)
    weight = QuantizedWeight(8, q, s, z)
    expected = (q.float().view(600, 4, 32) * s.float()[..., None]
                + z.float()[..., None]).view(600, 128).to(dtype)
    assert torch.equal(weight.dequantize(), expected)
    assert torch.equal(weight.dequantize(torch.float32), (q.float().view(600, 4, 32)
                       * s.float()[..., None] + z.float()[..., None]).view(600, 128))
    ids = torch.tensor([[0, 599, 256], [255, 3, 3]])
    assert torch.equal(weight.rows(ids), expected[ids])
    # an offset is not a per-row int8 weight, whatever the scales' shape: no int8 kernel
    # that ignores offsets may take it
    assert not weight.per_row and weight.group_size == 32
    assert not QuantizedWeight(8, q, s[:, 0], z[:, 0]).per_row
