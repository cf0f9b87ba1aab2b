"""Qwen2: the Llama layout with q/k/v biases (no o_proj bias), ``rope_theta`` 1e6 typically.

Its sliding window (``use_sliding_window``, layers from ``max_window_layers`` on, or
``layer_types`` naming ``sliding_attention``) is refused: released Qwen2 and Qwen3
checkpoints ship with it off, and a model that silently attended to everything would be wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnlab.models.config import check_value
from attnlab.models.decoder_config import DecoderLMConfig
from attnlab.models.families.base import Family
from attnlab.models.families.llama import (
    LLAMA_DEFAULTS,
    llama_like_weights,
    read_llama_like,
    write_llama_like,
)

__all__ = ["FAMILY", "QWEN_DEFAULTS", "refuse_sliding_window"]

# transformers' Qwen2Config (and Qwen3Config) defaults that differ from Llama's.
QWEN_DEFAULTS = {**LLAMA_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 32,
                 "bos_token_id": None, "eos_token_id": None}


def read_qwen2(d: Mapping[str, Any]) -> DecoderLMConfig:
    """``DecoderLMConfig`` of a Qwen2 ``config.json``: Llama's keys, q/k/v biases always."""
    refuse_sliding_window(d, "qwen2")
    return read_llama_like(d, family="qwen2", defaults=QWEN_DEFAULTS, qkv_bias=True,
                           o_bias=False, mlp_bias=False)


def refuse_sliding_window(d: Mapping[str, Any], family: str) -> None:
    """A ``ValueError`` naming the key when a Qwen config turns its sliding window on."""
    if check_value("use_sliding_window", d.get("use_sliding_window"), bool | None):
        raise ValueError(f"use_sliding_window=true is not supported for {family}; expected "
                         "false (every layer attending to all earlier tokens)")
    layer_types = check_value("layer_types", d.get("layer_types"), list[str] | None) or []
    sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if sliding:
        raise ValueError(f"layer_types[{sliding[0]}]={layer_types[sliding[0]]!r} is not "
                         f"supported for {family}; expected 'full_attention' for every layer")


def write_qwen2(c: DecoderLMConfig) -> dict[str, Any]:
    """A Qwen2 ``config.json`` object for ``c``."""
    d = write_llama_like(c, model_type="qwen2", architecture="Qwen2ForCausalLM", bias_keys=())
    return {**d, "use_sliding_window": False}


# Published shapes (the model's config.json): Qwen2.5 0.5B.
PRESETS = {
    "qwen2.5-0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "max_position_embeddings": 32768,
                     "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                     "bos_token_id": 151643, "eos_token_id": 151643},
}

FAMILY = Family(name="qwen2", model_types=("qwen2",), architecture="Qwen2ForCausalLM",
                config_from_hf=read_qwen2, config_to_hf=write_qwen2, weights=llama_like_weights,
                presets=PRESETS)
