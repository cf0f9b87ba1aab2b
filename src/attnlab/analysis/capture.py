"""Capture the attention weights of a model, per attention kind, layer and head.

``capture(model, inputs)`` runs the model once with a ``pattern`` hook (see
``attnlab.analysis.hooks``) on each chosen attention layer. The chosen layers run the
``math`` backend for that call (the one that forms the weights; a layer built with
``flash`` or ``fused`` is switched for the call and switched back), so the weights are
exact whatever backend the model was built with, and layers (and heads) that were not asked
for store nothing and keep their backend.

Kinds: ``"encoder"``, ``"decoder"`` (self-attention) and ``"cross"`` for the encoder-decoder
``Transformer``; ``"self"`` for decoder-only models (``DecoderLM``, every family). Layers and
heads are read from the modules (``attention_modules``: names and ``num_heads``), whatever
the model's class.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnlab._checks import is_int
from attnlab.analysis.hooks import attention_modules, run_with_cache

__all__ = [
    "AttentionCapture",
    "AttentionMaps",
    "capture",
    "capture_attention",
    "checked_list",
    "classify",
    "math_backend",
]

KINDS = ("encoder", "decoder", "cross", "self")
# Which token row (role) the queries and keys of each kind come from.
_ROLES = {
    "encoder": ("src", "src"),
    "decoder": ("tgt", "tgt"),
    "cross": ("tgt", "src"),
    "self": ("input", "input"),
}


@dataclass(frozen=True)
class AttentionMaps:
    """The weights of one attention kind.

    ``weights`` ``B x N x H x L x S`` for the ``N`` captured ``layers`` and ``H`` captured
    ``heads`` (model indices); ``query_tokens`` / ``key_tokens``: ``B`` rows of ``L`` / ``S``
    strings; ``query_mask`` ``B x L``, ``key_mask`` ``B x S``: True = a real token (not
    padding); ``causal``: whether queries see only earlier keys (self-attention of a decoder).
    """

    kind: str
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    weights: Tensor
    query_tokens: tuple[tuple[str, ...], ...]
    key_tokens: tuple[tuple[str, ...], ...]
    query_mask: Tensor
    key_mask: Tensor
    causal: bool

    def example(self, b: int = 0) -> tuple[Tensor, list[str], list[str]]:
        """Row ``b`` without padding: ``(weights N x H x l x s, query tokens, key tokens)``."""
        if not 0 <= b < self.weights.shape[0]:
            raise ValueError(f"b: expected 0 <= b < {self.weights.shape[0]}, got {b}")
        qm, km = self.query_mask[b], self.key_mask[b]
        w = self.weights[b][:, :, qm][:, :, :, km]
        qt = [t for t, keep in zip(self.query_tokens[b], qm.tolist()) if keep]
        kt = [t for t, keep in zip(self.key_tokens[b], km.tolist()) if keep]
        return w, qt, kt


@dataclass(frozen=True)
class AttentionCapture:
    """``maps[kind]`` -> ``AttentionMaps``; ``output``: what the model returned (logits)."""

    maps: dict[str, AttentionMaps]
    output: Any

    def __getitem__(self, kind: str) -> AttentionMaps:
        if kind not in self.maps:
            raise KeyError(f"kind: expected one of {sorted(self.maps)}, got {kind!r}")
        return self.maps[kind]

    @property
    def kinds(self) -> list[str]:
        return list(self.maps)


def capture(
    model: nn.Module,
    inputs: Any,
    layers: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
    *,
    kinds: Iterable[str] | None = None,
    tokens: Mapping[str, Sequence[Sequence[str]]] | Sequence[Sequence[str]] | None = None,
) -> AttentionCapture:
    """Run ``model`` once on ``inputs`` and return the attention weights it used.

    ``inputs``: token ids ``B x L`` (or ``{"input_ids", "attention_mask"}``) for a decoder-only
    model; ``(src B x S, tgt B x T)`` or a ``Seq2SeqBatch`` (``src``, ``tgt_in``) for the
    ``Transformer``. ``layers`` / ``heads``: indices to keep (all when None), the same for
    every kind; ``kinds``: a subset of the model's kinds. ``tokens``: the strings to label
    positions with, ``{"src": rows, "tgt": rows}`` or ``{"input": rows}`` (a plain list of
    rows for a decoder-only model); each row covers the real tokens or every position
    (default: the ids as text). Runs under ``torch.no_grad()``.
    """
    roles, masks = _roles(model, inputs)
    by_kind: dict[str, list[tuple[int, str]]] = {}
    for name in attention_modules(model):
        kind, layer = classify(model, name)
        by_kind.setdefault(kind, []).append((layer, name))
    if not by_kind:
        raise ValueError(f"model: expected attention layers, got {type(model).__name__}")
    chosen_kinds = list(by_kind) if kinds is None else checked_list("kinds", kinds, str)
    if not chosen_kinds:
        raise ValueError(f"kinds: expected some of {list(by_kind)}, got none")
    for k in chosen_kinds:
        if k not in by_kind:
            raise ValueError(f"kinds: expected some of {list(by_kind)}, got {k!r}")
    wanted_layers = None if layers is None else sorted(set(checked_list("layers", layers, int)))
    names: dict[str, list[tuple[int, str]]] = {}
    for k in chosen_kinds:
        available = [layer for layer, _ in by_kind[k]]
        if wanted_layers is not None:
            bad = [i for i in wanted_layers if i not in available]
            if bad:
                raise ValueError(f"layers: {kind_label(k)} has layers {available}, got {bad}")
        names[k] = [(i, n) for i, n in by_kind[k] if wanted_layers is None or i in wanted_layers]
    modules = attention_modules(model)
    chosen = [modules[n] for k in chosen_kinds for _, n in names[k]]
    missing = [n for k in chosen_kinds for _, n in names[k]
               if not is_int(getattr(modules[n], "num_heads", None))]
    if missing:
        raise ValueError(f"model: attention modules {missing} do not state their num_heads")
    H = min(m.num_heads for m in chosen)
    head_list = list(range(H)) if heads is None else sorted(set(checked_list("heads", heads, int)))
    if not head_list or any(not 0 <= h < H for h in head_list):
        raise ValueError(f"heads: expected indices in 0 .. {H - 1}, got {head_list}")
    index = torch.tensor(head_list)
    stored: dict[str, Tensor] = {}

    def keep(x: Tensor, name: str) -> None:  # only the asked heads, copied out of x
        stored[name] = x.detach().index_select(1, index.to(x.device))

    hook_names = {f"{n}.pattern": keep for k in chosen_kinds for _, n in names[k]}
    with torch.no_grad(), math_backend(chosen):
        output, _ = run_with_cache(model, inputs, [], hooks=hook_names)
    labels = _labels(tokens, roles)
    maps = {}
    for k in chosen_kinds:
        q_role, k_role = _ROLES[k]
        weights = torch.stack([stored[f"{n}.pattern"] for _, n in names[k]], dim=1)
        maps[k] = AttentionMaps(
            kind=k,
            layers=tuple(i for i, _ in names[k]),
            heads=tuple(head_list),
            weights=weights,
            query_tokens=_rows(labels[q_role], masks[q_role], roles[q_role]),
            key_tokens=_rows(labels[k_role], masks[k_role], roles[k_role]),
            query_mask=masks[q_role],
            key_mask=masks[k_role],
            causal=k in ("decoder", "self"),  # our decoders are always causal
        )
    return AttentionCapture(maps, output)


def capture_attention(
    model: nn.Module,
    run: Callable[[], Any],
    names: Iterable[str] | None = None,
) -> tuple[Any, dict[str, Tensor]]:
    """Call ``run()`` and return ``(its result, {module name: weights B x H x L x S})``.

    ``names``: qualified names of attention submodules of ``model`` (e.g.
    ``"decoder.layers.1.cross_attn"``, ``"layers.0.self_attn"``); all of them when None. A
    module called several times (incremental decoding) keeps the weights of its last call.
    The modules run the ``math`` backend for the call, as in ``capture``.
    """
    modules = attention_modules(model)
    wanted = list(modules) if names is None else list(names)
    unknown = [n for n in wanted if n not in modules]
    if unknown:
        raise ValueError(
            f"names: {unknown} are not attention modules of the model; "
            f"expected some of {sorted(modules)}"
        )
    with math_backend(modules[n] for n in wanted):
        result, cache = run_with_cache(model, run, [f"{n}.pattern" for n in wanted])
    return result, {n: cache[f"{n}.pattern"] for n in wanted if f"{n}.pattern" in cache}


def classify(model: nn.Module, name: str) -> tuple[str, int]:
    """``(kind, layer index)`` of the attention module called ``name`` in ``model``: the
    first index in the name (``"model.layers.3.self_attn"`` -> 3; 0 when there is none)."""
    numbers = re.findall(r"(?:^|\.)(\d+)(?:\.|$)", name)
    layer = int(numbers[0]) if numbers else 0
    if "cross" in name:
        return "cross", layer
    if name.startswith("encoder."):
        return "encoder", layer
    has_encoder = any(n.startswith("encoder.") for n in attention_modules(model))
    return ("decoder" if has_encoder and name.startswith("decoder.") else "self"), layer


def checked_list(name: str, values: object, kind: type) -> list:
    """``values`` (an iterable of ``kind``: ints, not bools, or strings) as a list; else a
    ``TypeError`` naming the argument ``name``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name}: expected a list of {kind.__name__}s, got "
                        f"{type(values).__name__}")
    values = list(values)
    bad = [v for v in values if not (is_int(v) if kind is int else isinstance(v, kind))]
    if bad:
        raise TypeError(f"{name}: expected a list of {kind.__name__}s, got {bad[0]!r}")
    return values


@contextmanager
def math_backend(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Within the block, every module of ``modules`` built with a backend other than ``auto``
    or ``math`` runs ``math`` (``auto`` runs it by itself under a pattern hook); the old
    backends come back afterwards, even when the block raises."""
    switched = [(m, m.backend) for m in modules
                if getattr(m, "backend", "auto") not in ("auto", "math")]
    try:
        for m, _ in switched:
            m.backend = "math"
        yield
    finally:
        for m, backend in switched:
            m.backend = backend


def kind_label(kind: str) -> str:
    """A human name for an attention kind."""
    return {
        "encoder": "encoder self-attention",
        "decoder": "decoder self-attention",
        "cross": "cross-attention",
        "self": "self-attention",
    }.get(kind, kind)


def _roles(model: nn.Module, inputs: Any) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Token ids and real-token masks (``B x len``) per role, from the model's inputs."""
    config = getattr(model, "config", None)
    pad_id = getattr(config, "pad_id", None)
    if hasattr(inputs, "src") and hasattr(inputs, "tgt_in"):
        inputs = (inputs.src, inputs.tgt_in)
    if isinstance(inputs, Mapping) and "src" in inputs:
        inputs = (inputs["src"], inputs["tgt"])
    if isinstance(inputs, (tuple, list)) and len(inputs) == 2:
        src, tgt = inputs
        roles = {"src": src, "tgt": tgt}
        masks = {r: (t != pad_id) if pad_id is not None else torch.ones_like(t, dtype=torch.bool)
                 for r, t in roles.items()}
        return roles, masks
    if isinstance(inputs, Mapping):
        ids = inputs.get("input_ids")
        mask = inputs.get("attention_mask")
    else:
        ids, mask = inputs, None
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        raise ValueError(
            "inputs: expected token ids B x L, {'input_ids', 'attention_mask'}, (src, tgt) or a "
            f"Seq2SeqBatch, got {type(inputs).__name__}"
        )
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    return {"input": ids}, {"input": mask}


def _labels(tokens: Any, roles: Mapping[str, Tensor]) -> dict[str, Sequence[Sequence[str]] | None]:
    if tokens is None:
        return dict.fromkeys(roles)
    if not isinstance(tokens, Mapping):
        if "input" not in roles:
            raise ValueError("tokens: expected {'src': rows, 'tgt': rows} for an encoder-decoder")
        tokens = {"input": tokens}
    unknown = [r for r in tokens if r not in roles]
    if unknown:
        raise ValueError(f"tokens: expected keys among {sorted(roles)}, got {unknown}")
    return {r: tokens.get(r) for r in roles}


def _rows(
    labels: Sequence[Sequence[str]] | None, mask: Tensor, ids: Tensor
) -> tuple[tuple[str, ...], ...]:
    """Per-row labels of every position (padding labelled ``<pad>``)."""
    B, n = ids.shape
    if labels is None:
        return tuple(tuple(str(i) for i in row.tolist()) for row in ids)
    if len(labels) != B:
        raise ValueError(f"tokens: expected {B} rows, got {len(labels)}")
    rows = []
    for b, row in enumerate(labels):
        row = [str(t) for t in row]
        real = mask[b].tolist()
        if len(row) == n:
            rows.append(tuple(row))
        elif len(row) == sum(real):
            it = iter(row)
            rows.append(tuple(next(it) if keep else "<pad>" for keep in real))
        else:
            raise ValueError(
                f"tokens: row {b} has {len(row)} labels, expected {sum(real)} (real tokens) or "
                f"{n} (all positions)"
            )
    return tuple(rows)
