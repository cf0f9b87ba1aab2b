"""The check every model runs on its token-id inputs before any compute."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_token_ids"]

# nn.Embedding indexes with these; any other dtype (bool, float, uint8, ...) is refused.
_ID_DTYPES = (torch.int64, torch.int32)


def check_token_ids(name: str, ids: object, vocab_size: int) -> tuple[int, int]:
    """``(B, L)`` of ``ids`` when it is a ``B x L`` (``L >= 1``) int64/int32 tensor of ids in
    ``[0, vocab_size)``; otherwise a ``TypeError`` (not a tensor) or ``ValueError`` naming
    ``name``, what was received and what was expected.

    The range check is one ``aminmax`` over ``ids`` (two numbers read back), cheap on the
    ``B x 1`` decode step.
    """
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name}: expected a tensor of integer token ids of shape B x L, got "
                        f"{type(ids).__name__}")
    if ids.dtype not in _ID_DTYPES:
        raise ValueError(f"{name}: expected integer token ids (torch.long or torch.int32) of "
                         f"shape B x L, got dtype {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"{name}: expected integer token ids of shape B x L, got shape "
                         f"{tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name}: expected at least one token (B, L >= 1), got shape "
                         f"{tuple(ids.shape)}")
    low, high = torch.stack(torch.aminmax(ids)).tolist()  # one read back
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name}: expected ids in [0, {vocab_size}), got min {low} and max "
                         f"{high}")
    return ids.shape[0], ids.shape[1]
