"""Qwen2: the Llama layout with q/k/v biases (no o_proj bias), ``rope_theta`` 1e6 typically.

Its sliding window (``use_sliding_window``, layers from ``max_window_layers`` on) is refused:
released Qwen2 checkpoints ship with it off.
"""

from __future__ import annotations

from typing import Any

from attnlab.models.config import check_value
from attnlab.models.decoder import DecoderLMConfig
from attnlab.models.families.base import Family
from attnlab.models.families.llama import llama_like_weights, read_llama_like, write_llama_like

__all__ = ["FAMILY"]


def read_qwen2(d: dict[str, Any]) -> DecoderLMConfig:
    """``DecoderLMConfig`` of a Qwen2 ``config.json``: Llama's keys, q/k/v biases always."""
    if check_value("use_sliding_window", d.get("use_sliding_window"), bool | None):
        raise ValueError("use_sliding_window=true is not supported for qwen2; expected false")
    return read_llama_like(d, family="qwen2", qkv_bias=True, o_bias=False, mlp_bias=False)


def write_qwen2(c: DecoderLMConfig) -> dict[str, Any]:
    """A Qwen2 ``config.json`` object for ``c``."""
    d = write_llama_like(c, model_type="qwen2", architecture="Qwen2ForCausalLM")
    for key in ("attention_bias", "mlp_bias"):
        del d[key]
    return {**d, "use_sliding_window": False}


FAMILY = Family(name="qwen2", model_types=("qwen2",), architecture="Qwen2ForCausalLM",
                config_from_hf=read_qwen2, config_to_hf=write_qwen2, weights=llama_like_weights)
