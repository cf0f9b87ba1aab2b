"""Llama (and the layout Mistral, Qwen2, Qwen3 and Gemma share): ``config.json`` <-> config,
stored names <-> ours.

Llama: RMSNorm, SwiGLU, RoPE (``rope_scaling`` types ``linear``, ``dynamic``, ``yarn``,
``llama3``), no biases unless ``attention_bias`` (q/k/v and o) or ``mlp_bias``, GQA.
``read_llama_like`` reads the keys the family shares, so another family states only what
differs (its transformers defaults, ``**fixed`` fields, or a check before calling it).

Dynamic NTK RoPE has no length limit in transformers: past ``max_position_embeddings`` ``M``
it raises the base. Our positions are bounded by ``max_len``, so a dynamic model reads as
``max_len = ceil(factor * M)`` (the context the scaling is for) with ``M`` kept as the
scaling's ``original_max_position_embeddings``, where the rotary embedding starts scaling;
``save_pretrained`` writes ``M`` back as ``max_position_embeddings``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from attnlab.layers.rope_scaling import RopeScaling
from attnlab.models.config import check_value
from attnlab.models.decoder_config import DecoderLMConfig
from attnlab.models.families.base import Family, WeightMap

__all__ = ["FAMILY", "llama_like_weights", "read_llama_like", "rope_dict", "rope_of",
           "rope_parameters_of", "write_llama_like"]

REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")

# config.json key -> (DecoderLMConfig field, the type transformers accepts), for the keys
# copied as they are. A JSON null takes the default only where transformers allows None.
_COPIED: dict[str, tuple[str, Any]] = {
    "vocab_size": ("vocab_size", int), "hidden_size": ("d_model", int),
    "intermediate_size": ("d_ff", int), "num_hidden_layers": ("num_layers", int),
    "num_attention_heads": ("num_heads", int), "num_key_value_heads": ("num_kv_heads", int | None),
    "head_dim": ("head_dim", int | None), "rms_norm_eps": ("norm_eps", float),
    "max_position_embeddings": ("max_len", int), "tie_word_embeddings": ("tie_embeddings", bool),
    "initializer_range": ("initializer_range", float), "bos_token_id": ("bos_token_id", int | None),
    "eos_token_id": ("eos_token_id", int | list[int] | None)}
# transformers' LlamaConfig defaults for the optional keys; other families pass their own.
LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
                  "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 1,
                  "eos_token_id": 2}
# The rope_parameters keys transformers reads for each rope_type (its validation warns about
# any other), besides rope_type and rope_theta.
_ROPE_KEYS = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
              "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                       "mscale", "mscale_all_dim", "attention_factor", "truncate"),
              "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
                         "high_freq_factor"),
              "longrope": ("short_factor", "long_factor", "original_max_position_embeddings",
                           "attention_factor", "factor")}
# DecoderLMConfig field -> the config.json key it comes from, to word its errors.
_HF_NAME = {**{ours: key for key, (ours, _) in _COPIED.items()}, "rope_base": "rope_theta",
            "rotary_dim": "head_dim"}
_OUR_NAMES = re.compile(r"\b(" + "|".join(_HF_NAME) + r")\b")


def read_llama_like(d: Mapping[str, Any], *, family: str, activation: str = "silu",
                    defaults: Mapping[str, Any] = LLAMA_DEFAULTS, **fixed: Any
                    ) -> DecoderLMConfig:
    """A ``DecoderLMConfig`` from a Llama-layout ``config.json`` object ``d``.

    Reads the sizes, ``rms_norm_eps``, the RoPE base (``rope_theta``, or
    ``rope_parameters.rope_theta`` in transformers 5) and scaling, ``attention_bias``,
    ``mlp_bias``, ``tie_word_embeddings``, token ids; ``hidden_act`` must be ``activation``.
    ``defaults`` are the family's transformers defaults for absent keys (config.json names);
    ``fixed`` overrides fields (e.g. ``qkv_bias=True`` for Qwen2). Keys it does not use are
    ignored, as transformers does. Every error names the config.json key.
    """
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise ValueError(f"missing key {missing[0]!r}; expected all of {REQUIRED}")
    act = check_value("hidden_act", d.get("hidden_act", activation), str)
    if act != activation:
        raise ValueError(f"hidden_act {act!r} is not supported for {family}; expected "
                         f"{activation!r}")
    fields: dict[str, Any] = {}
    for key, (ours, hint) in _COPIED.items():
        if key in d or key in defaults:
            value = check_value(key, d[key] if key in d else defaults[key], hint)
            if value is not None:
                fields[ours] = value
    bias, mlp_bias = (check_value(key, d.get(key, False), bool)
                      for key in ("attention_bias", "mlp_bias"))
    rope, theta = rope_of(d)
    for source in (d, d.get("rope_parameters") or {}):
        # transformers' Llama attention rotates whole heads: a fraction would not even run.
        if source.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor: expected 1.0 for {family} (every "
                             f"feature rotated), got {source['partial_rotary_factor']!r}")
    if rope is not None and rope.rope_type == "dynamic":
        if rope.factor < 1:  # it would shrink the context below the one trained on
            raise ValueError(f"rope_parameters: factor: expected a number >= 1 for dynamic, "
                             f"got {rope.factor}")
        original = fields["max_len"]
        rope = RopeScaling(rope_type="dynamic", factor=rope.factor,
                           original_max_position_embeddings=original)
        fields["max_len"] = math.ceil(rope.factor * original)
    fields.update(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=bias,
                  o_bias=bias, mlp_bias=mlp_bias, rope_base=theta,
                  rope_scaling=rope, family=family)
    fields.update(fixed)
    try:
        return DecoderLMConfig(**fields)
    except (TypeError, ValueError) as error:  # say it in config.json's words
        raise type(error)(_OUR_NAMES.sub(lambda m: _HF_NAME[m.group(1)], str(error))) from None


def rope_of(d: Mapping[str, Any]) -> tuple[RopeScaling | None, float]:
    """``(scaling or None for plain RoPE, rope_theta)`` from ``rope_parameters`` (transformers
    5) or ``rope_scaling`` + ``rope_theta`` (4)."""
    rope = rope_dict(d)
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    source = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    scaled = RopeScaling.from_hf(rope, source=source)
    theta = check_value("rope_theta", theta, float)
    if theta <= 1:  # base^(-2i/D) must fall with i: slower rotations for later features
        raise ValueError(f"rope_theta: expected a number > 1, got {theta}")
    return (None if scaled.rope_type == "default" else scaled), theta


def rope_dict(d: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE keys of a ``config.json`` object ``d``: its ``rope_scaling`` (transformers 4)
    updated by its ``rope_parameters`` (5), each an object or null (a ``TypeError`` naming
    the key otherwise)."""
    scaling, parameters = (check_value(k, d.get(k), dict | None) or {}
                           for k in ("rope_scaling", "rope_parameters"))
    return {**scaling, **parameters}


def rope_parameters_of(c: DecoderLMConfig) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` for ``c``: ``rope_type``, ``rope_theta`` and only
    the keys that type reads (a ``None`` field left out, a yarn ``factor`` made explicit)."""
    s = c.rope_scaling or RopeScaling()
    original = s.original_max_position_embeddings or c.max_len
    values = {**s.to_dict(), "original_max_position_embeddings": original,
              "factor": c.max_len / original if s.factor is None else s.factor}
    return {"rope_type": s.rope_type, "rope_theta": c.rope_base,
            **{k: values[k] for k in _ROPE_KEYS[s.rope_type] if values[k] is not None}}


def write_llama_like(c: DecoderLMConfig, *, model_type: str, architecture: str,
                     bias_keys: tuple[str, ...] = ("attention_bias", "mlp_bias")
                     ) -> dict[str, Any]:
    """The ``config.json`` keys shared by the Llama layout (readable by ``read_llama_like``
    and by transformers); of the bias switches, only the ``bias_keys`` that the family's
    format has (``attention_bias`` for q/k/v and o, ``mlp_bias``)."""
    d: dict[str, Any] = {key: getattr(c, ours) for key, (ours, _) in _COPIED.items()}
    rope = rope_parameters_of(c)
    if rope["rope_type"] == "dynamic":  # transformers' dynamic scales from here on
        d["max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings
    d.update(intermediate_size=c.ff_dim, num_key_value_heads=c.kv_heads,
             eos_token_id=list(c.eos_token_id) or None, model_type=model_type,
             architectures=[architecture], hidden_act="silu", rope_parameters=rope)
    biases = {"attention_bias": c.resolved_bias("qkv_bias"),
              "mlp_bias": c.resolved_bias("mlp_bias")}
    d.update({key: biases[key] for key in bias_keys})
    return d


def llama_like_weights(c: DecoderLMConfig) -> WeightMap:
    """``model.`` + our names (Llama, Mistral, Qwen2, Qwen3, Gemma), ``lm_head`` unless tied."""
    names = {"model.embed_tokens.weight": "embed_tokens.weight",
             "model.norm.weight": "norm.weight"}
    layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
             *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
             *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))]
    if c.resolved_bias("qkv_bias"):
        layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if c.resolved_bias("o_bias"):
        layer.append("self_attn.o_proj.bias")
    if c.resolved_bias("mlp_bias"):
        layer += [f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
    if c.qk_norm:
        layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names.update({f"model.layers.{{}}.{n}": f"layers.{{}}.{n}" for n in layer})
    if not c.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return WeightMap(names)


# Published shapes (the models' config.json): Llama 3.2 1B and Llama 3.1 8B, both with the
# llama3 RoPE scaling of a model trained at 8192 positions.
_LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
PRESETS = {
    "llama-3.2-1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                     "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3, "factor": 32.0},
                     "tie_word_embeddings": True, "bos_token_id": 128000,
                     "eos_token_id": 128001},
    "llama-3.1-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "max_position_embeddings": 131072,
                     "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": {**_LLAMA3, "factor": 8.0}, "tie_word_embeddings": False,
                     "bos_token_id": 128000, "eos_token_id": 128001},
}

FAMILY = Family(
    name="llama", model_types=("llama",), architecture="LlamaForCausalLM",
    config_from_hf=lambda d: read_llama_like(d, family="llama"),
    config_to_hf=lambda c: write_llama_like(c, model_type="llama",
                                            architecture="LlamaForCausalLM"),
    weights=llama_like_weights, presets=PRESETS,
)
