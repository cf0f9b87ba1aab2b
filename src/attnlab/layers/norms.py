"""Normalisation layers: ``RMSNorm``. (LayerNorm is PyTorch's ``torch.nn.LayerNorm``.)"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab._checks import check_positive

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight`` over the last dim (Zhang & Sennrich).

    No mean subtraction and no bias. The normalisation is computed in float32, cast back to
    ``x``'s dtype, then scaled by ``weight``, as Llama does. x ``N.. x dim`` -> ``N.. x dim``;
    ``weight`` ``dim``, initialised to ones.
    ``unit_offset=True`` scales by ``1 + weight`` instead (Gemma; ``weight`` then starts at
    zeros), the product taken in float32 before the cast, as Gemma does.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False) -> None:
        super().__init__()
        check_positive("dim", dim)
        if eps <= 0:
            raise ValueError(f"eps: expected a positive float, got {eps}")
        self.dim, self.eps, self.unit_offset = dim, eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1:] != (self.dim,):
            raise ValueError(f"x: expected shape N.. x {self.dim}, got {tuple(x.shape)}")
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return (normed.to(x.dtype) * self.weight).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}" + (", unit_offset=True" if self.unit_offset else "")
