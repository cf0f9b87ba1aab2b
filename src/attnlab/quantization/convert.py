"""Quantizing a model: which modules, in what format, recorded how.

``quantize_model(model, "int8" | "int4", group_size=64)`` replaces, in place, every
``nn.Linear`` (or ``InferenceLinear``) and every ``nn.Embedding`` whose qualified name matches
none of the ``skip`` patterns (``fnmatch``, e.g. ``"lm_head"``, ``"*.mlp.*"``) with its
quantized module. An ``nn.Linear`` whose weight is an ``nn.Embedding``'s (a tied LM head)
becomes one quantized table that both read; skipping either of the two keeps the table float
for both. The token tables (every embedding, and a head tied to one) take ``table_bits``:
int4 keeps them in int8 by default, as llama.cpp's 4-bit files keep theirs at 8 bits (what
that saves on a trained model: the SmolLM2 table of ``docs/tutorials/10-quantization.md``).
int4's scales and zeros are stored in ``scale_dtype`` (by default ``"int8"``: coded in 8 bits
against two float32 steps per row, 4.5 bits a weight in groups of 32, llama.cpp's Q4_0 size;
``"float16"`` for GPTQ; the tables keep their weight's dtype) and chosen by
``fit``: ``"search"`` by default (``attnlab.quantization.search``), ``"nearest"`` for
round-to-nearest; ``"gptq"`` is recorded by ``attnlab.quantization.gptq``, which computes the
codes from calibration text. The linear layers matching ``int8_layers`` (by default
``DEFAULT_INT8_LAYERS``: every ``v_proj`` and the last layer's ``down_proj``; ``{last}`` in a
pattern is the model's last layer number, ``last_layer``) stay int8 in an int4 scheme, as
llama.cpp's ``_M`` files give those more bits; so do, with the default layers, the
``down_proj`` whose weights hold the largest outliers (``int8_outliers``: the layers of the
largest ``max |W| / std(W)``, one for every ``OUTLIERS_EVERY`` ``down_proj``; a "super
weight" there makes the activations that the whole model leans on, and rounding it costs
more than rounding any other layer). They are chosen from the weights alone and recorded in
``int8_layers`` by name (``outlier_ratio``, ``with_outliers``). What is left
(norms, biases, skipped modules) keeps its dtype. The scheme is kept on the model as
``model.quantization``, a ``QuantizationConfig`` that ``save_pretrained`` records in
``config.json``.

A loader quantizes as it reads (``QuantizingLoad``): the model is built on the ``meta``
device, and each chosen module is swapped for its quantized module as soon as its weight is
placed, so that one float weight at a time lives in memory, never the float model. The codes
are those that ``quantize_model`` computes from the same weights.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnlab._checks import is_int
from attnlab.hook_point import share_hooks
from attnlab.kernels import InferenceLinear
from attnlab.quantization.formats import GROUP_SIZES, QuantizedWeight
from attnlab.quantization.modules import QuantizedEmbedding, QuantizedLinear

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_INT8_LAYERS",
    "DEFAULT_SCALE_DTYPE",
    "FITS",
    "METHODS",
    "OUTLIERS_EVERY",
    "OUTLIER_LAYERS",
    "SCALE_DTYPES",
    "QuantizationConfig",
    "QuantizingLoad",
    "chosen_modules",
    "last_layer",
    "outlier_ratio",
    "outliers_asked",
    "outliers_chosen",
    "quantize_model",
    "quantized_skeleton",
    "weight_bytes",
    "with_outliers",
]

METHODS = ("int8", "int4")
FITS = ("nearest", "search", "gptq")
# int4 groups of 32 with coded scales (4.5 bits a weight) measure better than groups of 64
# with float16 ones (the same bytes): the quantization tutorial's int4 table.
DEFAULT_GROUP_SIZE = 32
DEFAULT_SCALE_DTYPE = "int8"  # coded int4 scales and zeros (formats); GPTQ's: float16
SCALE_DTYPES = ("int8", "float16", "bfloat16", "float32")
# The linear layers an int4 scheme keeps in int8 by default: every v_proj, as llama.cpp's
# Q4_K_M gives attn_v more bits, and the last layer's down_proj, as it gives the last eighth
# of ffn_down more (``use_more_bits``); with them, the outlier down_proj (int8_outliers). The
# quantization tutorial's table measures the choice on the off-grid SmolLM2.
DEFAULT_INT8_LAYERS = ("*.v_proj", "layers.{last}.mlp.down_proj")
OUTLIER_LAYERS = "*.mlp.down_proj"  # the layers int8_outliers chooses among
OUTLIERS_EVERY = 15  # int8_outliers' default: one for every 15 of them, rounded, at least 1
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")


@dataclass(frozen=True)
class QuantizationConfig:
    """How a model's weights are quantized: ``method`` ``"int8"`` (per output row) or
    ``"int4"`` (groups of ``group_size`` inputs; None for int8), the ``skip`` patterns
    of module names left unquantized, ``table_bits`` of the token tables (8 or, for int4,
    4; None: 8), int4's ``fit`` (``FITS``; None: ``"search"`` for int4, ``"nearest"``
    for int8, whose scale is a row's maximum) and the dtype of the int4 linear layers'
    scales and zeros, ``scale_dtype`` (``SCALE_DTYPES``, ``"int8"`` for coded scales, which
    GPTQ does not write; None: ``DEFAULT_SCALE_DTYPE`` for int4, ``"float16"`` for GPTQ;
    int8's scales and the tables' keep their weight's dtype), and ``int8_layers``,
    patterns (``fnmatch``; ``{last}`` stands for the model's last layer number) of the linear
    layers an int4 scheme keeps in int8 per row, as
    llama.cpp's ``_M`` files give the sensitive tensors more bits (None:
    ``DEFAULT_INT8_LAYERS`` for int4), and ``int8_outliers``, how many more of the int4
    layers matching ``OUTLIER_LAYERS`` to keep in int8, those of the largest weight
    outliers (``with_outliers`` names them; None: one for every ``OUTLIERS_EVERY`` for int4,
    as ``quantize_model`` asks unless given ``int8_layers``, ``outliers_asked``; a quantized
    model's config holds 0 and the names). JSON:
    ``to_dict``/``from_dict`` (``config.json``'s ``"quantization"``; a record from before
    ``table_bits``, ``fit``, ``scale_dtype`` and ``int8_layers`` reads as it was written:
    tables in ``method``'s bits, round-to-nearest, scales in the weights' dtype
    (``"weight"``), every layer in ``method``'s bits)."""

    method: str
    group_size: int | None = None
    skip: tuple[str, ...] = ()
    table_bits: int | None = None
    fit: str | None = None
    scale_dtype: str | None = None
    int8_layers: tuple[str, ...] | None = None
    int8_outliers: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantize: expected one of {', '.join(METHODS)}, got "
                             f"{self.method!r}")
        if self.method == "int8":
            if self.group_size is not None:
                raise ValueError(f"group_size: int8 scales whole rows, so it takes no group "
                                 f"size; got {self.group_size!r}")
        elif not is_int(self.group_size) or self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size: expected one of {', '.join(map(str, GROUP_SIZES))} "
                             f"for int4, got {self.group_size!r}")
        if isinstance(self.skip, str) or not isinstance(self.skip, (tuple, list)) or not all(
                isinstance(p, str) and p for p in self.skip):
            raise TypeError(f"skip: expected a list of module-name patterns (non-empty "
                            f"strings), got {self.skip!r}")
        object.__setattr__(self, "skip", tuple(self.skip))
        if self.int8_outliers is None and self.method != "int4":
            object.__setattr__(self, "int8_outliers", 0)
        if self.int8_outliers is not None and (
                not is_int(self.int8_outliers) or self.int8_outliers < 0):
            raise ValueError(f"int8_outliers: expected a number of layers >= 0 (or None for "
                             f"the default), got {self.int8_outliers!r}")
        if self.int8_outliers and self.method != "int4":
            raise ValueError(f"int8_outliers: int8 quantizes every layer in 8 bits already; "
                             f"int8_outliers applies to int4, got {self.int8_outliers!r}")
        if self.int8_layers is None:
            object.__setattr__(self, "int8_layers",
                               DEFAULT_INT8_LAYERS if self.method == "int4" else ())
        if isinstance(self.int8_layers, str) or not isinstance(self.int8_layers, (
                tuple, list)) or not all(isinstance(p, str) and p for p in self.int8_layers):
            raise TypeError(f"int8_layers: expected a list of module-name patterns (non-empty "
                            f"strings), got {self.int8_layers!r}")
        object.__setattr__(self, "int8_layers", tuple(self.int8_layers))
        if self.int8_layers and self.method != "int4":
            raise ValueError(f"int8_layers: int8 quantizes every layer in 8 bits already; "
                             f"int8_layers applies to int4, got {self.int8_layers!r}")
        if self.table_bits is None:
            object.__setattr__(self, "table_bits", 8)
        if self.table_bits not in (8, self.bits):
            raise ValueError(f"table_bits: expected 8 or the method's {self.bits}, got "
                             f"{self.table_bits!r}")
        if self.fit is None:
            object.__setattr__(self, "fit", "search" if self.method == "int4" else "nearest")
        if self.fit not in (FITS if self.method == "int4" else ("nearest",)):
            allowed = ", ".join(FITS) if self.method == "int4" else "nearest (int8)"
            raise ValueError(f"fit: expected one of {allowed}, got {self.fit!r}")
        if self.scale_dtype is None and self.method == "int4":
            object.__setattr__(self, "scale_dtype",
                               "float16" if self.fit == "gptq" else DEFAULT_SCALE_DTYPE)
        allowed = (*SCALE_DTYPES, "weight") if self.method == "int4" else (None,)
        if self.scale_dtype not in allowed:
            raise ValueError(f"scale_dtype: expected one of {', '.join(map(str, allowed))} "
                             f"for {self.method}, got {self.scale_dtype!r}")
        if self.scale_dtype == "int8" and self.fit == "gptq":
            raise ValueError("scale_dtype: GPTQ writes float scales (float16, bfloat16 or "
                             "float32); int8 (coded scales) is for fit search or nearest")

    def bits_of(self, name: str, *, table: bool, last: int | None = None) -> int:
        """The bits of the module ``name``, a token ``table`` or not: ``table_bits`` for a
        table, 8 for a linear layer matching one of ``int8_layers`` (``{last}`` read as
        ``last``, the model's last layer number: ``last_layer``), else ``bits``."""
        if table:
            return self.table_bits
        patterns = (p.replace("{last}", str(last)) if last is not None else p
                    for p in self.int8_layers)
        return 8 if any(fnmatch.fnmatchcase(name, p) for p in patterns) else self.bits

    def scales_for(self, weight: torch.Tensor, *, table: bool, bits: int = 4) -> torch.dtype:
        """The dtype of the scales (and zeros) of ``weight`` quantized by this scheme in
        ``bits``, a token ``table`` or not: ``scale_dtype`` for an int4 linear layer, else
        the weight's dtype."""
        if table or bits == 8 or self.scale_dtype == "weight":
            return weight.dtype
        return getattr(torch, self.scale_dtype)

    @property
    def bits(self) -> int:
        """8 or 4."""
        return 8 if self.method == "int8" else 4

    @property
    def scheme(self) -> str:
        """``"int8"`` or ``"int4 (group_size 32, search, tables int8)"``, as messages name
        it."""
        if self.group_size is None:
            return self.method
        return (f"{self.method} (group_size {self.group_size}, {self.fit}, tables "
                f"int{self.table_bits})")

    def to_dict(self) -> dict[str, Any]:
        """``{"method", "group_size", "skip", "table_bits", "fit"}`` and int4's
        ``"scale_dtype"``, JSON-ready."""
        data = {**dataclasses.asdict(self), "skip": list(self.skip),
                "int8_layers": list(self.int8_layers)}
        if self.scale_dtype is None:  # int8
            del data["scale_dtype"]
        if not self.int8_layers:
            del data["int8_layers"]
        if self.int8_outliers == 0:
            del data["int8_outliers"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizationConfig:
        """The config ``to_dict`` wrote; unknown or missing keys are refused by name."""
        if not isinstance(data, Mapping):
            raise TypeError(f"quantization: expected an object, got {data!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown or "method" not in data:
            raise ValueError(f"quantization: expected the keys {sorted(fields)} ('method' "
                             f"required), got {sorted(data)}")
        method = data["method"]
        older = {"table_bits": 8 if method == "int8" else 4, "fit": "nearest",
                 "scale_dtype": "weight" if method == "int4" else None, "int8_layers": (),
                 "int8_outliers": 0}
        return cls(**{**older, **data})


def quantize_model(model: nn.Module, method: str = "int8", group_size: int | None = None, *,
                   skip: Iterable[str] = (), kernel: str | None = None,
                   table_bits: int | None = None, fit: str | None = None,
                   scale_dtype: str | None = None, int8_layers: Iterable[str] | None = None,
                   int8_outliers: int | None = None,
                   weights: Mapping[str, QuantizedWeight] | None = None) -> nn.Module:
    """``model`` with its linear layers and embeddings quantized in place (module docstring);
    returned for chaining. ``method`` ``"int8"`` or ``"int4"``; ``group_size`` (int4 only,
    default ``DEFAULT_GROUP_SIZE``) must divide every quantized layer's input size (an
    embedding's dim); a layer that it does not divide is refused by name before anything
    changes. ``table_bits``, ``fit``, ``scale_dtype``, ``int8_layers`` and ``int8_outliers`` are
    ``QuantizationConfig``'s.
    ``weights`` gives
    the quantized weight of some linear layers by name (computed elsewhere: GPTQ's), in
    the config's bits and group size; the others are quantized here. ``kernel`` forces one
    of ``attnlab.quantization.kernels.QUANTIZED_KERNELS``. A swapped module keeps the replaced
    one's train/eval mode and forward and backward hooks (their handles still remove them).
    Its other modules stay the reference ones: ``attnlab.kernels.optimize_for_inference``
    swaps in the fast modules (``from_pretrained`` does)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if method == "int4" and group_size is None:
        group_size = DEFAULT_GROUP_SIZE
    config = QuantizationConfig(method, group_size, tuple(skip) if not isinstance(skip, str)
                                else skip, table_bits, fit, scale_dtype,
                                tuple(int8_layers) if not isinstance(int8_layers, (str, type(None)))
                                else int8_layers, outliers_asked(int8_layers, int8_outliers))
    if getattr(model, "quantization", None) is not None:
        raise ValueError(f"model: already quantized ({model.quantization.method}); load the "
                         "float weights to quantize them another way")
    chosen = chosen_modules(model, config)
    config = outliers_chosen(model, config, chosen)
    _replace(model, chosen, config, kernel=kernel, empty=False, weights=weights or {})
    model.quantization = config
    return model


def quantized_skeleton(model: nn.Module, config: QuantizationConfig, *,
                       kernel: str | None = None, dtype: torch.dtype | None = None
                       ) -> nn.Module:
    """``model`` with the modules that ``config`` quantizes replaced by quantized ones whose
    codes and scales are left unset (uninitialised memory on the modules' device), to be
    filled by ``load_state_dict`` from a quantized checkpoint: nothing is computed.
    ``dtype``: the activations' dtype the model is filled in (default its weights').
    ``kernel`` forces one kernel, as in ``quantize_model``."""
    if not isinstance(config, QuantizationConfig):
        raise TypeError(f"config: expected a QuantizationConfig, got {type(config).__name__}")
    _replace(model, chosen_modules(model, config), config, kernel=kernel, empty=True,
             dtype=dtype)
    model.quantization = config
    return model


class QuantizingLoad:
    """Quantizing ``model`` (built on the ``meta`` device) while a loader fills it, one
    state-dict tensor at a time: ``placed(name)``, called once the weight ``name`` (one that
    ``takes(name)``) holds its loaded values, swaps the modules reading it (a linear layer,
    an embedding, or a tied LM head and its embedding, which become one quantized table) for
    their quantized modules at once, whose codes are then all that is kept of that weight.
    The sizes are checked against ``config`` when it is made, before anything is read.
    ``finish()`` records ``config`` on the model once every chosen module was swapped.
    ``kernel`` forces one kernel, as in ``quantize_model``."""

    def __init__(self, model: nn.Module, config: QuantizationConfig, *,
                 kernel: str | None = None) -> None:
        if not isinstance(config, QuantizationConfig):
            raise TypeError(f"config: expected a QuantizationConfig, got "
                            f"{type(config).__name__}")
        self.model, self.config, self.kernel = model, config, kernel
        chosen = chosen_modules(model, config)
        readers: dict[int, dict[str, nn.Module]] = {}  # a weight -> the chosen modules reading it
        for name, module in chosen.items():
            readers.setdefault(id(module.weight), {})[name] = module
        self._waiting = {f"{name}.weight": readers[id(module.weight)]
                         for name, module in chosen.items()}

    def survey(self, readers: Iterable[tuple[str, Callable[[], torch.Tensor]]]) -> None:
        """Before anything is placed: when the scheme keeps outlier layers in int8
        (``int8_outliers``), read the candidates' weights by ``readers`` ((our name, a
        function returning its values) pairs; the others are never read) and name the chosen
        ones in the config (``with_outliers``)."""
        if self.config.int8_outliers == 0:
            return
        chosen = {name: m for group in self._waiting.values() for name, m in group.items()}
        candidates = _outlier_candidates(self.model, self.config, chosen)
        ratios = {name.removesuffix(".weight"): outlier_ratio(read()) for name, read in readers
                  if name.endswith(".weight") and name.removesuffix(".weight") in candidates}
        self.config = with_outliers(self.config, ratios)

    def takes(self, name: str) -> bool:
        """Whether the state-dict tensor ``name`` is a weight still to be quantized."""
        return name in self._waiting

    def placed(self, name: str) -> None:
        """The weight ``name`` (``takes(name)``) now holds its values: swap the modules
        reading it for quantized ones (a weight that is not all finite is refused naming
        them)."""
        group = self._waiting[name]
        for module_name in group:
            self._waiting.pop(f"{module_name}.weight")
        first, module = next(iter(group.items()))
        _check_finite(first, module.weight)
        _replace(self.model, group, self.config, kernel=self.kernel, empty=False)

    def finish(self) -> None:
        """Record the scheme on the model, every chosen module having been swapped."""
        assert not self._waiting, f"never placed: {sorted(self._waiting)}"
        self.model.quantization = self.config


def _replace(model: nn.Module, chosen: dict[str, nn.Module], config: QuantizationConfig, *,
             kernel: str | None, empty: bool,
             weights: Mapping[str, QuantizedWeight] | None = None,
             dtype: torch.dtype | None = None) -> None:
    """Swap the ``chosen`` modules (a tied head with its embedding) for quantized ones,
    computed from their weights (or taken from ``weights``) or ``empty`` (to be filled in
    ``dtype``, default the weights')."""
    heads = {id(m.weight): name for name, m in chosen.items() if isinstance(m, nn.Linear)}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    group_size, fit = config.group_size or DEFAULT_GROUP_SIZE, config.fit
    last = last_layer(model)
    fit = "search" if fit == "gptq" else fit  # what GPTQ did not compute (the tables)
    made: dict[str, nn.Module] = {}
    for name, m in chosen.items():  # linear layers first: a tied table is the head's
        if not isinstance(m, nn.Linear):
            continue
        table = id(m.weight) in tables
        bits = config.bits_of(name, table=table, last=last)
        if empty:
            like = m.weight if dtype is None else m.weight.new_empty(0, dtype=dtype)
            made[name] = QuantizedLinear(m.in_features, m.out_features, m.bias is not None,
                                         bits=bits, group_size=group_size,
                                         scale_dtype=config.scales_for(like, table=table,
                                                                       bits=bits),
                                         bias_dtype=like.dtype, device=m.weight.device,
                                         kernel=kernel)
        elif name in (weights or {}):
            made[name] = QuantizedLinear.from_weight(weights[name], m.bias, kernel=kernel,
                                                     dtype=m.weight.dtype)
        else:
            made[name] = QuantizedLinear.from_linear(
                m, bits=bits, group_size=group_size, kernel=kernel, fit=fit,
                scale_dtype=config.scales_for(m.weight, table=table, bits=bits))
    for name, m in chosen.items():
        if not isinstance(m, nn.Embedding):
            continue
        head = heads.get(id(m.weight))
        if head is not None:
            made[name] = QuantizedEmbedding.tied_to(made[head])
        elif empty:
            made[name] = QuantizedEmbedding(m.num_embeddings, m.embedding_dim,
                                            bits=config.table_bits, group_size=group_size,
                                            scale_dtype=m.weight.dtype, device=m.weight.device)
        else:
            made[name] = QuantizedEmbedding.from_embedding(m, bits=config.table_bits,
                                                           group_size=group_size, fit=fit)
    for name, new in made.items():
        parent, _, child = name.rpartition(".")
        _take_over(chosen[name], new)
        model.get_submodule(parent)._modules[child] = new


def _take_over(old: nn.Module, new: nn.Module) -> None:
    """``new`` in ``old``'s place: its train/eval mode and its forward and backward hooks."""
    new.train(old.training)
    share_hooks(old, new)


def outliers_asked(int8_layers: Iterable[str] | None, int8_outliers: int | None
                   ) -> int | None:
    """``int8_outliers`` as a caller asks it: as given, else the default (None) with the
    default ``int8_layers``, else 0: a list of int8 layers given by hand is the whole list."""
    return 0 if int8_outliers is None and int8_layers is not None else int8_outliers


def outlier_ratio(weight: torch.Tensor) -> float:
    """``max |W| / std(W)`` over all of ``weight``'s values (0 for a constant weight): how far
    its largest weight stands out; summed in float64 a block of rows at a time."""
    w = weight.detach().reshape(-1, weight.shape[-1])
    total = squares = largest = 0.0
    for block in w.split(max(1, 2**20 // w.shape[-1])):
        b = block.double()
        total += b.sum().item()
        squares += (b * b).sum().item()
        largest = max(largest, b.abs().max().item())
    n = w.numel()
    variance = (squares - total * total / n) / max(n - 1, 1)
    return largest / variance**0.5 if variance > 0 else 0.0


def _outlier_candidates(model: nn.Module, config: QuantizationConfig,
                       chosen: Mapping[str, nn.Module]) -> set[str]:
    """The names of the ``chosen`` linear layers that ``int8_outliers`` chooses among: those
    matching ``OUTLIER_LAYERS`` that ``config`` puts in int4 (none when it chooses none)."""
    if config.int8_outliers == 0:
        return set()
    last = last_layer(model)
    return {name for name, m in chosen.items() if isinstance(m, nn.Linear)
            and fnmatch.fnmatchcase(name, OUTLIER_LAYERS)
            and config.bits_of(name, table=False, last=last) == 4}


def outliers_chosen(model: nn.Module, config: QuantizationConfig,
                    chosen: Mapping[str, nn.Module] | None = None) -> QuantizationConfig:
    """``with_outliers`` of ``config`` for ``model``, whose weights hold their values (the
    ``chosen`` modules, default ``chosen_modules``'s)."""
    if config.int8_outliers == 0:
        return config
    chosen = chosen_modules(model, config) if chosen is None else chosen
    candidates = _outlier_candidates(model, config, chosen)
    return with_outliers(config, {name: outlier_ratio(m.weight) for name, m in chosen.items()
                                  if name in candidates})


def with_outliers(config: QuantizationConfig, ratios: Mapping[str, float]
                  ) -> QuantizationConfig:
    """``config`` with its ``int8_outliers`` layers named: of the candidates ``ratios``
    (name -> ``outlier_ratio`` of its weight), the ``int8_outliers`` of the largest ratios
    (None: one for every ``OUTLIERS_EVERY``, rounded, at least one when there is any) added
    to ``int8_layers`` in the model's order, and ``int8_outliers`` 0; ``config`` itself when
    it chooses none."""
    if config.int8_outliers == 0:
        return config
    count = config.int8_outliers
    if count is None:
        count = max(1, round(len(ratios) / OUTLIERS_EVERY)) if ratios else 0
    picked = sorted(ratios, key=lambda name: -ratios[name])[:count]
    names = tuple(sorted(picked, key=_layer_order))
    return dataclasses.replace(config, int8_layers=(*config.int8_layers, *names),
                               int8_outliers=0)


def _layer_order(name: str) -> tuple:
    """A module name's sort key with its numbers as numbers (``layers.2`` before
    ``layers.11``)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def last_layer(model: nn.Module) -> int | None:
    """The largest ``N`` among the model's modules named ``layers.N`` (a decoder stack's last
    layer; None without one): what ``{last}`` in an ``int8_layers`` pattern stands for."""
    numbers = [int(m.group(1)) for name, _ in model.named_modules()
               for m in _LAYER.finditer(name)]
    return max(numbers, default=None)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers, each tensor counted once
    (a tied table once): what one forward reads of its weights."""
    seen: dict[tuple, int] = {}
    for tensor in [*model.parameters(), *model.state_dict(keep_vars=True).values()]:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                   tensor.shape, tensor.dtype)
            seen[key] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def chosen_modules(model: nn.Module, config: QuantizationConfig) -> dict[str, nn.Module]:
    """``{qualified name: module}`` of the modules to quantize, checked: every size fits the
    group size, every weight is finite, no embedding renormalises its rows."""
    chosen: dict[str, nn.Module] = {}
    readers: dict[int, list[str]] = {}  # the modules reading each weight (a tied table: two)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    last = last_layer(model)
    for name, module in model.named_modules():
        if type(module) not in (nn.Linear, InferenceLinear, nn.Embedding) or not name:
            continue
        readers.setdefault(id(module.weight), []).append(name)
        if any(fnmatch.fnmatchcase(name, p) for p in config.skip):
            continue
        embedding = isinstance(module, nn.Embedding)
        inputs = module.embedding_dim if embedding else module.in_features
        bits = config.bits_of(name, table=id(module.weight) in tables, last=last)
        if bits == 4 and inputs % config.group_size:  # an int8 table scales whole rows
            raise ValueError(f"group_size: {config.group_size} does not divide {name}'s "
                             f"{'embedding_dim' if embedding else 'in_features'} {inputs}; "
                             f"pick another or skip the layer (skip=[{name!r}])")
        if embedding and module.max_norm is not None:
            raise ValueError(f"{name}: an embedding with max_norm rewrites its rows at lookup "
                             "and cannot be quantized; skip it")
        if module.weight.device.type != "meta" or not module.weight.is_floating_point():
            _check_finite(name, module.weight)  # on meta: checked when loaded (QuantizingLoad)
        chosen[name] = module
    # A tied table is one weight: quantized for all of its readers or for none, so that
    # skipping the head does not leave a float head beside a second, quantized copy.
    return {name: m for name, m in chosen.items()
            if all(reader in chosen for reader in readers[id(m.weight)])}


def _check_finite(name: str, weight: torch.Tensor) -> None:
    # The extremes, in one pass: a NaN or an infinity is one of them, and no temporary as
    # large as the weight is made (isfinite's made three, 2.5x an embedding's float32 bytes).
    if not weight.is_floating_point() or (weight.numel() and not all(
            torch.isfinite(x) for x in torch.aminmax(weight.detach()))):
        raise ValueError(f"{name}: its weight is not all finite floating-point numbers; "
                         "refusing to quantize it")
