"""Gemma (model_type ``gemma``): the Llama layout with Gemma's three differences, as data.

- token embeddings times ``sqrt(hidden_size)``, the factor rounded to the weights' dtype
  (``embedding_scale``);
- RMSNorm scaling by ``1 + w`` (``norm="rmsnorm_unit_offset"``), the product taken in float32
  before the cast back, as transformers' ``GemmaRMSNorm``;
- GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))``; ``hidden_act`` ``"gelu"`` reads as the tanh
  approximation, as transformers 5 does (the released configs say ``"gelu"`` and mean it).

``head_dim`` is explicit (256 when absent, transformers' default; 2B: 8 heads of 256 in a
2048-wide model), the head tied to the embedding unless ``tie_word_embeddings`` is false.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from attnlab.models.config import check_value
from attnlab.models.decoder_config import DecoderLMConfig
from attnlab.models.families.base import Family
from attnlab.models.families.llama import llama_like_weights, read_llama_like, write_llama_like

__all__ = ["FAMILY", "read_gemma", "tiny_config", "write_gemma"]

ACTIVATION = "gelu_pytorch_tanh"
_MAX_WIDTH = 2**63 - 1  # torch's largest size
# transformers' GemmaConfig defaults for the keys a config.json may leave out.
_DEFAULTS = {"head_dim": 256, "tie_word_embeddings": True, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-6}


def read_gemma(d: dict[str, Any]) -> DecoderLMConfig:
    """``DecoderLMConfig`` of a Gemma ``config.json`` object; errors name the key."""
    act = d.get("hidden_act", ACTIVATION)
    # transformers 4 read `hidden_activation` first; 5 ignores it: refuse a disagreement.
    legacy = check_value("hidden_activation", d.get("hidden_activation"), str | None)
    if legacy not in (None, ACTIVATION):
        raise ValueError(f"hidden_activation {legacy!r} is not supported for gemma; expected "
                         f"{ACTIVATION!r} or null")
    if check_value("use_bidirectional_attention", d.get("use_bidirectional_attention"),
                   bool | None):
        raise ValueError("use_bidirectional_attention=true is not supported for gemma (a "
                         "causal LM); expected false or null")
    d = {**d, **{k: v for k, v in _DEFAULTS.items() if d.get(k) is None},
         "hidden_act": ACTIVATION if act == "gelu" else act}
    c = read_llama_like(d, family="gemma", activation=ACTIVATION, norm="rmsnorm_unit_offset",
                        mlp="geglu", mlp_bias=False)
    if c.d_model > _MAX_WIDTH:  # sqrt would overflow a float; no model is that wide
        raise ValueError(f"hidden_size: expected at most {_MAX_WIDTH}, got a "
                         f"{len(str(c.d_model))}-digit number")
    return replace(c, embedding_scale=math.sqrt(c.d_model))


def write_gemma(c: DecoderLMConfig) -> dict[str, Any]:
    """A Gemma ``config.json`` object for ``c`` (read back by ``read_gemma`` and transformers;
    ``save_family`` refuses a ``c`` that Gemma cannot hold, a plain RMSNorm say)."""
    d = write_llama_like(c, model_type="gemma", architecture="GemmaForCausalLM",
                         bias_keys=("attention_bias",))  # Gemma has no MLP biases
    return {**d, "hidden_act": ACTIVATION}


def tiny_config(**overrides: Any) -> DecoderLMConfig:
    """A tiny Gemma (``E = 32``, 4 heads of 16, 2 KV heads, 2 layers, ``V = 96``) for tests of
    code that runs on every family; ``overrides`` are ``config.json`` keys (``head_dim=8``)."""
    d = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 128}
    return read_gemma({**d, **overrides})


# Published shapes (the model's config.json): Gemma 2B, one key-value head.
PRESETS = {
    "gemma-2b": {"vocab_size": 256000, "hidden_size": 2048, "intermediate_size": 16384,
                 "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
                 "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                 "rope_theta": 10000.0, "hidden_act": ACTIVATION, "tie_word_embeddings": True,
                 "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
}

FAMILY = Family(name="gemma", model_types=("gemma",), architecture="GemmaForCausalLM",
                config_from_hf=read_gemma, config_to_hf=write_gemma, weights=llama_like_weights,
                presets=PRESETS)
