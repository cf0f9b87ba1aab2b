"""Mistral: the Llama layout without biases, every layer attending within a sliding window.

``sliding_window`` ``W`` (4096 when absent, as transformers reads it; ``null`` for none):
each token sees itself and the ``W - 1`` tokens before it, in the cache too
(``DecoderLMConfig.sliding_window``).
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

__all__ = ["FAMILY"]

# transformers' MistralConfig defaults that differ from Llama's.
_DEFAULTS = {**LLAMA_DEFAULTS, "max_position_embeddings": 4096 * 32, "num_key_value_heads": 8}


def read_mistral(d: Mapping[str, Any]) -> DecoderLMConfig:
    """``DecoderLMConfig`` of a Mistral ``config.json``: Llama's keys and ``sliding_window``."""
    window = check_value("sliding_window", d.get("sliding_window", 4096), int | None)
    if window is not None and window < 1:
        raise ValueError(f"sliding_window: expected a positive int or null, got {window}")
    return read_llama_like(d, family="mistral", defaults=_DEFAULTS, sliding_window=window,
                           qkv_bias=False, o_bias=False, mlp_bias=False)


def write_mistral(c: DecoderLMConfig) -> dict[str, Any]:
    """A Mistral ``config.json`` object for ``c``."""
    d = write_llama_like(c, model_type="mistral", architecture="MistralForCausalLM",
                         bias_keys=())
    return {**d, "sliding_window": c.sliding_window}


# Published shapes (the model's config.json): Mistral 7B v0.1, its window of 4096 tokens.
PRESETS = {
    "mistral-7b-v0.1": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                        "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "max_position_embeddings": 32768,
                        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4096,
                        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
}

FAMILY = Family(name="mistral", model_types=("mistral",), architecture="MistralForCausalLM",
                config_from_hf=read_mistral, config_to_hf=write_mistral,
                weights=llama_like_weights, presets=PRESETS)
