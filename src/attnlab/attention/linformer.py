"""Linformer attention (Wang et al., 2020): keys and values projected along the sequence.

Learned ``P x S`` matrices ``E`` and ``F`` shrink the ``S`` keys and values to ``P`` rows::

    out = softmax(Q (E K)^T * scale) (F V)        scores L x P instead of L x S

so time and memory are ``O(L * P)``: linear in ``L`` for a fixed ``P``. The paper's argument
is that the attention matrix is close to low rank. With ``P = S`` and ``E = F = I`` it is
exactly full attention (tested). The projection mixes all positions, so there is no causal
form. Padding keys are zeroed before the projection: their content adds nothing to ``E K`` and
``F V``, but the ``P`` projected rows all stay in the softmax, so with padding it is not the
same as masking keys in full attention.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnlab._checks import check_positive
from attnlab.attention.projected import ProjectedAttention
from attnlab.attention.sdpa import scaled_dot_product_attention
from attnlab.masks import key_mask_to_bool

__all__ = ["LinformerAttention", "linformer_attention", "mean_pooling_projection"]


def linformer_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    e_proj: Tensor,
    f_proj: Tensor,
    *,
    scale: float | None = None,
    key_mask: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """``softmax(Q (E K)^T * scale) (F V)``.

    query ``N.. x H x L x D``, key ``N.. x G x S x D``, value ``N.. x G x S x Dv`` (``G``
    dividing ``H``), e_proj and f_proj ``P x S`` -> ``N.. x H x L x Dv``. ``key_mask``
    ``N.. x S`` (bool or 0/1, True = a real key) zeroes padding keys and values first.
    ``backend`` is that of :func:`attnlab.attention.scaled_dot_product_attention` on the
    ``L x P`` problem.
    """
    if not isinstance(key, Tensor) or key.dim() < 3:
        raise ValueError(f"key: expected shape N.. x G x S x D, got {getattr(key, 'shape', key)}")
    S = key.shape[-2]
    for name, p in (("e_proj", e_proj), ("f_proj", f_proj)):
        if not isinstance(p, Tensor) or p.dim() != 2 or p.shape[1] != S:
            raise ValueError(
                f"{name}: expected shape P x S = P x {S}, got {tuple(getattr(p, 'shape', ()))}"
            )
    if e_proj.shape[0] != f_proj.shape[0]:
        raise ValueError(
            f"f_proj: expected {e_proj.shape[0]} rows like e_proj, got {f_proj.shape[0]}"
        )
    if key_mask is not None:
        key_mask = key_mask_to_bool(key_mask)
        if tuple(key_mask.shape) != (*key.shape[:-3], S):
            raise ValueError(
                f"key_mask: expected shape N.. x S = {(*key.shape[:-3], S)}, got "
                f"{tuple(key_mask.shape)}"
            )
        keep = key_mask[..., None, :, None].to(key.dtype)
        key, value = key * keep, value * keep
    k = torch.matmul(e_proj.to(key.dtype), key)  # N.. x G x P x D
    v = torch.matmul(f_proj.to(value.dtype), value)
    gqa = query.shape[-3] != key.shape[-3]
    return scaled_dot_product_attention(  # type: ignore[return-value]
        query, k, v, scale=scale, enable_gqa=gqa, backend=backend
    )


def mean_pooling_projection(
    proj_len: int,
    seq_len: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """``P x S`` matrix averaging ``P`` contiguous segments: ``E[p, j] = 1 / |seg p|`` for
    ``j`` in segment ``p = floor(j P / S)``.

    A training-free choice of ``E`` and ``F``: pooled keys and values, which approximate full
    attention where scores vary slowly within a segment (the random initial projections
    approximate nothing until trained). With ``P = S`` it is the identity.
    """
    for name, n in (("proj_len", proj_len), ("seq_len", seq_len)):
        check_positive(name, n)
    if proj_len > seq_len:
        raise ValueError(f"proj_len: expected at most seq_len={seq_len}, got {proj_len}")
    segment = torch.arange(seq_len, device=device) * proj_len // seq_len
    member = (segment == torch.arange(proj_len, device=device)[:, None]).to(
        dtype or torch.get_default_dtype())
    return member / member.sum(-1, keepdim=True)


class LinformerAttention(ProjectedAttention):
    """Drop-in multi-head layer with Linformer attention: ``B x L x E`` in and out.

    ``max_len`` is the longest key sequence ``S``; ``proj_len`` ``P`` the rows keys and values
    are projected to. ``e_proj`` and ``f_proj`` (``P x max_len``, shared by all heads, as the
    paper's head-wise sharing) start ``N(0, 1/P)`` (a Johnson-Lindenstrauss projection); a
    shorter input uses their first ``S`` columns. ``share_kv`` uses one matrix for both.
    ``backend`` is passed to ``scaled_dot_product_attention``. Other parameters as
    :class:`~attnlab.attention.projected.ProjectedAttention`. No causal form.
    """

    def __init__(self, embed_dim: int, num_heads: int, max_len: int, proj_len: int, *,
                 share_kv: bool = False, backend: str = "auto", **kwargs: object) -> None:
        super().__init__(embed_dim, num_heads, **kwargs)  # type: ignore[arg-type]
        for name, n in (("max_len", max_len), ("proj_len", proj_len)):
            check_positive(name, n)
        self.max_len, self.proj_len, self.share_kv = max_len, proj_len, share_kv
        self.backend = backend
        w = self.in_proj_weight
        std = 1.0 / math.sqrt(proj_len)

        def draw() -> nn.Parameter:
            t = torch.randn(proj_len, max_len, device=w.device, dtype=w.dtype)
            return nn.Parameter(t * std)

        self.e_proj = draw()
        if share_kv:
            self.register_parameter("f_proj", None)
        else:
            self.f_proj = draw()

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, key_mask: Tensor | None,
               is_causal: bool) -> Tensor:
        """``B x H x L x D`` -> ``B x H x L x D`` by :func:`linformer_attention`."""
        if is_causal:
            raise ValueError("is_causal: Linformer has no causal form (its projection mixes "
                             "all positions), got True")
        S = k.shape[-2]
        if self.max_len < S:
            raise ValueError(f"key: expected at most max_len={self.max_len} positions, got {S}")
        e = self.e_proj[:, :S]
        f = e if self.f_proj is None else self.f_proj[:, :S]
        return linformer_attention(q, k, v, e, f, key_mask=key_mask, backend=self.backend)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, max_len={self.max_len}, "
                f"proj_len={self.proj_len}, share_kv={self.share_kv}")
