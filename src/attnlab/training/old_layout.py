"""Checkpoints written by attnlab before the one decoder stack: their ``DecoderLM`` tensor
names, mapped onto today's (a ``WeightMap``, as a model family's names are).

The old ``DecoderLM`` named its parts ``embed``, ``pos``, ``blocks.{i}.norm1``/``norm2``,
``blocks.{i}.attn`` (``MultiHeadAttention``: one fused ``in_proj_weight``/``in_proj_bias``
holding q, k, v stacked along dim 0, as ``torch.nn.MultiheadAttention`` does, and
``out_proj``) and ``blocks.{i}.mlp``; today's are Hugging Face's (``embed_tokens``,
``embed_positions``, ``layers.{i}.input_layernorm``, ``self_attn.q_proj`` ...). The values
and the config fields are unchanged: only the names move and the fused projection splits.
"""

from __future__ import annotations

from collections.abc import Collection

from attnlab.models.families.base import WeightMap

__all__ = ["OLD_DECODER_LM", "is_old_decoder_lm"]

_ATTN = "layers.{}.self_attn."
_MLP = ("linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias",
        "gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias",
        "down_proj.weight", "down_proj.bias")

OLD_DECODER_LM = WeightMap({
    "embed.weight": "embed_tokens.weight",
    "pos.weight": "embed_positions.weight",
    "blocks.{}.norm1.weight": "layers.{}.input_layernorm.weight",
    "blocks.{}.norm1.bias": "layers.{}.input_layernorm.bias",
    "blocks.{}.attn.in_proj_weight": tuple(_ATTN + f"{p}_proj.weight" for p in "qkv"),
    "blocks.{}.attn.in_proj_bias": tuple(_ATTN + f"{p}_proj.bias" for p in "qkv"),
    "blocks.{}.attn.out_proj.weight": _ATTN + "o_proj.weight",
    "blocks.{}.attn.out_proj.bias": _ATTN + "o_proj.bias",
    "blocks.{}.norm2.weight": "layers.{}.post_attention_layernorm.weight",
    "blocks.{}.norm2.bias": "layers.{}.post_attention_layernorm.bias",
    **{f"blocks.{{}}.mlp.{name}": f"layers.{{}}.mlp.{name}" for name in _MLP},
    "norm.weight": "norm.weight",
    "norm.bias": "norm.bias",
    "lm_head.weight": "lm_head.weight",
})


def is_old_decoder_lm(names: Collection[str]) -> bool:
    """Whether stored tensor ``names`` are the old ``DecoderLM``'s (its token embedding was
    ``embed``, its blocks ``blocks``; one of them is stored even when the head is tied)."""
    return any(name == "embed.weight" or name.startswith("blocks.") for name in names)
