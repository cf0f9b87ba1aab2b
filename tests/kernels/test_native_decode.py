"""attnlab's C++ kernels of a decoding step besides its GEMVs (``attnlab.kernels.native``):
attention of a few queries over cached keys, equal to the formula in float64 for every mask
convention, grouped heads, strided cache views and rows with nothing to attend to; the greedy
argmax, equal to ``torch.argmax`` including ties, -inf and NaN; RMSNorm and RoPE; and the
conditions under which the fast modules run them (``attnlab.kernels.decode_attention``)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import built_for, thread_count

from attnlab.attention.math import math_attention
from attnlab.attention.sdpa import scaled_dot_product_attention
from attnlab.kernels import FastRMSNorm, native
from attnlab.kernels.decode_attention import native_attention, native_decoding
from attnlab.layers.rotary import apply_rotary

# Built by `attnlab build` before the session (conftest), else these tests skip saying so.
pytestmark = pytest.mark.usefixtures("native_kernels")


def _reference(q, k, v, mask, scale, is_causal):
    """The formula in float64, grouped heads repeated."""
    per = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(per, 1), v.repeat_interleave(per, 1)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    out, _ = math_attention(q.double(), k.double(), v.double(), mask, is_causal=is_causal,
                            scale=scale)
    return out


# (B, H, G, L, S, D, Dv)
SHAPES = [(1, 14, 2, 1, 37, 64, 64), (2, 4, 4, 3, 17, 8, 8), (3, 6, 2, 8, 9, 16, 16),
          (1, 4, 1, 2, 2, 32, 32), (2, 2, 1, 1, 70, 5, 7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_decode_attention_equals_the_formula(dtype, shape, is_causal, mask_kind) -> None:
    B, H, G, L, S, D, Dv = shape
    g = torch.Generator().manual_seed(B * S + L)
    # As a decoder hands them over: q a transposed view, k/v views into a longer cache.
    q = torch.randn(B, L, H, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, G, S + 4, D, generator=g).to(dtype)[:, :, :S]
    v = torch.randn(B, G, S + 4, Dv, generator=g).to(dtype)[:, :, :S]
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, L, S, generator=g) > 0.3
        mask[0, 0, 0] = False  # a query with nothing to attend to: zeros
    elif mask_kind == "float":
        mask = torch.randn(B, 1, 1, S, generator=g)
        mask[..., 0] = float("-inf")
    expanded = None if mask is None else mask.expand(B, H, L, S)
    with thread_count(2):
        out = native.decode_attention(q, k, v, expanded, 0.3, is_causal)
    assert out.shape == (B, H, L, Dv) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask, 0.3, is_causal),
                               rtol=tol, atol=tol)
    if mask_kind == "bool":
        assert bool((out[0, :, 0] == 0).all())


def test_decode_attention_refuses_bad_input_by_name() -> None:
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="query, key, value: expected one dtype"):
        native.decode_attention(q, k.double(), k, None, 1.0, False)
    with pytest.raises(RuntimeError, match="with G dividing H"):
        native.decode_attention(q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), None,
                                1.0, False)
    with pytest.raises(RuntimeError, match="mask: expected a bool or float32 B x H x L x S"):
        native.decode_attention(q, k, k, torch.ones(1, 4, 1, 4, dtype=torch.bool), 1.0, False)
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        native.decode_attention(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), k,
                                None, 1.0, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "key"])
def test_decoding_attention_runs_the_kernel_for_a_decoding_step(dtype, mask_kind) -> None:
    """A few CPU queries with no gradient are taken (``native_decoding``) and give the fused
    backend's answer; with gradients, dropout or many queries they are not."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 9, 16, generator=g).to(dtype) for _ in range(2))  # B broadcasts
    mask = {None: None, "bool": torch.rand(2, 1, 1, 9, generator=g) > 0.5,
            "float": torch.randn(2, 1, 1, 9, generator=g), "key": torch.rand(9) > 0.2}[mask_kind]
    with torch.no_grad():
        assert native_decoding(q, k, v, mask)
        out = native_attention(q, k, v, mask, is_causal=True)
        fused = scaled_dot_product_attention(q, k, v, mask, is_causal=True, enable_gqa=True,
                                             backend="fused")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), fused.float(), rtol=tol, atol=tol)
    assert not native_decoding(q.requires_grad_(), k, v, mask)
    with torch.no_grad():
        assert not native_decoding(q, k, v, mask, dropout_p=0.5)
        long = torch.randn(2, 6, native.MAX_ROWS + 1, 16).to(dtype)
        assert not native_decoding(long, k, v, None)
        assert not native_decoding(q, k, v, torch.ones(3, 1, 1, 9, dtype=torch.bool))  # B=3
        assert not native_decoding(q.double(), k.double(), v.double(), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("columns", [1, 7, 16384, 16385, 151936])
def test_argmax_equals_torch(dtype, columns) -> None:
    g = torch.Generator().manual_seed(columns)
    x = torch.randn(5, columns, generator=g).to(dtype)
    x[1] = float("-inf")  # nothing but -inf: index 0, as torch
    x[2, columns // 2] = x[2, -1] = 1e4  # a tie: the first
    x[3, -1] = float("nan")  # NaN wins, as in torch
    x[4, columns // 3] = float("nan")
    x[4, -1] = float("nan")
    with thread_count(2):
        got = native.argmax_rows(x)
    assert torch.equal(got, x.argmax(-1))
    assert native.argmax_rows(x[:0]).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_equals_the_formula(dtype, weight_dtype, unit_offset) -> None:
    """The kernel (``FastRMSNorm`` with no gradient) against the written-out formula
    (``FastRMSNorm`` with a gradient, which runs ``RMSNorm``'s): the same roundings, so at
    most one step of the last one apart."""
    calls = []
    norm = FastRMSNorm(40, eps=1e-5, unit_offset=unit_offset).eval()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40, generator=torch.Generator().manual_seed(2)))
    norm = norm.to(weight_dtype)
    x = (3 * torch.randn(2, 5, 40, generator=torch.Generator().manual_seed(1))).to(dtype)
    formula = norm(x.clone().requires_grad_()).detach()  # a gradient: the formula
    kernel = native.rms_norm
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native, "rms_norm", lambda *a: calls.append(1) or kernel(*a))
        with torch.no_grad():
            got = norm(x)
    assert calls == [1] and got.dtype == formula.dtype and got.shape == x.shape
    one_step = formula.abs().double() * (2.0**-7 if formula.dtype == torch.bfloat16 else 1e-6)
    assert bool(((got.double() - formula.double()).abs() <= one_step + 1e-6).all())
    with pytest.raises(RuntimeError, match="weight: expected 40 contiguous"):
        native.rms_norm(x.reshape(-1, 40), norm.weight[:3], 1e-5, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("rotary_dim", "cos_rows"), [(16, 1), (8, 2), (16, 2), (40, 1),
                                                    (24, 2), (36, 1)])
def test_rotary_equals_the_formula_exactly(dtype, interleaved, rotary_dim, cos_rows) -> None:
    """The kernel against ``apply_rotary``'s written-out formula (taken with a gradient): the
    same products and roundings in x's dtype, so the same numbers; partial rotation (R < D)
    passes the other features through; cos/sin per row or shared; x a strided view; halves
    and rotated parts of one, two and a part of a 16-wide vector."""
    g = torch.Generator().manual_seed(rotary_dim + cos_rows)
    x = torch.randn(2, 3, 10, 40, generator=g).to(dtype)[:, :, 1:6]  # B x L x H x D view
    angles = torch.randn(cos_rows, 3, rotary_dim, generator=g)
    cos, sin = angles.cos(), angles.sin()
    formula = apply_rotary(x.clone().requires_grad_(), cos, sin,
                           interleaved=interleaved).detach()
    with torch.no_grad():
        got = native.rotary(x, cos.to(dtype).contiguous(), sin.to(dtype).contiguous(),
                            interleaved)
    assert torch.equal(got, formula)
    with pytest.raises(RuntimeError, match="cos, sin: expected contiguous"):
        native.rotary(x, cos.to(dtype), sin.double(), interleaved)


@pytest.mark.parametrize("build", ["native", "x86-64-v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_edge_cases_match_the_formula(dtype, build, tmp_path_factory) -> None:
    """No keys at all (zeros, not a crash), queries before the first key under the causal
    mask (zeros), NaN in a query or +inf in a mask (NaN, as the formula: never a quiet zero);
    the same in a build for a CPU with AVX2 but not AVX-512 (its own softmax exp)."""
    native_attention = (native.decode_attention if build == "native"
                        else built_for(build, tmp_path_factory).decode_attention)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 3, 4, generator=g).to(dtype)
    empty = torch.zeros(1, 2, 0, 4, dtype=dtype)
    assert torch.equal(native_attention(q, empty, empty, None, 0.5, False),
                       torch.zeros(1, 2, 3, 4, dtype=dtype))
    k = torch.randn(1, 2, 1, 4, generator=g).to(dtype)
    out = native_attention(q, k, k, None, 0.5, True)
    torch.testing.assert_close(out.double(), _reference(q, k, k, None, 0.5, True))
    assert bool((out[:, :, :2] == 0).all())
    bad = q.clone()
    bad[0, 0, 1, 2] = float("nan")
    k3 = torch.randn(1, 2, 3, 4, generator=g).to(dtype)
    out = native_attention(bad, k3, k3, None, 0.5, False)
    assert bool(out[0, 0, 1].isnan().all()) and not bool(out[0, 1].isnan().any())
    plus = torch.zeros(1, 2, 3, 3)
    plus[0, 1, 0, 1] = float("inf")
    out = native_attention(q, k3, k3, plus, 0.5, False)
    expected = _reference(q, k3, k3, plus, 0.5, False)
    assert torch.equal(out.isnan(), expected.isnan()) and bool(out[0, 1, 0].isnan().all())


def _paged(B, G, P, S, D, Dv, dtype, g):
    """A pool of pages in random order holding rows of S, S - 3, 1 and 0 keys (left-padded to
    S); returns the pages, tables, first and the dense B x G x S x D keys/values (zeros
    where a row has none)."""
    lengths = [S, max(S - 3, 0), min(1, S), 0][:B]
    pages_needed = [-(-n // P) for n in lengths]
    order = torch.randperm(sum(pages_needed) + 3, generator=g).tolist()
    kp = torch.randn(len(order), G, P, D, generator=g).to(dtype)
    vp = torch.randn(len(order), G, P, Dv + 3, generator=g).to(dtype)[..., :Dv]  # strided
    tables = torch.zeros(B, max([*pages_needed, 1]), dtype=torch.long)
    k = torch.zeros(B, G, S, D, dtype=dtype)
    v = torch.zeros(B, G, S, Dv, dtype=dtype)
    for b, n in enumerate(lengths):
        tables[b, :pages_needed[b]] = torch.tensor(
            [order.pop() for _ in range(pages_needed[b])], dtype=torch.long)
        for t in range(n):
            page, slot = int(tables[b, t // P]), t % P
            k[b, :, S - n + t], v[b, :, S - n + t] = kp[page, :, slot], vp[page, :, slot]
    first = torch.tensor([S - n for n in lengths])
    return kp, vp, tables, first, k, v, lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("B", "H", "G", "L", "S", "P"), [
    (4, 14, 2, 1, 37, 16), (3, 4, 4, 3, 9, 2), (2, 6, 1, 8, 20, 4), (4, 2, 2, 1, 1, 16)])
@pytest.mark.parametrize("mask_kind", [None, "bool"])
def test_paged_attention_equals_the_formula_on_gathered_keys(dtype, B, H, G, L, S, P,
                                                             mask_kind) -> None:
    """Keys read in their pages through the block tables give the formula over the dense,
    left-padded keys that a gather would make (padding masked out); a row with no key gives
    zeros."""
    g = torch.Generator().manual_seed(S + L)
    D, Dv = 16, 8
    kp, vp, tables, first, k, v, lengths = _paged(B, G, P, S, D, Dv, dtype, g)
    q = torch.randn(B, L, H, D, generator=g).to(dtype).transpose(1, 2)
    real = torch.arange(S)[None, :] >= first[:, None]  # B x S
    mask = real[:, None, None, :] & (torch.rand(B, 1, L, S, generator=g) > 0.2
                                     if mask_kind == "bool" else True)
    is_causal = L > 1
    with thread_count(2):
        out = native.paged_attention(q, kp, vp, tables, first, S,
                                     None if mask_kind is None else mask.expand(B, H, L, S),
                                     0.25, is_causal)
    assert out.shape == (B, H, L, Dv) and out.dtype == dtype
    expected = _reference(q, k, v, mask, 0.25, is_causal)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected.nan_to_num(0.0), rtol=tol, atol=tol)
    for b, n in enumerate(lengths):
        if n == 0:
            assert bool((out[b] == 0).all())


def test_paged_attention_refuses_tables_outside_the_pool() -> None:
    """A hostile block table (a page past the pool, a negative one, too few pages, a first key
    past S) is refused by name instead of reading outside the pool."""
    kp, q = torch.randn(4, 2, 4, 8), torch.randn(1, 2, 1, 8)
    good, first = torch.tensor([[1, 3]]), torch.tensor([1])
    assert native.paged_attention(q, kp, kp, good, first, 8, None, 1.0, False).shape == (
        1, 2, 1, 8)
    for tables, first_key, keys in (([[1, 4]], 1, 8), ([[-1, 0]], 1, 8), ([[1, 3]], 0, 9),
                                    ([[1, 3]], 9, 8), ([[1, 3]], -1, 8)):
        with pytest.raises(RuntimeError, match=r"tables|first"):
            native.paged_attention(q, kp, kp, torch.tensor(tables), torch.tensor([first_key]),
                                   keys, None, 1.0, False)
    with pytest.raises(RuntimeError, match="tables, first: expected contiguous int64"):
        native.paged_attention(q, kp, kp, good.int(), first, 8, None, 1.0, False)


@pytest.mark.parametrize("build", ["native", "x86-64-v3"])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 12.0, 400.0])
def test_decode_attention_softmax_over_widely_spread_scores(scale, build,
                                                           tmp_path_factory) -> None:
    """The kernel's vectorised exp over scores from ~0 down to far below expf's underflow
    (-87.3: exactly 0 weight), a vector at a time and in the tail: the formula's softmax; the
    same in a build for a CPU with AVX2 but not AVX-512 (8 lanes, 2^n without scalef)."""
    attend = (native.decode_attention if build == "native"
              else built_for(build, tmp_path_factory).decode_attention)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 1, 32, generator=g) for _ in range(3))
    k = k.expand(2, 4, 53, 32) * torch.linspace(-3, 3, 53)[:, None]
    with thread_count(2):
        out = attend(q, k, v.expand(2, 4, 53, 32), None, scale, False)
    expected = _reference(q, k, v.expand(2, 4, 53, 32), None, scale, False)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_subnormal_bfloat16_outputs_are_kept_as_pytorch_keeps_them() -> None:
    """A bfloat16 has float32's exponent range, so values below 2^-126 are subnormal numbers,
    not zero: the kernels that write bfloat16 round as c10 does (the AVX512-BF16 conversion
    instruction would flush them to zero)."""
    g = torch.Generator().manual_seed(3)
    tiny = (torch.randn(2, 3, 4, 32, generator=g) * 1e-38).to(torch.bfloat16)
    assert bool((tiny.float().abs() < torch.finfo(torch.float32).tiny).any())
    angles = torch.randn(1, 3, 32, generator=g)
    cos, sin = angles.cos(), angles.sin()
    formula = apply_rotary(tiny.clone().requires_grad_(), cos, sin).detach()
    assert bool((formula != 0).float().mean() > 0.9)
    assert torch.equal(native.rotary(tiny, cos.bfloat16(), sin.bfloat16(), False), formula)
    if native.activation_available():
        flat = tiny.reshape(-1, 32)
        assert torch.equal(native.activation(flat, None, "silu"),
                           torch.nn.functional.silu(flat))
    norm = FastRMSNorm(32, eps=1e-5).to(torch.bfloat16).eval()
    with torch.no_grad():
        norm.weight.fill_(1e-39)
    x = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    expected = norm(x.clone().requires_grad_()).detach()
    assert bool((expected != 0).any())
    assert torch.equal(native.rms_norm(x, norm.weight.detach(), 1e-5, False) != 0, expected != 0)
