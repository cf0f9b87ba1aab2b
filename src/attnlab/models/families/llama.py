"""Llama (and the layout Mistral, Qwen2, Qwen3 and Gemma share): ``config.json`` <-> config,
stored names <-> ours.

Llama: RMSNorm, SwiGLU, RoPE (``rope_scaling`` types ``linear``, ``dynamic``, ``yarn``,
``llama3``), no biases unless ``attention_bias`` (q/k/v and o) or ``mlp_bias``, GQA.
``read_llama_like`` reads the keys the family shares, so another family states only what
differs (``**fixed`` fields, or a check before calling it).
"""

from __future__ import annotations

from typing import Any

from attnlab.layers.rope_scaling import RopeScaling
from attnlab.models.config import check_value
from attnlab.models.decoder import DecoderLMConfig
from attnlab.models.families.base import Family, WeightMap

__all__ = ["FAMILY", "llama_like_weights", "read_llama_like", "write_llama_like"]

REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")

# config.json key -> DecoderLMConfig field, for the keys copied as they are.
_COPIED = {"vocab_size": "vocab_size", "hidden_size": "d_model",
           "intermediate_size": "d_ff", "num_hidden_layers": "num_layers",
           "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
           "head_dim": "head_dim", "rms_norm_eps": "norm_eps",
           "max_position_embeddings": "max_len", "tie_word_embeddings": "tie_embeddings",
           "initializer_range": "initializer_range", "bos_token_id": "bos_token_id",
           "eos_token_id": "eos_token_id"}


def read_llama_like(d: dict[str, Any], *, family: str, activation: str = "silu",
                    **fixed: Any) -> DecoderLMConfig:
    """A ``DecoderLMConfig`` from a Llama-layout ``config.json`` object.

    Reads the sizes, ``rms_norm_eps``, the RoPE base (``rope_theta``, or
    ``rope_parameters.rope_theta`` in transformers 5) and scaling, ``attention_bias``,
    ``mlp_bias``, ``tie_word_embeddings``, token ids; ``hidden_act`` must be ``activation``.
    ``fixed`` overrides fields (e.g. ``qkv_bias=True`` for Qwen2). Keys it does not use are
    ignored, as transformers does. Errors name the key.
    """
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise ValueError(f"missing key {missing[0]!r}; expected all of {REQUIRED}")
    act = check_value("hidden_act", d.get("hidden_act", activation), str)
    if act != activation:
        raise ValueError(f"hidden_act {act!r} is not supported for {family}; expected "
                         f"{activation!r}")
    fields: dict[str, Any] = {ours: d[key] for key, ours in _COPIED.items()
                              if d.get(key) is not None}
    rope, theta = rope_of(d)
    bias = check_value("attention_bias", d.get("attention_bias", False), bool)
    fields.update(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=bias,
                  o_bias=bias, mlp_bias=check_value("mlp_bias", d.get("mlp_bias", False), bool),
                  rope_base=theta, rope_scaling=rope, family=family)
    fields.setdefault("tie_embeddings", False)
    fields.setdefault("norm_eps", 1e-6)
    fields.setdefault("max_len", 2048)
    fields.update(fixed)
    return DecoderLMConfig(**fields)


def rope_of(d: dict[str, Any]) -> tuple[RopeScaling | None, float]:
    """``(scaling or None for plain RoPE, rope_theta)`` from ``rope_parameters`` (transformers
    5) or ``rope_scaling`` + ``rope_theta`` (4)."""
    parameters, scaling = (check_value(k, d.get(k), dict | None) or {}
                           for k in ("rope_parameters", "rope_scaling"))
    rope = {**scaling, **parameters}
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    scaled = RopeScaling.from_hf(rope, source="rope_parameters" if parameters else "rope_scaling")
    return (None if scaled.rope_type == "default" else scaled), check_value("rope_theta", theta,
                                                                             float)


def write_llama_like(c: DecoderLMConfig, *, model_type: str, architecture: str
                     ) -> dict[str, Any]:
    """The ``config.json`` keys shared by the Llama layout (readable by ``read_llama_like``
    and by transformers)."""
    d: dict[str, Any] = {key: getattr(c, ours) for key, ours in _COPIED.items()}
    d.update(intermediate_size=c.ff_dim, num_key_value_heads=c.kv_heads,
             eos_token_id=list(c.eos_token_id) or None, model_type=model_type,
             architectures=[architecture], hidden_act="silu",
             attention_bias=c.resolved_bias("qkv_bias"), mlp_bias=c.resolved_bias("mlp_bias"),
             rope_parameters={"rope_theta": c.rope_base,
                              **(c.rope_scaling.to_dict() if c.rope_scaling is not None
                                 else {"rope_type": "default"})})
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


FAMILY = Family(
    name="llama", model_types=("llama",), architecture="LlamaForCausalLM",
    config_from_hf=lambda d: read_llama_like(d, family="llama"),
    config_to_hf=lambda c: write_llama_like(c, model_type="llama",
                                            architecture="LlamaForCausalLM"),
    weights=llama_like_weights,
)
