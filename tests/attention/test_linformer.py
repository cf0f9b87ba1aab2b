"""Linformer: with P = S and identity projections it is full attention; the layer is a drop-in."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import MultiHeadAttention, scaled_dot_product_attention
from attnlab.attention.linformer import (
    LinformerAttention,
    linformer_attention,
    mean_pooling_projection,
)
from conftest import assert_close


def test_identity_projections_equal_full_attention_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    eye = torch.eye(9, dtype=torch.float64)
    out = linformer_attention(q, k, v, eye, eye)
    ref = scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="math")
    assert_close(out, ref)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad),
                    torch.autograd.grad(ref, (q, k, v), grad)):
        assert_close(a, b)


def test_projection_is_the_formula():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    e, f = (torch.randn(3, 6, generator=g, dtype=torch.float64) for _ in range(2))
    scores = q @ (e @ k).transpose(-1, -2) / 2.0
    assert_close(linformer_attention(q, k, v, e, f), torch.softmax(scores, -1) @ (f @ v))


def test_layer_with_identity_projections_equals_multihead_attention():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4)
    layer = LinformerAttention(16, 4, max_len=12, proj_len=12)
    missing = layer.load_state_dict(mha.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["e_proj", "f_proj"]
    with torch.no_grad():
        layer.e_proj.copy_(torch.eye(12))
        layer.f_proj.copy_(torch.eye(12))
    x = torch.randn(2, 12, 16)
    assert_close(layer(x), mha(x), rtol=1e-5, atol=1e-6)
    # A shorter input uses the first S columns: with identity those are the first S rows too,
    # plus zero rows; P = S still gives full attention only when the rows match, so only shape.
    assert layer(x[:, :5]).shape == (2, 5, 16)


def test_padding_content_does_not_matter():
    torch.manual_seed(0)
    layer = LinformerAttention(16, 2, max_len=10, proj_len=4, share_kv=True)
    x = torch.randn(1, 10, 16)
    y = x.clone()
    y[:, 7:] = torch.randn(1, 3, 16)
    km = torch.tensor([[True] * 7 + [False] * 3])
    assert_close(layer(x, x, x, key_mask=km)[:, :7], layer(x, y, y, key_mask=km)[:, :7],
                 rtol=1e-5, atol=1e-6)
    assert layer.f_proj is None


def test_errors_name_the_argument():
    layer = LinformerAttention(16, 2, max_len=8, proj_len=4)
    with pytest.raises(ValueError, match="is_causal"):
        layer(torch.randn(1, 8, 16), is_causal=True)
    with pytest.raises(ValueError, match="max_len"):
        layer(torch.randn(1, 9, 16))
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="e_proj"):
        linformer_attention(q, q, q, torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="proj_len"):
        LinformerAttention(16, 2, max_len=8, proj_len=0)


def test_mean_pooling_projection():
    e = mean_pooling_projection(3, 7)
    assert_close(e.sum(-1), torch.ones(3))
    assert e.shape == (3, 7) and bool((e > 0).sum(0).eq(1).all())
    assert_close(mean_pooling_projection(5, 5), torch.eye(5))
    with pytest.raises(ValueError, match="proj_len"):
        mean_pooling_projection(8, 5)
