"""Block-sparse attention: sliding-window (local) and local + strided (Sparse Transformer).

Which keys a query sees. Query ``i`` of ``L`` sits at key position ``p = i + S - L``
(bottom-right, as the causal mask; ``p = i`` for self-attention), and sees key ``j`` when:

- sliding window, causal: ``p - window < j <= p`` (``window`` keys, itself included);
- sliding window, two-sided: ``|j - p| < window`` (up to ``2 window - 1`` keys);
- strided: the sliding-window keys, plus the *summary* keys ``j`` with
  ``j mod stride >= stride - summary`` (the last ``summary`` positions of every block of
  ``stride`` keys), only ``j <= p`` when causal. This is the Sparse Transformer's "fixed"
  pattern (Child et al., 2019) with its block-local part replaced by the sliding window, so
  that every query has ``window`` local keys, not only the last one of a block.

These are exactly :func:`attnlab.masks.sliding_window_mask` and :func:`strided_mask`; the
tests prove equality with the ``math`` backend under those masks, forward and backward.

How it stays ``O(L * w)``: queries are cut into blocks of ``b`` positions, and a block needs
only one contiguous span of ``b + window - 1`` keys (causal; ``b + 2 window - 2`` two-sided)
that holds every query's window. The span is a strided view (``unfold``) of the padded keys,
a band mask ``b x span`` picks each query's own window, and the scores are
``B x H x L/b x b x span``: never ``L x S``. Summary keys are gathered once (``M = S / stride
* summary`` of them) and scored by every query, ``O(L * M)`` more, which is the paper's
``O(L sqrt L)`` for ``stride ~ sqrt L``. Gradients come from autograd, whose saved tensors
have the same sizes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab._checks import is_int
from attnlab.attention.projected import ProjectedAttention
from attnlab.masks import key_mask_to_bool, sliding_window_mask

__all__ = ["SparseAttention", "sliding_window_attention", "strided_attention", "strided_mask"]


def sliding_window_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    window: int,
    *,
    causal: bool = True,
    scale: float | None = None,
    key_mask: Tensor | None = None,
    block_size: int | None = None,
) -> Tensor:
    """Local attention ``softmax(Q K^T * scale + local mask) V`` in ``O(L * window)``.

    query ``N.. x H x L x D``, key ``N.. x G x S x D``, value ``N.. x G x S x Dv`` (``G``
    divides ``H``: query head ``h`` uses key/value head ``h // (H / G)``) -> ``N.. x H x L x Dv``.
    Query ``i`` sees keys ``p - window < j <= p`` (causal) or ``|j - p| < window`` with
    ``p = i + S - L``. ``key_mask`` ``N.. x S`` (bool or 0/1, True = a real key) removes keys
    too. A query with no key gets zeros. ``block_size`` (default ``max(window, 32)``) is the
    query tile.
    """
    return _block_sparse(query, key, value, window, causal, scale, key_mask, block_size, None)


def strided_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    window: int,
    stride: int,
    *,
    summary: int = 1,
    causal: bool = True,
    scale: float | None = None,
    key_mask: Tensor | None = None,
    block_size: int | None = None,
) -> Tensor:
    """Local + strided attention (Sparse Transformer fixed pattern) in ``O(L (window + M))``.

    Shapes and ``window`` as :func:`sliding_window_attention`; in addition every query sees
    the ``M = ceil(S / stride) * summary`` summary keys ``j mod stride >= stride - summary``
    (``j <= p`` when causal). ``summary`` is in ``1 .. stride``.
    """
    _check_int("stride", stride, 1)
    _check_int("summary", summary, 1)
    if summary > stride:
        raise ValueError(f"summary: expected at most stride={stride}, got {summary}")
    S = key.shape[-2] if isinstance(key, Tensor) and key.dim() >= 2 else 0
    positions = torch.arange(S, device=key.device if isinstance(key, Tensor) else None)
    positions = positions[positions % stride >= stride - summary]
    return _block_sparse(query, key, value, window, causal, scale, key_mask, block_size, positions)


def strided_mask(
    L: int,
    S: int | None = None,
    window: int = 1,
    stride: int = 1,
    *,
    summary: int = 1,
    causal: bool = True,
    device: torch.device | str | None = None,
) -> Tensor:
    """The dense ``L x S`` boolean mask (True = may attend) of :func:`strided_attention`.

    For tests and pictures only: the point of :func:`strided_attention` is never to build it.
    """
    S = L if S is None else S
    _check_int("stride", stride, 1)
    _check_int("summary", summary, 1)
    local = sliding_window_mask(L, S, window, causal=causal, device=device)
    cols = torch.arange(S, device=device)
    summary_cols = (cols % stride >= stride - summary).expand(L, S)
    if causal:
        summary_cols = summary_cols & (cols <= torch.arange(L, device=device)[:, None] + S - L)
    return local | summary_cols


class SparseAttention(ProjectedAttention):
    """Drop-in multi-head layer with sliding-window (``stride=None``) or strided attention.

    ``B x L x E`` in and out, parameters as ``MultiHeadAttention`` (see
    :class:`~attnlab.attention.projected.ProjectedAttention`). ``forward(..., is_causal=True)``
    uses the causal window ``p - window < j <= p``, otherwise the two-sided one
    ``|j - p| < window``; with ``stride`` the summary keys are added (see the module docstring).
    """

    def __init__(self, embed_dim: int, num_heads: int, window: int, *, stride: int | None = None,
                 summary: int = 1, block_size: int | None = None, **kwargs: object) -> None:
        super().__init__(embed_dim, num_heads, **kwargs)  # type: ignore[arg-type]
        _check_int("window", window, 1)
        if stride is not None:
            _check_int("stride", stride, 1)
            if not isinstance(summary, int) or not 1 <= summary <= stride:
                raise ValueError(f"summary: expected an int in 1..stride={stride}, got {summary!r}")
        self.window, self.stride, self.summary = window, stride, summary
        self.block_size = block_size

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, key_mask: Tensor | None,
               is_causal: bool) -> Tensor:
        """``B x H x L x D`` -> ``B x H x L x D`` through the block-sparse kernel."""
        if self.stride is None:
            return sliding_window_attention(q, k, v, self.window, causal=is_causal,
                                            key_mask=key_mask, block_size=self.block_size)
        return strided_attention(q, k, v, self.window, self.stride, summary=self.summary,
                                 causal=is_causal, key_mask=key_mask, block_size=self.block_size)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, window={self.window}, "
                f"stride={self.stride}, summary={self.summary}")


def _block_sparse(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    window: int,
    causal: bool,
    scale: float | None,
    key_mask: Tensor | None,
    block_size: int | None,
    summary_pos: Tensor | None,
) -> Tensor:
    """The shared kernel: local span per query block, plus optional summary keys."""
    key_mask = None if key_mask is None else key_mask_to_bool(key_mask)
    _check_qkv(query, key, value, key_mask)
    _check_int("window", window, 1)
    *lead, H, L, D = query.shape
    G, S, Dv = key.shape[-3], key.shape[-2], value.shape[-1]
    R, Bn = H // G, math.prod(lead)
    b = max(window, 32) if block_size is None else block_size
    _check_int("block_size", b, 1)
    b = max(1, min(b, L))
    nb = -(-L // b)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    before, after = window - 1, (0 if causal else window - 1)
    span = b + before + after
    off = S - L  # query i sits at key position i + off
    front = before + max(0, -off)
    first = off - before + front  # index of block 0's first key in the padded keys
    back = max(0, first + (nb - 1) * b + span - (front + S))

    def blocks(t: Tensor) -> Tensor:  # N.. x G x S x X -> Bn x G x nb x span x X (a view)
        t = F.pad(t.reshape(Bn, -1, S, t.shape[-1]), (0, 0, front, back))
        return t[:, :, first : first + (nb - 1) * b + span].unfold(2, span, b).transpose(-1, -2)

    # Queries: Bn x G x nb x (R*b) x D, rows ordered (head-in-group, position) per block.
    q = F.pad((query * scale).reshape(Bn, G, R, L, D), (0, 0, 0, nb * b - L))
    q = q.view(Bn, G, R, nb, b, D).transpose(2, 3).reshape(Bn, G, nb, R * b, D)
    k_blocks, v_blocks = blocks(key), blocks(value)

    # What each (block, query, span column) may see; positions as in the module docstring.
    pos = torch.arange(nb * b, device=query.device).view(nb, b, 1) + off
    kpos = torch.arange(span, device=query.device) + (pos[:, :1] - before)  # nb x 1 x span
    rel = torch.arange(span, device=query.device) - torch.arange(b, device=query.device)[:, None]
    allowed = ((rel >= 0) & (rel <= before + after)) & ((kpos >= 0) & (kpos < S))  # nb x b x span
    allowed = allowed.unsqueeze(1)  # nb x 1 x b x span, broadcasting over the R heads
    if key_mask is not None:
        # Bn x 1 x nb x span: which keys of each block's span are real.
        km = blocks(key_mask.reshape(Bn, 1, S, 1).to(torch.uint8)).squeeze(-1).bool()
        allowed = allowed & km[:, :, :, None, None, :]
    if summary_pos is not None:
        ks, vs = key[..., summary_pos, :], value[..., summary_pos, :]
        ks = ks.reshape(Bn, G, -1, D).transpose(-1, -2)
        vs = vs.reshape(Bn, G, -1, Dv)
        # A summary key inside the window is already a local key: do not count it twice.
        dist = summary_pos - pos  # nb x b x M
        outside = (dist <= -window) if causal else (dist.abs() >= window)
        g_allowed = outside.unsqueeze(1)
        if key_mask is not None:
            g_allowed = g_allowed & key_mask.reshape(Bn, 1, 1, 1, 1, S)[..., summary_pos]
        allowed = torch.cat(_broadcast_front(allowed, g_allowed), dim=-1)

    def attend(c0: int, c1: int) -> Tensor:
        """Blocks ``c0 .. c1 - 1``: Bn x G x nc x R*b x Dv."""
        nc = c1 - c0
        q_c = q[:, :, c0:c1]
        scores = torch.matmul(q_c, k_blocks[:, :, c0:c1].transpose(-1, -2))
        if summary_pos is not None:
            g_scores = torch.matmul(q_c.reshape(Bn, G, nc * R * b, D), ks)
            scores = torch.cat([scores, g_scores.view(Bn, G, nc, R * b, -1)], dim=-1)
        ok = allowed[..., c0:c1, :, :, :]
        scores6 = scores.view(Bn, G, nc, R, b, -1)
        dead = ~ok.any(-1, keepdim=True)
        blocked = ~ok
        any_dead = bool(dead.any())
        if any_dead:
            # Rows with no key keep finite scores (so softmax and its gradient stay finite)
            # and are zeroed after it.
            blocked = blocked & ~dead
        scores6.masked_fill_(blocked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if any_dead:
            probs = probs.view(Bn, G, nc, R, b, -1).masked_fill(dead, 0.0).view(probs.shape)
        out = torch.matmul(probs[..., :span], v_blocks[:, :, c0:c1])
        if summary_pos is not None:
            g_out = torch.matmul(probs[..., span:].reshape(Bn, G, nc * R * b, -1), vs)
            out = out + g_out.view(out.shape)
        return out

    # A few blocks at a time keep the working set (scores, probabilities) near
    # _CHUNK_BYTES, so time stays linear in L instead of paging gigabytes per call.
    per_block = Bn * G * R * b * (span + (0 if summary_pos is None else len(summary_pos))) * 4
    step = max(1, _CHUNK_BYTES // per_block)
    out = torch.cat([attend(c0, min(nb, c0 + step)) for c0 in range(0, nb, step)], dim=2)
    out = out.view(Bn, G, nb, R, b, Dv).transpose(2, 3).reshape(Bn, G, R, nb * b, Dv)
    return out[..., :L, :].reshape(*lead, H, L, Dv)


_CHUNK_BYTES = 16 * 2**20


def _broadcast_front(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Broadcast all but the last dim of ``a`` and ``b`` so that they concatenate on it."""
    shape = torch.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    return a.expand(*shape, a.shape[-1]), b.expand(*shape, b.shape[-1])


def _check_qkv(query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor | None) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point Tensor, got {type(t).__name__}")
        if t.dim() < 3:
            raise ValueError(
                f"{name}: expected shape N.. x heads x len x dim, got {tuple(t.shape)}"
            )
        if t.dtype != query.dtype or t.device != query.device:
            raise TypeError(
                f"{name}: expected query's dtype {query.dtype} on {query.device}, got "
                f"{t.dtype} on {t.device}"
            )
    H, G = query.shape[-3], key.shape[-3]
    if key.shape[:-3] != query.shape[:-3] or key.shape[-1] != query.shape[-1] or H % G:
        raise ValueError(
            f"key: expected shape {(*query.shape[:-3], 'G', 'S', query.shape[-1])} with G dividing "
            f"H={H}, got {tuple(key.shape)}"
        )
    if value.shape[:-1] != key.shape[:-1]:
        raise ValueError(
            f"value: expected shape {(*key.shape[:-1], 'Dv')} to match key, got "
            f"{tuple(value.shape)}"
        )
    if key_mask is not None and tuple(key_mask.shape) != (*key.shape[:-3], key.shape[-2]):
        raise ValueError(
            f"key_mask: expected shape N.. x S = {(*key.shape[:-3], key.shape[-2])}, got "
            f"{tuple(key_mask.shape)}"
        )


def _check_int(name: str, value: int, low: int) -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
