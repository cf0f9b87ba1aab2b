"""Label-smoothed cross-entropy that ignores padding.

``loss = mean over non-pad tokens of (1 - eps) * (-log p[y]) + eps * mean_c(-log p[c])``,
the same as ``torch.nn.functional.cross_entropy(label_smoothing=eps, ignore_index=pad)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["label_smoothed_cross_entropy"]


def label_smoothed_cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """Label-smoothed cross-entropy over the tokens whose target is not ``ignore_index``.

    logits ``N.. x V``, target ``N..`` (class ids) -> scalar: the mean over kept tokens
    (zero when none is kept), or their sum with ``reduction="sum"``.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"target: expected shape {tuple(logits.shape[:-1])} (logits without V), got "
            f"{tuple(target.shape)}"
        )
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing: expected a float in [0, 1), got {smoothing}")
    logp = torch.log_softmax(logits.float(), dim=-1)
    keep = target != ignore_index
    safe = target.masked_fill(~keep, 0)
    nll = -logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    per_token = (1.0 - smoothing) * nll + smoothing * (-logp.mean(-1)) if smoothing else nll
    total = (per_token * keep).sum()
    return total if reduction == "sum" else total / keep.sum().clamp_min(1)
