"""Loading and writing a Hugging Face family's checkpoint folder as a ``DecoderLM``.

The folder's ``model_type`` picks the family; its ``config.json`` becomes a
``DecoderLMConfig`` and its tensors (memory-mapped, checked name by name and shape by shape
against what the config implies) are renamed, and transposed or split where the format needs
it, into the model's: raw-weight parity, values as stored. The model class is passed in
(``DecoderLM.from_pretrained`` calls this), so this module needs only the config. A
quantized load reads, quantizes and places one stored tensor at a time
(``attnlab.models.streaming``); a float one maps the tensors and uses them in place.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from attnlab._checks import is_int
from attnlab.durable import write_text_atomic
from attnlab.models.config import check_value
from attnlab.models.decoder_config import DecoderLMConfig
from attnlab.models.families import Family, family_for
from attnlab.models.families.base import check_round_trip
from attnlab.models.hf_loading import (
    CONFIG_NAME,
    check_folder,
    check_rotary,
    file_tensors,
    load_tensors,
    parse_dtype,
    read_json,
    save_tensors,
    stored_tensors,
    weight_files,
)
from attnlab.models.streaming import fill, loading_message
from attnlab.quantization.convert import QuantizationConfig, QuantizingLoad

__all__ = ["load_family", "read_config", "save_family"]

M = TypeVar("M", bound=nn.Module)


def load_family(cls: type[M], folder: Path, dtype: torch.dtype | None,
                device: torch.device, quantization: QuantizationConfig | None = None, *,
                kernel: str | None = None) -> M:
    """``cls(config)`` (a ``DecoderLM``) with the weights of the family checkpoint ``folder``,
    in eval mode on ``device``; ``dtype`` ``None`` keeps the stored one. ``quantization``:
    the weights quantized as they are read (``kernel`` forcing one quantized kernel)."""
    family, config, stored_dtype = read_config(folder)
    dtype = dtype or stored_dtype
    stored_names = weight_files(folder)
    if config.num_layers > len(stored_names):  # each layer stores tensors: refuse first
        raise ValueError(f"{folder / CONFIG_NAME}: asks for {config.num_layers} layers, but "
                         f"the weights hold only {len(stored_names)} tensors")
    _check_sizes(folder / CONFIG_NAME, config, stored_names)
    try:
        # Parameters on "meta", filled below; the rotary frequencies (plain tensors, not
        # buffers) are made on the CPU at the first forward, once the shapes are checked.
        with torch.device("meta"):
            model = cls(config)  # type: ignore[call-arg]
    except (RuntimeError, OverflowError) as error:  # a size past torch's int64 or a float
        raise ValueError(f"{folder / CONFIG_NAME}: sizes too large to build a model "
                         f"({error})") from None
    except (TypeError, ValueError) as error:  # a value only the layers check (RoPE's sizes)
        raise type(error)(f"{folder / CONFIG_NAME}: {error}") from None
    check_rotary(model, folder / CONFIG_NAME)
    weights = family.weights(config).matching(stored_names)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    expected = {k: tuple(t.shape) for k, t in weights.to_stored(model.state_dict()).items()}
    ignore = [*weights.skipped(stored_names), *(("lm_head.weight",) if config.tie_embeddings
                                                 else ())]
    if quantization is not None:
        quantizing = QuantizingLoad(model, quantization, kernel=kernel)  # sizes checked first
        records = stored_tensors(folder, expected, ignore=ignore).values()
        fill(model, records, dtype=dtype, device=device, quantizing=quantizing,
             rename=lambda name, t: weights.to_ours({name: t}, shapes),
             announce=loading_message(model, folder, quantization, stored=False))
        return model.eval()
    state = weights.to_ours(load_tensors(folder, expected, dtype=dtype, ignore=ignore), shapes)
    if config.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings:  # `assign` made two Parameters of the one tensor: one again
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device).eval()


# The sizes that each set a dim of some stored tensor (vocabulary rows, model width, heads,
# head width, MLP width): none can exceed the number of values the weights hold in all.
_SIZES = ("vocab_size", "d_model", "num_heads", "kv_heads", "head_dim", "ff_dim")


def _check_sizes(file: Path, config: DecoderLMConfig, files: Mapping[str, Path]) -> None:
    """Refuse a size of ``config`` (read from ``file``) that is larger than the number of
    values the weight ``files`` hold, from their headers alone, before anything is built: the
    error names the config.json key, where the shape check later could only name a tensor."""
    held = sum(math.prod(r.shape) for path in dict.fromkeys(files.values())
               for r in file_tensors(path).values())
    raw = read_json(file)
    for name in _SIZES:
        value = getattr(config, name)
        if value > held:
            key = next((k for k, v in raw.items() if is_int(v) and v == value), name)
            raise ValueError(f"{file}: {key} {value} is more than the {held} values the "
                             "weights hold in all; the config does not match the weights")


def read_config(path: str | Path) -> tuple[Family, DecoderLMConfig, torch.dtype]:
    """``(family, config, stored dtype)`` of the checkpoint folder ``path``'s ``config.json``.

    The family is picked by ``model_type``; the stored dtype is ``dtype`` (transformers 5) or
    ``torch_dtype`` (4), float32 when absent. Every error names the file and the key.
    """
    file = check_folder(path) / CONFIG_NAME
    raw = read_json(file)
    try:
        family = family_for(raw.get("model_type"))
        config = family.config_from_hf(raw)
        dtype_key = "dtype" if raw.get("dtype") is not None else "torch_dtype"
        stored = check_value(dtype_key, raw.get(dtype_key) or "float32", str)
        dtype = parse_dtype(stored, dtype_key)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{file}: {error}") from None
    return family, config, dtype


def save_family(model: nn.Module, path: str | Path) -> Path:
    """Write a ``DecoderLM`` of a Hugging Face family (``model.config.family``) in that
    family's format: its ``config.json`` and ``model.safetensors``.

    A config that the format cannot hold (one that would read back as another model: a
    Llama with q/k norms, say) is refused with a ``ValueError`` naming the field, before
    anything is written.
    """
    c = model.config
    family = family_for(c.family)
    hf = check_round_trip(c, family.config_to_hf(c), family.config_from_hf)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    hf["torch_dtype"] = dtype
    save_tensors(path, family.weights(c).to_stored(model.state_dict()))  # one step each
    write_text_atomic(path / CONFIG_NAME, json.dumps(hf, indent=2) + "\n")
    return path
