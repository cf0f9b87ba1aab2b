"""``from_pretrained`` / ``save_pretrained``: checkpoint folders <-> ``DecoderLM``/``Transformer``.

A folder holds ``config.json`` and ``model.safetensors`` (or a sharded index). Its
``model_type`` ``"attnlab_decoder"`` or ``"attnlab_transformer"`` is attnlab's own format
(``attnlab.models.pretrained``: our config fields, our tensor names); any other picks the
Hugging Face family (``attnlab.models.families``), which maps the config and the tensor
names; the tensors are memory-mapped and checked name by name and shape by shape against
what the config implies (raw-weight parity: values as stored, only renamed, and
transposed or split where the format needs it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from attnlab.models.config import check_value
from attnlab.models.decoder import DecoderLM, DecoderLMConfig, make_rotary
from attnlab.models.families import Family, family_for
from attnlab.models.hf_loading import (
    CONFIG_NAME,
    check_folder,
    load_tensors,
    parse_dtype,
    read_json,
    save_tensors,
    weight_files,
)
from attnlab.models.transformer import Transformer

__all__ = ["from_pretrained", "read_config", "save_pretrained"]

# attnlab's own formats: model_type -> the class that reads and writes it
_OWN = {cls.MODEL_TYPE: cls for cls in (DecoderLM, Transformer)}


def from_pretrained(path: str | Path, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None) -> DecoderLM | Transformer:
    """Load the checkpoint folder ``path`` as a ``DecoderLM`` (eval mode, trainable weights),
    or as a ``Transformer`` for attnlab's ``"attnlab_transformer"`` format.

    ``dtype`` (``"float32"``, ``"bfloat16"``, a ``torch.dtype``) defaults to the stored
    ``torch_dtype``/``dtype``; ``device`` to the CPU. An unsupported ``model_type`` is refused
    naming the supported ones; a missing, extra or misshapen tensor names the tensor.
    """
    folder = check_folder(path)
    dtype = parse_dtype(dtype)
    device = _device(device)
    raw = read_json(folder / CONFIG_NAME)
    own = _OWN.get(raw["model_type"]) if isinstance(raw.get("model_type"), str) else None
    if own is not None:
        return own.from_pretrained(folder, dtype=dtype, device=device)
    family, config, stored_dtype = read_config(folder)
    dtype = dtype or stored_dtype
    stored_names = weight_files(folder)
    if config.num_layers > len(stored_names):  # each layer stores tensors: refuse first
        raise ValueError(f"{folder / CONFIG_NAME}: asks for {config.num_layers} layers, but "
                         f"the weights hold only {len(stored_names)} tensors")
    try:
        with torch.device("meta"):
            model = DecoderLM(config)
    except RuntimeError as error:  # a size whose element count overflows
        raise ValueError(f"{folder / CONFIG_NAME}: sizes too large to build a model "
                         f"({error})") from None
    except (TypeError, ValueError) as error:  # a value only the layers check (RoPE's sizes)
        raise type(error)(f"{folder / CONFIG_NAME}: {error}") from None
    weights = family.weights(config).matching(stored_names)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    expected = {k: tuple(t.shape) for k, t in weights.to_stored(model.state_dict()).items()}
    ignore = [*weights.skipped(stored_names), *(("lm_head.weight",) if config.tie_embeddings
                                                 else ())]
    stored_tensors = load_tensors(folder, expected, dtype=dtype, ignore=ignore)
    state = weights.to_ours(stored_tensors, shapes)
    if config.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings:  # `assign` made two Parameters of the one tensor: one again
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = make_rotary(config)  # its frequencies are buffers, made on "meta" above
    return model.to(device).eval()


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


def save_pretrained(model: DecoderLM | Transformer, path: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` in the model's family format, or in
    attnlab's own for a ``Transformer`` or a ``DecoderLM`` whose ``config.family`` is ``None``."""
    if not isinstance(model, (DecoderLM, Transformer)):
        raise TypeError(f"model: expected a DecoderLM or a Transformer, got "
                        f"{type(model).__name__}")
    if isinstance(model, Transformer) or model.config.family is None:
        return model.save_pretrained(path)
    c = model.config
    family = family_for(c.family)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    hf = {**family.config_to_hf(c), "torch_dtype": dtype}
    (path / CONFIG_NAME).write_text(json.dumps(hf, indent=2) + "\n")
    save_tensors(path, family.weights(c).to_stored(model.state_dict()))
    return path


def _device(device: object) -> torch.device:
    """``device`` as a ``torch.device`` (CPU for ``None``); else a ``ValueError`` naming it."""
    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device: expected a str or torch.device, got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device: expected a device such as 'cpu' or 'cuda:0', got "
                         f"{device!r} ({error})") from None
