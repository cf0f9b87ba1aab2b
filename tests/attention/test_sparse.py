"""Block-sparse attention equals the math backend under the equivalent dense mask."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import MultiHeadAttention, scaled_dot_product_attention
from attnlab.attention.sparse import (
    SparseAttention,
    sliding_window_attention,
    strided_attention,
    strided_mask,
)
from attnlab.bench.harness import peak_memory
from attnlab.masks import sliding_window_mask
from conftest import assert_close

# (H, G, L, S, window, block_size): GQA, S > L (KV cache), S < L (queries with no key),
# window larger than the sequence, window 1, blocks that do not divide L.
CASES = [
    (2, 2, 10, 10, 3, None),
    (4, 2, 13, 13, 4, 3),
    (2, 1, 5, 12, 3, 2),
    (2, 2, 12, 5, 3, 4),
    (2, 2, 7, 7, 20, None),
    (3, 3, 9, 9, 1, 2),
]


def _qkv(H, G, L, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, L, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, G, S, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, G, S, 6, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


def _check_against_math(fn, mask, q, k, v):
    out = fn(q, k, v)
    ref = scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, backend="math")
    assert_close(out, ref, what="forward")
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip("qkv", got, want):
        assert_close(a, b, what=f"d{name}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_key_mask", [False, True])
def test_sliding_window_equals_math_with_mask(case, causal, with_key_mask):
    H, G, L, S, w, bs = case
    q, k, v = _qkv(H, G, L, S)
    mask = sliding_window_mask(L, S, w, causal=causal)
    km = None
    if with_key_mask:
        km = torch.rand(2, S, generator=torch.Generator().manual_seed(1)) > 0.3
        mask = mask & km[:, None, None, :]
    _check_against_math(
        lambda q, k, v: sliding_window_attention(q, k, v, w, causal=causal, block_size=bs,
                                                 key_mask=km),
        mask, q, k, v,
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_strided_equals_math_with_mask(case, causal):
    H, G, L, S, w, bs = case
    q, k, v = _qkv(H, G, L, S)
    km = torch.rand(2, S, generator=torch.Generator().manual_seed(2)) > 0.2
    mask = strided_mask(L, S, w, 3, summary=2, causal=causal) & km[:, None, None, :]
    _check_against_math(
        lambda q, k, v: strided_attention(q, k, v, w, 3, summary=2, causal=causal,
                                          block_size=bs, key_mask=km),
        mask, q, k, v,
    )


@pytest.mark.parametrize("causal", [True, False])
def test_strided_mask_is_the_documented_pattern(causal):
    L, S, w, stride, summary = 7, 11, 3, 4, 2
    mask = strided_mask(L, S, w, stride, summary=summary, causal=causal)
    for i in range(L):
        p = i + S - L
        for j in range(S):
            local = p - w < j <= p if causal else abs(j - p) < w
            summary_key = j % stride >= stride - summary and (j <= p or not causal)
            assert bool(mask[i, j]) == (local or summary_key), (i, j)


def test_leading_dims_and_float32():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 2, 50, 16, generator=g) for _ in range(3))
    out = sliding_window_attention(q, k, v, 8)
    ref = scaled_dot_product_attention(q, k, v, sliding_window_mask(50, 50, 8), backend="math")
    assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_memory_is_linear_not_quadratic():
    """L = 16384 with a dense L x L float32 matrix would need 1 GiB; the blocks need ~20 MiB."""
    L = 16384
    q, k, v = (torch.randn(1, 1, L, 8) for _ in range(3))

    def run():
        with torch.no_grad():
            sliding_window_attention(q, k, v, 16)

    peak = peak_memory(run)
    if peak is None:
        pytest.skip("peak memory is not measurable here")
    assert peak < 200 * 2**20, f"peak {peak / 2**20:.0f} MiB"


def test_module_with_wide_window_equals_multihead_attention():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4)
    x = torch.randn(2, 9, 16)
    for stride in (None, 4):
        layer = SparseAttention(16, 4, window=9, stride=stride)
        layer.load_state_dict(mha.state_dict())
        assert_close(layer(x), mha(x), rtol=1e-5, atol=1e-6)
        assert_close(layer(x, is_causal=True), mha(x, is_causal=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"window": 0}, "window"), ({"window": 2, "block_size": 0}, "block_size")],
)
def test_bad_arguments_name_themselves(kwargs, match):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=match):
        sliding_window_attention(q, q, q, **kwargs)


def test_bad_shapes_and_strides():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="key"):
        sliding_window_attention(q, torch.randn(1, 2, 4, 7), q, 2)
    with pytest.raises(ValueError, match="key_mask"):
        sliding_window_attention(q, q, q, 2, key_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="summary"):
        strided_attention(q, q, q, 2, 3, summary=4)
    with pytest.raises(ValueError, match="stride"):
        strided_attention(q, q, q, 2, 0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]])
def test_one_block_per_chunk_gives_the_same_result(case, causal, monkeypatch):
    # Long inputs are processed a few query blocks at a time; force one block per chunk.
    from attnlab.attention import sparse

    monkeypatch.setattr(sparse, "_CHUNK_BYTES", 1)
    H, G, L, S, w, bs = case
    q, k, v = _qkv(H, G, L, S)
    km = torch.rand(2, S, generator=torch.Generator().manual_seed(4)) > 0.3
    mask = sliding_window_mask(L, S, w, causal=causal) & km[:, None, None, :]
    _check_against_math(
        lambda q, k, v: sliding_window_attention(q, k, v, w, causal=causal, block_size=bs,
                                                 key_mask=km),
        mask, q, k, v,
    )
    mask = strided_mask(L, S, w, 3, summary=2, causal=causal) & km[:, None, None, :]
    _check_against_math(
        lambda q, k, v: strided_attention(q, k, v, w, 3, summary=2, causal=causal,
                                          block_size=bs, key_mask=km),
        mask, q, k, v,
    )
