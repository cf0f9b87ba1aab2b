"""Performer (FAVOR+): the algebra of its estimate, its causal prefix form, and the layer."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.attention import MultiHeadAttention, scaled_dot_product_attention
from attnlab.attention.performer import (
    PerformerAttention,
    favor_attention,
    orthogonal_random_features,
    positive_random_features,
)
from conftest import assert_close


def _qkv(L=32, D=16, H=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = 0.5 * torch.randn(1, H, L, D, generator=g, dtype=torch.float64)
    k = 0.5 * torch.randn(1, H, L, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, H, L, D, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_estimate_converges_to_softmax_attention(causal):
    """Relative error, averaged over 4 fixed feature seeds, falls as m grows (~ 1/sqrt(m))."""
    q, k, v = _qkv()
    exact = scaled_dot_product_attention(q, k, v, is_causal=causal, backend="math")
    errors = []
    for m in (16, 256, 4096):
        err = 0.0
        for seed in range(4):
            w = orthogonal_random_features(m, 16, generator=torch.Generator().manual_seed(seed),
                                           dtype=torch.float64)
            out = favor_attention(q, k, v, w, causal=causal)
            err += ((out - exact).norm() / exact.norm()).item() / 4
        errors.append(err)
    assert errors[0] > errors[1] > errors[2], errors
    assert errors[2] < errors[0] / 4, errors
    assert errors[2] < 0.06, errors


def test_features_estimate_the_softmax_kernel_without_bias():
    """E[phi(x) . phi(y)] = exp(x . y): the mean over many draws approaches the kernel."""
    g = torch.Generator().manual_seed(0)
    x, y = 0.3 * torch.randn(5, 8, generator=g, dtype=torch.float64), \
        0.3 * torch.randn(6, 8, generator=g, dtype=torch.float64)
    w = orthogonal_random_features(8 * 4000, 8, generator=g, dtype=torch.float64)
    m = w.shape[0]
    phi_x = torch.exp(x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True)) / math.sqrt(m)
    phi_y = torch.exp(y @ w.T - 0.5 * (y * y).sum(-1, keepdim=True)) / math.sqrt(m)
    assert_close(phi_x @ phi_y.T, torch.exp(x @ y.T), rtol=6e-2, atol=0)


def test_orthogonal_blocks():
    w = orthogonal_random_features(20, 8, generator=torch.Generator().manual_seed(0),
                                   dtype=torch.float64)
    assert w.shape == (20, 8)
    for block in (w[:8], w[8:16]):
        unit = block / block.norm(dim=1, keepdim=True)
        assert_close(unit @ unit.T, torch.eye(8, dtype=torch.float64), rtol=0, atol=1e-12)


def test_causal_form_equals_a_loop_over_prefixes():
    q, k, v = _qkv(L=23)
    w = orthogonal_random_features(24, 16, generator=torch.Generator().manual_seed(1),
                                   dtype=torch.float64)
    out = favor_attention(q, k, v, w, causal=True, chunk_size=5)
    root = 16 ** -0.25
    pq = positive_random_features(q * root, w, is_query=True)
    pk = positive_random_features(k * root, w, is_query=False)
    state = torch.zeros(1, 4, 24, 16, dtype=torch.float64)
    norm = torch.zeros(1, 4, 24, dtype=torch.float64)
    rows = []
    for i in range(23):
        state = state + pk[:, :, i, :, None] * v[:, :, i, None, :]
        norm = norm + pk[:, :, i]
        num = (pq[:, :, i, :, None] * state).sum(-2)
        rows.append(num / (pq[:, :, i] * norm).sum(-1, keepdim=True))
    assert_close(out, torch.stack(rows, dim=2))


def test_non_causal_form_equals_normalised_feature_matrix():
    q, k, v = _qkv(L=12)
    w = orthogonal_random_features(32, 16, dtype=torch.float64)
    km = torch.tensor([[True] * 9 + [False] * 3])
    out = favor_attention(q, k, v, w, key_mask=km)
    root = 16 ** -0.25
    a = positive_random_features(q * root, w, is_query=True) @ \
        positive_random_features(k * root, w, is_query=False).transpose(-1, -2)
    a = a * km[:, None, None, :]
    assert_close(out, (a / a.sum(-1, keepdim=True)) @ v)


def test_gradients_are_finite_and_match_float64_finite_differences():
    q, k, v = (t[:, :1, :6, :4].clone().requires_grad_() for t in _qkv(D=4))
    w = orthogonal_random_features(8, 4, dtype=torch.float64)
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda q, k, v, c=causal: favor_attention(q, k, v, w, causal=c, chunk_size=4),
            (q, k, v),
        )


def test_layer_is_a_drop_in_and_deterministic():
    torch.manual_seed(0)
    a = PerformerAttention(32, 4, num_features=64)
    torch.manual_seed(0)
    b = PerformerAttention(32, 4, num_features=64)
    assert torch.equal(a.features, b.features)
    mha = MultiHeadAttention(32, 4)
    assert not a.load_state_dict(mha.state_dict(), strict=False).unexpected_keys
    x = torch.randn(2, 10, 32)
    assert a(x).shape == (2, 10, 32)
    assert a(x, is_causal=True).shape == (2, 10, 32)
    before = a.features.clone()
    a.redraw_features(torch.Generator().manual_seed(5))
    assert not torch.equal(before, a.features)


def test_bad_inputs_raise():
    q = torch.randn(1, 2, 4, 8)
    w = orthogonal_random_features(16, 8)
    with pytest.raises(ValueError, match="features"):
        favor_attention(q, q, q, torch.randn(16, 7))
    with pytest.raises(ValueError, match="S == L"):
        favor_attention(q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), w, causal=True)
    with pytest.raises(ValueError, match="num_features"):
        orthogonal_random_features(0, 8)
