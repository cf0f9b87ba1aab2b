"""Writing a ``DecoderLM`` as a GGUF file (llama.cpp's format: Ollama, LM Studio, llama.cpp and
transformers' ``gguf_file=`` read it), the inverse of ``attnlab.models.gguf``.

The file is written with the ``gguf`` package's ``GGUFWriter`` (llama.cpp's own), under the
names and metadata keys that ``attnlab.models.gguf`` reads (the same tables, inverted):

- metadata: ``general.architecture`` (llama, qwen2, qwen3, gemma, phi3 or gpt2: the model's
  ``config.family``), the sizes under ``<arch>.*``, and, given a tokenizer, its vocabulary,
  merges, special tokens and chat template under ``tokenizer.*``
  (``attnlab.models.gguf_tokenizer.tokenizer_fields``);
- tensors: every 2-d weight in ``type`` (``f32``, ``f16``, ``bf16``, or the block types
  ``q8_0``, ``q4_0``, ``q4_1`` made by ``gguf.quants.quantize``, llama.cpp's round-to-nearest
  blocks of 32 inputs), the norms and biases in F32 as llama.cpp's converter keeps them. A
  weight whose inputs are not whole blocks of 32 is written in F16 instead (llama.cpp's
  converter does the same). Llama's q and k rows are interleaved as llama.cpp stores them,
  Phi-3's and GPT-2's fused tensors stacked, Gemma's norms written as ``1 + w``.

Before anything is written, the metadata is read back as ``attnlab.models.gguf`` will read it
and compared with the model's config (floats rounded to float32, as GGUF stores them): a
config that the format cannot hold (a RoPE scaling, a sliding window) is refused naming the
field. The file is written to a temporary file beside ``path`` and renamed over it once
complete (``attnlab.durable.write_file_atomic``): an interrupted export leaves no partial file.
Tensors are converted one at a time as they are written, so the export holds at most one
converted tensor besides the model.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor, nn

from attnlab.durable import write_file_atomic
from attnlab.models.decoder_config import DecoderLMConfig
from attnlab.models.families import family_for
from attnlab.models.families.base import check_round_trip
from attnlab.models.gguf import (
    ARCHITECTURES,
    BLOCK,
    CONFIG_KEYS,
    FUSED,
    GPT2_KEYS,
    LAYER_NAMES,
    NAMES,
    PERMUTED,
    UNIT_OFFSET_NORMS,
    config_dict,
    our_names,
    row_order,
)
from attnlab.models.gguf_tokenizer import tokenizer_fields

__all__ = ["TYPES", "export_gguf"]

Q = gguf.GGMLQuantizationType
# --type -> the GGUF type of the 2-d weights (file_type: llama.cpp's LLAMA_FTYPE_* number).
TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0,
         "q4_1": Q.Q4_1}
_FILE_TYPES = {Q.F32: 0, Q.F16: 1, Q.BF16: 32, Q.Q8_0: 7, Q.Q4_0: 2, Q.Q4_1: 3}
_ARCH_OF = {model_type: arch for arch, model_type in ARCHITECTURES.items()}
_FLOAT32_FIELDS = ("norm_eps", "rope_base")  # stored as GGUF float32


def export_gguf(model: nn.Module, path: str | Path, *, type: str = "f16",
                tokenizer: Any = None) -> Path:
    """Write ``model`` (a float ``DecoderLM`` of a family GGUF names: llama, qwen2, qwen3,
    gemma, phi3, gpt2) as the GGUF file ``path``, its 2-d weights in ``type`` (``TYPES``), and
    return ``path``. ``tokenizer`` (an ``attnlab.tokenizer.Tokenizer``; None writes no
    vocabulary, which llama.cpp needs to run the file) adds the vocabulary, merges, special
    tokens and chat template. Module docstring: names, layouts, the checks before writing,
    the atomic write."""
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or not isinstance(config, DecoderLMConfig):
        raise TypeError(f"model: expected a DecoderLM, got {_type_name(model)}")
    if not isinstance(type, str) or type.lower() not in TYPES:
        raise ValueError(f"type: expected one of {sorted(TYPES)}, got {type!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a file path (str or Path), got {_type_name(path)}")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"path: {path} is a folder; expected the GGUF file to write")
    qtype = TYPES[type.lower()]
    arch = _ARCH_OF.get(config.family or "")
    if arch is None:
        raise ValueError(f"model: its family {config.family!r} has no GGUF architecture here; "
                         f"expected one of {sorted(_ARCH_OF)}")
    quantized = sorted(name for name, _ in model.named_buffers() if name.endswith("qweight"))
    if quantized:
        raise ValueError(f"model: {quantized[0]!r} is quantized; export the float model "
                         "(GGUF's types are chosen by `type`, from float weights)")
    state = model.state_dict()
    plan = _tensor_plan(arch, config, state)
    metadata = _metadata(arch, config, qtype)
    _check_reads_back(arch, config, metadata, [name for name, _ in plan])
    if tokenizer is not None:
        metadata.update(tokenizer_fields(tokenizer, config.vocab_size))
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"attnlab: writing {len(plan)} tensors as {type.lower()} to {path} ...",
          file=sys.stderr, flush=True)
    write_file_atomic(path, lambda tmp: _write(tmp, arch, metadata, plan, state, config, qtype))
    return path


def _type_name(value: object) -> str:
    """``value``'s type's name, for error messages."""
    return value.__class__.__name__


def _tensor_plan(arch: str, config: DecoderLMConfig, state: dict[str, Tensor]
                 ) -> list[tuple[str, tuple[str, ...]]]:
    """``[(GGUF name, our names stacked by rows in it)]`` for every tensor of ``state``, in
    llama.cpp's order (whole-model tensors around the blocks); an unplaced tensor of ours
    raises a ``ValueError`` naming it."""
    layer_leaves = [*FUSED.get(arch, {}), *LAYER_NAMES]  # a fused name before its parts
    candidates = ["token_embd.weight", "position_embd.weight",
                  *(f"blk.{i}.{leaf}" for i in range(config.num_layers) for leaf in layer_leaves),
                  *(name for name in NAMES if name not in ("token_embd.weight",
                                                            "position_embd.weight"))]
    plan, placed = [], set()
    if config.tie_embeddings:  # llama.cpp stores a tied table once, as token_embd
        placed.add("lm_head.weight")
    for name in candidates:
        parts = our_names(name, arch)
        if parts and all(p in state for p in parts) and not placed.intersection(parts):
            plan.append((name, parts))
            placed.update(parts)
    left = [n for n in state if n not in placed]
    if left:
        raise ValueError(f"model: no GGUF tensor of a {arch} file holds {left[:4]}")
    return plan


def _metadata(arch: str, config: DecoderLMConfig, qtype: Q) -> dict[str, Any]:
    """The ``general.*`` and ``<arch>.*`` metadata (GGUF key -> value) of ``config``."""
    hf = family_for(config.family).config_to_hf(config)
    hf.setdefault("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta"))
    keys = GPT2_KEYS if arch == "gpt2" else CONFIG_KEYS
    d: dict[str, Any] = {"general.architecture": arch, "general.name": config.family,
                         "general.file_type": _FILE_TYPES[qtype],
                         "general.quantization_version": gguf.GGML_QUANT_VERSION}
    for key, hf_key in keys.items():
        value = hf.get(hf_key)
        if key == "attention.key_length" and value is not None:
            d[f"{arch}.attention.value_length"] = value
        if value is not None and not (key == "rope.freq_base" and config.position != "rope"):
            d[f"{arch}.{key}"] = float(value) if isinstance(value, float) else value
    for role in ("bos", "eos"):
        ids = getattr(config, f"{role}_token_id")
        if isinstance(ids, tuple):  # several end tokens: GGUF holds one, the first
            ids = ids[0] if ids else None
        if ids is not None:
            d[f"tokenizer.ggml.{role}_token_id"] = ids
    return d


def _check_reads_back(arch: str, config: DecoderLMConfig, metadata: dict[str, Any],
                      names: list[str]) -> None:
    """Refuse a config that the metadata would read back as another model (module
    docstring), naming the field."""
    stored = {k: _as_float32(v) for k, v in metadata.items()}
    d = config_dict(stored, names, "model")
    rounded = replace(config, **{f: _as_float32(getattr(config, f)) for f in _FLOAT32_FIELDS})
    try:
        check_round_trip(rounded, d, family_for(config.family).config_from_hf)
    except ValueError as error:
        raise ValueError(f"model: {error}; a GGUF file of {arch} cannot hold this config") \
            from None


def _as_float32(value: Any) -> Any:
    """A float as GGUF's float32 stores it; anything else as it is."""
    return float(np.float32(value)) if isinstance(value, float) else value


def _write(tmp: Path, arch: str, metadata: dict[str, Any],
           plan: list[tuple[str, tuple[str, ...]]], state: dict[str, Tensor],
           config: DecoderLMConfig, qtype: Q) -> None:
    """The GGUF file at ``tmp``: header, metadata, tensor infos, then each tensor converted
    as it is written."""
    writer = gguf.GGUFWriter(tmp, arch)
    for key, value in metadata.items():
        if key == "general.architecture":
            continue  # the writer adds it
        _add(writer, key, value)
    kinds = []
    for name, parts in plan:
        shape = (sum(state[p].shape[0] for p in parts), *state[parts[0]].shape[1:])
        kind = qtype if len(shape) == 2 else Q.F32
        if kind not in (Q.F32, Q.F16, Q.BF16) and shape[-1] % BLOCK:
            kind = Q.F16
        block, size = gguf.GGML_QUANT_SIZES[kind]
        writer.add_tensor_info(name, shape, np.dtype(np.float32),
                               math.prod(shape) // block * size, raw_dtype=kind)
        kinds.append(kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for kind, values in zip(kinds, _values(arch, config, plan, state)):
        writer.write_tensor_data(gguf.quants.quantize(values, kind))
    writer.close()


def _values(arch: str, config: DecoderLMConfig, plan: list[tuple[str, tuple[str, ...]]],
            state: dict[str, Tensor]) -> Iterator[np.ndarray]:
    """Each planned tensor as a float32 array in GGUF's layout (rows stacked, Llama's q/k
    rows interleaved, Gemma's norms as ``1 + w``)."""
    for name, parts in plan:
        value = torch.cat([state[p] for p in parts]) if len(parts) > 1 else state[parts[0]]
        value = value.detach().to(device="cpu", dtype=torch.float32)
        if arch in PERMUTED:
            rows = row_order(parts[0], config)
            if rows is not None:  # ours = theirs[rows]: put each row back where it was
                value = value[torch.argsort(rows)]
        if arch in UNIT_OFFSET_NORMS and name.endswith("norm.weight"):
            value = value + 1
        yield np.ascontiguousarray(value.numpy())


def _add(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """One metadata entry with the value type llama.cpp reads it as."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:  # a list: of strings, or of ints stored as int32 (GGUFWriter's add_token_types)
        writer.add_array(key, value)
