"""Phi-3 (model_type ``phi3``): the Llama layout with fused projections, as data.

- ``self_attn.qkv_proj`` holds q, k and v (``(H + 2G) D x E``), ``mlp.gate_up_proj`` gate
  and up (``2 d_ff x E``): each is split along dim 0 into our ``q/k/v_proj`` and
  ``gate/up_proj`` on the way in, and concatenated on the way out;
- no biases; RMSNorm; SwiGLU;
- ``partial_rotary_factor`` (in ``rope_parameters`` or at the top level): only the first
  ``int(head_dim * factor)`` features of each head turn (``rotary_dim``);
- ``rope_type`` ``default`` or ``longrope`` (``"su"`` and ``"yarn"`` are old spellings of
  longrope, as transformers reads them): short factors up to
  ``original_max_position_embeddings`` (the top-level key wins, default 4096, as in
  transformers) positions, long factors beyond. With a KV cache, the step that crosses that
  length recomputes the whole cache with the long factors (``DecoderLM.cache_expires``, which
  ``generate`` asks), as transformers' ``generate`` does;
- ``sliding_window`` (Phi-3-mini: 2047): each token sees itself and the ``W - 1`` before it,
  as transformers' Phi-3 masks it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from attnlab.models.config import check_value
from attnlab.models.decoder_config import DecoderLMConfig
from attnlab.models.families.base import Family, WeightMap
from attnlab.models.families.llama import read_llama_like, rope_dict, write_llama_like

__all__ = ["FAMILY", "phi3_weights", "read_phi3", "tiny_config", "write_phi3"]

# transformers' Phi3Config defaults for the keys a config.json may leave out.
_DEFAULTS = {"tie_word_embeddings": False, "max_position_embeddings": 4096,
             "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
_ROPE_TYPES = {"default": "default", "longrope": "longrope", "su": "longrope",
               "yarn": "longrope"}


def read_phi3(d: dict[str, Any]) -> DecoderLMConfig:
    """``DecoderLMConfig`` of a Phi-3 ``config.json`` object; errors name the key."""
    d = {**d, **{k: v for k, v in _DEFAULTS.items() if d.get(k) is None}}
    rope = rope_dict(d)
    kind = rope.pop("type", None) or rope.get("rope_type") or "default"
    if not isinstance(kind, str) or kind not in _ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type {kind!r} is not supported for phi3; "
                         f"expected one of {sorted(_ROPE_TYPES)}")
    rope["rope_type"] = _ROPE_TYPES[kind]
    if rope["rope_type"] == "longrope":
        rope["original_max_position_embeddings"] = check_value(
            "original_max_position_embeddings", d["original_max_position_embeddings"], int)
    factor = rope.pop("partial_rotary_factor", d.get("partial_rotary_factor"))
    factor = check_value("partial_rotary_factor", 1.0 if factor is None else factor, float)
    window = check_value("sliding_window", d.get("sliding_window"), int | None)
    # The Llama reader refuses a partial rotary: it is read here, for Phi-3.
    whole = {k: v for k, v in d.items() if k != "partial_rotary_factor"}
    c = read_llama_like({**whole, "rope_parameters": rope, "rope_scaling": None}, family="phi3",
                        qkv_bias=False, o_bias=False, mlp_bias=False, sliding_window=window)
    rotary_dim = int(c.head_dim * factor)
    if not 0.0 < factor <= 1.0 or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor: expected a number in (0, 1] that turns an "
                         f"even number >= 2 of the head_dim={c.head_dim} features, got {factor} "
                         f"({rotary_dim} features)")
    for name in ("short_factor", "long_factor"):
        given = rope.get(name)
        if isinstance(given, list) and len(given) != rotary_dim // 2:
            raise ValueError(f"rope_parameters.{name}: expected rotary_dim/2 = {rotary_dim // 2} "
                             f"numbers (head_dim={c.head_dim} x partial_rotary_factor={factor}, "
                             f"halved), got {len(given)}")
    return replace(c, rotary_dim=rotary_dim) if rotary_dim != c.head_dim else c


def write_phi3(c: DecoderLMConfig) -> dict[str, Any]:
    """A Phi-3 ``config.json`` object for ``c`` (read back by ``read_phi3`` and transformers;
    ``save_family`` refuses a ``c`` that Phi-3 cannot hold)."""
    d = write_llama_like(c, model_type="phi3", architecture="Phi3ForCausalLM", bias_keys=())
    s = c.rope_scaling
    rope: dict[str, Any] = {"rope_type": "default" if s is None else s.rope_type,
                            "rope_theta": c.rope_base,
                            "partial_rotary_factor": c.rotary_size / c.head_dim}
    if s is not None:
        rope.update({k: v for k, v in s.to_dict().items()
                     if k in ("short_factor", "long_factor", "factor", "attention_factor")
                     and v is not None})
        d["original_max_position_embeddings"] = s.original_max_position_embeddings or c.max_len
    # No pad id: transformers' default (32000) is outside a small vocabulary.
    d.update(rope_parameters=rope, sliding_window=c.sliding_window, pad_token_id=None)
    return d


def phi3_weights(c: DecoderLMConfig) -> WeightMap:
    """``model.`` + our names, ``qkv_proj`` and ``gate_up_proj`` split; ``lm_head`` unless
    tied."""
    layer: dict[str, str | tuple[str, ...]] = {
        n: n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                       "self_attn.o_proj.weight", "mlp.down_proj.weight")}
    layer["self_attn.qkv_proj.weight"] = tuple(f"self_attn.{p}_proj.weight" for p in "qkv")
    layer["mlp.gate_up_proj.weight"] = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
    names: dict[str, str | tuple[str, ...]] = {
        "model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight"}
    for stored, ours in layer.items():
        names[f"model.layers.{{}}.{stored}"] = (
            f"layers.{{}}.{ours}" if isinstance(ours, str)
            else tuple(f"layers.{{}}.{p}" for p in ours))
    if not c.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return WeightMap(names)


def tiny_config(**overrides: Any) -> DecoderLMConfig:
    """A tiny Phi-3 (``E = 32``, 4 heads of 8, 2 KV heads, 2 layers, ``V = 96``, half the
    features rotary) for tests of code that runs on every family; ``overrides`` are
    ``config.json`` keys (``sliding_window=4``)."""
    d = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "partial_rotary_factor": 0.5}
    return read_phi3({**d, **overrides})


# Published shapes (the model's config.json): Phi-3 mini with a 4k context, full attention
# heads (32 key-value heads) and a window of 2047 tokens.
PRESETS = {
    "phi-3-mini-4k": {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
                      "num_hidden_layers": 32, "num_attention_heads": 32,
                      "num_key_value_heads": 32, "max_position_embeddings": 4096,
                      "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                      "rope_theta": 10000.0, "sliding_window": 2047,
                      "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 32000,
                      "pad_token_id": 32000},
}

FAMILY = Family(name="phi3", model_types=("phi3",), architecture="Phi3ForCausalLM",
                config_from_hf=read_phi3, config_to_hf=write_phi3, weights=phi3_weights,
                presets=PRESETS)
