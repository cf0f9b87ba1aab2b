"""The ``math`` backend: attention written out as its formula, returning the weights.

``weights = softmax(Q K^T * scale + mask)``, ``out = dropout(weights) V``. It costs
``O(L x S)`` memory per head, which is what lets it return the weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnlab.formulas import softmax
from attnlab.masks import causal_mask


def math_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float,
    dropout_p: float = 0.0,
    hook: Callable[[str, Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention by the formula; inputs already checked by ``scaled_dot_product_attention``.

    query ``N.. x H x L x D``, key ``M.. x G x S x D``, value ``M.. x G x S x Dv`` with ``G``
    dividing ``H`` and ``M..`` broadcasting to ``N..`` -> ``(out N.. x H x L x Dv, weights
    N.. x H x L x S)``. bfloat16/float16 inputs are computed in float32 (scores, softmax and
    the sum over keys), as PyTorch's kernels do; out and weights come back in their dtype.

    ``hook(point, tensor) -> tensor`` (for ``attnlab.analysis``) sees and may replace the
    masked ``"scores"`` and the ``"pattern"`` (the weights that multiply V), ``N.. x H x L x S``,
    in the computing dtype (float32 for half-precision inputs).
    """
    *lead, H, L, D = query.shape
    G, S = key.shape[-3], key.shape[-2]
    R = H // max(G, 1)  # G = 0 only with H = 0
    compute = torch.promote_types(query.dtype, torch.float32)
    # Grouped heads share K/V without copies: the R = H/G query heads of a group are stacked
    # along the query axis and meet their one K/V head in a single matmul.
    q = (query.to(compute) * scale).reshape(*lead, G, R * L, D)
    scores = torch.matmul(q, key.to(compute).transpose(-2, -1)).view(*lead, H, L, S)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(compute)
    if is_causal:
        scores = scores.masked_fill(~causal_mask(L, S, device=scores.device), float("-inf"))
    if hook is not None:
        scores = hook("scores", scores)
    weights = softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = torch.nn.functional.dropout(weights, p=dropout_p, training=True)
    if hook is not None:
        weights = hook("pattern", weights)
    out = torch.matmul(weights.reshape(*lead, G, R * L, S), value.to(compute))
    out = out.view(*lead, H, L, value.shape[-1])
    return out.to(query.dtype), weights.to(query.dtype)
