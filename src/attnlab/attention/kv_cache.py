"""A pre-allocated key/value cache for incremental (token-by-token) decoding.

Decoding step ``t`` needs the keys and values of every earlier position. Recomputing them
costs ``O(t)`` projections per step (``O(T^2)`` in all); keeping them costs memory
``2 * layers * B * G * max_len * D`` elements. With grouped-query attention only the ``G``
key/value heads are stored, not the ``H`` query heads.

``KVCache`` holds one ``LayerKVCache`` per layer; the attention modules call
``layer_cache.update(k, v)`` with the new keys/values ``B x G x L x D`` and attend over what
it returns (``B x G x (offset + L) x D``). ``offset`` (the cache's ``length`` before the
call) is the position of the first new token.

A cache made with ``grow=True`` starts with room for ``max_len`` positions and, when an
update would overflow it, reallocates to ``max(needed, 2 * max_len)`` (amortised ``O(1)`` per
token, as a Python list grows): ``model(ids, use_cache=True)`` makes one sized to the prompt
that then takes any number of next tokens, up to the model's own limit of positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab._checks import check_positive, is_int

__all__ = ["KVCache", "LayerKVCache"]


class KVCache:
    """Per-layer key/value buffers of shape ``B x G x max_len x D``, filled left to right.

    ``cache[i]`` is layer ``i``'s ``LayerKVCache``; ``cache.length`` is the number of
    positions stored (the offset of the next token). Models build one with
    ``model.make_cache(batch_size, max_len)``. With ``grow=True`` ``max_len`` is the room
    allocated first, doubled whenever an update needs more (module docstring).
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, grow: bool = False) -> None:
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size),
                            ("num_kv_heads", num_kv_heads), ("max_len", max_len),
                            ("head_dim", head_dim)):
            check_positive(name, value)
        if not isinstance(grow, bool):
            raise TypeError(f"grow: expected a bool, got {grow!r}")
        self.layers = [LayerKVCache(batch_size, num_kv_heads, max_len, head_dim,
                                    dtype=dtype, device=device, grow=grow)
                       for _ in range(num_layers)]

    def __getitem__(self, index: int) -> LayerKVCache:
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        """Positions stored so far: the offset of the next token."""
        return self.layers[0].length

    @property
    def max_len(self) -> int:
        """Positions the buffers hold now (a growing cache's grows)."""
        return self.layers[0].max_len

    @property
    def batch_size(self) -> int:
        return self.layers[0].k.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by all the buffers (allocated up front, whatever ``length`` is)."""
        return sum(layer.nbytes for layer in self.layers)

    def reset(self) -> None:
        """Forget everything stored (the buffers are kept)."""
        self.truncate(0)

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` positions of every layer."""
        for layer in self.layers:
            layer.truncate(length)

    def reorder(self, index: Tensor) -> None:
        """Select batch rows: row ``b`` becomes old row ``index[b]`` (beam search)."""
        for layer in self.layers:
            layer.reorder(index)

    def __repr__(self) -> str:
        k = self.layers[0].k
        return (f"KVCache(layers={len(self.layers)}, shape={tuple(k.shape)}, length={self.length}, "
                f"dtype={k.dtype}, MiB={self.nbytes / 2**20:.2f})")


class LayerKVCache:
    """One layer's buffers ``k``, ``v``: ``B x G x max_len x D``; ``length`` positions filled;
    ``grow``: reallocate instead of refusing an update that overflows ``max_len``."""

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, grow: bool = False) -> None:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self.grow = grow

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``, ``v`` (``B x G x L x D``) at ``length``; return all keys and values.

        Returns views ``B x G x (length + L) x D`` of the buffers. Raises a ``ValueError`` when
        the shapes do not match the buffers or the cache would overflow ``max_len`` (a growing
        cache reallocates instead).
        """
        B, G, _, D = self.k.shape
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4 or t.shape[0] != B or t.shape[1] != G or t.shape[3] != D:
                raise ValueError(f"{name}: expected shape B x G x L x D = ({B}, {G}, L, {D}), "
                                 f"got {tuple(t.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        L = k.shape[2]
        end = self.length + L
        self.reserve(L)
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def reserve(self, count: int) -> None:
        """Make room for ``count`` more positions after ``length`` (a growing cache
        reallocates); raise a ``ValueError`` when a fixed cache cannot take them."""
        end = self.length + count
        if end > self.max_len and self.grow:
            self._reallocate(max(end, 2 * self.max_len))
        if end > self.max_len:
            raise ValueError(f"k: the cache holds {self.length} of max_len={self.max_len} "
                             f"positions and cannot take {count} more")

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def _reallocate(self, max_len: int) -> None:
        """New buffers of ``max_len`` positions holding the ``length`` stored ones."""
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], max_len, old.shape[3]))
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)
        self.max_len = max_len

    def truncate(self, length: int) -> None:
        if not is_int(length) \
                or not 0 <= length <= self.length:
            raise ValueError(f"length: expected an int in [0, {self.length}], got {length}")
        self.length = length

    def reorder(self, index: Tensor) -> None:
        B = self.k.shape[0]
        if index.dim() != 1 or index.shape[0] != B:
            raise ValueError(f"index: expected shape ({B},), got {tuple(index.shape)}")
        if index.dtype == torch.bool or index.is_floating_point() or index.is_complex() \
                or bool(((index < 0) | (index >= B)).any()):
            raise ValueError(f"index: expected integer rows in [0, {B}), got {index.tolist()}")
        self.k = self.k.index_select(0, index)
        self.v = self.v.index_select(0, index)
