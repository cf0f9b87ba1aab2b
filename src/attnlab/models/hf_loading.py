"""Hugging Face-format checkpoint folders, read and written without ``transformers``.

A folder holds ``config.json`` and the weights: one ``model.safetensors``, or shards listed
by ``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``).
Tensors are memory-mapped (``safetensors.safe_open``): nothing is read from disk until it is
used, and a tensor kept in its stored dtype is used in place, without a copy. A loader that
converts each tensor (a quantized load) reads ``StoredTensor`` records instead: checked from
the headers alone, each read through a handle of its own, so that its pages leave memory with
it (a handle's mapping keeps every page read through it until the handle and all its tensors
are gone).

Every check names the file and the tensor: a missing file, a missing or unexpected tensor name,
a shape other than the config implies, a dtype we cannot run, a truncated or corrupt
safetensors file, a NaN or an infinity in a floating-point tensor (``check_finite``, as each
tensor is read: one pass over its values, no copy). Only local folders are read: a Hugging Face
Hub name (``Qwen/...``) that is not a folder here raises, saying how to download it; nothing is
fetched from a network.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from attnlab.durable import write_file_atomic
from attnlab.layers.rotary import RotaryEmbedding

__all__ = [
    "CONFIG_NAME",
    "INDEX_NAME",
    "SUPPORTED_DTYPES",
    "WEIGHTS_NAME",
    "StoredTensor",
    "check_finite",
    "check_folder",
    "check_rotary",
    "dtype_mismatch",
    "file_tensors",
    "load_tensors",
    "parse_dtype",
    "read_json",
    "save_tensors",
    "stored_tensors",
    "weight_files",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                    "float16": torch.float16}
# safetensors' dtype codes for the dtypes we run; any other code is refused by name.
_STORED = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# The codes of the integer dtypes a model may hold (quantized codes), to name what is expected.
_INTEGER_CODES = {torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32",
                  torch.int64: "I64", torch.bool: "BOOL"}
# "owner/name" as the Hub spells repositories: what a user who expects a download types.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file as its header describes it: the ``path`` of the file,
    its ``name`` there, its ``shape`` and its ``dtype`` (safetensors' code: ``"F32"``,
    ``"U8"``, ...); nothing is read until ``read``."""

    path: Path
    name: str
    shape: tuple[int, ...]
    dtype: str

    def read(self, *, checked: bool = True) -> Tensor:
        """The tensor as stored, memory-mapped through a handle of its own: the pages it
        touches stay in memory only while the tensor (or a view of it) lives. A NaN or an
        infinity in it raises (``check_finite``) when ``checked``; unchecked, no page is read
        until the values are."""
        with _open(self.path) as f:
            tensor = f.get_tensor(self.name)
        return check_finite(self.path, self.name, tensor) if checked else tensor


def load_tensors(folder: str | Path, expected: Mapping[str, tuple[int, ...]], *,
                 dtype: torch.dtype | None = None,
                 ignore: Collection[str] = ()) -> dict[str, Tensor]:
    """Memory-map the tensors named in ``expected`` (name -> shape) from ``folder``, checked
    as ``stored_tensors`` checks them. A tensor is converted to ``dtype`` when given (a copy),
    and otherwise returned as stored (mapped, one handle per file).
    """
    by_file: dict[Path, list[str]] = {}
    for record in stored_tensors(folder, expected, ignore=ignore).values():
        by_file.setdefault(record.path, []).append(record.name)
    tensors: dict[str, Tensor] = {}
    for path, names in by_file.items():
        with _open(path) as f:
            for name in names:
                t = check_finite(path, name, f.get_tensor(name))  # header checked: size right
                tensors[name] = t if dtype is None or t.dtype == dtype else t.to(dtype)
    return tensors


def stored_tensors(folder: str | Path, expected: Mapping[str, tuple[int, ...]], *,
                   ignore: Collection[str] = ()) -> dict[str, StoredTensor]:
    """The tensors named in ``expected`` (name -> shape) in ``folder``, checked from the
    files' headers alone (nothing is read).

    Every expected name must be stored with that shape and a float dtype we run (float32,
    bfloat16, float16); any other stored name raises, except those in ``ignore`` and
    ``*.rotary_emb.inv_freq`` buffers (old Llama checkpoints), which are skipped.
    """
    files = weight_files(folder)
    missing = [name for name in expected if name not in files]
    if missing:
        stored = _describe_source(Path(folder))
        raise ValueError(f"{stored}: missing tensor {missing[0]!r} (expected shape "
                         f"{tuple(expected[missing[0]])}); {len(missing)} of {len(expected)} "
                         f"expected tensors are missing: {missing[:5]}")
    for name, path in files.items():
        if name not in expected and name not in ignore and not name.endswith("inv_freq"):
            raise ValueError(f"{path}: unexpected tensor {name!r}; the config expects "
                             f"{len(expected)} tensors such as {next(iter(expected))!r}")
    records: dict[str, StoredTensor] = {}
    for path in dict.fromkeys(files[name] for name in expected):
        with _open(path) as f:
            for name in f.keys():  # noqa: SIM118 (a handle, not a dict)
                if name not in expected or files[name] != path:
                    continue
                view = f.get_slice(name)
                shape, code = tuple(view.get_shape()), view.get_dtype()
                if shape != tuple(expected[name]):
                    raise ValueError(f"{path}: tensor {name!r} has shape {shape}, "
                                     f"expected {tuple(expected[name])} from {CONFIG_NAME}")
                if code not in _STORED:
                    raise ValueError(f"{path}: tensor {name!r} has dtype {code}, expected "
                                     f"one of {sorted(_STORED)} (float32, bfloat16, float16)")
                records[name] = StoredTensor(path, name, shape, code)
    absent = [name for name in expected if name not in records]
    if absent:
        raise ValueError(f"{_describe_source(Path(folder))}: tensor {absent[0]!r} is listed in "
                         f"shard {files[absent[0]].name!r}, which does not hold it")
    return records


def file_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of the safetensors file ``path``, from its header alone; a missing,
    truncated or corrupt file raises a ``ValueError`` naming it."""
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is missing")
    with _open(path) as f:
        views = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (a handle)
        return {name: StoredTensor(path, name, tuple(v.get_shape()), v.get_dtype())
                for name, v in views.items()}


def check_finite(path: Path, name: str, tensor: Tensor) -> Tensor:
    """``tensor`` (``name`` in the file ``path``) when it holds no NaN or infinity, else a
    ``ValueError`` naming both: such a weight would turn every output into NaN, or worse, into
    plausible text (a fused attention kernel returns zeros for a NaN query). Integer tensors
    pass. One pass over the values: the extremes are finite exactly when every value is
    (``aminmax`` propagates NaN), and no temporary the size of the tensor is made."""
    if tensor.is_floating_point() and tensor.numel() and not all(
            bool(torch.isfinite(x)) for x in torch.aminmax(tensor)):
        raise ValueError(f"{path}: tensor {name!r} holds NaN or infinite values; the weights "
                         "are corrupt (a diverged training run or a damaged file)")
    return tensor


def dtype_mismatch(records: Iterable[StoredTensor], targets: Mapping[str, Tensor]) -> str | None:
    """Why the stored dtypes of ``records`` do not fit the tensors ``targets`` (name -> the
    model's tensor, on ``meta`` will do) they are loaded into, or None: a floating-point
    tensor must be stored in a float dtype we run (it is then cast to the load's dtype), an
    integer one (quantized codes: int8 for int8, uint8 for int4's packed pairs) in exactly
    its dtype, as a cast would change the codes (3.5 becomes 3, 300 wraps to 44)."""
    for r in records:
        target = targets.get(r.name)
        if target is None:
            continue
        if target.is_floating_point():
            if r.dtype not in _STORED:
                return (f"{r.path}: tensor {r.name!r} has dtype {r.dtype} and shape {r.shape}, "
                        f"expected a float dtype ({', '.join(_STORED)}) and shape "
                        f"{tuple(target.shape)}")
        elif r.dtype != _INTEGER_CODES.get(target.dtype):
            return (f"{r.path}: tensor {r.name!r} has dtype {r.dtype} and shape {r.shape}, "
                    f"expected {_INTEGER_CODES.get(target.dtype, target.dtype)} "
                    f"({str(target.dtype).removeprefix('torch.')}) and shape "
                    f"{tuple(target.shape)}")
    return None


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded index)."""
    folder = check_folder(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map' object "
                             "(tensor name -> shard file)")
        files: dict[str, Path] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                raise ValueError(f"{index}: tensor {name!r} is in shard {shard!r}; expected "
                                 "the name of a file in the checkpoint folder")
            path = folder / shard
            if not path.is_file():
                raise FileNotFoundError(f"{index}: tensor {name!r} is in shard {shard!r}, "
                                        f"which does not exist in {folder}")
            files[name] = path
        return files
    single = folder / WEIGHTS_NAME
    if not single.is_file():
        raise FileNotFoundError(f"{folder}: no weights; expected {WEIGHTS_NAME} or "
                                f"{INDEX_NAME} (safetensors) in the folder")
    with _open(single) as f:
        return dict.fromkeys(f.keys(), single)


def check_folder(folder: str | Path, *, needs: str = f"{CONFIG_NAME} and {WEIGHTS_NAME}"
                 ) -> Path:
    """``folder`` as a ``Path`` when it is a local folder; else a ``FileNotFoundError``.

    The message says the folder does not exist (or is a file) and, for a Hugging Face Hub
    name such as ``Qwen/Qwen2.5-0.5B-Instruct`` (``owner/name`` exactly, not ``./owner/name``),
    that only local folders are read and how to download one. ``needs`` names the files the
    caller expects in it.
    """
    text, folder = str(folder), Path(folder)
    if folder.is_dir():
        return folder
    if folder.exists():
        raise FileNotFoundError(f"{folder}: not a folder; expected a folder holding {needs}")
    if _HUB_NAME.fullmatch(text):  # as typed: "./Qwen/x" is a path, not a Hub name
        raise FileNotFoundError(
            f"{text}: no such folder. Only local folders are read (nothing is downloaded); to "
            f"use the Hugging Face Hub model {text!r}, download it first, e.g. "
            f"`huggingface-cli download {text} --local-dir {folder.name}`, and pass that folder")
    raise FileNotFoundError(f"{folder}: no such folder; expected a folder holding {needs}")


def save_tensors(folder: str | Path, tensors: Mapping[str, Tensor]) -> Path:
    """Write ``tensors`` (name -> tensor, none sharing memory) to ``folder/model.safetensors``,
    replacing an earlier file in one step (a crash leaves the old file or the new one)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / WEIGHTS_NAME
    plain = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    write_file_atomic(path, lambda tmp: save_file(plain, str(tmp), metadata={"format": "pt"}))
    return path


def read_json(path: str | Path) -> dict:
    """A JSON object from ``path``; a missing file or bad JSON raises naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def parse_dtype(value: str | torch.dtype | None, name: str = "dtype") -> torch.dtype | None:
    """``"bfloat16"``/``torch.bfloat16``/``None`` -> a dtype we run (or ``None``); else raise."""
    if value is None or value in SUPPORTED_DTYPES.values():
        return value  # type: ignore[return-value]
    if isinstance(value, str) and value.removeprefix("torch.") in SUPPORTED_DTYPES:
        return SUPPORTED_DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"{name}: expected one of {sorted(SUPPORTED_DTYPES)}, got {value!r}")


@contextmanager
def _open(path: Path) -> Iterator[Any]:
    """``safe_open(path)``, a corrupt or truncated file raising a ``ValueError`` naming it."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error}); it is truncated "
                         "or corrupt: download it again") from None
    with handle as f:
        yield f


def parse_device(device: object) -> torch.device:
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


def _describe_source(folder: Path) -> str:
    index = folder / INDEX_NAME
    return str(index if index.is_file() else folder / WEIGHTS_NAME)


def check_rotary(model: nn.Module, file: Path) -> None:
    """Make each rotary embedding's frequencies now (``R/2`` values, ``R`` already checked
    against the weights), so that RoPE scaling values that overflow together are refused at
    load naming ``file`` (the config), not found as NaN logits at the first token."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            try:
                module.make_frequencies()
            except ValueError as error:
                raise ValueError(f"{file}: {error}") from None
