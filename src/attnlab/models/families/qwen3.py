"""Qwen3: the Llama layout with an RMSNorm on each query and key head (``q_norm``,
``k_norm``, over ``head_dim`` features, before RoPE), ``head_dim`` given explicitly (128 when
absent, as transformers reads it, not ``hidden_size / num_attention_heads``) and q/k/v/o
biases only with ``attention_bias``. Its sliding window is refused, as Qwen2's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnlab.models.decoder_config import DecoderLMConfig
from attnlab.models.families.base import Family
from attnlab.models.families.llama import llama_like_weights, read_llama_like, write_llama_like
from attnlab.models.families.qwen2 import QWEN_DEFAULTS, refuse_sliding_window

__all__ = ["FAMILY"]

_DEFAULTS = {**QWEN_DEFAULTS, "head_dim": 128}


def read_qwen3(d: Mapping[str, Any]) -> DecoderLMConfig:
    """``DecoderLMConfig`` of a Qwen3 ``config.json``: Llama's keys plus q/k norms."""
    refuse_sliding_window(d, "qwen3")
    return read_llama_like(d, family="qwen3", defaults=_DEFAULTS, qk_norm=True,
                           mlp_bias=False)


def write_qwen3(c: DecoderLMConfig) -> dict[str, Any]:
    """A Qwen3 ``config.json`` object for ``c``."""
    d = write_llama_like(c, model_type="qwen3", architecture="Qwen3ForCausalLM",
                         bias_keys=("attention_bias",))
    return {**d, "use_sliding_window": False}


# Published shapes (the model's config.json): Qwen3 0.6B, heads of 128 wider than 1024 / 16.
PRESETS = {
    "qwen3-0.6b": {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                   "rope_theta": 1000000.0, "tie_word_embeddings": True,
                   "bos_token_id": 151643, "eos_token_id": 151645},
}

FAMILY = Family(name="qwen3", model_types=("qwen3",), architecture="Qwen3ForCausalLM",
                config_from_hf=read_qwen3, config_to_hf=write_qwen3, weights=llama_like_weights,
                presets=PRESETS)
