"""The formulas at the bottom of the package: ``linear`` and ``softmax``.

These are the lowest layer (everything else may import them; they import nothing of
attnlab's but ``_checks``). :mod:`attnlab.functional` is the public namespace that gathers
them with ``scaled_dot_product_attention``, as ``torch.nn.functional`` does.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["linear", "softmax"]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``y = x W^T + b``.

    x ``N.. x I``, weight ``O x I`` (stored ``out x in`` like ``torch.nn.Linear``),
    bias ``O`` -> ``N.. x O``.
    """
    if x.shape[-1:] != weight.shape[-1:] or weight.dim() != 2:
        raise ValueError(
            f"weight: expected shape O x {x.shape[-1] if x.dim() else '?'} to match x's last "
            f"dim, got {tuple(weight.shape)} for x of shape {tuple(x.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    flat = x.reshape(-1, x.shape[-1])
    # addmm folds the bias into the GEMM: one pass over the output instead of two.
    y = torch.addmm(bias, flat, weight.t()) if bias is not None else flat.matmul(weight.t())
    return y.view(*x.shape[:-1], weight.shape[0])


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """``softmax(x)_i = exp(x_i - max x) / sum_j exp(x_j - max x)`` along ``dim``.

    Subtracting the max keeps ``exp`` from overflowing. A slice that is all ``-inf`` (nothing
    to attend to) gives zeros, not NaN. Any shape.
    """
    if x.shape[dim] == 0:
        return x.clone()
    # The max only stabilises: softmax is shift-invariant, so it needs no gradient.
    m = x.detach().amax(dim=dim, keepdim=True)
    m = m.masked_fill(m == float("-inf"), 0.0)
    e = torch.exp(x - m)
    total = e.sum(dim=dim, keepdim=True)
    # total >= 1 whenever one entry is finite (the max contributes exp(0)); 0 means all -inf.
    return e / total.masked_fill(total == 0, 1.0)
