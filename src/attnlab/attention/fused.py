"""The ``fused`` backend: PyTorch's own ``scaled_dot_product_attention`` kernel.

Our conventions are mapped onto it: the bottom-right causal mask becomes an explicit mask
when ``L != S`` or when a mask is given too (PyTorch's ``is_causal`` is top-left and cannot
be combined with a mask), and grouped-query heads use its ``enable_gqa``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.masks import causal_mask

# Before 2.5, PyTorch had no enable_gqa and returned NaN for rows with nothing to attend to.
_TORCH_2_5 = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def fused_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float,
    dropout_p: float = 0.0,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` under our conventions.

    query ``N.. x H x L x D``, key ``M.. x G x S x D``, value ``M.. x G x S x Dv`` (``M..``
    broadcasting to ``N..``), ``mask`` of any shape that broadcasts to ``N.. x H x L x S``
    -> ``N.. x H x L x Dv``. PyTorch's kernel returns zeros for a NaN query row and finite
    values for some overflowing scores: ``scaled_dot_product_attention`` runs the formula for
    such calls instead (its docstring), so call this through it.
    """
    L, S = query.shape[-2], key.shape[-2]
    if mask is not None and mask.dim() < 2:
        # PyTorch indexes the mask's dim -2 (an IndexError for a key mask of shape S).
        mask = mask.view((1,) * (2 - mask.dim()) + tuple(mask.shape))
    if is_causal and (mask is not None or L != S):
        allowed = causal_mask(L, S, device=query.device)
        if mask is None:
            mask = allowed
        elif mask.dtype == torch.bool:
            mask = mask & allowed
        else:
            mask = mask.masked_fill(~allowed, float("-inf"))
        is_causal = False
    if mask is not None and mask.is_floating_point():
        mask = mask.to(query.dtype)
    H, G = query.shape[-3], key.shape[-3]
    gqa = {}
    if H != G:
        if _TORCH_2_5:
            gqa = {"enable_gqa": True}
        else:
            key = key.repeat_interleave(H // G, dim=-3)
            value = value.repeat_interleave(H // G, dim=-3)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        **gqa,
    )
    if not _TORCH_2_5 and mask is not None:
        has_key = (mask if mask.dtype == torch.bool else mask != float("-inf")).any(
            -1, keepdim=True
        )
        out = out.masked_fill(~has_key, 0.0)
    return out
