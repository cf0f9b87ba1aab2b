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

from pathlib import Path

import torch

from attnlab.models.decoder import DecoderLM
from attnlab.models.families import family_for
from attnlab.models.families.loading import read_config
from attnlab.models.gguf import gguf_file
from attnlab.models.hf_loading import CONFIG_NAME, check_folder, read_json
from attnlab.models.transformer import Transformer

__all__ = ["from_pretrained", "read_config", "save_pretrained"]


def from_pretrained(path: str | Path, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None, *, kernels: bool = True,
                    extra_memory: bool = False, quantize: str | None = None,
                    group_size: int | None = None, skip: tuple[str, ...] | list[str] = (),
                    quantized_kernel: str | None = None) -> DecoderLM | Transformer:
    """Load the checkpoint folder ``path`` (or a GGUF file, or a folder holding one: a
    ``DecoderLM`` whose Q8_0/Q4_0/Q4_1 blocks stay quantized, ``attnlab.models.gguf``): a
    ``Transformer`` for attnlab's
    ``"attnlab_transformer"`` format, else ``DecoderLM.from_pretrained`` (attnlab's
    ``"attnlab_decoder"`` or any supported Hugging Face family), in eval mode with trainable
    weights. ``kernels``, ``extra_memory``, ``quantize``, ``group_size``, ``skip`` and
    ``quantized_kernel`` are ``DecoderLM.from_pretrained``'s (the ``Transformer`` has no
    inference kernels yet: it takes the last four).

    ``dtype`` (``"float32"``, ``"bfloat16"``, a ``torch.dtype``) defaults to the stored
    ``torch_dtype``/``dtype``; ``device`` to the CPU. An unsupported ``model_type`` is refused
    naming the supported ones; a missing, extra or misshapen tensor names the tensor.
    """
    if isinstance(path, (str, Path)) and gguf_file(path) is not None:
        return DecoderLM.from_pretrained(path, dtype=dtype, device=device, kernels=kernels,
                                         extra_memory=extra_memory, quantize=quantize,
                                         group_size=group_size, skip=skip,
                                         quantized_kernel=quantized_kernel)
    file = check_folder(path) / CONFIG_NAME
    raw = read_json(file)
    model_type = raw.get("model_type")
    ours = (DecoderLM.MODEL_TYPE, Transformer.MODEL_TYPE)
    if model_type not in ours:
        try:
            family_for(model_type)
        except ValueError as error:
            raise ValueError(f"{file}: {error} (Hugging Face families) or "
                             f"{', '.join(map(repr, ours))} (attnlab's own)") from None
    if model_type == Transformer.MODEL_TYPE:
        return Transformer.from_pretrained(path, dtype=dtype, device=device, quantize=quantize,
                                           group_size=group_size, skip=skip,
                                           quantized_kernel=quantized_kernel)
    return DecoderLM.from_pretrained(path, dtype=dtype, device=device, kernels=kernels,
                                     extra_memory=extra_memory, quantize=quantize,
                                     group_size=group_size, skip=skip,
                                     quantized_kernel=quantized_kernel)


def save_pretrained(model: DecoderLM | Transformer, path: str | Path) -> Path:
    """``model.save_pretrained(path)``: the model's family format, or attnlab's own for a
    ``Transformer`` or a ``DecoderLM`` whose ``config.family`` is ``None``."""
    if not isinstance(model, (DecoderLM, Transformer)):
        raise TypeError(f"model: expected a DecoderLM or a Transformer, got "
                        f"{type(model).__name__}")
    return model.save_pretrained(path)
