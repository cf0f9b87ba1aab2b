"""``SelfAttention``: a decoder's causal self-attention, with its projections as submodules.

    q, k, v = q_proj(x), k_proj(x), v_proj(x)             B x L x (H|G) x D per head
    q, k    = norm(q), norm(k)                            q/k norms (Qwen3), optional
    z       = AttentionLayer.heads(q, k, v)               RoPE, hooks, cache, attention
    out     = o_proj(z)                                   B x L x E

The heads run the path that ``MultiHeadAttention`` runs too (``attnlab.attention.layer``):
RoPE with the ``(cos, sin)`` that the model computes once per forward, hook points ``q``,
``k``, ``v`` (after RoPE, before the cache), ``scores``, ``pattern`` and ``z``, the cache (or a
serving step's pages), attention. A hook on ``scores`` or ``pattern`` makes the ``auto``
backend run ``math``, the only one that forms them.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from attnlab._checks import check_positive
from attnlab.attention.kv_cache import LayerKVCache
from attnlab.attention.layer import AttentionLayer
from attnlab.attention.paged import LayerPages
from attnlab.attention.sdpa import BACKENDS

__all__ = ["SelfAttention"]


class SelfAttention(AttentionLayer):
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
        self.add_hook_points()

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
        z, _ = self.heads(q, k, v, rotary=rotary, mask=mask, is_causal=is_causal, cache=cache,
                          paged=paged)
        return self.o_proj(z)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, backend={self.backend!r}")
