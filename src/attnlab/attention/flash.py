"""The ``flash`` backend: our own FlashAttention, written with PyTorch tensor ops.

Forward (online softmax): for each tile of queries, walk over tiles of keys keeping a
running max ``m``, a running sum ``l`` and an unnormalised output ``acc``::

    s = q k^T            m' = max(m, rowmax s)      p = exp(s - m')
    l = l e^(m - m') + rowsum p                     acc = acc e^(m - m') + p v

and finish with ``out = acc / l``, saving only ``lse = m + log l`` per query. The ``L x S``
score matrix never exists: memory beyond the inputs is one tile per step.

Backward (FlashAttention-2): recompute each tile's ``p = exp(s - lse)`` from the saved
statistics, with ``delta = rowsum(dO * out)``::

    dV += p^T dO      dS = p * (dO V^T - delta)      dQ += dS K      dK += dS^T Q

Causal tiles above the diagonal are skipped, not masked. Grouped-query heads are handled by
stacking the ``R = H/G`` query heads of a group along the query axis, so K/V are never copied.
"""

from __future__ import annotations

import torch
from torch import Tensor

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
        if not isinstance(b, int) or b < 1:
            raise ValueError(f"{name}: expected a positive int, got {b!r}")
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

    def apply_masks(self, s: Tensor, i0: int, i1: int, j0: int, j1: int) -> Tensor | None:
        """Mask the score tile ``BG x (bq*R) x bk`` in place with ``-inf``.

        Returns what is blocked (a bool tile broadcasting to ``B x G x bq x R x bk``), or
        None when nothing is, so that the caller can zero those entries after ``exp``.
        """
        bq, bk = i1 - i0, j1 - j0
        s5 = s.view(self.B, self.G, bq, self.R, bk)
        blocked = None
        if self.mask is not None:
            tile = self.mask[:, :, i0:i1, :, j0:j1]
            if self.mask_is_bool:
                blocked = tile
            else:
                s5.add_(tile)
                blocked = tile == float("-inf")
        if self.is_causal and j1 - 1 > i0 + self.S - self.L:
            future = self._future(i0, i1, j0, j1, s.device)
            blocked = future if blocked is None else blocked | future
        if blocked is not None:
            s5.masked_fill_(blocked, float("-inf"))
        return blocked

    def _future(self, i0: int, i1: int, j0: int, j1: int, device: torch.device) -> Tensor:
        """Keys after each query's causal limit in a tile, ``bq x 1 x bk`` (cached by shape)."""
        key = (i0 - j0, i1 - i0, j1 - j0)
        if key not in self._future_cache:
            rows = torch.arange(i0, i1, device=device).unsqueeze(-1) + (self.S - self.L)
            self._future_cache[key] = (torch.arange(j0, j1, device=device) > rows).unsqueeze(-2)
        return self._future_cache[key]

    def exp_(self, s: Tensor, blocked: Tensor | None) -> Tensor:
        """``exp`` of a shifted score tile in place, with blocked entries exactly zero.

        Arguments below ``log(tiny)`` are clamped first: ``exp`` is many times slower where
        its result underflows, and those weights (< 1e-35 of the row max) do not count.
        """
        floor = _EXP_FLOOR.get(s.dtype)
        if floor is not None:
            s.clamp_(min=floor)
        s.exp_()
        if blocked is not None:
            s.view(self.B, self.G, -1, self.R, s.shape[-1]).masked_fill_(blocked, 0.0)
        return s


_EXP_FLOOR = {torch.float32: -80.0, torch.bfloat16: -80.0, torch.float64: -700.0}
_RESCALE_MARGIN = 8.0


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, is_causal, scale, block_q, block_k):
        t = _Tiling(query, key, value, mask, is_causal, block_q, block_k)
        q = t.q_rows(query * scale)
        k, v = t.kv_rows(key), t.kv_rows(value)
        R = t.R
        out = q.new_zeros(q.shape[0], t.L * R, t.Dv)
        lse = q.new_full((q.shape[0], t.L * R), float("inf"))
        for i0 in range(0, t.L, block_q):
            i1 = min(i0 + block_q, t.L)
            _forward_tile(
                t,
                q[:, i0 * R : i1 * R],
                k,
                v,
                i0,
                i1,
                out[:, i0 * R : i1 * R],
                lse[:, i0 * R : i1 * R],
            )
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
                p = t.exp_(s, t.apply_masks(s, i0, i1, j0, j1))
                dv[:, j0:j1].baddbmm_(p.transpose(1, 2), do_i)
                ds = torch.baddbmm(delta_i, do_i, v_j.transpose(1, 2), beta=-1.0).mul_(p)
                dq_i.baddbmm_(ds, k_j)
                dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), q_i)
        dq.mul_(scale)
        grad_q = t.from_rows(dq)
        grad_k = dk.view(*t.lead, t.G, t.S, -1)
        grad_v = dv.view(*t.lead, t.G, t.S, -1)
        return grad_q, grad_k, grad_v, None, None, None, None, None


def _forward_tile(
    t: _Tiling, q_i: Tensor, k: Tensor, v: Tensor, i0: int, i1: int, out_i: Tensor, lse_i: Tensor
) -> None:
    """Online softmax over the key tiles for one query tile; writes ``out_i`` and ``lse_i``.

    The reference max ``m`` moves only when a score exceeds it by more than
    ``_RESCALE_MARGIN`` (so ``exp`` stays below e^8, far from overflow): most tiles need no
    rescaling pass, and ``-m`` is folded into the score GEMM as its bias.
    """
    n, rows = q_i.shape[0], q_i.shape[1]
    m = q_i.new_zeros(n, rows, 1)
    seen = torch.zeros(n, rows, dtype=torch.bool, device=q_i.device)
    denom = q_i.new_zeros(n, rows, 1)
    acc = q_i.new_zeros(n, rows, v.shape[-1])
    for j0 in range(0, t.key_end(i1), t.block_k):
        j1 = min(j0 + t.block_k, t.S)
        s = torch.baddbmm(m, q_i, k[:, j0:j1].transpose(1, 2), beta=-1.0)
        blocked = t.apply_masks(s, i0, i1, j0, j1)
        mx = s.amax(-1)
        has_key = mx > float("-inf")
        # A row seen for the first time takes its max as reference, whatever its size.
        grow = (mx > _RESCALE_MARGIN) | (has_key & ~seen)
        if bool(grow.any()):
            shift = torch.where(grow, mx, 0.0).unsqueeze(-1)
            s.sub_(shift)
            m.add_(shift)
            alpha = shift.neg_().exp_()
            acc.mul_(alpha)
            denom.mul_(alpha)
        seen |= has_key
        p = t.exp_(s, blocked)
        denom.add_(p.sum(-1, keepdim=True))
        acc.baddbmm_(p, v[:, j0:j1])
    empty = denom == 0
    out_i.copy_(acc / denom.masked_fill(empty, 1.0))
    lse_i.copy_((m + denom.log()).masked_fill(empty, float("inf")).squeeze(-1))
