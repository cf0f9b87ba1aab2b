"""Tutorial 4, position encodings: the exercises.

Fill in each function, then run ``attnlab exercises check 4`` (or ``pytest exercises/``).
"""

from __future__ import annotations

# --8<-- [start:imports]
import math

import torch
from torch import Tensor

# --8<-- [end:imports]

EXERCISES = {
    "4.1": "shift_matrix",
    "4.2": "uniform_causal_attention",
    "4.3": "complex_rope",
    "4.4": "pairs_under_one_turn",
}


# --8<-- [start:shift_matrix]
def shift_matrix(k: int, E: int, base: float = 10000.0) -> Tensor:
    """The ``E x E`` float64 matrix M_k with PE[p + k] = M_k PE[p] for the sinusoidal encoding
    (PE[p, 2i] = sin(p w_i), PE[p, 2i + 1] = cos(p w_i), w_i = base^(-2i/E)): block diagonal,
    one 2 x 2 rotation by k w_i per pair."""
    M = torch.zeros(E, E, dtype=torch.float64)
    for i in range(0, E, 2):
        w = k / base ** (i / E)
        c, s = math.cos(w), math.sin(w)
        M[i, i], M[i, i + 1] = c, s           # sin(a + b) = sin a cos b + cos a sin b
        M[i + 1, i], M[i + 1, i + 1] = -s, c  # cos(a + b) = cos a cos b - sin a sin b
    return M
# --8<-- [end:shift_matrix]


# --8<-- [start:uniform_causal_attention]
def uniform_causal_attention(x: Tensor) -> Tensor:
    """Causal attention whose scores are all equal (W_q = W_k = 0) and whose values are the
    inputs: query i averages the inputs 0..i. x ``N.. x L x E`` -> ``N.. x L x E``."""
    counts = torch.arange(1, x.shape[-2] + 1, dtype=x.dtype)[:, None]
    return x.cumsum(dim=-2) / counts
# --8<-- [end:uniform_causal_attention]


# --8<-- [start:complex_rope]
def complex_rope(x: Tensor, base: float = 10000.0) -> Tensor:
    """Interleaved RoPE with complex numbers: x ``B x L x H x D`` at positions 0..L-1; the
    pair (x[2i], x[2i+1]) read as x[2i] + i x[2i+1] is multiplied by e^(i m theta_i),
    theta_i = base^(-2i/D). Float32 result of x's shape."""
    L, D = x.shape[-3], x.shape[-1]
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)     # D/2
    angles = torch.arange(L, dtype=torch.float64)[:, None] * theta        # L x D/2
    turn = torch.polar(torch.ones_like(angles), angles)[:, None, :]       # L x 1 x D/2
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], D // 2, 2))
    return torch.view_as_real(z * turn).flatten(-2).float()
# --8<-- [end:complex_rope]


# --8<-- [start:pairs_under_one_turn]
def pairs_under_one_turn(head_dim: int, base: float, context: int) -> int:
    """How many of the ``head_dim / 2`` rotary pairs (theta_i = base^(-2i/head_dim)) turn less
    than once (2 pi) over ``context`` positions."""
    theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return int((context * theta / (2 * math.pi) < 1).sum())
# --8<-- [end:pairs_under_one_turn]
