"""What a model family is to attnlab: a config mapping and a weight-name map, as data.

A ``Family`` says how a Hugging Face ``config.json`` of its ``model_type`` becomes a
``DecoderLMConfig`` (and back), and how its stored tensor names become ``DecoderLM``'s
(``WeightMap``: name patterns, plus the few transposes and splits that a format needs). The
forward pass is ``DecoderLM``'s for every family; a family module holds no model code.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnlab.models.decoder import DecoderLMConfig

__all__ = ["Family", "WeightMap"]

_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class WeightMap:
    """Stored (Hugging Face) tensor names <-> ``DecoderLM`` state-dict names.

    ``names``: stored pattern -> our pattern, ``{}`` standing for the layer index
    (``"model.layers.{}.self_attn.q_proj.weight" -> "layers.{}.self_attn.q_proj.weight"``).
    A tuple of our patterns means the stored tensor is theirs concatenated along dim 0
    (Phi-3's ``qkv_proj``, GPT-2's ``c_attn``); it is split by our tensors' sizes.
    ``transposed``: stored patterns kept ``in x out`` (GPT-2's ``Conv1D``), transposed to our
    ``out x in`` on the way in and back on the way out.
    """

    names: Mapping[str, str | tuple[str, ...]]
    transposed: frozenset[str] = field(default_factory=frozenset)

    def to_ours(self, stored: Mapping[str, Tensor], shapes: Mapping[str, torch.Size]
                ) -> dict[str, Tensor]:
        """Stored tensors -> ours; ``shapes`` are our state dict's (for the splits).

        A stored name that matches no pattern raises a ``ValueError`` naming it.
        """
        ours: dict[str, Tensor] = {}
        for name, t in stored.items():
            pattern, index = _pattern(name)
            if pattern not in self.names:
                raise ValueError(f"unexpected tensor {name!r}: no weight of this family is "
                                 f"stored under that name")
            if pattern in self.transposed:
                t = t.t()
            target = self.names[pattern]
            if isinstance(target, str):
                ours[target.format(index)] = t
                continue
            parts = [p.format(index) for p in target]
            for part, piece in zip(parts, t.split([shapes[p][0] for p in parts])):
                ours[part] = piece
        return ours

    def to_stored(self, ours: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Our tensors -> the stored names and layouts (the inverse of ``to_ours``).

        Our names that no pattern produces (a tied ``lm_head``) are left out.
        """
        # A stored tensor is written when we meet the first of the tensors it is made of.
        first = {((t,) if isinstance(t, str) else t)[0]: (stored, (t,) if isinstance(t, str) else t)
                 for stored, t in self.names.items()}
        out: dict[str, Tensor] = {}
        for name in ours:
            pattern, index = _pattern(name)
            if pattern not in first:
                continue
            stored, parts = first[pattern]
            t = torch.cat([ours[p.format(index)] for p in parts]) if len(parts) > 1 else ours[name]
            out[stored.format(index)] = (t.t() if stored in self.transposed else t).contiguous()
        return out


@dataclass(frozen=True)
class Family:
    """One model family: ``model_types`` it reads, the architecture name it writes, its config
    mapping (``config_from_hf(config.json dict) -> DecoderLMConfig`` raising a ``ValueError``
    or ``TypeError`` naming the key; ``config_to_hf``) and its ``weights``."""

    name: str
    model_types: tuple[str, ...]
    architecture: str
    config_from_hf: Callable[[dict[str, Any]], DecoderLMConfig]
    config_to_hf: Callable[[DecoderLMConfig], dict[str, Any]]
    weights: Callable[[DecoderLMConfig], WeightMap]


def _pattern(name: str) -> tuple[str, int | None]:
    """``"model.layers.12.mlp.up.weight"`` -> ``("model.layers.{}.mlp.up.weight", 12)``."""
    match = _LAYER.search(name)
    if match is None:
        return name, None
    return name[:match.start()] + ".{}." + name[match.end():], int(match.group(1))
