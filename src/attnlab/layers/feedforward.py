"""Position-wise feed-forward networks: ``FeedForward`` (ReLU/GELU) and ``SwiGLU``.

Both map ``N.. x E`` -> ``N.. x E`` and act on every position independently.
"""

from __future__ import annotations

from torch import Tensor, nn

from attnlab.functional import linear

__all__ = ["FeedForward", "SwiGLU"]

_ACTIVATIONS = {"relu": nn.functional.relu, "gelu": nn.functional.gelu}


class FeedForward(nn.Module):
    """``FFN(x) = W_2 dropout(act(W_1 x + b_1)) + b_2`` with ``act`` ReLU or GELU (exact, erf).

    ``linear1``: ``d_ff x E``, ``linear2``: ``E x d_ff`` (the names of
    ``torch.nn.TransformerEncoderLayer``, so weights copy across by name).
    x ``N.. x E`` -> ``N.. x E``.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0,
                 bias: bool = True) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation: expected one of {tuple(_ACTIVATIONS)}, got {activation!r}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: expected a float in [0, 1), got {dropout}")
        self.activation, self.dropout = activation, dropout
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        h = _ACTIVATIONS[self.activation](linear(x, self.linear1.weight, self.linear1.bias))
        if self.dropout:
            h = nn.functional.dropout(h, self.dropout, self.training)
        return linear(h, self.linear2.weight, self.linear2.bias)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, dropout={self.dropout}"


class SwiGLU(nn.Module):
    """``SwiGLU(x) = W_down (silu(W_gate x) * W_up x)`` (Shazeer 2020; Llama's MLP).

    ``silu(z) = z * sigmoid(z)``. ``gate_proj``, ``up_proj``: ``d_ff x E``; ``down_proj``:
    ``E x d_ff`` (Llama/Qwen names), no biases by default. x ``N.. x E`` -> ``N.. x E``.
    """

    def __init__(self, d_model: int, d_ff: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gate = nn.functional.silu(linear(x, self.gate_proj.weight, self.gate_proj.bias))
        up = linear(x, self.up_proj.weight, self.up_proj.bias)
        return linear(gate * up, self.down_proj.weight, self.down_proj.bias)
