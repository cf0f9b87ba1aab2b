"""Position information: sinusoidal encodings, learned embeddings and rotary embeddings (RoPE).

Every module takes the positions of its ``L`` inputs as ``offset``:

- ``None``: positions ``0 .. L-1``;
- an ``int`` ``o``: positions ``o .. o+L-1`` (the first position; a KV cache's length);
- a ``slice``: the positions it selects (``slice(o, o + L)``, as tiny-llm does);
- an integer ``Tensor`` of positions, ``L`` or ``B x L`` (one row per sequence, e.g. for
  left-padded batches where each row starts at its own position).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnlab._checks import check_positive
from attnlab.layers import initialisation

__all__ = [
    "LearnedPositionalEmbedding",
    "RoPE",
    "SinusoidalPositionalEncoding",
    "positions_from_offset",
]

Offset = int | slice | Tensor | None


class SinusoidalPositionalEncoding(nn.Module):
    """``x + PE[positions]``, then dropout ("Attention Is All You Need", section 3.5).

    ``PE[p, 2i] = sin(p / base^(2i/E))`` and ``PE[p, 2i+1] = cos(p / base^(2i/E))``.
    x ``B x L x E`` (or ``L x E``) -> same shape. No parameters; ``pe`` is a buffer
    ``max_len x E``.
    """

    def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.0,
                 base: float = 10000.0) -> None:
        super().__init__()
        check_positive("d_model", d_model)
        check_positive("max_len", max_len)
        _check_dropout(dropout)
        self.d_model, self.max_len, self.dropout = d_model, max_len, dropout
        # On the CPU even inside `torch.device("meta")`: a model built there and then loaded
        # (attnlab.models.streaming) keeps this computed table, which no checkpoint holds.
        cpu = torch.device("cpu")
        position = torch.arange(max_len, dtype=torch.float64, device=cpu).unsqueeze(1)
        two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=cpu)
        div = torch.exp(two_i * (-math.log(base) / d_model))
        pe = torch.zeros(max_len, d_model, dtype=torch.float64, device=cpu)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div[: d_model // 2])
        self.register_buffer("pe", pe.float(), persistent=False)

    def forward(self, x: Tensor, offset: Offset = None) -> Tensor:
        """x ``N.. x L x E`` -> ``dropout(x + PE[positions])``, positions from ``offset``."""
        _check_last_dim("x", x, self.d_model)
        pos = positions_from_offset(offset, x.shape[-2], self.max_len, x.device)
        out = x + self.pe[pos].to(x.dtype)
        return nn.functional.dropout(out, self.dropout, self.training) if self.dropout else out

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}, dropout={self.dropout}"


class LearnedPositionalEmbedding(nn.Module):
    """``x + W[positions]`` with a trained table ``W`` (``max_len x E``, GPT-2 style), then dropout.

    x ``N.. x L x E`` -> same shape. ``W`` starts as ``N(0, 0.02^2)``.
    """

    def __init__(self, max_len: int, d_model: int, dropout: float = 0.0) -> None:
        super().__init__()
        check_positive("max_len", max_len)
        check_positive("d_model", d_model)
        _check_dropout(dropout)
        self.max_len, self.d_model, self.dropout = max_len, d_model, dropout
        self.weight = nn.Parameter(torch.empty(max_len, d_model))
        initialisation.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, offset: Offset = None) -> Tensor:
        """x ``N.. x L x E`` -> ``dropout(x + W[positions])``, positions from ``offset``."""
        _check_last_dim("x", x, self.d_model)
        pos = positions_from_offset(offset, x.shape[-2], self.max_len, x.device)
        out = x + self.weight[pos].to(x.dtype)
        return nn.functional.dropout(out, self.dropout, self.training) if self.dropout else out

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, d_model={self.d_model}, dropout={self.dropout}"


class RoPE(nn.Module):
    """Rotary position embedding (Su et al., 2021) for ``x`` of shape ``N.. x L x H x D``.

    Feature pairs ``(a_i, b_i)``, ``i < D/2``, at position ``p`` are rotated by the angle
    ``p * theta_i`` with ``theta_i = base^(-2i/D)``:
    ``(a, b) -> (a cos - b sin, a sin + b cos)``, i.e. ``(a + ib) * e^(i p theta_i)``.

    - ``traditional=True``: pairs are interleaved, ``(x[2i], x[2i+1])`` (the paper, GPT-J);
    - ``traditional=False``: pairs are the two halves, ``(x[i], x[i + D/2])`` (Llama, Qwen).

    The layout is the one of projected heads before the head transpose, ``B x L x H x D``
    (for ``B x H x L x D`` tensors, transpose dims -2 and -3 first). Called as
    ``rope(x, offset=None)``, see the module docstring for ``offset``. Returns ``x``'s shape
    and dtype; the angles are computed in float64 and kept as float32 ``cos``/``sin`` buffers
    ``max_len x D/2`` (Hugging Face computes them in float32: differences of ~1e-7).
    """

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0,
                 traditional: bool = False) -> None:
        super().__init__()
        check_positive("head_dim", head_dim)
        check_positive("max_len", max_len)
        if head_dim % 2:
            raise ValueError(f"head_dim: expected an even int, got {head_dim}")
        if base <= 0:
            raise ValueError(f"base: expected a positive number, got {base}")
        self.head_dim, self.max_len = head_dim, max_len
        self.base, self.traditional = base, traditional
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(max_len, dtype=torch.float64).unsqueeze(1) * inv_freq
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor, offset: Offset = None) -> Tensor:
        """x ``N.. x L x H x D`` -> the rotated ``x``, same shape."""
        if x.dim() < 3 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x: expected shape N.. x L x H x {self.head_dim}, got {tuple(x.shape)}"
            )
        pos = positions_from_offset(offset, x.shape[-3], self.max_len, x.device)
        # cos/sin: (L or B x L) x D/2 -> ... x L x 1 x D/2, broadcast over the heads.
        cos = self.cos[pos].unsqueeze(-2).to(x.dtype)
        sin = self.sin[pos].unsqueeze(-2).to(x.dtype)
        if self.traditional:
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        half = self.head_dim // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, max_len={self.max_len}, base={self.base}, "
                f"traditional={self.traditional}")


def positions_from_offset(offset: Offset, length: int, max_len: int,
                          device: torch.device | str | None = None) -> Tensor:
    """The positions of ``length`` inputs described by ``offset`` (see the module docstring).

    Returns a long tensor ``L`` (``B x L`` for a 2-D tensor ``offset``); raises a ``ValueError``
    when a position falls outside ``[0, max_len)`` or a slice does not select ``length``.
    """
    if offset is None:
        offset = 0
    if isinstance(offset, bool):
        raise TypeError(f"offset: expected an int, slice, Tensor or None, got {offset!r}")
    if isinstance(offset, int):
        if offset == 0 and length > max_len:  # the input is too long, whatever the offset
            raise ValueError(f"x: expected a length of at most max_len={max_len} positions, "
                             f"got {length}")
        if offset < 0 or offset + length > max_len:
            raise ValueError(
                f"offset: positions {offset} .. {offset + length - 1} must lie in [0, {max_len}) "
                f"(max_len={max_len}), got offset={offset} for length {length}"
            )
        return torch.arange(offset, offset + length, device=device)
    if isinstance(offset, slice):
        pos = range(max_len + 1)[offset]  # +1 so that an overflowing slice is reported
        if len(pos) != length:
            raise ValueError(f"offset: expected a slice of {length} positions, got {offset} "
                             f"selecting {len(pos)}")
        if len(pos) and max(pos) >= max_len:
            raise ValueError(f"offset: positions must lie in [0, {max_len}), got {offset}")
        return torch.tensor(list(pos), dtype=torch.long, device=device)
    if isinstance(offset, Tensor):
        if offset.is_floating_point() or offset.dim() not in (1, 2) or offset.shape[-1] != length:
            raise ValueError(f"offset: expected integer positions of shape L or B x L with "
                             f"L={length}, got {tuple(offset.shape)} ({offset.dtype})")
        if offset.numel() and (int(offset.min()) < 0 or int(offset.max()) >= max_len):
            raise ValueError(f"offset: positions must lie in [0, {max_len}), got min "
                             f"{int(offset.min())} and max {int(offset.max())}")
        return offset.to(device=device, dtype=torch.long)
    raise TypeError(f"offset: expected an int, slice, Tensor or None, got {type(offset).__name__}")


def _check_dropout(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: expected a float in [0, 1), got {p}")


def _check_last_dim(name: str, x: Tensor, dim: int) -> None:
    if x.dim() < 2 or x.shape[-1] != dim:
        raise ValueError(f"{name}: expected shape N.. x L x {dim}, got {tuple(x.shape)}")
