"""Head metrics: what one head's attention pattern looks like, as numbers.

Every metric takes weights ``w`` of shape ``N.. x L x S`` (rows: queries, summing to 1) and
returns ``N..``: the mean over query rows of a per-row quantity. A row whose weights sum to
0 (a query with nothing to attend to) is left out of the mean. Query ``i`` sits at key
position ``p_i = i + offset``; ``offset`` defaults to ``S - L`` (bottom-right, as the causal
mask: right for self-attention, with or without a cache); use ``offset=0`` to align the
first query with the first key (cross-attention of copy-like tasks).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnlab.analysis.capture import AttentionCapture
from attnlab.analysis.table import Table
from attnlab.masks import causal_mask

__all__ = [
    "attention_distance",
    "broadness",
    "diagonal_share",
    "entropy",
    "first_token_share",
    "head_report",
    "head_similarity",
    "js_divergence",
    "previous_token_share",
]

METRICS = ("entropy", "broadness", "distance", "diagonal", "previous", "first")


def entropy(w: Tensor) -> Tensor:
    """``mean_i H_i`` with ``H_i = -sum_j w_ij ln w_ij`` (nats; ``0 ln 0 = 0``).

    0 for a head that puts all weight on one key; ``ln n`` for a uniform row over ``n`` keys.
    """
    _check("w", w)
    return _mean_rows(_row_entropy(w), w)


def broadness(w: Tensor, mask: Tensor | None = None) -> Tensor:
    """``mean_i exp(H_i) / n_i``: the effective number of keys over the keys row ``i`` may see.

    ``exp(H_i)`` (the perplexity of the row) is 1 for one key and ``n_i`` for a uniform row;
    ``n_i`` is the number of True entries of ``mask`` (``L x S`` or broadcasting to ``w``,
    True = may attend) in row ``i``, ``S`` when ``mask`` is None. 1 = uniform, ``1/n_i`` = one
    key.
    """
    _check("w", w)
    if mask is None:
        n = torch.full(w.shape[:-1], float(w.shape[-1]), dtype=w.dtype, device=w.device)
    else:
        n = torch.broadcast_to(mask, w.shape).sum(-1).to(w.dtype).clamp(min=1)
    return _mean_rows(_row_entropy(w).exp() / n, w)


def attention_distance(w: Tensor, offset: int | None = None) -> Tensor:
    """``mean_i sum_j w_ij |j - p_i|``: how far (in positions) a head looks on average."""
    _check("w", w)
    L, S = w.shape[-2:]
    p = torch.arange(L, device=w.device) + (S - L if offset is None else offset)
    dist = (torch.arange(S, device=w.device)[None, :] - p[:, None]).abs().to(w.dtype)
    return _mean_rows((w * dist).sum(-1), w)


def diagonal_share(w: Tensor, offset: int | None = None) -> Tensor:
    """``mean_i w_{i, p_i}``: the weight a query puts on its own position."""
    return _band(w, 0, offset)


def previous_token_share(w: Tensor, offset: int | None = None) -> Tensor:
    """``mean_i w_{i, p_i - 1}``: the weight on the position before (0 where there is none)."""
    return _band(w, -1, offset)


def first_token_share(w: Tensor) -> Tensor:
    """``mean_i w_{i, 0}``: the weight on the first key (an "attention sink" when large)."""
    _check("w", w)
    return _mean_rows(w[..., 0], w)


def js_divergence(p: Tensor, q: Tensor) -> Tensor:
    """Jensen-Shannon divergence of rows: ``p, q`` ``N.. x S`` -> ``N..`` (nats, in [0, ln 2]).

    ``JS(p, q) = KL(p || m) / 2 + KL(q || m) / 2`` with ``m = (p + q) / 2``.
    """
    if p.shape != q.shape:
        raise ValueError(f"q: expected the shape of p {tuple(p.shape)}, got {tuple(q.shape)}")
    m = (p + q) / 2
    return (_kl_terms(p, m) + _kl_terms(q, m)).sum(-1) / 2


def head_similarity(w: Tensor) -> Tensor:
    """Pairwise head similarity: weights ``H x L x S`` -> ``H x H`` in [0, 1].

    ``sim(a, b) = 1 - mean_i JS(w_a,i, w_b,i) / ln 2``: 1 for identical patterns, 0 for heads
    that attend to disjoint keys on every row. Rows that are empty in either head are left out.
    """
    _check("w", w)
    if w.dim() != 3:
        raise ValueError(f"w: expected shape H x L x S, got {tuple(w.shape)}")
    a, b = w[:, None], w[None, :]
    js = js_divergence(a.expand(-1, w.shape[0], -1, -1), b.expand(w.shape[0], -1, -1, -1))
    valid = (a.sum(-1) > 0.5) & (b.sum(-1) > 0.5)
    mean = (js * valid).sum(-1) / valid.sum(-1).clamp(min=1)
    return 1 - mean / math.log(2)


def head_report(result: AttentionCapture) -> Table:
    """One row per (kind, layer, head): every metric, averaged over the batch's examples.

    Columns: ``kind, layer, head, entropy, broadness, distance, diagonal, previous, first,
    max_similarity`` (the largest ``head_similarity`` to another head of the same layer).
    Padding is removed first; cross-attention uses ``offset=0``; a causal kind counts only
    the keys a query may see in ``broadness``.
    """
    table = Table(["kind", "layer", "head", *METRICS, "max_similarity"])
    for kind, maps in result.maps.items():
        B = maps.weights.shape[0]
        totals = torch.zeros(len(maps.layers), len(maps.heads), len(METRICS) + 1)
        for b in range(B):
            w, _, _ = maps.example(b)
            totals += _example_metrics(w.float(), kind, maps.causal)
        totals /= B
        for li, layer in enumerate(maps.layers):
            for hi, head in enumerate(maps.heads):
                table.rows.append([kind, layer, head, *(float(v) for v in totals[li, hi])])
    return table


def _example_metrics(w: Tensor, kind: str, causal: bool) -> Tensor:
    """``N x H x l x s`` -> ``N x H x (metrics + max_similarity)``."""
    L, S = w.shape[-2:]
    offset = 0 if kind == "cross" else S - L
    mask = causal_mask(L, S, device=w.device) if causal else None
    cols = [
        entropy(w),
        broadness(w, mask),
        attention_distance(w, offset),
        diagonal_share(w, offset),
        previous_token_share(w, offset),
        first_token_share(w),
    ]
    H = w.shape[1]
    sims = []
    for layer in w:
        sim = head_similarity(layer)
        if H > 1:
            sim = sim.masked_fill(torch.eye(H, dtype=torch.bool, device=w.device), -1.0)
            sims.append(sim.amax(-1))
        else:
            sims.append(torch.ones(1, device=w.device))
    cols.append(torch.stack(sims))
    return torch.stack(cols, dim=-1).cpu()


def _row_entropy(w: Tensor) -> Tensor:
    return -(w * torch.where(w > 0, w.log(), torch.zeros_like(w))).sum(-1)


def _kl_terms(p: Tensor, m: Tensor) -> Tensor:
    return torch.where(p > 0, p * (p / m.clamp(min=1e-30)).log(), torch.zeros_like(p))


def _band(w: Tensor, shift: int, offset: int | None) -> Tensor:
    _check("w", w)
    L, S = w.shape[-2:]
    keys = torch.arange(L, device=w.device) + (S - L if offset is None else offset) + shift
    inside = (keys >= 0) & (keys < S)
    picked = w[..., torch.arange(L, device=w.device), keys.clamp(0, S - 1)]
    return _mean_rows(picked * inside.to(w.dtype), w)


def _mean_rows(x: Tensor, w: Tensor) -> Tensor:
    """Mean of the per-row values ``x`` ``N.. x L`` over rows whose weights are not all 0."""
    valid = (w.sum(-1) > 0.5).to(x.dtype)
    return (x * valid).sum(-1) / valid.sum(-1).clamp(min=1)


def _check(name: str, w: Tensor) -> None:
    if not isinstance(w, Tensor) or w.dim() < 2 or not w.is_floating_point():
        got = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(f"{name}: expected float attention weights N.. x L x S, got {got}")
