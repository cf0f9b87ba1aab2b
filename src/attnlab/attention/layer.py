"""``AttentionLayer``: the one path of an attention layer's heads, shared by
``MultiHeadAttention`` (the encoder-decoder's, PyTorch's packed weights) and
``attnlab.layers.SelfAttention`` (the decoder families'). Each projects its own way, then

    q, k    = RoPE(q), RoPE(k)          (cos, sin) made once per forward, apply_rotary
    q, k, v = hooks q, k, v             B x H x L x D, B x G x S x D: after RoPE, before the cache
    k, v    = cache(k, v)               the cached keys come first (or a serving step's pages)
    z       = softmax(q k^T * scale + mask) v   hooks scores, pattern; head h reads h // (H/G)
    z       = hook z, heads merged      B x L x H*D, for the layer's output projection

so a hook, a cache, a backend or a fast module's kernel behaves the same in both.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from attnlab.attention.kv_cache import LayerKVCache
from attnlab.attention.paged import LayerPages, paged_attention, write_pages
from attnlab.attention.sdpa import scaled_dot_product_attention
from attnlab.formulas import apply_rotary
from attnlab.hook_point import HookPoint

__all__ = ["HOOK_POINTS", "AttentionLayer"]

HOOK_POINTS = ("q", "k", "v", "scores", "pattern", "z")


class AttentionLayer(nn.Module):
    """The heads of an attention layer (module docstring). A subclass sets ``num_heads``
    ``H``, ``num_kv_heads`` ``G``, ``head_dim`` ``D``, ``scale`` (None: ``1 / sqrt(D)``),
    ``dropout`` (on the attention weights, in training), ``backend``, ``rope_interleaved``,
    calls ``add_hook_points()`` and runs ``heads`` between its projections."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None
    dropout: float
    backend: str
    rope_interleaved: bool

    def add_hook_points(self) -> None:
        """The hook points ``q``, ``k``, ``v``, ``scores``, ``pattern``, ``z``."""
        for point in HOOK_POINTS:
            setattr(self, point, HookPoint())

    def heads(self, q: Tensor, k: Tensor, v: Tensor, *,
              rotary: tuple[Tensor, Tensor] | None = None, mask: Tensor | None = None,
              is_causal: bool = False, cache: LayerKVCache | None = None,
              paged: LayerPages | None = None,
              return_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """q ``B x L x H x D``, k and v ``B x S x G x D`` (projected, split into heads) ->
        ``(z, weights)``: z ``B x L x H*D`` (the heads merged), weights ``B x H x L x S``
        with ``return_weights``, else None.

        ``rotary``: ``(cos, sin)`` ``B x L x R`` for the ``L = S`` positions
        (``attnlab.layers.RotaryEmbedding``); ``mask`` bool or additive, broadcasting to ``B
        x H x L x S``; ``is_causal`` the bottom-right causal mask; ``cache`` a
        ``LayerKVCache`` holding ``offset`` earlier positions, taking the ``S`` new ones;
        ``paged`` a serving step's pages instead (``attnlab.attention.paged``: ``B = 1``, its
        metadata masks each request)."""
        B, L, H, D = q.shape
        if rotary is not None:
            q, k = self._rotate(q, k, *rotary)
        q, k, v = self.q(q.transpose(1, 2)), self.k(k.transpose(1, 2)), self.v(v.transpose(1, 2))
        hook = self._score_hook if self.scores.has_hooks or self.pattern.has_hooks else None
        weights = None
        if paged is not None:
            if return_weights:
                raise ValueError("return_weights: a serving step's attention returns no "
                                 "weights (a hook on scores or pattern sees them)")
            write_pages(paged, k, v)
            z = self._attend_paged(q, paged, hook=hook)
        else:
            if cache is not None:
                offset = cache.length
                k, v = cache.update(k, v)
                if L + offset != k.shape[-2]:
                    raise ValueError(f"cache: expected query length + offset = {L} + {offset} "
                                     f"keys, got {k.shape[-2]}")
            z = self._attend(q, k, v, mask, is_causal=is_causal, hook=hook,
                             return_weights=return_weights)
            if return_weights:
                z, weights = z
        z = self.z(z)
        return z.transpose(1, 2).reshape(B, L, H * D), weights

    def _rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """RoPE on q ``B x L x H x D`` and k ``B x L x G x D`` (``apply_rotary``)."""
        return (apply_rotary(q, cos, sin, interleaved=self.rope_interleaved),
                apply_rotary(k, cos, sin, interleaved=self.rope_interleaved))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
                is_causal: bool, hook: Callable[[str, Tensor], Tensor] | None,
                return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """``softmax(q k^T * scale + mask) v``: q ``B x H x L x D``, k and v ``B x G x S x D``
        -> ``B x H x L x D`` (``scaled_dot_product_attention`` on this layer's backend)."""
        return scaled_dot_product_attention(
            q, k, v, mask, is_causal=is_causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.num_kv_heads != self.num_heads, return_weights=return_weights,
            backend=self.backend, hook=hook)

    def _attend_paged(self, q: Tensor, paged: LayerPages, *,
                      hook: Callable[[str, Tensor], Tensor] | None) -> Tensor:
        """q ``1 x H x T x D`` of a packed step over the keys in its pages (``paged_attention``
        on this layer's backend) -> ``1 x H x T x D``."""
        if self.training and self.dropout > 0:
            raise ValueError("paged: a serving step runs in eval mode (no attention dropout); "
                             "expected model.eval()")
        return paged_attention(q, paged, scale=self.scale, backend=self.backend, hook=hook)

    def _score_hook(self, point: str, x: Tensor) -> Tensor:
        """What ``scaled_dot_product_attention`` calls at ``"scores"`` and ``"pattern"``."""
        return self.get_submodule(point)(x)
