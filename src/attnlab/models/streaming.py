"""Filling a model built on the ``meta`` device from a checkpoint, one stored tensor at a time.

``fill`` reads each stored tensor (a ``StoredTensor``, memory-mapped through a handle of its
own), renames it (a family's ``WeightMap``: transposed or split where the format needs it),
gives it the load's dtype and device and places it under every name that reads it (a tied
tensor once). On a quantized load (``QuantizingLoad``) the module whose weight it is becomes
its quantized module at once, before the next tensor is read. Nothing else keeps a float
weight, and every kept tensor is a copy in memory of its own, so the file's pages leave memory
with each mapped tensor: a quantized load holds the quantized model, one float weight and the
pages of one stored tensor, never the float model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from attnlab.models.hf_loading import StoredTensor
from attnlab.quantization.convert import QuantizationConfig, QuantizingLoad

__all__ = ["fill", "loading_message"]

# A stored tensor (its name, its mapped values) -> ours: names -> tensors (views of it).
Renaming = Callable[[str, Tensor], Mapping[str, Tensor]]


def fill(model: nn.Module, records: Collection[StoredTensor], *, dtype: torch.dtype,
         device: torch.device, quantizing: QuantizingLoad | None = None,
         rename: Renaming | None = None, announce: str | None = None) -> nn.Module:
    """Give ``model`` (built on ``meta``, every stored tensor's name and shape checked
    against it) the values of ``records``, in ``dtype`` (floating-point tensors; others as
    stored) on ``device``; returned for chaining.

    ``rename`` maps a stored tensor to our names (default: the names are ours).
    ``quantizing`` swaps each chosen module for its quantized one as soon as its weight is
    placed; an error there (a weight that is not finite) names the file and the tensor.
    ``announce``: a line for stderr before the first read (a quantized load takes a while),
    followed by a progress bar when the load lasts over a second.
    """
    targets = model.state_dict(keep_vars=True)  # each name -> its meta tensor
    aliases: dict[int, list[str]] = {}  # a tied tensor: every name that reads it
    for name, t in targets.items():
        aliases.setdefault(id(t), []).append(name)
    if announce is not None:
        print(f"attnlab: {announce} ...", file=sys.stderr, flush=True)
    if quantizing is not None:
        quantizing.survey(_readers(records, rename))
    bar = tqdm(records, desc="attnlab: loading", unit="tensor", delay=1.0, leave=False,
               disable=announce is None, file=sys.stderr)
    for record in bar:
        _place(model, record, targets, aliases, dtype, device, quantizing, rename)
    if quantizing is not None:
        quantizing.finish()
    unfilled = [name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    assert not unfilled, f"checked against the file, yet never placed: {unfilled[:4]}"
    return model.to(device)  # what the modules computed when built (rotary tables) too


def _readers(records: Collection[StoredTensor], rename: Renaming | None
             ) -> Iterator[tuple[str, Callable[[], Tensor]]]:
    """(our name, a function reading that tensor) for every stored tensor: the names come
    from renaming a ``meta`` stand-in of each record, so a quantizing load's survey reads only
    the weights it measures (reading every tensor made a copy of each, the largest one the
    load's peak)."""
    for record in records:
        stand_in = torch.empty(record.shape, device="meta")
        names = [record.name] if rename is None else list(rename(record.name, stand_in))
        for name in names:
            yield name, partial(_read_as, record, rename, name)


def _read_as(record: StoredTensor, rename: Renaming | None, name: str) -> Tensor:
    """Our tensor ``name`` of ``record``, read unchecked (the load checks it when it places
    it)."""
    stored = record.read(checked=False)
    return stored if rename is None else rename(record.name, stored)[name]


def loading_message(model: nn.Module, folder: Path, config: QuantizationConfig, *,
                    stored: bool) -> str:
    """``"loading 30 layers as int4 (group_size 64) from FOLDER"`` (quantized as read), or
    ``"loading 30 int8 layers from FOLDER"`` for a folder ``stored`` quantized; the layers are
    the blocks of the model's ``layers`` lists."""
    layers = sum(len(m) for name, m in model.named_modules()
                 if name.rpartition(".")[2] == "layers" and isinstance(m, nn.ModuleList))
    return (f"loading {layers} {config.scheme} layers from {folder}" if stored
            else f"loading {layers} layers as {config.scheme} from {folder}")


def _place(model: nn.Module, record: StoredTensor, targets: Mapping[str, Tensor],
           aliases: Mapping[int, list[str]], dtype: torch.dtype, device: torch.device,
           quantizing: QuantizingLoad | None, rename: Renaming | None) -> None:
    """Read ``record`` and place what it holds; its mapping is released on return, as
    nothing placed is a view of it but a weight being quantized, gone once swapped."""
    stored = record.read()
    ours = {record.name: stored} if rename is None else rename(record.name, stored)
    for name, t in ours.items():
        target = targets[name]
        consumed = quantizing is not None and quantizing.takes(name)
        # A weight about to be quantized is read in place when it needs no conversion; a
        # kept one is copied, so that no tensor of the model holds the file's mapping.
        # int4's float16 scales and zeros (float16 in the quantized skeleton, which is
        # otherwise in the default float32) stay float16 whatever the activations' dtype,
        # and coded int4 scales' steps as stored (they are part of the codes).
        kept = (t.dtype == target.dtype == torch.float16
                or (name.endswith(".steps") and t.dtype == target.dtype))
        value = t.to(device=device, dtype=dtype if t.is_floating_point() and not kept
                     else t.dtype, copy=not consumed)
        if isinstance(target, nn.Parameter):
            value = nn.Parameter(value, requires_grad=target.requires_grad)
        for alias in aliases[id(target)]:
            owner, _, leaf = alias.rpartition(".")
            setattr(model.get_submodule(owner), leaf, value)
        if consumed:
            try:
                quantizing.placed(name)
            except ValueError as error:
                raise ValueError(f"{record.path}: tensor {record.name!r}: {error}") from None
