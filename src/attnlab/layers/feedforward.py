"""Position-wise feed-forward networks: ``FeedForward`` (two layers) and ``GatedMLP``
(SwiGLU, GeGLU).

Both map ``N.. x E`` -> ``N.. x E`` and act on every position independently. They call their
``nn.Linear`` submodules, so a hook, a LoRA wrapper or a quantized Linear swapped in for one
of them takes effect. (``attnlab.kernels.FastGatedMLP`` and ``FastFeedForward``, installed
by ``optimize_for_inference``, compute the activation in one C++ pass for inference.)
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["ACTIVATIONS", "FeedForward", "GatedMLP", "SwiGLU", "activated"]

# "gelu" is exact (erf); "gelu_tanh" is the tanh approximation (GPT-2's gelu_new, Gemma's
# gelu_pytorch_tanh).
ACTIVATIONS = {
    "relu": nn.functional.relu,
    "gelu": nn.functional.gelu,
    "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "silu": nn.functional.silu,
}


class FeedForward(nn.Module):
    """``FFN(x) = W_2 dropout(act(W_1 x + b_1)) + b_2``, ``act`` one of ``ACTIVATIONS``.

    ``linear1``: ``d_ff x E``, ``linear2``: ``E x d_ff`` (the names of
    ``torch.nn.TransformerEncoderLayer``, so weights copy across by name).
    x ``N.. x E`` -> ``N.. x E``.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0,
                 bias: bool = True) -> None:
        super().__init__()
        _check_activation(activation)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: expected a float in [0, 1), got {dropout}")
        self.activation, self.dropout = activation, dropout
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        h = activated(self.activation, self.linear1(x))
        if self.dropout:
            h = nn.functional.dropout(h, self.dropout, self.training)
        return self.linear2(h)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, dropout={self.dropout}"


class GatedMLP(nn.Module):
    """``GLU(x) = W_down (act(W_gate x) * W_up x)`` (Shazeer 2020): SwiGLU with ``silu``
    (Llama, Qwen, Mistral, Phi-3), GeGLU with ``gelu_tanh`` (Gemma).

    ``gate_proj``, ``up_proj``: ``d_ff x E``; ``down_proj``: ``E x d_ff`` (Llama/Qwen names),
    no biases by default. x ``N.. x E`` -> ``N.. x E``.
    """

    def __init__(self, d_model: int, d_ff: int, bias: bool = False,
                 activation: str = "silu") -> None:
        super().__init__()
        _check_activation(activation)
        self.activation = activation
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(activated(self.activation, self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class SwiGLU(GatedMLP):
    """``SwiGLU(x) = W_down (silu(W_gate x) * W_up x)``, ``silu(z) = z * sigmoid(z)``: the
    ``GatedMLP`` with ``silu``. x ``N.. x E`` -> ``N.. x E``."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False) -> None:
        super().__init__(d_model, d_ff, bias=bias, activation="silu")


def activated(name: str, gate: Tensor, up: Tensor | None = None) -> Tensor:
    """``ACTIVATIONS[name](gate)``, times ``up`` when given (``up`` gate's shape)."""
    h = ACTIVATIONS[name](gate)
    return h if up is None else h * up


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {tuple(ACTIVATIONS)}, got {activation!r}")
