"""The model families ``attnlab.models.from_pretrained`` reads, by ``config.json`` ``model_type``.

Each module holds one family's config mapping and weight-name map (``base.Family``); the
model is always ``DecoderLM``.
"""

from attnlab.models.families import gemma, gpt2, llama, mistral, phi3, qwen2, qwen3
from attnlab.models.families.base import Family, WeightMap

FAMILIES: dict[str, Family] = {
    model_type: module.FAMILY
    for module in (llama, mistral, qwen2, qwen3, gemma, gpt2, phi3)
    for model_type in module.FAMILY.model_types
}

__all__ = ["FAMILIES", "Family", "WeightMap", "family_for"]


def family_for(model_type: object) -> Family:
    """The family that reads ``model_type``; else a ``ValueError`` naming the supported ones."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; expected one of "
                         f"{sorted(FAMILIES)}")
    return FAMILIES[model_type]
