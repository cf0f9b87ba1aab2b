"""attnlab's own checkpoint format: ``save_pretrained`` / ``from_pretrained`` on every model.

A folder holds ``config.json`` = ``{"model_type": <the class's MODEL_TYPE>, "torch_dtype":
<the weights' dtype>, <every field of the model's config>}`` and ``model.safetensors``, the
state dict under our own names (a tied tensor stored once). ``DecoderLM`` writes
``"attnlab_decoder"``, ``Transformer`` ``"attnlab_transformer"``; Hugging Face family
folders are ``attnlab.models.io``'s business.

Loading checks before it allocates: the config is rebuilt (every field typed and checked,
errors naming ``config.json`` and the field), the model is built on the ``meta`` device and
every stored tensor's shape and dtype is compared with it (quantized codes in exactly their
dtype: a cast would change them), so a config from elsewhere that asks for a huge model fails
on its shapes, not on memory; a NaN or an infinity in a tensor is refused as it is read. The
tensors are then placed one at a time (``attnlab.models.streaming``), quantized as they are
read when asked: a quantized load never holds the float model. The parameters come back
trainable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor, nn

from attnlab.durable import write_text_atomic
from attnlab.kernels import optimize_for_inference
from attnlab.models.config import ConfigMixin
from attnlab.models.hf_loading import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_folder,
    check_rotary,
    dtype_mismatch,
    file_tensors,
    parse_device,
    parse_dtype,
    read_json,
    save_tensors,
)
from attnlab.models.streaming import fill, loading_message
from attnlab.quantization.convert import (
    DEFAULT_GROUP_SIZE,
    QuantizationConfig,
    QuantizingLoad,
    quantize_model,
    quantized_skeleton,
)

__all__ = [
    "PreTrainedModel",
    "cast_weights",
    "contiguous_state",
    "install_kernels",
    "load_state",
    "read_weights",
    "requested_quantization",
    "shape_mismatch",
    "stored_shapes",
]

M = TypeVar("M", bound="PreTrainedModel")


class PreTrainedModel(nn.Module):
    """A model built as ``cls(config)`` with ``save_pretrained(folder)`` and
    ``cls.from_pretrained(folder, dtype=, device=)`` in attnlab's own format (module
    docstring). A subclass names its ``MODEL_TYPE`` (the ``config.json`` tag) and
    ``CONFIG_CLASS``.
    """

    MODEL_TYPE: ClassVar[str]
    CONFIG_CLASS: ClassVar[type[ConfigMixin]]
    config: Any
    quantization: QuantizationConfig | None = None  # set by ``quantize``

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: that of the first floating-point parameter (quantized
        weights are buffers; norms and biases stay in it)."""
        return next(p for p in self.parameters() if p.is_floating_point()).dtype

    @property
    def device(self) -> torch.device:
        """Where the model lives: its first parameter's device."""
        return next(self.parameters()).device

    def quantize(self: M, method: str = "int8", group_size: int | None = None, *,
                 skip: tuple[str, ...] | list[str] = (), kernel: str | None = None,
                 table_bits: int | None = None, fit: str | None = None,
                 scale_dtype: str | None = None,
                 int8_layers: tuple[str, ...] | list[str] | None = None,
                 int8_outliers: int | None = None) -> M:
        """Quantize this model's weights in place and return it:
        ``attnlab.quantization.quantize_model(self, method, group_size, skip=, kernel=,
        table_bits=, fit=, scale_dtype=, int8_layers=, int8_outliers=)`` (``"int8"`` per
        output row, ``"int4"`` in groups of ``group_size``, default 32; ``skip``: module-name
        patterns kept in float; the token tables in ``table_bits``, default 8; int4's ``fit``
        default ``"search"``, its scales and zeros in ``scale_dtype`` (default ``"int8"``:
        coded in 8 bits, 4.5 bits a weight in all) and the layers matching ``int8_layers`` in
        int8 (default ``DEFAULT_INT8_LAYERS`` and the ``down_proj`` of the largest weight
        outliers, ``int8_outliers``; ``()``: none)). ``save_pretrained`` then writes the
        quantized weights and records the scheme in ``config.json``."""
        return quantize_model(self, method, group_size, skip=skip, kernel=kernel,
                              table_bits=table_bits, fit=fit, scale_dtype=scale_dtype,
                              int8_layers=int8_layers, int8_outliers=int8_outliers)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` to the folder ``path`` (made if
        needed); returns it."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a folder path (str or Path), got "
                            f"{type(path).__name__}")
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise FileExistsError(f"path: {path} is a file; expected a folder (made if "
                                  f"missing) to write {CONFIG_NAME} and {WEIGHTS_NAME} in")
        path.mkdir(parents=True, exist_ok=True)
        dtype = str(self.dtype).removeprefix("torch.")
        config = {"model_type": self.MODEL_TYPE, "torch_dtype": dtype, **self.config.to_dict()}
        if self.quantization is not None:
            config["quantization"] = self.quantization.to_dict()
        save_tensors(path, contiguous_state(self))  # each file replaced in one step
        write_text_atomic(path / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
        return path

    @classmethod
    def from_pretrained(cls: type[M], path: str | Path, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None, *,
                        quantize: str | QuantizationConfig | None = None,
                        group_size: int | None = None,
                        skip: tuple[str, ...] | list[str] = (),
                        quantized_kernel: str | None = None) -> M:
        """Load a folder written by ``save_pretrained`` (eval mode, trainable weights).

        ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"`` or a ``torch.dtype``) defaults
        to the stored ``torch_dtype``; ``device`` to the CPU. ``quantize`` (``"int8"`` or
        ``"int4"``, with ``group_size`` and ``skip`` as in ``quantize``; or a whole
        ``QuantizationConfig``) quantizes each weight as it is read; a folder saved quantized
        loads as stored, without ``quantize`` or with the same scheme (another one is refused:
        re-quantizing quantized weights would compound their error). ``quantized_kernel``
        forces one kernel on the quantized layers (``quantize``'s ``kernel``).
        """
        folder = check_folder(path)
        dtype = parse_dtype(dtype)
        device = parse_device(device)
        file = folder / CONFIG_NAME
        raw = read_json(file)
        model_type = raw.pop("model_type", None)
        if model_type != cls.MODEL_TYPE:
            raise ValueError(f"{file}: model_type {model_type!r} is not {cls.__name__}'s "
                             f"{cls.MODEL_TYPE!r}; attnlab.models.from_pretrained reads every "
                             f"supported model_type")
        stored = parse_dtype(raw.pop("torch_dtype", None) or "float32", f"{file}: torch_dtype")
        quantization = raw.pop("quantization", None)
        config = cls.CONFIG_CLASS.from_dict(raw, source=file)
        if quantization is not None:
            try:
                quantization = QuantizationConfig.from_dict(quantization)
            except (TypeError, ValueError) as error:
                raise type(error)(f"{file}: {error}") from None
        asked = requested_quantization(quantize, group_size, skip)
        if asked is not None and quantization is not None:
            _check_same_scheme(asked, quantization, folder)
        weights = folder / WEIGHTS_NAME
        records = file_tensors(weights)
        with torch.device("meta"):  # shapes without memory, checked against the file first
            model = cls(config)  # type: ignore[call-arg]
            if quantization is not None:
                _quantized_skeleton(model, quantization, file, quantized_kernel,
                                    dtype or stored)
        check_rotary(model, file)
        wrong = (shape_mismatch({name: r.shape for name, r in records.items()}, model, weights)
                 or dtype_mismatch(records.values(), model.state_dict()))
        if wrong:
            raise ValueError(wrong)
        unexpected = sorted(set(records) - set(model.state_dict()))
        if unexpected:
            raise ValueError(f"{str(weights)!r} does not match the model: unexpected "
                             f"{unexpected}")
        quantizing = (QuantizingLoad(model, asked, kernel=quantized_kernel)
                      if asked is not None and quantization is None else None)
        scheme = quantization or asked
        announce = (None if scheme is None else
                    loading_message(model, folder, scheme, stored=quantization is not None))
        fill(model, records.values(), dtype=dtype or stored, device=device,
             quantizing=quantizing, announce=announce)
        return model.eval()


def requested_quantization(method: str | QuantizationConfig | None, group_size: int | None,
                           skip: tuple[str, ...] | list[str]) -> QuantizationConfig | None:
    """The scheme that ``from_pretrained(quantize=method, group_size=, skip=)`` asks for
    (int4's groups default to ``DEFAULT_GROUP_SIZE``, its tables to 8 bits, its fit to the
    search; a ``QuantizationConfig`` as ``method`` is the whole scheme), or None without
    ``method``."""
    if method is None or isinstance(method, QuantizationConfig):
        return method
    return QuantizationConfig(method, DEFAULT_GROUP_SIZE if method == "int4" and group_size is
                              None else group_size, tuple(skip) if not isinstance(skip, str)
                              else skip)


def _check_same_scheme(asked: QuantizationConfig, stored: QuantizationConfig,
                       folder: Path) -> None:
    """A folder saved quantized loads only as the scheme it holds (a mismatch names both)."""
    if (asked.method, asked.group_size) != (stored.method, stored.group_size):
        raise ValueError(f"quantize: {folder} holds {stored.scheme} weights, but "
                         f"{asked.scheme} was asked; load it without quantize=, or quantize "
                         "the float checkpoint it was made from")


def install_kernels(model: nn.Module, *, extra_memory: bool = False) -> None:
    """The loading entry point's last step: the fast inference modules swapped in for the
    reference ones (``attnlab.kernels.optimize_for_inference``; ``extra_memory`` is its)."""
    optimize_for_inference(model, extra_memory=extra_memory)


def _quantized_skeleton(model: nn.Module, quantization: QuantizationConfig, file: Path,
                        kernel: str | None, dtype: torch.dtype) -> None:
    """``quantized_skeleton`` for a model loaded in ``dtype``, its errors (a group size that
    does not fit a layer) naming ``file``."""
    try:
        quantized_skeleton(model, quantization, kernel=kernel, dtype=dtype)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{file}: quantization: {error}") from None


def contiguous_state(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s state dict with each tied tensor once (under its first name) and every
    tensor contiguous: inference kernels may keep a weight column-major, which safetensors
    does not write."""
    state: dict[str, Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key not in seen:
            seen.add(key)
            state[name] = t.contiguous()
    return state


def cast_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters and stored buffers to ``dtype``; computed buffers (sinusoids, rotary
    frequencies: not in the state dict) stay in the float32 they were made in, as the modules
    cast them to the input's dtype where they are used."""
    stored = model.state_dict(keep_vars=True)
    computed = [(name, b) for name, b in model.named_buffers() if name not in stored]
    model.to(dtype)
    for name, buffer in computed:
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)


def read_weights(path: Path, what: str | None = None) -> dict[str, Tensor]:
    """Every tensor of the safetensors file ``path`` (memory-mapped); a missing, truncated or
    corrupt file raises a ``ValueError`` naming it (after ``what: `` when given)."""
    where = "" if what is None else f"{what}: "
    if not path.is_file():
        raise ValueError(f"{where}{str(path)!r} is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{where}cannot read {str(path)!r}: the file is truncated or corrupt "
                         f"({error})") from None


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the safetensors file ``path``, read from its header
    alone (nothing allocated); empty when the file cannot be read (``read_weights`` says
    why)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError):
        return {}


def shape_mismatch(stored: Mapping[str, tuple[int, ...]], model: nn.Module, source: Path,
                   what: str | None = None) -> str | None:
    """Why tensors of these ``stored`` shapes (from ``source``) do not fit ``model`` (a shape
    differs, a tensor is absent), or ``None`` when they fit or nothing was read."""
    if not stored:
        return None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wrong = [f"{name}: {tuple(shape)} in the file, {expected[name]} from the config"
             for name, shape in stored.items()
             if name in expected and tuple(shape) != expected[name]]
    # tied tensors (one tensor under two names) are stored once, under either name
    tensors = model.state_dict(keep_vars=True)
    stored_ids = {id(t) for name, t in tensors.items() if name in stored}
    wrong += [f"{name}: not in the file" for name, t in tensors.items()
              if name not in stored and id(t) not in stored_ids]
    if not wrong:
        return None
    more = f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else ""
    where = "" if what is None else f"{what}: "
    return (f"{where}the config does not match the weights in {str(source)!r}: "
            + "; ".join(wrong[:4]) + more)


def load_state(model: nn.Module, state: Mapping[str, Tensor], source: Path,
               what: str | None = None) -> None:
    """Copy ``state`` (read from ``source``) into ``model``, strictly: every tensor of the
    model is given (a tied one under either of its names) and nothing else; a mismatch raises
    a ``ValueError`` naming ``source`` and the tensors."""
    wrong = shape_mismatch({k: tuple(v.shape) for k, v in state.items()}, model, source, what)
    if wrong:
        raise ValueError(wrong)
    tensors = model.state_dict(keep_vars=True)
    unexpected = sorted(set(state) - set(tensors))
    if unexpected:
        where = "" if what is None else f"{what}: "
        raise ValueError(f"{where}{str(source)!r} does not match the model: unexpected "
                         f"{unexpected}")
    model.load_state_dict(state, strict=False)  # the missing ones are tied (checked above)
