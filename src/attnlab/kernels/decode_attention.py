"""Attention of a decoding step's few queries through attnlab's C++ kernel
(``attnlab.kernels.native.decode_attention``, and ``paged_attention`` for keys kept in a
serving engine's pages): the formula of ``attnlab.attention.scaled_dot_product_attention``
(scores, softmax and sums in float32), with none of the set-up that PyTorch's fused kernel
spends on tiles for so few queries.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnlab.kernels import native

__all__ = ["native_attention", "native_decoding", "paged_native_attention", "paged_native_part"]


def native_decoding(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                    dropout_p: float = 0.0, *, keys: int | None = None) -> bool:
    """Whether the kernel computes this call: query ``B x H x L x D`` with ``L`` at most
    ``native.MAX_ROWS`` (a decoding step), key and value ``B x G x S x D`` (``G`` dividing
    ``H``), a mask (bool or float) broadcasting to ``B x H x L x keys`` (``keys`` default
    ``S``; a paged cache attends over more keys than the new ones) or None, float32 or
    bfloat16 on the CPU, no dropout, no gradient needed, the kernels built."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or dropout_p > 0:
        return False
    B, H, L, D = query.shape
    if L > native.MAX_ROWS or key.shape != value.shape or key.shape[-1] != D:
        return False
    if key.shape[0] not in (1, B) or H % key.shape[1]:
        return False
    if mask is not None:
        if mask.dim() > 4 or not (mask.dtype == torch.bool or mask.is_floating_point()):
            return False
        wanted = (B, H, L, key.shape[-2] if keys is None else keys)[4 - mask.dim():]
        if any(m not in (1, w) for m, w in zip(mask.shape, wanted)):
            return False
        if mask.requires_grad and torch.is_grad_enabled():
            return False
    return native.takes(query, key, value)


def native_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, *,
                     is_causal: bool, scale: float | None = None) -> Tensor:
    """``softmax(Q K^T * scale + mask) V`` for the inputs ``native_decoding`` accepts ->
    ``B x H x L x D``; ``is_causal`` the bottom-right causal mask; ``scale`` None: ``1 /
    sqrt(D)``. Key/value rows that broadcast become stride-0 views."""
    B = query.shape[0]
    key, value = (t.expand(B, -1, -1, -1) for t in (key, value))
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
    query, mask = _native_query_mask(query, mask, key.shape[-2])
    return native.decode_attention(query, key, value, mask, _scale(query, scale), is_causal)


def paged_native_attention(query: Tensor, key_pages: Tensor, value_pages: Tensor,
                           tables: Tensor, first: Tensor, keys: int, mask: Tensor | None, *,
                           is_causal: bool, scale: float | None = None) -> Tensor:
    """``native_attention`` over ``keys`` keys kept in pages, read where they lie
    (``attnlab.kernels.native.paged_attention``: its arguments); ``scale`` None: ``1 /
    sqrt(D)``. For queries that ``native_decoding`` accepts."""
    query, mask = _native_query_mask(query, mask, keys)
    return native.paged_attention(query, key_pages, value_pages, tables, first, keys, mask,
                                  _scale(query, scale), is_causal)


def paged_native_part(query: Tensor, key_pages: Tensor, value_pages: Tensor, tables: Tensor,
                      first: Tensor, keys: int, mask: Tensor | None, *, is_causal: bool,
                      scale: float | None = None) -> Tensor | None:
    """``paged_native_attention`` where the kernel takes the call (``native_decoding``, pages
    in the query's dtype), else None: a kernel for one part of a serving step, as
    ``attnlab.attention.paged.paged_attention`` asks it (``PartKernel``)."""
    if query.dtype != key_pages.dtype or not native_decoding(query, key_pages[:1],
                                                               value_pages[:1], mask, keys=keys):
        return None
    return paged_native_attention(query, key_pages, value_pages, tables, first, keys, mask,
                                  is_causal=is_causal, scale=scale)


def _native_query_mask(query: Tensor, mask: Tensor | None,
                       keys: int) -> tuple[Tensor, Tensor | None]:
    """The query with a contiguous last dim and the mask as the kernels take it: an expanded
    ``B x H x L x S`` view, bool or float32."""
    B, H, L, _ = query.shape
    if mask is not None:
        mask = (mask if mask.dtype == torch.bool else mask.float()).expand(B, H, L, keys)
    return (query if query.stride(-1) == 1 else query.contiguous()), mask


def _scale(query: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
