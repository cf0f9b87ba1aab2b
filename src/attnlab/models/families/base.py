"""What a model family is to attnlab: a config mapping and a weight-name map, as data.

A ``Family`` says how a Hugging Face ``config.json`` of its ``model_type`` becomes a
``DecoderLMConfig`` (and back), and how its stored tensor names become ``DecoderLM``'s
(``WeightMap``: name patterns, plus the few transposes and splits that a format needs). The
forward pass is ``DecoderLM``'s for every family; a family module holds no model code.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

from attnlab.models.decoder_config import DecoderLMConfig

__all__ = ["Family", "WeightMap", "check_round_trip", "config_from_keys"]

_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class WeightMap:
    """Stored (Hugging Face) tensor names <-> ``DecoderLM`` state-dict names.

    ``names``: stored pattern -> our pattern, ``{}`` standing for the layer index
    (``"model.layers.{}.self_attn.q_proj.weight" -> "layers.{}.self_attn.q_proj.weight"``).
    A tuple of our patterns means the stored tensor is theirs concatenated along dim 0
    (Phi-3's ``qkv_proj``, GPT-2's ``c_attn``); it is split by our tensors' sizes.
    ``transposed``: stored patterns kept ``in x out`` (GPT-2's ``Conv1D``), transposed to our
    ``out x in`` on the way in and back on the way out. ``ignored``: stored patterns skipped
    when present (buffers of old checkpoints: GPT-2's ``attn.bias`` causal mask).
    ``optional_prefix``: a prefix of the patterns that some checkpoints leave out (GPT-2's
    ``transformer.``); ``matching`` gives the map as a checkpoint spells it.
    """

    names: Mapping[str, str | tuple[str, ...]]
    transposed: frozenset[str] = field(default_factory=frozenset)
    ignored: frozenset[str] = field(default_factory=frozenset)
    optional_prefix: str = ""

    def matching(self, stored: Iterable[str]) -> WeightMap:
        """This map as the stored names ``stored`` spell it: without ``optional_prefix`` when
        none of them starts with it, else as it is."""
        prefix = self.optional_prefix
        if not prefix or any(name.startswith(prefix) for name in stored):
            return self

        def strip(patterns: Iterable[str]) -> frozenset[str]:
            return frozenset(p.removeprefix(prefix) for p in patterns)

        return WeightMap({k.removeprefix(prefix): v for k, v in self.names.items()},
                         strip(self.transposed), strip(self.ignored))

    def skipped(self, stored: Iterable[str]) -> list[str]:
        """The names in ``stored`` that an ``ignored`` pattern matches (read, then dropped)."""
        return [name for name in stored if _pattern(name)[0] in self.ignored]

    def to_ours(self, stored: Mapping[str, Tensor], shapes: Mapping[str, torch.Size]
                ) -> dict[str, Tensor]:
        """Stored tensors -> ours; ``shapes`` are our state dict's (for the splits).

        A stored name that matches no pattern raises a ``ValueError`` naming it; those that
        match an ``ignored`` pattern are dropped.
        """
        ours: dict[str, Tensor] = {}
        for name, t in stored.items():
            pattern, index = _pattern(name)
            if pattern in self.ignored:
                continue
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
    or ``TypeError`` naming the key; ``config_to_hf``, whose result ``check_round_trip``
    proves to read back as the same model), its ``weights`` and its ``presets``: published
    models' shapes by name, as the ``config.json`` keys that set them."""

    name: str
    model_types: tuple[str, ...]
    architecture: str
    config_from_hf: Callable[[dict[str, Any]], DecoderLMConfig]
    config_to_hf: Callable[[DecoderLMConfig], dict[str, Any]]
    weights: Callable[[DecoderLMConfig], WeightMap]
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def config_from_keys(keys: Mapping[str, str], **fields: Any) -> DecoderLMConfig:
    """``DecoderLMConfig(**fields)``; an error about a field read from a ``config.json`` key
    (``keys``: field -> key) names the key first: ``"n_embd (d_model): expected ..."``."""
    try:
        return DecoderLMConfig(**fields)
    except (TypeError, ValueError) as error:
        field_name, colon, rest = str(error).partition(":")
        if not colon or field_name not in keys:
            raise
        raise type(error)(f"{keys[field_name]} ({field_name}):{rest}") from None


def check_round_trip(config: DecoderLMConfig, hf: dict[str, Any],
                     read: Callable[[dict[str, Any]], DecoderLMConfig]) -> dict[str, Any]:
    """``hf`` (a ``config.json`` object written for ``config``) when ``read(hf)`` builds the same
    model; else a ``ValueError`` naming the first field the family's format cannot hold (a
    GPT-2 file for a rotary config, say), so that a save never writes a different model.

    Fields that do not change the computation (dropout, backend) are not compared, and
    defaults are compared resolved (``num_kv_heads=None`` is ``num_heads``).
    """
    want, got = _resolved(config), _resolved(read(hf))
    for f in fields(want):
        ours, theirs = getattr(want, f.name), getattr(got, f.name)
        if ours != theirs:
            raise ValueError(f"{f.name}: the {hf.get('model_type')} format cannot hold "
                             f"{ours!r} (it reads back as {theirs!r}); expected a "
                             f"{hf.get('model_type')} config, e.g. one loaded from such a "
                             f"checkpoint")
    return hf


def _resolved(c: DecoderLMConfig) -> DecoderLMConfig:
    """``c`` with its defaults resolved and the fields that do not change outputs cleared."""
    rope = c.position == "rope"
    return replace(
        c, num_kv_heads=c.kv_heads, d_ff=c.ff_dim, bias=False,
        **{name: c.resolved_bias(name) for name in ("qkv_bias", "o_bias", "mlp_bias")},
        norm_bias=c.norm == "layernorm" and c.resolved_bias("norm_bias"),
        rotary_dim=c.rotary_size if rope else None, rope_base=c.rope_base if rope else 1.0,
        rope_traditional=rope and c.rope_traditional, rope_scaling=c.rope_scaling if rope else None,
        dropout=0.0, backend="auto")


def _pattern(name: str) -> tuple[str, int | None]:
    """``"model.layers.12.mlp.up.weight"`` -> ``("model.layers.{}.mlp.up.weight", 12)``."""
    match = _LAYER.search(name)
    if match is None:
        return name, None
    return name[:match.start()] + ".{}." + name[match.end():], int(match.group(1))
