"""The model families ``attnlab.models.from_pretrained`` reads, by ``config.json`` ``model_type``.

Each module holds one family's config mapping, weight-name map and presets (``base.Family``);
the model is always ``DecoderLM``.
"""

from typing import Any

from attnlab.models.decoder_config import DecoderLMConfig
from attnlab.models.families import gemma, gpt2, llama, mistral, phi3, qwen2, qwen3
from attnlab.models.families.base import Family, WeightMap

_MODULES = (llama, mistral, qwen2, qwen3, gemma, gpt2, phi3)
FAMILIES: dict[str, Family] = {
    model_type: module.FAMILY for module in _MODULES for model_type in module.FAMILY.model_types
}
# Every family's presets, by name (names are unique across families).
PRESETS: dict[str, Family] = {name: module.FAMILY for module in _MODULES
                              for name in module.FAMILY.presets}

__all__ = ["FAMILIES", "PRESETS", "Family", "WeightMap", "family_for", "preset"]


def family_for(model_type: object) -> Family:
    """The family that reads ``model_type``; else a ``ValueError`` naming the supported ones."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; expected one of "
                         f"{sorted(FAMILIES)}")
    return FAMILIES[model_type]


def preset(name: str, **overrides: Any) -> DecoderLMConfig:
    """The ``DecoderLMConfig`` of a published model's shape (``PRESETS``: ``"qwen2.5-0.5b"``,
    ``"llama-3.2-1b"``, ``"gpt2"``, ...), read by its family as from its ``config.json``;
    ``overrides`` are ``config.json`` keys (``num_hidden_layers=2``). The weights are the
    model's own random initialisation: ``from_pretrained`` reads trained ones."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"name: expected one of {sorted(PRESETS)}, got {name!r}")
    family = PRESETS[name]
    return family.config_from_hf({"model_type": family.model_types[0],
                                  **family.presets[name], **overrides})
