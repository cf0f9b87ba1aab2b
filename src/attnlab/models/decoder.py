"""The one decoder-only causal LM of attnlab; every model family is this stack, configured.

``DecoderLM(config)(input_ids B x L) -> logits B x L x V``. Each block is pre-norm:

    x = x + Dropout(SelfAttention(Norm(x)))   causal, GQA when G < H, RoPE or learned positions
    x = x + Dropout(MLP(Norm(x)))             two-layer (GELU/ReLU) or gated (SwiGLU, GeGLU)

followed by a final norm and ``lm_head`` (tied to the token embedding or not). What differs
between GPT-2, Llama, Mistral, Qwen2/3, Gemma and Phi-3 is data in ``DecoderLMConfig``: the
norm (LayerNorm, RMSNorm, Gemma's ``1 + w`` RMSNorm), the MLP, the biases, q/k norms, the
positions (RoPE with scaling, or learned), an embedding scale, a sliding window.
``attnlab.models.families`` maps each family's ``config.json`` and weight names onto it.

Positions: ``attention_mask`` (``B x (offset + L)``, 1 = real token) gives each real token
the position ``(number of real tokens before it)``, so a left-padded prompt starts at 0, as
Hugging Face's ``generate`` does; without a mask the positions are ``offset .. offset + L - 1``.
The rotary ``(cos, sin)`` and the attention mask are computed once per forward.

Hook points (``HookPoint`` modules, see ``attnlab.analysis.hooks``): ``layers.{i}.resid_pre``,
``attn_out``, ``resid_mid``, ``mlp_out``, ``resid_post`` (``B x L x E``) and, inside
``layers.{i}.self_attn``, ``q``, ``k``, ``v``, ``scores``, ``pattern``, ``z``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from attnlab._checks import check_positive, is_int
from attnlab.attention.kv_cache import KVCache, LayerKVCache
from attnlab.attention.sdpa import BACKENDS
from attnlab.generation import generate
from attnlab.hook_point import HookPoint
from attnlab.layers import FeedForward, GatedMLP, LearnedPositionalEmbedding, RMSNorm
from attnlab.layers.rope_scaling import RopeScaling
from attnlab.layers.rotary import RotaryEmbedding
from attnlab.layers.self_attention import SelfAttention
from attnlab.masks import causal_mask, sliding_window_mask
from attnlab.models.config import ConfigMixin
from attnlab.models.inputs import decoder_inputs
from attnlab.models.outputs import (
    CausalLMOutput,
    check_hf_keywords,
    check_labels,
    next_token_loss,
)
from attnlab.models.pretrained import PreTrainedModel
from attnlab.models.summary import summary

__all__ = ["DecoderBlock", "DecoderLM", "DecoderLMConfig", "make_norm", "make_rotary"]

Backend = Literal[BACKENDS]  # type: ignore[valid-type]
_GATED = {"swiglu": "silu", "geglu": "gelu_tanh"}


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
        ids = {"bos_token_id": self.bos_token_id,
               **{f"eos_token_id[{i}]": t for i, t in enumerate(self.eos_token_id)}}
        for name, value in ids.items():
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}: expected an id in [0, {self.vocab_size}), got {value}")

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
        if self.mlp in _GATED:
            return -(-8 * self.d_model // 3 // 8) * 8
        return 4 * self.d_model

    def resolved_bias(self, name: str) -> bool:
        """``qkv_bias``, ``o_bias``, ``mlp_bias`` or ``norm_bias``, defaulting to ``bias``."""
        value = getattr(self, name)
        return self.bias if value is None else value


class DecoderLM(PreTrainedModel):
    """Causal LM: ``forward(input_ids B x L, attention_mask, *, cache, ...) -> logits B x L x V``.

    Submodules (Hugging Face's names): ``embed_tokens``, ``embed_positions`` (learned
    positions only), ``layers[i]`` (``input_layernorm``, ``self_attn`` with ``q_proj``,
    ``k_proj``, ``v_proj``, ``o_proj``, ``post_attention_layernorm``, ``mlp``), ``norm``,
    ``lm_head``. New weights are drawn as Hugging Face does: ``N(0, initializer_range^2)``
    for linear and embedding weights, zero biases, unit norms.

    The Hugging Face call surface: ``model(ids, attention_mask=, labels=, past_key_values=,
    use_cache=)`` returns a ``CausalLMOutput`` (``attnlab.models.outputs``: ``loss``,
    ``logits``, ``past_key_values``); ``generate``; ``save_pretrained``/``from_pretrained``
    (attnlab's own format, ``attnlab.models.pretrained``).
    """

    MODEL_TYPE = "attnlab_decoder"
    CONFIG_CLASS = DecoderLMConfig

    def __init__(self, config: DecoderLMConfig) -> None:
        super().__init__()
        if not isinstance(config, DecoderLMConfig):
            raise TypeError(f"config: expected a DecoderLMConfig, got {type(config).__name__}")
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.embed_positions = (LearnedPositionalEmbedding(c.max_len, c.d_model)
                                if c.position == "learned" else None)
        self.rotary = make_rotary(c)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(DecoderBlock(c) for _ in range(c.num_layers))
        self.norm = make_norm(c, c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Hugging Face's initialisation; ties ``lm_head`` to ``embed_tokens`` when asked."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, LearnedPositionalEmbedding):
                nn.init.normal_(module.weight, std=std)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                labels: Tensor | None = None, past_key_values: KVCache | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None,
                cache: KVCache | None = None, position_ids: Tensor | None = None,
                logits_to_keep: int = 0) -> Tensor | CausalLMOutput:
        """input_ids ``B x L`` -> logits ``B x L x V`` (``B x min(k, L) x V`` for ``k > 0``).

        ``attention_mask``: ``B x (offset + L)``, 1/True = real token (covering the cached
        positions too), or ``None`` (all real). ``cache``: a ``KVCache`` from ``make_cache``
        holding ``offset`` positions; ``input_ids`` are then the next ``L`` tokens and the
        cache is extended by them. ``position_ids`` ``B x L`` overrides the positions.
        ``logits_to_keep=k > 0`` projects only the last ``k`` positions (generation: ``k = 1``).

        Hugging Face keywords (any of them, or ``return_dict=True``, returns a
        ``CausalLMOutput`` instead of the logits): ``labels`` ``B x L`` (the input ids,
        ``-100`` where no loss is wanted; shifted inside) gives ``.loss``, the next-token
        cross-entropy (``attnlab.models.outputs``); ``past_key_values`` is ``cache`` under
        Hugging Face's name; ``use_cache=True`` without one makes a cache that grows as
        tokens come (``KVCache(grow=True)``); either way ``.past_key_values`` is the cache,
        holding every position so far, to pass back with the next tokens.
        """
        c = self.config
        as_output = check_hf_keywords(
            labels=labels, use_cache=use_cache, past_key_values=past_key_values, cache=cache,
            return_dict=return_dict, logits_to_keep=logits_to_keep)
        cache = past_key_values if past_key_values is not None else cache
        B, L, offset, key_mask, positions = decoder_inputs(
            input_ids, attention_mask, cache, position_ids, logits_to_keep,
            vocab_size=c.vocab_size, max_len=c.max_len, max_len_name="max_len",
            num_layers=c.num_layers)
        if labels is not None:
            check_labels(labels, (B, L), c.vocab_size)
        if use_cache and cache is None:
            cache = self.make_cache(B, L, grow=True)
        if key_mask is not None and bool(key_mask.all()):  # no padding: the plain causal path
            key_mask = None
            positions = offset if position_ids is None else positions
        mask = self._attention_mask(key_mask, L, offset)
        x = self.embed_tokens(input_ids)
        if c.embedding_scale is not None:  # in x's dtype, as Gemma rounds it
            x = x * torch.tensor(c.embedding_scale, dtype=x.dtype)
        if self.embed_positions is not None:
            x = self.embed_positions(x, offset=positions)
        rotary = None
        if self.rotary is not None:
            if isinstance(positions, int):
                positions = torch.arange(positions, positions + L, device=input_ids.device)
            rotary = tuple(t.to(x.dtype) for t in self.rotary(positions))
        x = self.drop(x)
        is_causal = mask is None and L > 1
        for i, layer in enumerate(self.layers):
            x = layer(x, rotary=rotary, mask=mask, is_causal=is_causal,
                      cache=None if cache is None else cache[i])
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(self.norm(x))
        if not as_output:
            return logits
        loss = None if labels is None else next_token_loss(logits, labels)
        return CausalLMOutput(logits=logits, loss=loss, past_key_values=cache)

    def _attention_mask(self, key_mask: Tensor | None, L: int, offset: int) -> Tensor | None:
        """``B x 1 x L x S`` (or ``L x S``) bool, True = may attend, or ``None`` for the plain
        causal case: real keys only, bottom-right causal, within the sliding window."""
        S, window = offset + L, self.config.sliding_window
        device = self.embed_tokens.weight.device
        windowed = window is not None and window < S
        if key_mask is None and not windowed:
            return None
        mask = (sliding_window_mask(L, S, window, device=device) if windowed
                else causal_mask(L, S, device=device))
        return mask if key_mask is None else key_mask[:, None, None, :] & mask

    def make_cache(self, batch_size: int, max_len: int | None = None, *,
                   grow: bool = False) -> KVCache:
        """An empty ``KVCache`` (``G`` heads per layer, ``max_len`` positions, model's dtype);
        ``grow=True``: ``max_len`` is the room allocated first, doubled when needed."""
        c, p = self.config, self.embed_tokens.weight
        return KVCache(c.num_layers, batch_size, c.kv_heads,
                       c.max_len if max_len is None else max_len, c.head_dim,
                       dtype=p.dtype, device=p.device, grow=grow)

    def generate(self, input_ids: Tensor, max_new_tokens: int | None = None,
                 **kwargs: Any) -> Tensor:
        """``attnlab.generation.generate(self, input_ids, max_new_tokens, **kwargs)``: the
        prompts ``B x P`` followed by the new tokens, ``B x (P + n)`` (greedy by default;
        ``do_sample``, ``attention_mask``, ``eos_token_id``, ... as documented there)."""
        return generate(self, input_ids, max_new_tokens, **kwargs)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write attnlab's own format (``config.json`` with ``"model_type":
        "attnlab_decoder"``, ``model.safetensors`` under our names) for a model whose
        ``config.family`` is ``None``; a model of a Hugging Face family is written in its
        family's format by ``attnlab.models.io.save_pretrained(model, path)``."""
        if self.config.family is not None:
            raise ValueError(f"config.family: this model is a Hugging Face {self.config.family!r}"
                             f" model, written in that format by attnlab.models.io."
                             f"save_pretrained(model, path); DecoderLM.save_pretrained writes "
                             f"attnlab's own format, for family None")
        return super().save_pretrained(path)

    def summary(self, max_depth: int = 2) -> str:
        """Print and return the per-module parameter counts."""
        text = summary(self, max_depth=max_depth)
        print(text)
        return text


class DecoderBlock(nn.Module):
    """Pre-norm block: self-attention then MLP, each with a residual. ``B x L x E``.

    Hook points: ``resid_pre``, ``attn_out``, ``resid_mid``, ``mlp_out``, ``resid_post``.
    """

    def __init__(self, config: DecoderLMConfig) -> None:
        super().__init__()
        c = config
        qk_norm = partial(RMSNorm, c.head_dim, eps=c.norm_eps,
                          unit_offset=c.norm == "rmsnorm_unit_offset") if c.qk_norm else None
        self.input_layernorm = make_norm(c, c.d_model)
        self.self_attn = SelfAttention(
            c.d_model, c.num_heads, c.kv_heads, c.head_dim,
            qkv_bias=c.resolved_bias("qkv_bias"), o_bias=c.resolved_bias("o_bias"),
            qk_norm=qk_norm, rope_interleaved=c.rope_traditional, scale=c.attention_scale,
            dropout=c.dropout, backend=c.backend)
        self.post_attention_layernorm = make_norm(c, c.d_model)
        mlp_bias = c.resolved_bias("mlp_bias")
        self.mlp = (GatedMLP(c.d_model, c.ff_dim, bias=mlp_bias, activation=_GATED[c.mlp])
                    if c.mlp in _GATED
                    else FeedForward(c.d_model, c.ff_dim, activation=c.mlp, bias=mlp_bias))
        self.drop = nn.Dropout(c.dropout)
        for point in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"):
            setattr(self, point, HookPoint())

    def forward(self, x: Tensor, *, rotary: tuple[Tensor, Tensor] | None = None,
                mask: Tensor | None = None, is_causal: bool = True,
                cache: LayerKVCache | None = None) -> Tensor:
        """x ``B x L x E``; ``rotary`` ``(cos, sin)``; ``mask`` ``B x 1 x L x S`` bool or
        ``None`` with ``is_causal``; ``cache`` this layer's ``LayerKVCache``."""
        x = self.resid_pre(x)
        h = self.self_attn(self.input_layernorm(x), rotary=rotary, mask=mask,
                           is_causal=is_causal, cache=cache)
        x = self.resid_mid(x + self.drop(self.attn_out(h)))
        h = self.mlp_out(self.mlp(self.post_attention_layernorm(x)))
        return self.resid_post(x + self.drop(h))


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


def make_norm(c: DecoderLMConfig, dim: int) -> nn.Module:
    """The config's norm over ``dim`` features."""
    if c.norm == "layernorm":
        return nn.LayerNorm(dim, eps=c.norm_eps, bias=c.resolved_bias("norm_bias"))
    return RMSNorm(dim, eps=c.norm_eps, unit_offset=c.norm == "rmsnorm_unit_offset")

