"""FeedForward, SwiGLU and RMSNorm against their formulas."""

from __future__ import annotations

import pytest
import torch

from attnlab.layers import FeedForward, RMSNorm, SwiGLU
from conftest import assert_close


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_feedforward_formula(activation: str) -> None:
    torch.manual_seed(0)
    ffn = FeedForward(8, 16, activation=activation)
    x = torch.randn(2, 3, 8)
    h = x @ ffn.linear1.weight.T + ffn.linear1.bias
    h = torch.relu(h) if activation == "relu" else 0.5 * h * (1 + torch.erf(h / 2**0.5))
    assert_close(ffn(x), h @ ffn.linear2.weight.T + ffn.linear2.bias, atol=1e-6)


def test_swiglu_formula() -> None:
    torch.manual_seed(0)
    mlp = SwiGLU(8, 12)
    x = torch.randn(2, 3, 8)
    g = x @ mlp.gate_proj.weight.T
    expected = (g * torch.sigmoid(g) * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    assert_close(mlp(x), expected, atol=1e-6)
    assert mlp.gate_proj.bias is None


def test_rmsnorm_formula_and_dtype() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(6, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 6)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert_close(norm(x), expected)
    assert norm(x.bfloat16()).dtype == torch.bfloat16


def test_ffn_norm_bad_input() -> None:
    with pytest.raises(ValueError, match="activation"):
        FeedForward(4, 8, activation="tanh")
    with pytest.raises(ValueError, match="x: expected shape"):
        RMSNorm(4)(torch.randn(2, 5))
    with pytest.raises(ValueError, match="dim"):
        RMSNorm(0)
