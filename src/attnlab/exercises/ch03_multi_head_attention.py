"""Tutorial 3, multi-head attention: the exercises.

Fill in each function, then run ``attnlab exercises check 3`` (or ``pytest exercises/``).
"""

from __future__ import annotations

# --8<-- [start:imports]
import math

import torch
from torch import Tensor

from attnlab.attention import MultiHeadAttention, SimpleMultiHeadAttention

# --8<-- [end:imports]

EXERCISES = {
    "3.1": "projection_shapes",
    "3.2": "offset_read_by_heads",
    "3.3": "gqa_by_repeat",
    "3.4": "kv_cache_gib",
    "3.5": "simple_from_module",
    "3.6": "xavier_uniform_bound",
}


# --8<-- [start:projection_shapes]
def projection_shapes(E: int, H: int, head_dim: int | None = None) -> dict[str, tuple[int, int]]:
    """The weight shapes of ``MultiHeadAttention(E, H, head_dim=head_dim)``: the fused
    ``"in_proj_weight"`` (``3 * H * D x E``) and ``"out_proj.weight"`` (``E x H * D``), with
    ``D = head_dim`` or, when None, ``E / H``: then a ``ValueError`` naming ``num_heads``
    when E is not a multiple of H."""
    if head_dim is None:
        if E % H:
            raise ValueError(f"num_heads: d_model={E} is not a multiple of num_heads={H}; "
                             f"give head_dim")
        head_dim = E // H
    return {"in_proj_weight": (3 * H * head_dim, E), "out_proj.weight": (E, H * head_dim)}
# --8<-- [end:projection_shapes]


# --8<-- [start:offset_read_by_heads]
def offset_read_by_heads(weights: Tensor, max_offset: int) -> list[int]:
    """Which offset k in ``1..max_offset`` each head reads: ``weights`` is ``H x L x S``
    (averaged over examples, L = S); head h reads the k with the largest mean weight on key
    ``i - k`` over the queries ``i >= max_offset``."""
    share = torch.stack([
        torch.diagonal(weights, offset=-k, dim1=-2, dim2=-1)[:, max_offset - k:].mean(-1)
        for k in range(1, max_offset + 1)])  # offsets x heads
    return (share.argmax(0) + 1).tolist()
# --8<-- [end:offset_read_by_heads]


# --8<-- [start:gqa_by_repeat]
def gqa_by_repeat(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Grouped-query attention by copying: q ``B x H x L x D``, k and v ``B x G x S x D``;
    query head h reads key/value head ``h // (H / G)``. Repeat each key/value head for its
    group and run ordinary attention (no mask): ``B x H x L x D``."""
    H, G = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v
# --8<-- [end:gqa_by_repeat]


# --8<-- [start:kv_cache_gib]
def kv_cache_gib(tokens: int, num_layers: int, kv_heads: int, head_dim: int,
                 element_bytes: int) -> float:
    """The KV cache of one sequence of ``tokens`` in GiB (2**30 bytes): keys and values, for
    every layer, ``kv_heads`` heads of ``head_dim`` elements of ``element_bytes`` each."""
    return 2 * num_layers * kv_heads * head_dim * element_bytes * tokens / 2**30
# --8<-- [end:kv_cache_gib]


# --8<-- [start:simple_from_module]
def simple_from_module(module: MultiHeadAttention) -> SimpleMultiHeadAttention:
    """The same attention as a bias-free ``MultiHeadAttention(E, H, bias=False)``, as a
    ``SimpleMultiHeadAttention(E, H, wq, wk, wv, wo)`` built from its weights: the fused
    ``in_proj_weight`` (``3E x E``) split into wq, wk, wv, and ``out_proj.weight`` as wo."""
    wq, wk, wv = module.in_proj_weight.detach().chunk(3)
    return SimpleMultiHeadAttention(module.embed_dim, module.num_heads, wq, wk, wv,
                                    module.out_proj.weight.detach())
# --8<-- [end:simple_from_module]


# --8<-- [start:xavier_uniform_bound]
def xavier_uniform_bound(fan_in: int, fan_out: int) -> float:
    """The bound a of Xavier (Glorot) uniform initialisation, weights drawn from U(-a, a) with
    a = sqrt(6 / (fan_in + fan_out)), so that the variance 2 / (fan_in + fan_out) keeps the
    activations' and the gradients' scale through the layer."""
    return math.sqrt(6 / (fan_in + fan_out))
# --8<-- [end:xavier_uniform_bound]
