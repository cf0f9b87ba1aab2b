"""A decoder-only causal language model, GPT-style or Llama-style by its config.

``DecoderLM(config)(input_ids B x L) -> logits B x L x V``. Each block is Pre-LN:

    x = x + Dropout(Attention(Norm(x)))      causal self-attention (GQA when G < H)
    x = x + Dropout(MLP(Norm(x)))

followed by a final norm and the output projection (tied to the token embedding by default).

- GPT-style (``DecoderLMConfig.gpt``): learned positions, LayerNorm, GELU MLP, biases;
- Llama-style (``DecoderLMConfig.llama``): RoPE on queries and keys, RMSNorm, SwiGLU, no
  biases, grouped-query attention.

Positions: ``attention_mask`` (``B x (offset + L)``, 1 = real token) gives each real token
the position ``(number of real tokens before it)``, so a left-padded prompt starts at 0,
as Hugging Face does; without a mask the positions are ``offset .. offset + L - 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

from torch import Tensor, nn

from attnlab._checks import check_positive
from attnlab.attention.kv_cache import KVCache, LayerKVCache
from attnlab.attention.multihead import MultiHeadAttention
from attnlab.attention.sdpa import BACKENDS
from attnlab.functional import linear
from attnlab.layers import FeedForward, LearnedPositionalEmbedding, RMSNorm, RoPE, SwiGLU
from attnlab.models.config import ConfigMixin
from attnlab.models.inputs import decoder_inputs
from attnlab.models.summary import summary

__all__ = ["DecoderBlock", "DecoderLM", "DecoderLMConfig"]

Backend = Literal[BACKENDS]  # type: ignore[valid-type]


@dataclass(frozen=True)
class DecoderLMConfig(ConfigMixin):
    """Sizes and style of a ``DecoderLM``.

    ``position``: ``"learned"`` or ``"rope"``; ``norm``: ``"layernorm"`` or ``"rmsnorm"``;
    ``mlp``: ``"gelu"``, ``"relu"`` or ``"swiglu"``. ``num_kv_heads`` (``G``) defaults to
    ``num_heads`` (``H``); ``d_ff`` defaults to ``4 E`` (``8E/3`` rounded up to a multiple of
    8 for SwiGLU, so the parameter count matches). ``max_len`` is the number of positions.
    """

    vocab_size: int
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    d_ff: int | None = None
    max_len: int = 1024
    position: Literal["learned", "rope"] = "learned"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    mlp: Literal["gelu", "relu", "swiglu"] = "gelu"
    bias: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_traditional: bool = False
    dropout: float = 0.0
    backend: Backend = "auto"

    @classmethod
    def gpt(cls, vocab_size: int, **overrides: object) -> DecoderLMConfig:
        """GPT-2 style: learned positions, LayerNorm, GELU, biases."""
        fields = {"position": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True}
        return cls(vocab_size=vocab_size, **{**fields, **overrides})  # type: ignore[arg-type]

    @classmethod
    def llama(cls, vocab_size: int, **overrides: object) -> DecoderLMConfig:
        """Llama style: RoPE (half-split), RMSNorm, SwiGLU, no biases, GQA (``G = H / 2``)."""
        heads = check_positive("num_heads", overrides.get("num_heads", cls.num_heads))
        fields = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
                  "norm_eps": 1e-6, "num_kv_heads": max(1, heads // 2)}
        return cls(vocab_size=vocab_size, **{**fields, **overrides})  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        self._check_types()
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_len"):
            check_positive(name, getattr(self, name))
        for name in ("num_kv_heads", "d_ff"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model: expected a multiple of num_heads={self.num_heads}, "
                             f"got {self.d_model}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads={self.num_heads}, "
                             f"got {self.num_kv_heads}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"d_model: RoPE needs an even head dim, got {self.head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: expected a float in [0, 1), got {self.dropout}")
        for name in ("norm_eps", "rope_base"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive number, got {getattr(self, name)}")

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def ff_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "swiglu":
            return -(-8 * self.d_model // 3 // 8) * 8
        return 4 * self.d_model


class DecoderLM(nn.Module):
    """Causal LM: ``forward(input_ids B x L, *, attention_mask, cache) -> logits B x L x V``."""

    def __init__(self, config: DecoderLMConfig) -> None:
        super().__init__()
        if not isinstance(config, DecoderLMConfig):
            raise TypeError(f"config: expected a DecoderLMConfig, got {type(config).__name__}")
        c = self.config = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = (LearnedPositionalEmbedding(c.max_len, c.d_model)
                    if c.position == "learned" else None)
        self.rope = (RoPE(c.head_dim, c.max_len, c.rope_base, c.rope_traditional)
                     if c.position == "rope" else None)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(DecoderBlock(c) for _ in range(c.num_layers))
        self.norm = _norm(c)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.lm_head.weight, std=0.02)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: Tensor, *, attention_mask: Tensor | None = None,
                cache: KVCache | None = None, position_ids: Tensor | None = None,
                logits_to_keep: int = 0) -> Tensor:
        """input_ids ``B x L`` -> logits ``B x L x V`` (``B x min(k, L) x V`` for ``k > 0``).

        ``attention_mask``: ``B x (offset + L)``, 1/True = real token (covering the cached
        positions too), or ``None`` (all real). ``cache``: a ``KVCache`` from ``make_cache``
        holding ``offset`` positions; ``input_ids`` are then the next ``L`` tokens and the
        cache is extended by them. ``position_ids`` ``B x L`` overrides the positions.
        ``logits_to_keep=k > 0`` projects only the last ``k`` positions (generation: ``k = 1``).
        """
        c = self.config
        _, _, _, key_mask, positions = decoder_inputs(
            input_ids, attention_mask, cache, position_ids, logits_to_keep,
            vocab_size=c.vocab_size, max_len=c.max_len, max_len_name="max_len",
            num_layers=c.num_layers)
        x = self.embed(input_ids)
        if self.pos is not None:
            x = self.pos(x, offset=positions)
        x = self.drop(x)
        rotary = None if self.rope is None else partial(self.rope, offset=positions)
        for i, block in enumerate(self.blocks):
            x = block(x, key_mask=key_mask, cache=None if cache is None else cache[i],
                      rotary=rotary)
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        return linear(self.norm(x), self.lm_head.weight)

    def make_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty ``KVCache`` (``G`` heads per layer, ``max_len`` positions, model's dtype)."""
        c, p = self.config, self.embed.weight
        return KVCache(c.num_layers, batch_size, c.kv_heads,
                       c.max_len if max_len is None else max_len, c.head_dim,
                       dtype=p.dtype, device=p.device)

    def summary(self, max_depth: int = 2) -> str:
        """Print and return the per-module parameter counts."""
        text = summary(self, max_depth=max_depth)
        print(text)
        return text


class DecoderBlock(nn.Module):
    """Pre-LN block: causal self-attention then MLP, each with a residual. ``B x L x E``."""

    def __init__(self, config: DecoderLMConfig) -> None:
        super().__init__()
        c = config
        self.norm1 = _norm(c)
        self.attn = MultiHeadAttention(c.d_model, c.num_heads, num_kv_heads=c.kv_heads,
                                       dropout=c.dropout, bias=c.bias, backend=c.backend)
        self.norm2 = _norm(c)
        self.mlp = (SwiGLU(c.d_model, c.ff_dim, bias=c.bias) if c.mlp == "swiglu"
                    else FeedForward(c.d_model, c.ff_dim, activation=c.mlp, bias=c.bias))
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: Tensor, *, key_mask: Tensor | None = None,
                cache: LayerKVCache | None = None,
                rotary: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """x ``B x L x E``; ``key_mask`` ``B x (offset + L)``; ``rotary`` maps q and k."""
        h = self.attn(self.norm1(x), key_mask=key_mask, is_causal=True, cache=cache,
                      rotary=rotary)
        x = x + self.drop(h)
        return x + self.drop(self.mlp(self.norm2(x)))


def _norm(c: DecoderLMConfig) -> nn.Module:
    if c.norm == "rmsnorm":
        return RMSNorm(c.d_model, eps=c.norm_eps)
    return nn.LayerNorm(c.d_model, eps=c.norm_eps, bias=c.bias)
