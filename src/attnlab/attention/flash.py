"""The ``flash`` backend: our own FlashAttention, written with PyTorch tensor ops.

Forward (online softmax): for each tile of queries, walk over tiles of keys keeping a
reference ``m``, a running sum ``l`` and an unnormalised output ``acc``::

    s = q k^T            m' >= m, near rowmax s        p = exp(s - m')
    l = l e^(m - m') + rowsum p                        acc = acc e^(m - m') + p v

and finish with ``out = acc / l``, saving only ``lse = m + log l`` per query. The ``L x S``
score matrix never exists: memory beyond the inputs is one tile per step. Scores are kept in
base 2 (``log2 e`` folded into the query scale, ``exp2`` in place of ``exp``), and ``m`` moves
only when a score passes it by a margin, so most tiles are one GEMM, one ``exp2`` and one sum.

Backward (FlashAttention-2): recompute each tile's ``p = exp(s - lse)`` from the saved
statistics, with ``delta = rowsum(dO * out)``::

    dV += p^T dO      dS = p * (dO V^T - delta)      dQ += dS K      dK += dS^T Q

Causal tiles above the diagonal are skipped, not masked. Grouped-query heads are handled by
stacking the ``R = H/G`` query heads of a group along the query axis, and so are batch dims
that K/V broadcast over, so K/V are never copied. bfloat16/float16 inputs are computed in
float32 one tile at a time, as PyTorch's kernels do: their 8 or 11 bits would otherwise round
every score and running sum.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnlab._checks import check_positive

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "flash_attention"]

DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256


def flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> Tensor:
    """Tiled exact attention; inputs already checked by ``scaled_dot_product_attention``.

    query ``N.. x H x L x D``, key ``M.. x G x S x D``, value ``M.. x G x S x Dv`` with ``G``
    dividing ``H`` and ``M..`` equal to ``N..`` or 1 in each dim (a dim where K/V are 1 is
    folded into the query rows, so K/V are never repeated); ``mask`` bool or additive,
    broadcasting to ``N.. x H x L x S`` (no gradient flows to it) -> ``N.. x H x L x Dv``.
    bfloat16/float16 inputs are computed in float32 one tile at a time (scores, softmax
    statistics, sums); the output comes back in their dtype. ``block_q`` / ``block_k`` are
    the tile sizes.
    """
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        check_positive(name, b)
    return _FlashAttention.apply(query, key, value, mask, is_causal, scale, block_q, block_k)


class _Tiling:
    """Shapes and the mask of one call, laid out as ``BG`` batches of ``L*F*R`` query rows.

    The dims of ``N..`` split into batch dims (K/V have them too; ``B`` is their product) and
    fold dims (K/V have size 1 there; ``F`` is their product). Query rows are ordered
    (position, fold dims, head-in-group) so a tile of ``bq`` positions is a contiguous block of
    ``bq * F * R`` rows that share one K/V head. A tile of scores is viewed with every dim
    apart (:meth:`tile_view`), so that the mask broadcasts onto it as a view.
    """

    def __init__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None,
        is_causal: bool,
        block_q: int,
        block_k: int,
    ) -> None:
        *lead, H, L, _ = query.shape
        G, S = key.shape[-3], key.shape[-2]
        n = len(lead)
        batch = [d for d in range(n) if key.shape[d] == lead[d]]
        fold = [d for d in range(n) if key.shape[d] != lead[d]]
        self.lead, self.H, self.G, self.R = lead, H, G, H // max(G, 1)
        self.batch_sizes = [lead[d] for d in batch]
        self.fold_sizes = [lead[d] for d in fold]
        self.B, self.F = math.prod(self.batch_sizes), math.prod(self.fold_sizes)
        self.L, self.S, self.Dv = L, S, value.shape[-1]
        self.kv_shape = key.shape[:-1]
        self.compute = torch.promote_types(query.dtype, torch.float32)
        self.is_causal, self.block_q, self.block_k = is_causal, block_q, block_k
        # N.. x G x R x L x E -> batch.. x G x L x fold.. x R x E, and back.
        self.perm = [*batch, n, n + 2, *fold, n + 1, n + 3]
        self.unperm = [self.perm.index(d) for d in range(n + 4)]
        self.mask = None
        self.mask_is_bool = False
        self._future_cache: dict[tuple[int, int, int], Tensor] = {}
        if mask is not None:
            self.mask_is_bool = mask.dtype == torch.bool
            m = ~mask if self.mask_is_bool else mask.to(self.compute)
            # Broadcast views only: the full N.. x H x L x S mask is never materialised.
            m = m.expand(*lead, H, L, S).reshape(*lead, G, self.R, L, S)
            self.mask = m.permute(self.perm)

    def q_rows(self, query: Tensor, factor: float) -> Tensor:
        """``N.. x H x L x D`` -> ``BG x (L*F*R) x D`` times ``factor``, in one pass (none
        when ``factor`` is 1 and the layout allows a view)."""
        D = query.shape[-1]
        q = query.reshape(*self.lead, self.G, self.R, self.L, D).permute(self.perm)
        if factor == 1.0:
            return q.reshape(self.B * self.G, self.L * self.F * self.R, D)
        rows = torch.empty(q.shape, dtype=query.dtype, device=query.device)
        torch.mul(q, factor, out=rows)
        return rows.view(self.B * self.G, self.L * self.F * self.R, D)

    def from_rows(self, rows: Tensor) -> Tensor:
        """``BG x (L*F*R) x E`` -> ``N.. x H x L x E``."""
        E = rows.shape[-1]
        out = rows.view(*self.batch_sizes, self.G, self.L, *self.fold_sizes, self.R, E)
        return out.permute(self.unperm).reshape(*self.lead, self.H, self.L, E)

    def kv_rows(self, t: Tensor) -> Tensor:
        """``M.. x G x S x E`` -> ``BG x S x E``."""
        return t.reshape(self.B * self.G, self.S, t.shape[-1])

    def key_end(self, i1: int) -> int:
        """One past the last key that any query before ``i1`` may see."""
        return min(self.S, i1 + self.S - self.L) if self.is_causal else self.S

    def tile_mask(
        self, i0: int, i1: int, j0: int, j1: int, device: torch.device
    ) -> tuple[Tensor | None, Tensor | None]:
        """The mask of one tile as ``(additive part, blocked)``, either None when absent.

        Both broadcast onto :meth:`tile_view`; ``blocked`` is True where the query may not
        attend to the key (False in a bool mask, ``-inf`` in a float one, or causal).
        """
        add = blocked = None
        if self.mask is not None:
            at_l = len(self.batch_sizes) + 1
            index = (slice(None),) * at_l + (slice(i0, i1),)
            tile = self.mask[index][..., j0:j1]
            if self.mask_is_bool:
                blocked = tile
            else:
                add, blocked = tile, tile == float("-inf")
        if self.is_causal and j1 - 1 > i0 + self.S - self.L:
            future = self._future(i0, i1, j0, j1, device)
            blocked = future if blocked is None else blocked | future
        return add, blocked

    def _future(self, i0: int, i1: int, j0: int, j1: int, device: torch.device) -> Tensor:
        """Keys after each query's causal limit in a tile, ``bq x 1.. x bk`` (cached by shape)."""
        key = (i0 - j0, i1 - i0, j1 - j0)
        if key not in self._future_cache:
            rows = torch.arange(i0, i1, device=device).unsqueeze(-1) + (self.S - self.L)
            future = torch.arange(j0, j1, device=device) > rows
            ones = (1,) * (len(self.fold_sizes) + 1)
            self._future_cache[key] = future.view(i1 - i0, *ones, j1 - j0)
        return self._future_cache[key]

    def tile_view(self, s: Tensor) -> Tensor:
        """A score tile ``BG x (bq*F*R) x bk`` as ``batch.. x G x bq x fold.. x R x bk``."""
        bq = s.shape[1] // (self.F * self.R)
        return s.view(*self.batch_sizes, self.G, bq, *self.fold_sizes, self.R, s.shape[-1])

    def exp2_(self, s: Tensor, add: Tensor | None, blocked: Tensor | None) -> Tensor:
        """``2^s`` of a shifted score tile in place: the additive mask (natural units) added,
        blocked entries exactly zero.

        Arguments are clamped at a floor first: ``exp2`` is many times slower where its result
        underflows, and those weights (< 2^-120 of the reference) do not count.
        """
        view = self.tile_view(s)
        if add is not None:
            view.add_(add, alpha=_LOG2E)
        s.clamp_(min=_EXP2_FLOOR[s.dtype])
        if blocked is not None:
            view.masked_fill_(blocked, float("-inf"))
        return s.exp2_()


# Scores are kept in base 2 (``log2(e)`` folded into the query scale) because ``exp2`` runs
# about twice as fast as ``exp`` on CPUs.
_LOG2E = 1.4426950408889634
_EXP2_FLOOR = {torch.float32: -120.0, torch.float64: -1000.0}
# The reference ``m`` of a row moves only when a score passes it by more than this (base 2),
# or when the row's first scores lie below ``-_MARGIN``.
_MARGIN = 16.0


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, is_causal, scale, block_q, block_k):
        t = _Tiling(query, key, value, mask, is_causal, block_q, block_k)
        # Half precisions keep their rows as they are and get scaled in float32 per tile.
        q_scale = scale * _LOG2E
        q = t.q_rows(query, 1.0 if t.compute != query.dtype else q_scale)
        k, v = t.kv_rows(key), t.kv_rows(value)
        rows_per_q = t.F * t.R
        out = q.new_empty(q.shape[0], q.shape[1], t.Dv)
        lse = q.new_empty(q.shape[0], q.shape[1], dtype=t.compute)
        kt_tiles = [k[:, j0 : j0 + block_k].transpose(1, 2) for j0 in range(0, t.S, block_k)]
        v_tiles = [v[:, j0 : j0 + block_k] for j0 in range(0, t.S, block_k)]
        for i0 in range(0, t.L if q.numel() else 0, block_q):
            i1 = min(i0 + block_q, t.L)
            rows = slice(i0 * rows_per_q, i1 * rows_per_q)
            q_i = _scaled(q[:, rows], t.compute, q_scale)
            _forward_tile(t, q_i, kt_tiles, v_tiles, i0, i1, out[:, rows], lse[:, rows])
        ctx.tiling, ctx.scale = t, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return t.from_rows(out)

    @staticmethod
    def backward(ctx, grad_out):
        t, scale = ctx.tiling, ctx.scale
        q, k, v, out, lse = ctx.saved_tensors
        q_scale, half = scale * _LOG2E, t.compute != q.dtype
        rows_per_q = t.F * t.R
        do = t.q_rows(grad_out, 1.0)
        dq = torch.zeros_like(q)
        # K/V gradients gather over every query tile: half precisions sum them in float32.
        dk = torch.zeros_like(k, dtype=t.compute)
        dv = torch.zeros_like(v, dtype=t.compute)
        for i0 in range(0, t.L if q.numel() else 0, t.block_q):
            i1 = min(i0 + t.block_q, t.L)
            rows = slice(i0 * rows_per_q, i1 * rows_per_q)
            q_i = _scaled(q[:, rows], t.compute, q_scale)
            do_i = do[:, rows].to(t.compute)
            lse_i = lse[:, rows].unsqueeze(-1)
            delta_i = (do_i * out[:, rows].to(t.compute)).sum(-1, keepdim=True)
            dq_i = dq[:, rows] if not half else torch.zeros_like(q_i)
            for j0 in range(0, t.key_end(i1), t.block_k):
                j1 = min(j0 + t.block_k, t.S)
                k_j, v_j = k[:, j0:j1].to(t.compute), v[:, j0:j1].to(t.compute)
                s = torch.baddbmm(lse_i, q_i, k_j.transpose(1, 2), beta=-1.0)
                p = t.exp2_(s, *t.tile_mask(i0, i1, j0, j1, s.device))
                dv[:, j0:j1].baddbmm_(p.transpose(1, 2), do_i)
                ds = torch.baddbmm(delta_i, do_i, v_j.transpose(1, 2), beta=-1.0).mul_(p)
                dq_i.baddbmm_(ds, k_j)
                dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), q_i)
            # q_i holds query * scale * log2(e): dS/dq = scale * k, dS/dk = q / log2(e).
            dq_i.mul_(scale)
            if half:
                dq[:, rows] = dq_i
        dk.div_(_LOG2E)
        grad_q = t.from_rows(dq)
        grad_k = dk.to(q.dtype).view(*t.kv_shape, k.shape[-1])
        grad_v = dv.to(q.dtype).view(*t.kv_shape, t.Dv)
        return grad_q, grad_k, grad_v, None, None, None, None, None


def _scaled(rows: Tensor, compute: torch.dtype, q_scale: float) -> Tensor:
    """Query rows ready for the scores: as they are when already scaled (``compute`` is their
    dtype), else a float32 copy of this tile scaled by ``q_scale``."""
    return rows if rows.dtype == compute else rows.to(compute).mul_(q_scale)


def _forward_tile(
    t: _Tiling,
    q_i: Tensor,
    kt_tiles: list[Tensor],
    v_tiles: list[Tensor],
    i0: int,
    i1: int,
    out_i: Tensor,
    lse_i: Tensor,
) -> None:
    """Online softmax (base 2) over the key tiles for one query tile; writes ``out_i``, ``lse_i``.

    A row's reference ``m`` starts at 0 and moves only when needed (see ``_MARGIN``), so most
    score tiles are a plain GEMM with no shift and most steps need no rescaling. Once every
    row has seen a key, the row max is not computed: a tile whose row sum exceeds
    ``bk * 2^_MARGIN`` (some score passed ``m`` by more than the margin) is redone with it.
    """
    n, rows = q_i.shape[0], q_i.shape[1]
    m = q_i.new_zeros(n, rows, 1)
    m_is_zero, all_seen = True, False
    seen = torch.zeros(n, rows, 1, dtype=torch.bool, device=q_i.device)
    denom = q_i.new_zeros(n, rows, 1)
    acc = q_i.new_zeros(n, rows, t.Dv)
    buffer = q_i.new_empty(n * rows * t.block_k)

    def scores(kt_j: Tensor) -> Tensor:
        s = buffer[: n * rows * kt_j.shape[-1]].view(n, rows, kt_j.shape[-1])
        if m_is_zero:
            return torch.bmm(q_i, kt_j, out=s)
        return torch.baddbmm(m, q_i, kt_j, beta=-1.0, out=s)

    for j, j0 in enumerate(range(0, t.key_end(i1), t.block_k)):
        j1 = min(j0 + t.block_k, t.S)
        add, blocked = t.tile_mask(i0, i1, j0, j1, q_i.device)
        # No-ops in float32; one tile of K/V in float32 for half precisions.
        kt_j, v_j = kt_tiles[j].to(q_i.dtype), v_tiles[j].to(q_i.dtype)
        s = scores(kt_j)
        p = None
        if all_seen:
            p = t.exp2_(s, add, blocked)
            row_sum = p.sum(-1, keepdim=True)
            if bool(row_sum.max() > (j1 - j0) * 2.0**_MARGIN):
                p, s = None, scores(kt_j)
        if p is None:
            s5 = t.tile_view(s)
            if add is not None:
                s5.add_(add, alpha=_LOG2E)
            if blocked is not None:
                s5.masked_fill_(blocked, float("-inf"))
            mx = s.amax(-1, keepdim=True)
            has_key = mx > float("-inf")
            # A row seen for the first time takes its max as reference only when far below 0.
            grow = (mx > _MARGIN) | (has_key & ~seen & (mx < -_MARGIN))
            if bool(grow.any()):
                shift = torch.where(grow, mx, 0.0)
                s.sub_(shift)
                m.add_(shift)
                # Only a row's first shift can be negative, and it has nothing to rescale yet:
                # clamping keeps e.g. 2^1440 from turning its zeros into NaN.
                alpha = shift.neg().clamp_(max=0.0).exp2_()
                acc.mul_(alpha)
                denom.mul_(alpha)
                m_is_zero = False
            seen |= has_key
            all_seen = bool(seen.all())
            p = t.exp2_(s, None, blocked)
            row_sum = p.sum(-1, keepdim=True)
        denom.add_(row_sum)
        acc.baddbmm_(p, v_j)
    empty = denom == 0
    out_i.copy_(acc / denom.masked_fill(empty, 1.0))
    lse_i.copy_((m + denom.log2()).masked_fill(empty, float("inf")).squeeze(-1))
