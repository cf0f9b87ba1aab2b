"""Initialising weights so that a model built on the ``meta`` device stays cheap.

A loader builds a model under ``torch.device("meta")`` (shapes, no memory) and places the
stored weights afterwards. Initialising a meta tensor sets nothing, yet torch's ``normal_`` on
one imports its compiler stack on first use (``torch._dynamo``, sympy: about 70 MiB resident
and a second or two), so ``normal_`` here leaves a meta tensor as it is, and ``embedding``
makes a meta ``nn.Embedding`` without ``nn.Embedding``'s own ``N(0, 1)`` draw (which every
model here replaces by its own initialisation anyway).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["embedding", "normal_"]


def normal_(weight: Tensor, std: float) -> Tensor:
    """``weight`` filled with ``N(0, std^2)`` in place (``nn.init.normal_``); a meta tensor is
    returned untouched (module docstring)."""
    if not weight.is_meta:
        nn.init.normal_(weight, std=std)
    return weight


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """``nn.Embedding(num_embeddings, embedding_dim)`` on the current default device; on the
    meta device without ``nn.Embedding``'s own ``N(0, 1)`` draw (module docstring). On a real
    device the draw is kept, though its model initialises the table again, so that a seeded
    model has the same weights as before."""
    if torch.empty(0).is_meta:  # the default device, without allocating a table for it
        return nn.Embedding.from_pretrained(torch.empty(num_embeddings, embedding_dim),
                                            freeze=False)
    return nn.Embedding(num_embeddings, embedding_dim)
