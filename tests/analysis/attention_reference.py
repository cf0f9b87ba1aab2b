"""The attention pattern of one layer written out with plain PyTorch (the test oracle):
``softmax(q k^T * scale)`` over the keys a query may see."""

from __future__ import annotations

import torch


def reference_pattern(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None = None,
                      *, window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """q ``B x H x L x D``, k ``B x G x S x D`` (query head ``h`` uses ``h // (H / G)``),
    ``key_mask`` ``B x S`` (True = real key) -> ``B x H x L x S``: causal (bottom-right),
    within the sliding ``window`` when given; a row that sees no key is all zeros."""
    H, L, D = q.shape[1:]
    S = k.shape[-2]
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    scores = q.double() @ k.double().transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
    i = torch.arange(L)[:, None] + S - L
    j = torch.arange(S)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    allowed = allowed.expand(q.shape[0], 1, L, S)
    if key_mask is not None:
        allowed = allowed & key_mask.bool()[:, None, None, :]
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return weights.nan_to_num(0.0).to(q.dtype)
