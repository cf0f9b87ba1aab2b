"""A lean, checked reader of a GGUF file's header, its tensors memory-mapped.

``gguf.GGUFReader`` (llama.cpp's own) keeps a numpy array per metadata part: on a model with a
49,152-token vocabulary that is about 160 MiB of Python objects, more than the model's own
weights. This reader keeps the metadata as plain Python values (a list of strings for the
vocabulary), maps the file once, and gives each tensor as a ``uint8`` view ``rows x row
bytes`` of the mapping, which ``gguf.quants.dequantize`` takes; the block sizes and types are
``gguf``'s. Every count and offset is checked against the file's size as it is read, so a
hostile header fails with a ``ValueError`` naming the file before anything large is made.

Layout (GGUF v2/v3, little-endian): ``"GGUF"``, version u32, tensor count u64, metadata count
u64; each metadata entry a string key, a u32 type and a value (arrays: item type u32, count
u64, items); each tensor a string name, u32 dims, u64 per dim (fastest first), u32 type, u64
offset from the data section, which starts at the next multiple of ``general.alignment``
(default 32) after the header. A string is a u64 length and UTF-8 bytes.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

__all__ = ["SHARD", "GGUFFile", "GGUFShards", "GGUFTensor", "first_shard"]

# value type -> (struct format, size); 8 is a string, 9 an array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in GGUF's order (fastest dim first: ``(I, O)`` for an ``O x I``
    weight), ``data`` its bytes as ``rows x row bytes`` uint8 (a view of the mapping)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """The GGUF file ``path``: ``fields`` (metadata key -> int, float, bool, str or list),
    ``tensors`` (``GGUFTensor``, in the file's order). ``release(t)`` drops a tensor's pages
    from memory once read; ``close()`` unmaps the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = len(self._map)
        self._at = 0
        if self._bytes(4) != b"GGUF":
            raise self._error("not a GGUF file (no 'GGUF' magic)")
        version, tensors, kvs = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise self._error(f"GGUF version {version} is not supported; expected 2 or 3")
        # the least an entry takes: a key/name length, a type, a value / a dim and an offset
        if kvs * 13 > self.size or tensors * 32 > self.size:
            raise self._error(f"the header claims {tensors} tensors and {kvs} metadata "
                              f"entries, more than its {self.size} bytes can hold")
        self.fields: dict[str, Any] = {}
        for _ in range(kvs):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = [self._tensor_info() for _ in range(tensors)]
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise self._error(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def release(self, t: GGUFTensor) -> None:
        """Drop ``t``'s mapped pages from this process's resident memory."""
        page = mmap.PAGESIZE
        begin = t.data_offset // page * page
        end = min(self.size, -(-(t.data_offset + t.n_bytes) // page) * page)
        if end > begin:
            self._map.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def close(self) -> None:
        """Unmap the file (the tensors' ``data`` must no longer be used)."""
        self.tensors = []
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it goes
            self._map.close()

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = self._unpack("<I")
        if dims > 4:
            raise self._error(f"tensor {name!r} has {dims} dims; GGUF allows at most 4")
        shape = tuple(self._unpack("<Q") for _ in range(dims))
        return name, shape, self._unpack("<I"), self._unpack("<Q")

    def _tensor(self, start: int, name: str, shape: tuple[int, ...], kind: int,
                offset: int) -> GGUFTensor:
        try:
            qtype = gguf.GGMLQuantizationType(kind)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise self._error(f"tensor {name!r} has an unknown type {kind}") from None
        if not shape or shape[0] % block:
            raise self._error(f"tensor {name!r}: shape {shape} is not whole blocks of {block}")
        n_bytes = math.prod(shape) // block * type_size
        begin = start + offset
        if begin + n_bytes > self.size:
            raise self._error(f"tensor {name!r} ({n_bytes} bytes at offset {begin}) reaches "
                              f"past the file's {self.size} bytes")
        rows = math.prod(shape[1:])
        data = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=begin)
        return GGUFTensor(name, qtype, shape, n_bytes, begin, data.reshape(rows, -1))

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind][0])
        if kind != _ARRAY:
            raise self._error(f"metadata value type {kind} is unknown")
        item, count = self._unpack("<I"), self._unpack("<Q")
        least = 8 if item == _STRING else _SCALARS.get(item, ("", 1))[1]
        if count * least > self.size - self._at:
            raise self._error(f"an array claims {count} items, more than the file holds")
        if item in _NUMPY:
            values = np.frombuffer(self._bytes(count * _SCALARS[item][1]), dtype=_NUMPY[item])
            return values.tolist()
        return [self._value(item) for _ in range(count)]

    def _string(self) -> str:
        raw = self._bytes(self._unpack("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._error(f"a string at byte {self._at - len(raw)} is not UTF-8") from None

    def _unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._bytes(struct.calcsize(fmt)))[0]

    def _bytes(self, n: int) -> bytes:
        if n > self.size - self._at:
            raise self._error(f"truncated: {n} bytes wanted at byte {self._at} of "
                              f"{self.size}")
        self._at += n
        return self._map[self._at - n:self._at]

    def _error(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {what}")


SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFShards:
    """A model split into shards ``STEM-0000i-of-0000N.gguf`` (llama.cpp's ``gguf-split``,
    ``GGUFWriter(split_max_*)``) read as one ``GGUFFile``: ``fields`` those of the first
    shard (which holds the metadata; each shard records ``split.no`` and ``split.count``),
    ``tensors`` every shard's, in order. A shard missing or recording another place in the
    set raises a ``ValueError`` naming it."""

    def __init__(self, first: Path) -> None:
        match = SHARD.match(first.name)
        if match is None:
            raise ValueError(f"{first}: not a shard name (STEM-00001-of-0000N.gguf)")
        count = int(match["count"])
        self.path = first
        self._files: list[GGUFFile] = []
        self._owner: dict[str, GGUFFile] = {}
        try:
            for no in range(count):
                path = first.with_name(f"{match['stem']}-{no + 1:05d}-of-{count:05d}.gguf")
                if not path.is_file():
                    raise ValueError(f"{path}: shard {no + 1} of {count} is missing")
                shard = GGUFFile(path)
                self._files.append(shard)
                recorded = (shard.fields.get("split.no"), shard.fields.get("split.count"))
                if recorded != (no, count):
                    raise ValueError(f"{path}: records split.no/split.count {recorded}; "
                                     f"its name says ({no}, {count})")
                self._owner.update((t.name, shard) for t in shard.tensors)
        except BaseException:
            self.close()
            raise
        self.fields = self._files[0].fields
        self.tensors = [t for shard in self._files for t in shard.tensors]
        self.size = sum(shard.size for shard in self._files)

    def release(self, t: GGUFTensor) -> None:
        """Drop ``t``'s mapped pages (``GGUFFile.release``)."""
        self._owner[t.name].release(t)

    def close(self) -> None:
        """Unmap every shard."""
        self.tensors = []
        for shard in self._files:
            shard.close()


def first_shard(path: Path) -> Path | None:
    """The first shard of the set that ``path`` names (any of its shards), or None when
    ``path`` is no shard name."""
    match = SHARD.match(path.name)
    if match is None:
        return None
    return path.with_name(f"{match['stem']}-00001-of-{match['count']}.gguf")
