"""Attention over keys and values kept in pages: the formula of a serving step.

A serving step runs the new tokens of ``R`` requests as one packed sequence of ``T`` rows
(the linear layers, norms and RoPE are row by row, so they never mix requests). Request
``r`` has ``start_r`` tokens stored already and ``n_r`` new ones; its token ``t`` lives in
slot ``t % P`` of page ``block_tables[r, t // P]`` of every layer's pages ``N x G x P x D``.
Attention alone must see the requests apart; ``PagedAttentionMetadata`` says everything it
needs, built once per step by the runner (``attnlab.serving.runner``):

    rows 0 .. num_decode - 1      decode rows, one new token per request
    rows num_decode .. T - 1      prefill chunks, one request's n_r tokens after another

The formula, per layer (``paged_attention``): write the new keys and values into their slots
(``slot_mapping``), then, for each request, ``softmax(q k^T * scale + mask) v`` of its new
queries over its ``start_r + n_r`` keys read from its pages, under the model's causal mask
(token ``t`` sees tokens ``0 .. t``; within a sliding ``window``, the last ``window`` of
them). The decode rows attend together (their keys gathered into one left-padded batch), each
chunk alone. ``attnlab.kernels.FastSelfAttention`` runs the decode rows through a C++ kernel
that reads the keys where they lie instead of gathering them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from attnlab.attention.sdpa import scaled_dot_product_attention
from attnlab.masks import decoder_mask

__all__ = ["LayerPages", "PagedAttentionMetadata", "paged_attention", "write_pages"]


class LayerPages(NamedTuple):
    """One layer's view of a step: its key and value pages ``N x G x P x D`` and the step's
    ``metadata``."""

    k: Tensor
    v: Tensor
    metadata: PagedAttentionMetadata


@dataclass(frozen=True, eq=False)
class PagedAttentionMetadata:
    """What attention needs to know of one packed serving step (module docstring).

    ``positions`` ``T``: each row's position in its request (RoPE's); ``slot_mapping``
    ``T``: where each row's key and value go, ``page * P + slot``; ``block_tables`` ``R x
    M``: each request's pages (0 past its last); ``starts`` and ``query_lens``: each
    request's stored and new token counts (``R`` ints, in row order); ``num_decode``: the
    first requests, one row each, that decode; ``page_size`` ``P``; ``window``: the model's
    sliding window (None: none). The index tensors that only the gathering formula reads are
    made on first use, once a step (``functools.cached_property``).
    """

    positions: Tensor
    slot_mapping: Tensor
    block_tables: Tensor
    starts: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_decode: int
    page_size: int
    window: int | None = None

    def __post_init__(self) -> None:
        R, T = len(self.starts), sum(self.query_lens)
        if len(self.query_lens) != R or self.block_tables.shape[0] != R or not R:
            raise ValueError(f"block_tables: expected one row per request (starts and "
                             f"query_lens of {R} requests, R >= 1), got "
                             f"{tuple(self.block_tables.shape)}")
        if self.positions.shape != (T,) or self.slot_mapping.shape != (T,):
            raise ValueError(f"positions, slot_mapping: expected shape ({T},) (sum of "
                             f"query_lens), got {tuple(self.positions.shape)} and "
                             f"{tuple(self.slot_mapping.shape)}")
        if any(n != 1 for n in self.query_lens[:self.num_decode]) or min(self.query_lens) < 1:
            raise ValueError(f"query_lens: expected 1 for the first num_decode="
                             f"{self.num_decode} requests and at least 1 after, got "
                             f"{list(self.query_lens)}")

    @property
    def num_rows(self) -> int:
        """``T``, the new tokens of the step."""
        return self.positions.shape[0]

    @functools.cached_property
    def context_lens(self) -> tuple[int, ...]:
        """Each request's keys after the step, ``start_r + n_r``."""
        return tuple(s + n for s, n in zip(self.starts, self.query_lens))

    @functools.cached_property
    def decode_keys(self) -> int:
        """``S``: the decode rows' keys, left-padded to the longest, ``max T_r``."""
        return max(self.context_lens[:self.num_decode])

    @functools.cached_property
    def write_index(self) -> tuple[Tensor, Tensor]:
        """``slot_mapping`` as the page and the slot in it of each new row, ``T`` each."""
        return self.slot_mapping // self.page_size, self.slot_mapping % self.page_size

    @functools.cached_property
    def decode_first(self) -> Tensor:
        """``first`` ``B``: each decode row's left padding, ``S - T_r`` (its token ``t`` is
        key ``first + t``)."""
        total = torch.tensor(self.context_lens[:self.num_decode],
                             device=self.block_tables.device)
        return self.decode_keys - total

    @functools.cached_property
    def decode_gather(self) -> tuple[Tensor, Tensor]:
        """The gather indices ``pages``, ``slots`` ``B x S`` of the decode rows' left-padded
        keys (a padded key reads slot 0 of the request's first page; the mask hides it)."""
        first = self.decode_first
        t = (torch.arange(self.decode_keys, device=first.device) - first[:, None]).clamp(min=0)
        return (self.block_tables[:self.num_decode].gather(1, t // self.page_size),
                t % self.page_size)

    @functools.cached_property
    def decode_mask(self) -> Tensor | None:
        """The decode rows' mask ``B x 1 x 1 x S`` over their left-padded keys (True = may
        attend): their real keys, within the window."""
        first, S = self.decode_first, self.decode_keys
        real = torch.arange(S, device=first.device) >= first[:, None]
        return decoder_mask(real, 1, S - 1, self.window, device=first.device)

    @functools.cached_property
    def chunk_first(self) -> Tensor:
        """``first`` of a chunk, ``[0]``: a request alone has no left padding."""
        return torch.zeros(1, dtype=torch.long, device=self.block_tables.device)

    @functools.cached_property
    def chunk_masks(self) -> tuple[Tensor | None, ...]:
        """Each prefill chunk's mask ``n x T_r`` over its request's keys: bottom-right causal
        within the window; None where the plain causal mask is all there is (``is_causal``)."""
        return tuple(decoder_mask(None, n, total - n, self.window,
                                  device=self.block_tables.device)
                     for n, total in zip(self.query_lens[self.num_decode:],
                                         self.context_lens[self.num_decode:]))

    @functools.cached_property
    def window_mask(self) -> Tensor | None:
        """The decode rows' window alone, ``B x 1 x 1 x S`` (None without one): what a kernel
        that skips the padding itself needs."""
        S = self.decode_keys
        if self.window is None or self.window >= S:
            return None
        return decoder_mask(None, 1, S - 1, self.window, device=self.block_tables.device
                            ).expand(self.num_decode, 1, 1, S)


def write_pages(pages: LayerPages, k: Tensor, v: Tensor) -> None:
    """Store the step's new keys and values, k and v ``1 x G x T x D``, in their slots."""
    page, slot = pages.metadata.write_index
    T = pages.metadata.num_rows
    for name, new, store in (("k", k, pages.k), ("v", v, pages.v)):
        if new.dim() != 4 or new.shape[0] != 1 or new.shape[2] != T \
                or new.shape[1:2] + new.shape[3:] != store.shape[1:2] + store.shape[3:]:
            raise ValueError(f"{name}: expected shape 1 x G x T x D = (1, {store.shape[1]}, "
                             f"{T}, {store.shape[3]}), got {tuple(new.shape)}")
        store[page, :, slot] = new[0].transpose(0, 1).to(store.dtype)


# A fast kernel for one part of a step, given what it reads: (the part's queries, B x H x 1 x D
# for the decode rows or 1 x H x n x D for a chunk; the key and value pages; the part's block
# tables, left padding ``first`` and key count; its mask or None; is_causal=, scale=) -> the
# part's output, or None where it does not take the call. Given as arguments, so that the
# kernel reads no metadata (the path goes down into it and back, never up again).
PartKernel = Callable[..., "Tensor | None"]


def paged_attention(q: Tensor, pages: LayerPages, *, scale: float | None = None,
                    backend: str = "auto", hook: Callable[[str, Tensor], Tensor] | None = None,
                    kernel: PartKernel | None = None) -> Tensor:
    """q ``1 x H x T x D`` of a packed step -> ``1 x H x T x D``: each request's queries over
    its keys in ``pages`` (written already: ``write_pages``), under the causal mask (module
    docstring); ``scale``, ``backend`` and ``hook`` as ``scaled_dot_product_attention``'s
    (a hook sees the decode rows' scores ``B x H x 1 x S`` and each chunk's ``1 x H x n x
    S``). ``kernel``: a fast module's kernel (``PartKernel``), asked first for each part: the
    decode rows' queries ``B x H x 1 x D``, then each chunk's ``1 x H x n x D``."""
    m = pages.metadata
    d = m.num_decode
    parts = []
    if d:
        one = q[0, :, :d, None].transpose(0, 1)  # B x H x 1 x D: a request's row each
        out = None if kernel is None else kernel(
            one, pages.k, pages.v, m.block_tables[:d], m.decode_first, m.decode_keys,
            m.window_mask, is_causal=False, scale=scale)
        if out is None:
            page, slot = m.decode_gather
            k, v = (store[page, :, slot].transpose(1, 2) for store in (pages.k, pages.v))
            out = scaled_dot_product_attention(
                one, k, v, m.decode_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1],
                backend=backend, hook=hook)
        parts.append(out.transpose(0, 2))
    row = d
    for r, mask in zip(range(d, len(m.starts)), m.chunk_masks):
        n, total = m.query_lens[r], m.context_lens[r]
        chunk = q[:, :, row:row + n]
        out = None if kernel is None else kernel(
            chunk, pages.k, pages.v, m.block_tables[r:r + 1], m.chunk_first, total, mask,
            is_causal=mask is None and n > 1, scale=scale)
        if out is None:
            t = torch.arange(total, device=q.device)
            page = m.block_tables[r, t // m.page_size]
            k, v = (store[page, :, t % m.page_size].transpose(0, 1)[None]
                    for store in (pages.k, pages.v))
            out = scaled_dot_product_attention(
                chunk, k, v, mask, is_causal=mask is None and n > 1, scale=scale,
                enable_gqa=k.shape[1] != q.shape[1], backend=backend, hook=hook)
        parts.append(out)
        row += n
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
