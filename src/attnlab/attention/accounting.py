"""What grouped-query and multi-query attention save: parameters and KV-cache bytes.

With ``H`` query heads, ``G`` key/value heads (``G = H`` MHA, ``1 < G < H`` GQA, ``G = 1``
MQA), head dim ``D`` and model dim ``E``, one attention layer holds::

    params = E*H*D (W_q) + kdim*G*D (W_k) + vdim*G*D (W_v) + H*D*E (W_o)
             + [(H + 2G)*D + E]  biases, when bias=True

and a KV cache for ``layers`` layers, batch ``B`` and ``S`` cached positions holds::

    kv_bytes = 2 (K and V) * layers * B * G * S * D * bytes_per_element

so the cache shrinks by ``H / G`` while only the K/V projections shrink among the weights.
These match :class:`attnlab.attention.MultiHeadAttention` (tested by counting its parameters).
"""

from __future__ import annotations

import torch

from attnlab._checks import check_positive, is_int

__all__ = ["attention_parameter_count", "gqa_table", "kv_cache_bytes"]


def attention_parameter_count(
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    *,
    head_dim: int | None = None,
    bias: bool = True,
    kdim: int | None = None,
    vdim: int | None = None,
) -> int:
    """Parameters of one ``MultiHeadAttention(embed_dim, num_heads, num_kv_heads=..., ...)``.

    ``num_kv_heads`` ``G`` defaults to ``H``, ``head_dim`` to ``E / H``, ``kdim``/``vdim`` to ``E``.
    """
    E, H = check_positive("embed_dim", embed_dim), check_positive("num_heads", num_heads)
    G = H if num_kv_heads is None else check_positive("num_kv_heads", num_kv_heads)
    if H % G:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads={H}, got {G}")
    if head_dim is None:
        if E % H:
            raise ValueError(
                f"embed_dim: expected a multiple of num_heads={H} when head_dim is not given, "
                f"got {E}"
            )
        head_dim = E // H
    D = check_positive("head_dim", head_dim)
    kd = E if kdim is None else check_positive("kdim", kdim)
    vd = E if vdim is None else check_positive("vdim", vdim)
    weights = E * H * D + kd * G * D + vd * G * D + H * D * E
    biases = (H + 2 * G) * D + E if bias else 0
    return weights + biases


def kv_cache_bytes(
    seq_len: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    num_layers: int = 1,
    batch_size: int = 1,
    dtype: torch.dtype = torch.float16,
) -> int:
    """Bytes of the K and V caches: ``2 * layers * B * G * S * D * itemsize(dtype)``."""
    S = seq_len
    if not is_int(S) or S < 0:
        raise ValueError(f"seq_len: expected a non-negative int, got {S!r}")
    G, D = check_positive("num_kv_heads", num_kv_heads), check_positive("head_dim", head_dim)
    layers, B = check_positive("num_layers", num_layers), check_positive("batch_size", batch_size)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * B * G * S * D * itemsize


def gqa_table(
    embed_dim: int,
    num_heads: int,
    *,
    head_dim: int | None = None,
    seq_len: int = 4096,
    num_layers: int = 1,
    batch_size: int = 1,
    dtype: torch.dtype = torch.float16,
    bias: bool = False,
) -> list[dict[str, int | float]]:
    """One row per divisor ``G`` of ``H`` (``H`` first, MQA last): parameters of one layer and
    the KV cache of the whole model, with their ratios to ``G = H``."""
    D = head_dim if head_dim is not None else embed_dim // check_positive("num_heads", num_heads)
    rows: list[dict[str, int | float]] = []
    for G in sorted((g for g in range(1, num_heads + 1) if num_heads % g == 0), reverse=True):
        params = attention_parameter_count(embed_dim, num_heads, G, head_dim=D, bias=bias)
        cache = kv_cache_bytes(seq_len, G, D, num_layers=num_layers, batch_size=batch_size,
                               dtype=dtype)
        rows.append({"num_kv_heads": G, "params": params, "kv_cache_bytes": cache})
    base_params, base_cache = rows[0]["params"], rows[0]["kv_cache_bytes"] or 1
    for row in rows:
        row["params_vs_mha"] = row["params"] / base_params
        row["kv_cache_vs_mha"] = row["kv_cache_bytes"] / base_cache
    return rows
