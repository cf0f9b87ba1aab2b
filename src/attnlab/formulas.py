"""The formulas at the bottom of the package: ``linear``, ``softmax`` and ``apply_rotary``
(RoPE's rotation; ``attnlab.layers.rotary`` makes its cos and sin).

These are the lowest layer (everything else may import them; they import nothing of
attnlab's but ``_checks``). :mod:`attnlab.functional` is the public namespace that gathers
them with ``scaled_dot_product_attention``, as ``torch.nn.functional`` does.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_rotary", "linear", "softmax"]


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


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """Rotate the first ``R`` features of each head of ``x`` by cos/sin; pass the rest through.

    x ``B x L x H x D`` (heads before the head transpose), cos and sin ``B x L x R`` or
    ``1 x L x R`` from ``RotaryEmbedding`` (``R <= D``, even) -> x's shape and dtype:
    ``x_rot * cos + rotate(x_rot) * sin`` with ``rotate`` the pair turn ``(a, b) -> (-b, a)``
    of the layout (``interleaved`` must match the module's). As transformers does, cos and sin
    are cast to x's dtype first, so half-precision results match its own; a model that is not
    float32 casts them once per forward (``cos.to(dtype)``) rather than in every layer.
    """
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"x: expected a Tensor of shape B x L x H x D, got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: expected a Tensor of shape B x L x R, got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point Tensor, got {x.dtype}")
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"cos, sin: expected x's device {x.device}, got {cos.device} and "
                         f"{sin.device}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin: expected cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    batch, length, _, dim = x.shape
    rows, cos_len, rotary_dim = cos.shape
    if rows not in (1, batch) or cos_len != length or rotary_dim % 2 or rotary_dim > dim:
        raise ValueError(f"cos: expected shape ({batch} or 1) x {length} x R with R even and "
                         f"<= {dim} (x is {tuple(x.shape)}), got {tuple(cos.shape)}")
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # B x L x 1 x R: the same for every head
    rot = x if rotary_dim == dim else x[..., :rotary_dim]
    turned = _rotate_pairs(rot) if interleaved else _rotate_half(rot)
    out = rot * cos + turned * sin
    return out if rotary_dim == dim else torch.cat((out, x[..., rotary_dim:]), dim=-1)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: Tensor) -> Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
