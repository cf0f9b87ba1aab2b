"""``DecoderLMConfig``: the data that makes ``DecoderLM`` any of the model families.

Kept apart from the model so that the families (``attnlab.models.families``), which map a
``config.json`` onto it, and the model, which loads any family, import it without a cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from attnlab._checks import check_positive, is_int
from attnlab.attention.sdpa import BACKENDS
from attnlab.layers.rope_scaling import RopeScaling
from attnlab.layers.rotary import RotaryEmbedding
from attnlab.models.config import ConfigMixin

__all__ = ["GATED", "DecoderLMConfig", "make_rotary"]

Backend = Literal[BACKENDS]  # type: ignore[valid-type]
# gated MLP kind -> the activation of its gate
GATED = {"swiglu": "silu", "geglu": "gelu_tanh"}


@dataclass(frozen=True)
class DecoderLMConfig(ConfigMixin):
    """Sizes and style of a ``DecoderLM``; every field is plain data (JSON round trip).

    Sizes: ``d_model`` ``E``, ``num_heads`` ``H``, ``num_kv_heads`` ``G`` (default ``H``),
    ``head_dim`` ``D`` (default ``E / H``), ``d_ff`` (default ``4 E``; ``8E/3`` rounded up to
    a multiple of 8 for gated MLPs, so the parameter count matches), ``max_len`` positions.

    Style: ``position`` ``"learned"`` or ``"rope"`` (``rope_base``, ``rope_scaling``,
    ``rotary_dim`` for partial rotary, ``rope_traditional`` for interleaved pairs); ``norm``
    ``"layernorm"``, ``"rmsnorm"`` or ``"rmsnorm_unit_offset"`` (Gemma's ``1 + w``);
    ``mlp`` ``"gelu"``, ``"gelu_tanh"``, ``"relu"``, ``"swiglu"`` or ``"geglu"``. ``bias`` is
    the default of ``qkv_bias``, ``o_bias``, ``mlp_bias`` and ``norm_bias`` (LayerNorm's
    shift). ``qk_norm``: RMSNorm on each query and key head (Qwen3). ``embedding_scale``
    multiplies the token embeddings (Gemma: ``sqrt(E)``); ``attention_scale`` replaces
    ``1/sqrt(D)``; ``sliding_window`` ``W``: each token sees itself and the ``W - 1`` before
    it (Mistral). ``family`` is the Hugging Face ``model_type`` the model was loaded from (its
    ``save_pretrained`` writes that format back), or ``None`` for attnlab's own format.

    ``bos_token_id`` and ``eos_token_id`` are kept as the file gives them, even outside
    ``[0, vocab_size)`` (tiny test checkpoints keep GPT-2's 50256, and transformers reads
    them): they are refused where they would be used (``generate``'s ``eos_token_id`` and
    ``pad_token_id``, ``attnlab generate``'s end ids), naming the id, the key and the
    vocabulary size.
    """

    vocab_size: int
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    max_len: int = 1024
    position: Literal["learned", "rope"] = "learned"
    norm: Literal["layernorm", "rmsnorm", "rmsnorm_unit_offset"] = "layernorm"
    mlp: Literal["gelu", "gelu_tanh", "relu", "swiglu", "geglu"] = "gelu"
    bias: bool = True
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias: bool | None = None
    norm_bias: bool | None = None
    qk_norm: bool = False
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: RopeScaling | None = None
    rotary_dim: int | None = None
    embedding_scale: float | None = None
    attention_scale: float | None = None
    sliding_window: int | None = None
    dropout: float = 0.0
    backend: Backend = "auto"
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default=())
    family: str | None = None

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
        if isinstance(self.rope_scaling, Mapping):  # from JSON
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        eos = self.eos_token_id  # Hugging Face allows one id or a list of them
        if eos is None or is_int(eos):
            object.__setattr__(self, "eos_token_id", () if eos is None else (eos,))
        self._check_types()
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_len"):
            check_positive(name, getattr(self, name))
        for name in ("num_kv_heads", "head_dim", "d_ff", "rotary_dim", "sliding_window"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(f"d_model: expected a multiple of num_heads={self.num_heads} "
                                 f"(or an explicit head_dim), got {self.d_model}")
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads={self.num_heads}, "
                             f"got {self.num_kv_heads}")
        if self.position == "rope":
            if self.rotary_dim is not None and self.rotary_dim > self.head_dim:
                raise ValueError(f"rotary_dim: expected at most head_dim={self.head_dim}, "
                                 f"got {self.rotary_dim}")
            if self.rotary_size % 2:
                raise ValueError(f"rotary_dim: RoPE needs an even number of rotated features, "
                                 f"got {self.rotary_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: expected a float in [0, 1), got {self.dropout}")
        for name in ("norm_eps", "rope_base", "initializer_range"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive number, got {getattr(self, name)}")
        for name in ("embedding_scale", "attention_scale"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}: expected a positive number or None, got {value}")

    @property
    def kv_heads(self) -> int:
        """``G``: ``num_kv_heads``, or ``num_heads`` when not given."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def rotary_size(self) -> int:
        """The number of features of each head that RoPE rotates (all by default)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def ff_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp in GATED:
            return -(-8 * self.d_model // 3 // 8) * 8
        return 4 * self.d_model

    def resolved_bias(self, name: str) -> bool:
        """``qkv_bias``, ``o_bias``, ``mlp_bias`` or ``norm_bias``, defaulting to ``bias``."""
        value = getattr(self, name)
        return self.bias if value is None else value


def make_rotary(c: DecoderLMConfig) -> RotaryEmbedding | None:
    """The config's rotary embedding (no parameters; its frequencies are buffers), if any."""
    if c.position != "rope":
        return None
    scaling = c.rope_scaling
    # Dynamic NTK scales past the length trained on, kept as the scaling's
    # original_max_position_embeddings; max_len is then the extended context.
    start = (scaling.original_max_position_embeddings
             if scaling is not None and scaling.rope_type == "dynamic" else None)
    return RotaryEmbedding(c.rotary_size, base=c.rope_base, max_len=c.max_len,
                           scaling=scaling, interleaved=c.rope_traditional,
                           max_position_embeddings=start)
