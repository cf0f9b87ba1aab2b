"""``SelfAttention``: a decoder's causal self-attention, with its projections as submodules.

    q, k, v = q_proj(x), k_proj(x), v_proj(x)             B x L x (H|G) x D per head
    q, k    = RoPE(norm(q)), RoPE(norm(k))                q/k norms (Qwen3) and RoPE optional
    k, v    = cache(k, v)                                 the cached keys come first (or
                                                          the pages of a serving step)
    z       = softmax(q k^T * scale + mask) v  B x H x L x D; head h uses kv head h // (H/G)
    out     = o_proj(concat_h z_h)                        B x L x E

The model computes the rotary ``(cos, sin)`` and the mask once per forward and passes them
to every layer. Hook points (``attnlab.hook_point.HookPoint``) name ``q``, ``k``, ``v`` (after
RoPE, before the cache), ``scores``, ``pattern`` and ``z``; a hook on ``scores`` or
``pattern`` makes the ``auto`` backend run ``math``, the only one that forms them.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from attnlab._checks import check_positive
from attnlab.attention.kv_cache import LayerKVCache
from attnlab.attention.paged import LayerPages, paged_attention, write_pages
from attnlab.attention.sdpa import BACKENDS, scaled_dot_product_attention
from attnlab.hook_point import HookPoint
from attnlab.layers.rotary import apply_rotary

__all__ = ["SelfAttention"]


class SelfAttention(nn.Module):
    """Causal self-attention with ``H`` query heads and ``G`` key/value heads of size ``D``.

    Submodules: ``q_proj`` (``H*D x E``), ``k_proj``, ``v_proj`` (``G*D x E``), ``o_proj``
    (``E x H*D``), all ``nn.Linear`` (Hugging Face's names); ``q_norm``/``k_norm`` (each made
    by the factory ``qk_norm``, over ``D``, shared by the heads) when it is given; hook points
    ``q``, ``k``, ``v``, ``scores``, ``pattern``, ``z``. ``scale`` defaults to ``1 / sqrt(D)``.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: Callable[[], nn.Module] | None = None, rope_interleaved: bool = False,
                 scale: float | None = None, dropout: float = 0.0,
                 backend: str = "auto") -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_positive(name, value)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads={num_heads}, "
                             f"got {num_kv_heads}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: expected a float in [0, 1), got {dropout}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_interleaved, self.dropout, self.backend = rope_interleaved, dropout, backend
        self.scale = scale
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm = None if qk_norm is None else qk_norm()
        self.k_norm = None if qk_norm is None else qk_norm()
        for point in ("q", "k", "v", "scores", "pattern", "z"):
            setattr(self, point, HookPoint())

    def forward(self, x: Tensor, *, rotary: tuple[Tensor, Tensor] | None = None,
                mask: Tensor | None = None, is_causal: bool = True,
                cache: LayerKVCache | None = None, paged: LayerPages | None = None) -> Tensor:
        """x ``B x L x E`` -> ``B x L x E``.

        ``rotary``: ``(cos, sin)`` for these ``L`` positions (``attnlab.layers.rotary``);
        ``mask``: bool, broadcasting to ``B x H x L x S`` (True = may attend) over the
        ``S = offset + L`` keys; ``is_causal`` adds the bottom-right causal mask; ``cache``
        (``LayerKVCache``) holds ``offset`` earlier positions and takes the ``L`` new ones.
        ``paged``: a serving step instead (``attnlab.attention.paged``): x ``1 x T x E`` is
        its packed rows, their keys and values go to the pages, and its metadata, not
        ``mask`` and ``is_causal``, says what each row sees.
        """
        B, L, _ = x.shape
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, L, H, D)
        k = self.k_proj(x).view(B, L, G, D)
        v = self.v_proj(x).view(B, L, G, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = self._rotate(q, k, *rotary)
        q, k, v = self.q(q.transpose(1, 2)), self.k(k.transpose(1, 2)), self.v(v.transpose(1, 2))
        hook = self._score_hook if self.scores.has_hooks or self.pattern.has_hooks else None
        if paged is not None:
            write_pages(paged, k, v)
            z = self._attend_paged(q, paged, hook=hook)
        else:
            if cache is not None:
                offset = cache.length
                k, v = cache.update(k, v)
                if L + offset != k.shape[-2]:
                    raise ValueError(f"cache: expected query length + offset = {L} + {offset} "
                                     f"keys, got {k.shape[-2]}")
            z = self._attend(q, k, v, mask, is_causal=is_causal, hook=hook)
        z = self.z(z)
        return self.o_proj(z.transpose(1, 2).reshape(B, L, H * D))

    def _rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """RoPE on q ``B x L x H x D`` and k ``B x L x G x D`` (``apply_rotary``)."""
        return (apply_rotary(q, cos, sin, interleaved=self.rope_interleaved),
                apply_rotary(k, cos, sin, interleaved=self.rope_interleaved))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
                is_causal: bool, hook: Callable[[str, Tensor], Tensor] | None) -> Tensor:
        """``softmax(q k^T * scale + mask) v``: q ``B x H x L x D``, k and v ``B x G x S x D``
        -> ``B x H x L x D`` (``scaled_dot_product_attention`` on this layer's backend)."""
        return scaled_dot_product_attention(
            q, k, v, mask, is_causal=is_causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.num_kv_heads != self.num_heads, backend=self.backend, hook=hook)

    def _attend_paged(self, q: Tensor, paged: LayerPages, *,
                      hook: Callable[[str, Tensor], Tensor] | None) -> Tensor:
        """q ``1 x H x T x D`` of a packed step over the keys in its pages (``paged_attention``
        on this layer's backend) -> ``1 x H x T x D``."""
        if self.training and self.dropout > 0:
            raise ValueError("paged: a serving step runs in eval mode (no attention dropout); "
                             "expected model.eval()")
        return paged_attention(q, paged, scale=self.scale, backend=self.backend, hook=hook)

    def _score_hook(self, point: str, x: Tensor) -> Tensor:
        return self.get_submodule(point)(x)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, backend={self.backend!r}")

