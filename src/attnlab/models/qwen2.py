"""The Qwen2 names of attnlab before the one decoder stack, kept working: ``Qwen2Config``
takes the keys of a Hugging Face Qwen2 ``config.json`` and gives the ``DecoderLMConfig`` of
the qwen2 family; ``Qwen2ForCausalLM`` is ``DecoderLM`` (its ``save_pretrained`` writes a
Qwen2 folder, its ``from_pretrained`` reads one).

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(config)
"""

from __future__ import annotations

from typing import Any

from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderLMConfig
from attnlab.models.families.qwen2 import FAMILY

__all__ = ["Qwen2Config", "Qwen2ForCausalLM"]

Qwen2ForCausalLM = DecoderLM


def Qwen2Config(**keys: Any) -> DecoderLMConfig:  # noqa: N802 - the name it had as a class
    """The ``DecoderLMConfig`` of a Qwen2 ``config.json`` with these keys (Hugging Face's
    names: ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ...). ``num_key_value_heads`` defaults
    to ``num_attention_heads``, as it did; the other defaults are transformers'. A missing
    key or a value of the wrong type is refused naming it."""
    if "num_attention_heads" in keys:
        keys.setdefault("num_key_value_heads", keys["num_attention_heads"])
    return FAMILY.config_from_hf({**keys, "model_type": "qwen2"})
