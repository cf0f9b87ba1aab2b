"""RoPE against a rotation written with complex numbers, and its offsets."""

from __future__ import annotations

import pytest
import torch

from attnlab.layers import RoPE
from conftest import assert_close


def complex_rope(x: torch.Tensor, positions: torch.Tensor, base: float, traditional: bool):
    """Reference: pairs as complex numbers z = a + ib, rotated as z * exp(i p theta_j)."""
    D = x.shape[-1]
    x = x.double()
    if traditional:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : D // 2], x[..., D // 2:]
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = positions.double()[..., None] * theta  # (.. x L) x D/2
    z = torch.complex(a, b) * torch.polar(torch.ones_like(angle), angle).unsqueeze(-2)
    if traditional:
        return torch.stack((z.real, z.imag), dim=-1).flatten(-2).float()
    return torch.cat((z.real, z.imag), dim=-1).float()


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_rope_matches_complex_reference(traditional: bool, base: float) -> None:
    torch.manual_seed(0)
    B, L, H, D = 2, 7, 3, 16
    x = torch.randn(B, L, H, D)
    rope = RoPE(D, max_len=32, base=base, traditional=traditional)
    assert_close(rope(x), complex_rope(x, torch.arange(L), base, traditional), atol=1e-5)


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_offsets_int_slice_tensor(traditional: bool) -> None:
    torch.manual_seed(1)
    B, L, H, D = 2, 4, 2, 8
    x = torch.randn(B, L, H, D)
    rope = RoPE(D, max_len=20, traditional=traditional)
    expected = complex_rope(x, torch.arange(5, 5 + L), 10000.0, traditional)
    assert_close(rope(x, offset=5), expected, atol=1e-5)
    assert_close(rope(x, offset=slice(5, 9)), expected, atol=1e-5)
    assert_close(rope(x, offset=torch.arange(5, 9)), expected, atol=1e-5)
    # Per-row positions (left padding): each row has its own start.
    pos = torch.tensor([[0, 1, 2, 3], [6, 7, 8, 9]])
    assert_close(rope(x, offset=pos), complex_rope(x, pos, 10000.0, traditional), atol=1e-5)
    # The rotation with an offset equals the tail of the rotation of a longer sequence.
    long = torch.randn(B, 9, H, D)
    assert_close(rope(long[:, 5:], offset=5), rope(long)[:, 5:])


def test_rope_preserves_norm_and_relative_scores() -> None:
    torch.manual_seed(2)
    rope = RoPE(8, max_len=64)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    assert_close(rope(q, offset=9).norm(), q.norm(), atol=1e-5)
    # <R_m q, R_n k> depends only on m - n.
    s1 = (rope(q, offset=10) * rope(k, offset=3)).sum()
    s2 = (rope(q, offset=30) * rope(k, offset=23)).sum()
    assert_close(s1, s2, atol=1e-5)


def test_rope_bad_input() -> None:
    rope = RoPE(8, max_len=10)
    with pytest.raises(ValueError, match="head_dim"):
        RoPE(7, max_len=10)
    with pytest.raises(ValueError, match="x: expected shape"):
        rope(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="offset"):
        rope(torch.randn(1, 4, 1, 8), offset=8)
    with pytest.raises(ValueError, match="offset"):
        rope(torch.randn(1, 4, 1, 8), offset=slice(0, 3))
    with pytest.raises(ValueError, match="offset"):
        rope(torch.randn(1, 4, 1, 8), offset=-1)
