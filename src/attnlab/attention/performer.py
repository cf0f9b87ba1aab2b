"""Performer attention: FAVOR+ with positive orthogonal random features (Choromanski et al., 2021).

The softmax kernel ``exp(q . k * scale)`` is estimated without bias by positive random
features. With ``x = sqrt(scale) q``, ``y = sqrt(scale) k`` and ``m`` feature rows ``w_r``::

    phi(x)_r = exp(w_r . x - |x|^2 / 2) / sqrt(m)        E[phi(x) . phi(y)] = exp(x . y)

The ``w_r`` are Gaussian but drawn in orthogonal blocks of ``D`` (lower variance). Then
attention becomes linear in ``L``:

- non-causal: ``out = phi(Q) (phi(K)^T V) / (phi(Q) (phi(K)^T 1))``, memory ``O((L + S) m)``;
- causal (prefix sums): ``out_i = phi(q_i)^T sum_{j<=i} phi(k_j) v_j^T / phi(q_i)^T sum_{j<=i}
  phi(k_j)``, computed chunk by chunk: a masked ``c x c`` product inside each chunk plus the
  running sums of the chunks before it, so only ``L/c`` states of ``m x Dv`` are kept.

Numerical stabilisers (a max per query row, one max over all keys of a head) multiply
numerator and denominator alike and cancel exactly, so they carry no gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnlab._checks import check_positive
from attnlab.attention.projected import ProjectedAttention
from attnlab.masks import key_mask_to_bool

__all__ = ["PerformerAttention", "favor_attention", "orthogonal_random_features",
           "positive_random_features"]


def favor_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    features: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    key_mask: Tensor | None = None,
    chunk_size: int = 128,
) -> Tensor:
    """FAVOR+ estimate of ``softmax(Q K^T * scale) V`` in time and memory linear in ``L``.

    query ``N.. x H x L x D``, key ``N.. x H x S x D``, value ``N.. x H x S x Dv``, features
    ``m x D`` (from :func:`orthogonal_random_features`) -> ``N.. x H x L x Dv``. ``causal``
    needs ``L == S`` (query ``i`` sees keys ``j <= i``). ``key_mask`` ``N.. x S`` (bool or 0/1, True
    = a real key) drops keys. ``scale`` defaults to ``1 / sqrt(D)``. A query with no key gets zeros.
    """
    key_mask = None if key_mask is None else key_mask_to_bool(key_mask)
    _check(query, key, value, features, causal, key_mask, chunk_size)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    root = math.sqrt(scale)
    phi_q = positive_random_features(query * root, features, is_query=True)
    phi_k = positive_random_features(key * root, features, is_query=False)
    if key_mask is not None:
        phi_k = phi_k * key_mask[..., None, :, None].to(phi_k.dtype)
    if causal:
        return _causal(phi_q, phi_k, value, chunk_size)
    kv = torch.matmul(phi_k.transpose(-1, -2), value)  # N.. x H x m x Dv
    num = torch.matmul(phi_q, kv)
    den = torch.matmul(phi_q, phi_k.sum(-2).unsqueeze(-1))  # N.. x H x L x 1
    return num / _safe(den)


def orthogonal_random_features(
    num_features: int,
    head_dim: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """``m x D`` Gaussian feature rows, orthogonal within each block of ``D`` rows.

    Each block is ``Q`` of the QR decomposition of a ``D x D`` Gaussian matrix, its rows
    rescaled by the norms of independent ``D``-dim Gaussian vectors, so every row is
    marginally ``N(0, I_D)`` as the unbiased estimator needs.
    """
    for name, n in (("num_features", num_features), ("head_dim", head_dim)):
        check_positive(name, n)
    n_blocks = -(-num_features // head_dim)
    g = torch.randn(n_blocks, head_dim, head_dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar rotations
    w = q.transpose(-1, -2).reshape(n_blocks * head_dim, head_dim)[:num_features]
    gauss = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64)
    norms = gauss.norm(dim=1)
    return (w * norms[:, None]).to(device=device, dtype=dtype or torch.get_default_dtype())


def positive_random_features(x: Tensor, features: Tensor, *, is_query: bool) -> Tensor:
    """``phi(x)_r = exp(w_r . x - |x|^2 / 2 - c) / sqrt(m)``: ``N.. x L x D`` -> ``N.. x L x m``.

    ``c`` is a detached stabiliser: the max over each row for queries (``is_query``), the max
    over the whole ``L x m`` slice for keys, so it cancels in the attention ratio.
    """
    proj = torch.matmul(x, features.to(x.dtype).T)  # N.. x L x m
    sq = 0.5 * (x * x).sum(-1, keepdim=True)
    if is_query:
        c = proj.detach().amax(-1, keepdim=True)
    else:
        c = (proj - sq).detach().amax((-2, -1), keepdim=True)
        c = c.masked_fill(~torch.isfinite(c), 0.0)
    return torch.exp(proj - sq - c) / math.sqrt(features.shape[0])


class PerformerAttention(ProjectedAttention):
    """Drop-in multi-head layer with FAVOR+ attention: ``B x L x E`` in and out.

    ``num_features`` ``m`` (default 256) rows are drawn at construction from torch's global
    RNG (deterministic under ``torch.manual_seed``), shared by all heads, and kept as the
    buffer ``features``; :meth:`redraw_features` draws new ones. ``forward(..., is_causal=True)``
    uses the prefix-sum form (self-attention, ``L == S``). Other parameters as
    :class:`~attnlab.attention.projected.ProjectedAttention`.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_features: int = 256,
                 chunk_size: int = 128, **kwargs: object) -> None:
        super().__init__(embed_dim, num_heads, **kwargs)  # type: ignore[arg-type]
        self.num_features, self.chunk_size = num_features, chunk_size
        w = self.in_proj_weight
        self.register_buffer("features", orthogonal_random_features(
            num_features, self.head_dim, device=w.device, dtype=w.dtype))

    def redraw_features(self, generator: torch.Generator | None = None) -> None:
        """Replace ``features`` by a fresh draw (as the paper does periodically in training)."""
        self.features.copy_(orthogonal_random_features(
            self.num_features, self.head_dim, generator=generator))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, key_mask: Tensor | None,
               is_causal: bool) -> Tensor:
        """``B x H x L x D`` -> ``B x H x L x D`` by :func:`favor_attention`."""
        return favor_attention(q, k, v, self.features, causal=is_causal, key_mask=key_mask,
                               chunk_size=self.chunk_size)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_features={self.num_features}")


def _causal(phi_q: Tensor, phi_k: Tensor, value: Tensor, c: int) -> Tensor:
    """Chunked prefix sums: features ``N.. x L x m``, values ``N.. x L x Dv`` -> ``N.. x L x Dv``.
    """
    *lead, L, _ = phi_q.shape
    Dv = value.shape[-1]
    c = max(1, min(c, L))
    nc = -(-L // c)
    pad = nc * c - L

    def chunks(t: Tensor) -> Tensor:
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
        return t.view(*lead, nc, c, t.shape[-1])

    q, k, v = chunks(phi_q), chunks(phi_k), chunks(value)
    kv = torch.matmul(k.transpose(-1, -2), v)  # N.. x nc x m x Dv: each chunk's sum
    state = torch.cumsum(kv, dim=-3) - kv  # sums of the chunks strictly before
    z = k.sum(-2)  # N.. x nc x m
    z_state = torch.cumsum(z, dim=-2) - z
    inside = torch.matmul(q, k.transpose(-1, -2)).tril()  # N.. x nc x c x c, j <= i in a chunk
    num = torch.matmul(q, state) + torch.matmul(inside, v)
    den = torch.matmul(q, z_state.unsqueeze(-1)) + inside.sum(-1, keepdim=True)
    out = (num / _safe(den)).reshape(*lead, nc * c, Dv)
    return out[..., :L, :]


def _safe(den: Tensor) -> Tensor:
    """Denominators are positive sums; 0 only where nothing was attended (output then 0)."""
    return den.masked_fill(den == 0, 1.0)


def _check(query: Tensor, key: Tensor, value: Tensor, features: Tensor, causal: bool,
           key_mask: Tensor | None, chunk_size: int) -> None:
    for name, t in (("query", query), ("key", key), ("value", value), ("features", features)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point Tensor, got {type(t).__name__}")
        if name != "features" and (t.dtype != query.dtype or t.device != query.device):
            raise TypeError(
                f"{name}: expected query's dtype {query.dtype} on {query.device}, got "
                f"{t.dtype} on {t.device}"
            )
    if query.dim() < 3 or key.shape[:-2] != query.shape[:-2] or key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"key: expected shape {(*query.shape[:-2], 'S', query.shape[-1])} (query's N.. x H "
            f"and D), got {tuple(key.shape)}"
        )
    if value.shape[:-1] != key.shape[:-1]:
        raise ValueError(
            f"value: expected shape {(*key.shape[:-1], 'Dv')}, got {tuple(value.shape)}"
        )
    if features.dim() != 2 or features.shape[1] != query.shape[-1]:
        raise ValueError(
            f"features: expected shape m x D = m x {query.shape[-1]}, got {tuple(features.shape)}"
        )
    if causal and query.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"key: the causal form needs S == L = {query.shape[-2]}, got S = {key.shape[-2]}"
        )
    if key_mask is not None and tuple(key_mask.shape) != (*key.shape[:-3], key.shape[-2]):
        raise ValueError(
            f"key_mask: expected shape N.. x S = {(*key.shape[:-3], key.shape[-2])}, got "
            f"{tuple(key_mask.shape)}"
        )
    check_positive("chunk_size", chunk_size)
