"""``scaled_dot_product_attention``: one entry point, checked once, over every backend.

It checks its inputs once and hands them to one of the backends of this package: ``math``
(the formula, returns weights), ``flash`` (our tiled online-softmax kernel) or ``fused``
(PyTorch's kernel). See ``DESIGN.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from attnlab._checks import is_number
from attnlab.attention.flash import flash_attention
from attnlab.attention.fused import fused_attention
from attnlab.attention.math import math_attention

__all__ = ["BACKENDS", "scaled_dot_product_attention"]

BACKENDS = ("auto", "math", "flash", "fused")


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    return_weights: bool = False,
    backend: str = "auto",
    hook: Callable[[str, Tensor], Tensor] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``softmax(Q K^T * scale + mask) V``.

    query ``N.. x H x L x D``, key ``N.. x G x S x D``, value ``N.. x G x S x Dv`` -> output
    ``N.. x H x L x Dv``. Every dim before the last two broadcasts as in ``torch.matmul``
    (ranks may differ; ``L x D`` works), exactly as
    ``torch.nn.functional.scaled_dot_product_attention``: without ``enable_gqa`` the heads
    dim is one more batch dim; with it, ``G`` divides ``H`` and only the dims before the heads
    broadcast. Gradients are summed over broadcast dims.

    - ``scale`` defaults to ``1 / sqrt(D)``.
    - ``mask`` broadcasts to the output's ``N.. x H x L x S``: boolean (True = may attend) or
      additive float.
    - ``is_causal`` adds the bottom-right causal mask (query ``i`` sees keys up to
      ``S - L + i``); it may be combined with ``mask``.
    - ``enable_gqa``: query head ``h`` uses key/value head ``h // (H / G)``.
    - A query with no key to attend to gets a zero output (and zero weights), never NaN.
    - Non-finite scores, one behaviour in every backend (and ``attnlab.kernels``' decode
      kernel): a score that is NaN or ``+inf`` at a key the query may attend to (a NaN or an
      infinity in its query or that key, or ``q . k`` overflowing float32) makes the query's
      output (and weights) NaN, as no weight can be given; a ``-inf`` score (masked, or
      ``q . k`` overflowing below) is a weight of 0, the limit. Masked keys never count. NaN
      in, NaN out, so a corrupt weight reaches the logits' NaN check instead of becoming text.
      ``flash`` and ``fused`` run the formula (``math``) for a call whose scores might leave
      float32's range (``D max|q| max|k| max(1, scale)`` past ``2^124``, or a NaN in the
      inputs: one ``aminmax`` of q and of k per call); no trained model comes near it.
    - bfloat16/float16 inputs: scores, softmax and sums are computed in float32 by every
      backend; output and weights come back in the input dtype.
    - ``return_weights=True`` returns ``(output, weights)``, weights ``N.. x H x L x S`` being
      the ones that multiplied ``V`` (after dropout when ``dropout_p > 0``).
    - ``backend``: ``"math"``, ``"flash"``, ``"fused"`` or ``"auto"`` (the fused kernel, or
      ``math`` when weights are asked for). A backend asked for something it cannot do
      raises. (For inference, ``attnlab.kernels.FastSelfAttention`` runs a decoding step's
      few queries through attnlab's C++ kernel instead.)
    - ``hook(point, tensor) -> tensor`` sees, and may replace, the masked ``"scores"`` and the
      ``"pattern"`` ``N.. x H x L x S`` (analysis hook points): only ``math`` forms them, so
      ``auto`` then runs ``math`` and another explicit backend raises.
    """
    scale = _check_inputs(query, key, value, mask, scale, dropout_p, backend)
    if is_causal and query.shape[-2] == 1:
        # One query is the last position: the bottom-right causal mask lets it see every key
        # (decoding). Dropping it spares the backends a mask, and the fused one its slow path.
        is_causal = False
    chosen = _choose_backend(backend, return_weights, dropout_p, mask, hook is not None)
    rank = max(query.dim(), key.dim(), value.dim())
    query, key, value = _broadcast(query, key, value, enable_gqa)
    _check_mask(mask, query, key, rank)
    if chosen != "math" and not _scores_in_range(query, key, scale):
        # Each kernel orders and scales the products its own way, and PyTorch's returns zeros
        # for a NaN query: the formula alone defines what non-finite scores give.
        chosen = "math"
    if chosen == "math":
        out, weights = math_attention(
            query, key, value, mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
            hook=hook,
        )
        if rank == 2:
            out, weights = out.squeeze(0), weights.squeeze(0)
        return (out, weights) if return_weights else out
    if chosen == "flash":
        out = flash_attention(query, key, value, mask, is_causal=is_causal, scale=scale)
    else:
        out = fused_attention(
            query, key, value, mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p
        )
    return out.squeeze(0) if rank == 2 else out


# A bound on |q . k| * max(1, scale) below which no backend's scores (scaled before or after
# the products, in base 2 for flash, shifted by a running max) can overflow float32.
_SCORE_LIMIT = 2.0**124


def _scores_in_range(query: Tensor, key: Tensor, scale: float) -> bool:
    """Whether every score is surely finite in every backend: ``D max|q| max|k| max(1,
    |scale|)`` below ``_SCORE_LIMIT``; False when the inputs hold a NaN or an infinity. One
    ``aminmax`` pass over each (a NaN propagates into it) and one read back."""
    if query.numel() == 0 or key.numel() == 0:
        return True
    extremes = torch.stack([*torch.aminmax(query), *torch.aminmax(key)]).double().tolist()
    if not all(math.isfinite(x) for x in extremes):
        return False
    top_q, top_k = max(map(abs, extremes[:2])), max(map(abs, extremes[2:]))
    return top_q * top_k * query.shape[-1] * max(1.0, abs(scale)) < _SCORE_LIMIT


def _default_scale(query: Tensor) -> float:
    return 1.0 / math.sqrt(query.shape[-1])


def _broadcast_shapes(*shapes: torch.Size) -> torch.Size:
    """``torch.broadcast_shapes``, answered at once when the shapes are equal (every call of
    a model: the general one costs microseconds per call in Python)."""
    first = shapes[0]
    return first if all(s == first for s in shapes[1:]) else torch.broadcast_shapes(*shapes)


def _broadcast(
    query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Views (no copies) of the inputs that every backend takes: query ``N.. x H x L x D``,
    key and value ``M.. x G x S x D/Dv`` with ``G`` dividing ``H``, one rank (at least 3).

    ``M..`` equals the broadcast ``N..`` except where key and value both have size 1 and the
    query does not: a backend may fold such a dim into its query rows (as it does the ``H / G``
    heads of a group) rather than repeat K and V. Heads that broadcast without
    ``enable_gqa`` become ``G = 1`` where only the query has them; elsewhere they expand.
    """
    rank = max(query.dim(), key.dim(), value.dim(), 3)
    query, key, value = (t.view((1,) * (rank - t.dim()) + tuple(t.shape))
                         for t in (query, key, value))
    shapes = {"query": query.shape[:-3], "key": key.shape[:-3], "value": value.shape[:-3]}
    try:
        lead = _broadcast_shapes(*shapes.values())
    except RuntimeError:
        raise ValueError(
            "key: expected leading dims N.. that broadcast with query's (as torch.matmul), "
            + ", ".join(f"got {n} {tuple(s)}" for n, s in shapes.items())
        ) from None
    H, Gk, Gv = query.shape[-3], key.shape[-3], value.shape[-3]
    if enable_gqa:
        if Gk != Gv:
            raise ValueError(
                f"value: with enable_gqa, expected key's {Gk} heads (dim -3), got {Gv}"
            )
        if Gk == 0 or H % Gk:
            raise ValueError(
                f"key: with enable_gqa, the query heads H={H} must be a multiple of the "
                f"key/value heads G={Gk}"
            )
    elif not (Gk == Gv and Gk in (1, H)):
        try:
            H = torch.broadcast_shapes((H,), (Gk,), (Gv,))[0]
        except RuntimeError:
            raise ValueError(
                f"key: expected {H} heads like query (dim -3) or 1, got {Gk} (value {Gv}); "
                "pass enable_gqa=True for grouped-query attention"
            ) from None
        query = query.expand(*query.shape[:-3], H, -1, -1)
        key, value = key.expand(*key.shape[:-3], H, -1, -1), value.expand(
            *value.shape[:-3], H, -1, -1)
    kv_lead = _broadcast_shapes(key.shape[:-3], value.shape[:-3])
    return (query.expand(*lead, -1, -1, -1), key.expand(*kv_lead, -1, -1, -1),
            value.expand(*kv_lead, -1, -1, -1))


def _choose_backend(
    backend: str, return_weights: bool, dropout_p: float, mask: Tensor | None, hooked: bool
) -> str:
    """The backend that runs; weights and a scores/pattern hook (``hooked``) need ``math``."""
    if backend == "auto":
        # torch's fused kernel is the fastest exact path on every device we run on; only the
        # weights need the written-out formula.
        return "math" if return_weights or hooked else "fused"
    if hooked and backend != "math":
        raise ValueError(
            f"hook: backend {backend!r} forms no scores or pattern for a hook to see; "
            "use backend='math' or 'auto'"
        )
    if return_weights and backend != "math":
        raise ValueError(
            f"return_weights: backend {backend!r} cannot return attention weights; "
            "use backend='math' or 'auto'"
        )
    if backend == "flash":
        if dropout_p > 0:
            raise ValueError(
                f"dropout_p: backend 'flash' supports only 0.0, got {dropout_p}; "
                "use backend='math', 'fused' or 'auto' for attention dropout"
            )
        if mask is not None and mask.requires_grad:
            raise ValueError(
                "mask: backend 'flash' does not compute gradients for the mask, got a mask "
                "with requires_grad=True; use backend='math', 'fused' or 'auto'"
            )
    return backend


def _check_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    scale: float | None,
    dropout_p: float,
    backend: str,
) -> float:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
        if t.dim() < 2:
            raise ValueError(
                f"{name}: expected shape N.. x L x D (rank >= 2), got {tuple(t.shape)}"
            )
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(
                f"{name}: expected query's dtype {query.dtype}, got {t.dtype}; cast the "
                "inputs to one dtype"
            )
        if t.device != query.device:
            raise ValueError(f"{name}: expected query's device {query.device}, got {t.device}")
    if query.shape[-1] == 0:
        raise ValueError(f"query: expected a head dim D >= 1, got shape {tuple(query.shape)}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"key: expected head dim D={query.shape[-1]} (query's last dim), got shape "
            f"{tuple(key.shape)}"
        )
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"value: expected S={key.shape[-2]} positions (key's dim -2), got shape "
            f"{tuple(value.shape)}"
        )
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask: expected a Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(
                f"mask: expected a bool (True = may attend) or float (additive) tensor, "
                f"got dtype {mask.dtype}"
            )
        if mask.device != query.device:
            raise ValueError(f"mask: expected query's device {query.device}, got {mask.device}")
    if not is_number(dropout_p):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p}")
    if scale is None:
        return _default_scale(query)
    if not is_number(scale):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    if not is_number(scale, finite=True):
        raise ValueError(f"scale: expected a finite float, got {scale}")
    return float(scale)


def _check_mask(mask: Tensor | None, query: Tensor, key: Tensor, rank: int) -> None:
    """``mask`` must broadcast to the output's ``N.. x H x L x S`` (of the callers' ``rank``)."""
    if mask is None:
        return
    target = (*query.shape[:-1], key.shape[-2])[-rank:]
    try:
        ok = torch.broadcast_shapes(mask.shape, target) == torch.Size(target)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"mask: expected a shape that broadcasts to N.. x H x L x S = {tuple(target)}, got "
            f"{tuple(mask.shape)}"
        )
