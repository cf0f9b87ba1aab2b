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
stacking the ``R = H/G`` query heads of a group along the query axis, so K/V are never copied.
"""

from __future__ import annotations

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

    query ``N.. x H x L x D``, key ``N.. x G x S x D``, value ``N.. x G x S x Dv`` with ``G``
    dividing ``H``; ``mask`` bool or additive, broadcasting to ``N.. x H x L x S`` (no gradient
    flows to it) -> ``N.. x H x L x Dv``. ``block_q`` / ``block_k`` are the tile sizes.
    """
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        check_positive(name, b)
    if query.dtype == torch.float16:
        # float16 tops out at 2^16, too close for the online sums: compute in float32.
        out = _FlashAttention.apply(
            query.float(), key.float(), value.float(), mask, is_causal, scale, block_q, block_k
        )
        return out.to(torch.float16)
    return _FlashAttention.apply(query, key, value, mask, is_causal, scale, block_q, block_k)


class _Tiling:
    """Shapes and the mask of one call, laid out as ``BG`` batches of ``L*R`` query rows.

    Query rows are ordered (position, head-in-group) so a tile of ``bq`` positions is a
    contiguous block of ``bq * R`` rows.
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
        self.lead, self.H, self.G, self.R = lead, H, G, H // G
        self.B = 1
        for n in lead:
            self.B *= n
        self.L, self.S, self.Dv = L, S, value.shape[-1]
        self.is_causal, self.block_q, self.block_k = is_causal, block_q, block_k
        self.mask = None
        self.mask_is_bool = False
        self._future_cache: dict[tuple[int, int, int], Tensor] = {}
        if mask is not None:
            self.mask_is_bool = mask.dtype == torch.bool
            m = ~mask if self.mask_is_bool else mask.to(query.dtype)
            # Broadcast views only: the full N.. x H x L x S mask is never materialised.
            m = m.expand(*lead, H, L, S).reshape(self.B, self.G, self.R, L, S)
            self.mask = m.permute(0, 1, 3, 2, 4)  # B x G x L x R x S, rows as in the tiles

    def q_rows(self, query: Tensor) -> Tensor:
        """``N.. x H x L x D`` -> ``BG x (L*R) x D``."""
        q = query.reshape(self.B, self.G, self.R, self.L, query.shape[-1]).transpose(2, 3)
        return q.reshape(self.B * self.G, self.L * self.R, query.shape[-1])

    def from_rows(self, rows: Tensor) -> Tensor:
        """``BG x (L*R) x E`` -> ``N.. x H x L x E``."""
        E = rows.shape[-1]
        out = rows.view(self.B, self.G, self.L, self.R, E).transpose(2, 3)
        return out.reshape(*self.lead, self.H, self.L, E)

    def kv_rows(self, t: Tensor) -> Tensor:
        """``N.. x G x S x E`` -> ``BG x S x E``."""
        return t.reshape(self.B * self.G, self.S, t.shape[-1])

    def key_end(self, i1: int) -> int:
        """One past the last key that any query before ``i1`` may see."""
        return min(self.S, i1 + self.S - self.L) if self.is_causal else self.S

    def tile_mask(
        self, i0: int, i1: int, j0: int, j1: int, device: torch.device
    ) -> tuple[Tensor | None, Tensor | None]:
        """The mask of one tile as ``(additive part, blocked)``, either None when absent.

        Both broadcast to ``B x G x bq x R x bk``; ``blocked`` is True where the query may not
        attend to the key (False in a bool mask, ``-inf`` in a float one, or causal).
        """
        add = blocked = None
        if self.mask is not None:
            tile = self.mask[:, :, i0:i1, :, j0:j1]
            if self.mask_is_bool:
                blocked = tile
            else:
                add, blocked = tile, tile == float("-inf")
        if self.is_causal and j1 - 1 > i0 + self.S - self.L:
            future = self._future(i0, i1, j0, j1, device)
            blocked = future if blocked is None else blocked | future
        return add, blocked

    def _future(self, i0: int, i1: int, j0: int, j1: int, device: torch.device) -> Tensor:
        """Keys after each query's causal limit in a tile, ``bq x 1 x bk`` (cached by shape)."""
        key = (i0 - j0, i1 - i0, j1 - j0)
        if key not in self._future_cache:
            rows = torch.arange(i0, i1, device=device).unsqueeze(-1) + (self.S - self.L)
            self._future_cache[key] = (torch.arange(j0, j1, device=device) > rows).unsqueeze(-2)
        return self._future_cache[key]

    def tile5(self, s: Tensor) -> Tensor:
        """A score tile ``BG x (bq*R) x bk`` viewed as ``B x G x bq x R x bk`` for its mask."""
        return s.view(self.B, self.G, -1, self.R, s.shape[-1])

    def exp2_(self, s: Tensor, add: Tensor | None, blocked: Tensor | None) -> Tensor:
        """``2^s`` of a shifted score tile in place: the additive mask (natural units) added,
        blocked entries exactly zero.

        Arguments are clamped at a floor first: ``exp2`` is many times slower where its result
        underflows, and those weights (< 2^-120 of the reference) do not count.
        """
        s5 = self.tile5(s)
        if add is not None:
            s5.add_(add, alpha=_LOG2E)
        s.clamp_(min=_EXP2_FLOOR[s.dtype])
        if blocked is not None:
            s5.masked_fill_(blocked, float("-inf"))
        return s.exp2_()


# Scores are kept in base 2 (``log2(e)`` folded into the query scale) because ``exp2`` runs
# about twice as fast as ``exp`` on CPUs.
_LOG2E = 1.4426950408889634
_EXP2_FLOOR = {torch.float32: -120.0, torch.bfloat16: -120.0, torch.float64: -1000.0}
# The reference ``m`` of a row moves only when a score passes it by more than this (base 2),
# or when the row's first scores lie below ``-_MARGIN``.
_MARGIN = 16.0


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, is_causal, scale, block_q, block_k):
        t = _Tiling(query, key, value, mask, is_causal, block_q, block_k)
        q = t.q_rows(query * (scale * _LOG2E))
        k, v = t.kv_rows(key), t.kv_rows(value)
        R = t.R
        out = q.new_empty(q.shape[0], t.L * R, t.Dv)
        lse = q.new_empty(q.shape[0], t.L * R)
        kt_tiles = [k[:, j0 : j0 + block_k].transpose(1, 2) for j0 in range(0, t.S, block_k)]
        v_tiles = [v[:, j0 : j0 + block_k] for j0 in range(0, t.S, block_k)]
        for i0 in range(0, t.L, block_q):
            i1 = min(i0 + block_q, t.L)
            rows = slice(i0 * R, i1 * R)
            _forward_tile(t, q[:, rows], kt_tiles, v_tiles, i0, i1, out[:, rows], lse[:, rows])
        ctx.tiling, ctx.scale = t, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return t.from_rows(out)

    @staticmethod
    def backward(ctx, grad_out):
        t, scale = ctx.tiling, ctx.scale
        q, k, v, out, lse = ctx.saved_tensors
        R = t.R
        do = t.q_rows(grad_out)
        delta = (do * out).sum(-1)
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        for i0 in range(0, t.L, t.block_q):
            i1 = min(i0 + t.block_q, t.L)
            rows = slice(i0 * R, i1 * R)
            q_i, do_i = q[:, rows], do[:, rows]
            lse_i, delta_i = lse[:, rows].unsqueeze(-1), delta[:, rows].unsqueeze(-1)
            dq_i = dq[:, rows]
            for j0 in range(0, t.key_end(i1), t.block_k):
                j1 = min(j0 + t.block_k, t.S)
                k_j, v_j = k[:, j0:j1], v[:, j0:j1]
                s = torch.baddbmm(lse_i, q_i, k_j.transpose(1, 2), beta=-1.0)
                p = t.exp2_(s, *t.tile_mask(i0, i1, j0, j1, s.device))
                dv[:, j0:j1].baddbmm_(p.transpose(1, 2), do_i)
                ds = torch.baddbmm(delta_i, do_i, v_j.transpose(1, 2), beta=-1.0).mul_(p)
                dq_i.baddbmm_(ds, k_j)
                dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), q_i)
        # q holds query * scale * log2(e): dS/dq = scale * k, dS/dk = q / log2(e).
        dq.mul_(scale)
        dk.div_(_LOG2E)
        grad_q = t.from_rows(dq)
        grad_k = dk.view(*t.lead, t.G, t.S, k.shape[-1])
        grad_v = dv.view(*t.lead, t.G, t.S, t.Dv)
        return grad_q, grad_k, grad_v, None, None, None, None, None


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
        s = scores(kt_tiles[j])
        p = None
        if all_seen:
            p = t.exp2_(s, add, blocked)
            row_sum = p.sum(-1, keepdim=True)
            if bool(row_sum.max() > (j1 - j0) * 2.0**_MARGIN):
                p, s = None, scores(kt_tiles[j])
        if p is None:
            s5 = t.tile5(s)
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
        acc.baddbmm_(p, v_tiles[j])
    empty = denom == 0
    out_i.copy_(acc / denom.masked_fill(empty, 1.0))
    lse_i.copy_((m + denom.log2()).masked_fill(empty, float("inf")).squeeze(-1))
