"""Attention over the pages: one ``DecoderLM.forward`` for a ragged batch of requests.

Row ``b`` of a step has ``start_b`` tokens already in its pages and ``n_b`` new ones (a
decode token or a prefill chunk). The model is called unchanged, with

    input_ids     B x L        the new tokens, left-padded to ``L = max n_b``
    cache         PagedKVCache a ``KVCache`` whose layer ``i`` writes the new keys/values
                               into each row's pages and returns the row's keys gathered from
                               its pages, left-padded to ``S = offset + L``
    attention_mask B x S       True on each row's ``T_b = start_b + n_b`` real keys (the last)
    position_ids  B x L        token ``t`` of a row sits at position ``t``

with ``offset = max T_b - L``. Row ``b``'s token ``t`` is key ``S - T_b + t``, and its new
token ``j`` is query ``L - n_b + j``, i.e. key ``offset + L - n_b + j``: the model's
bottom-right causal mask (query ``i`` sees keys up to ``offset + i``) is then exactly "token
``t`` sees tokens ``0 .. t``" in every row. Padding queries write nothing and are not read.
The model's own mask, RoPE and sliding window code run as they do for a dense cache: no
model code is copied.

The gather is the formula; for a few queries on the CPU a layer's ``attention`` skips it:
``attnlab.kernels.native.paged_attention`` reads key ``j >= S - T_b`` of row ``b`` in its
page, through the row's block table, under the same mask.

Padding a step's rows to ``L`` would run a 500-token prefill chunk's positions for every
decode row; running each chunk alone reads every weight once more per chunk. ``packed_hidden``
does neither (as vLLM's flattened batches): the new tokens of all rows as one sequence

    input_ids     1 x T        the rows' new tokens one after another (T = sum n_b), the
                               one-token rows first
    position_ids  1 x T        token t of a row at position t
    cache         PackedPagedKVCache  whose layer ``attention`` splits q, k, v back into the
                               rows: the one-token rows together, over a ``PagedKVCache`` of
                               them, each longer chunk alone, over its own; each under the mask
                               the model would give it (``attnlab.masks.decoder_mask``)

so the linear layers, norms and RoPE run once on ``T`` rows and attention never crosses rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnlab.attention.kv_cache import KVCache
from attnlab.attention.sdpa import scaled_dot_product_attention
from attnlab.kernels.decode_attention import native_decoding, paged_native_attention
from attnlab.masks import decoder_mask
from attnlab.serving.paged_cache import PagePool

__all__ = ["PackedPagedKVCache", "PagedKVCache", "PagedRow", "packed_hidden", "paged_forward",
           "paged_hidden"]


class PagedRow(NamedTuple):
    """One request in a step: its block ``table`` (pages), ``start`` tokens already stored,
    the ``new`` token ids to run (``n >= 1``); ``table`` covers ``start + n`` tokens."""

    table: Sequence[int]
    start: int
    new: Sequence[int]


def paged_forward(model: nn.Module, pool: PagePool, rows: Sequence[PagedRow], *,
                  logits_to_keep: int = 1) -> Tensor:
    """Run ``model`` on the new tokens of ``rows``, reading and extending their pages.

    Returns the logits ``B x k x V`` of each row's last ``k = logits_to_keep`` query
    positions (``k = 0``: all ``L``; the real ones of row ``b`` are its last ``n_b``).
    """
    ids, cache = _paged_inputs(pool, rows)
    return model(ids, attention_mask=cache.key_mask, cache=cache,
                 position_ids=cache.position_ids, logits_to_keep=logits_to_keep)


def paged_hidden(model: nn.Module, pool: PagePool, rows: Sequence[PagedRow]) -> Tensor:
    """As ``paged_forward``, but the final hidden state of each row's last token, ``B x H``
    (``model.final_hidden``: what ``model.lm_head`` projects to logits), so that a caller
    projects only the rows it wants logits for, all of a step's in one call."""
    ids, cache = _paged_inputs(pool, rows)
    return model.final_hidden(ids, attention_mask=cache.key_mask, cache=cache,
                              position_ids=cache.position_ids, logits_to_keep=1)[:, -1]


def packed_hidden(model: nn.Module, pool: PagePool, rows: Sequence[PagedRow]) -> Tensor:
    """As ``paged_hidden`` (the final hidden state of each row's last token, ``B x H``, in the
    order of ``rows``), in one forward of the rows' new tokens as one sequence (module
    docstring). The model must let its layers' caches attend (no score or pattern hooks: a
    hooked attention asks for the keys, which a packed step does not gather)."""
    cache = PackedPagedKVCache(pool, rows, window=model.config.sliding_window,
                               device=pool.k[0].device)
    hidden = model.final_hidden(cache.input_ids, cache=cache, position_ids=cache.position_ids)
    return hidden[0, cache.last]


def _paged_inputs(pool: PagePool, rows: Sequence[PagedRow]) -> tuple[Tensor, PagedKVCache]:
    """The model's ``input_ids`` ``B x L`` (left-padded) and the ``PagedKVCache`` of
    ``rows``."""
    cache = PagedKVCache(pool, rows, device=pool.k[0].device)
    L = cache.query_length
    ids = torch.zeros((len(rows), L), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, L - len(row.new):] = torch.tensor(list(row.new), dtype=torch.long)
    return ids.to(cache.key_mask.device), cache


class _OneForward(KVCache):
    """What the caches of one forward over a ``PagePool`` share: their bytes are the pool's,
    and its pages are the engine's to free, not the cache's to reset."""

    pool: PagePool
    offset: int  # keys stored before this forward, common to its rows (KVCache.length)
    query_length: int  # new positions of this forward (L)

    @property
    def length(self) -> int:
        return self.offset

    @property
    def max_len(self) -> int:
        return self.offset + self.query_length

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.pool.k, *self.pool.v))

    def reset(self, *args: object) -> None:
        """Refused, as ``truncate`` and ``reorder``: the pages belong to the engine."""
        raise NotImplementedError(f"a {type(self).__name__} serves one forward; its pages "
                                  f"belong to the engine, which frees them")

    truncate = reorder = reset


class PagedKVCache(_OneForward):
    """A ``KVCache`` (by type, so that ``DecoderLM.forward`` takes it) over a ``PagePool``
    for one forward of ``rows``; ``length`` is the ``offset`` of the module docstring.

    Built once per step: the gather indices ``page_index``, ``slot_index`` ``B x S`` (key
    ``j`` of row ``b`` is ``pool.k[i][page_index[b, j], :, slot_index[b, j]]``), the new
    tokens' scatter targets, ``key_mask`` ``B x S`` and ``position_ids`` ``B x L``.
    """

    def __init__(self, pool: PagePool, rows: Sequence[PagedRow], *,
                 device: torch.device | str | None = None) -> None:
        # KVCache.__init__ would allocate dense buffers; this cache has its own layers.
        if not rows:
            raise ValueError("rows: expected at least one request, got none")
        ps = pool.page_size
        start = torch.tensor([row.start for row in rows])
        count = torch.tensor([len(row.new) for row in rows])
        if bool((count < 1).any()):
            raise ValueError(f"rows: expected at least one new token per row, got counts "
                             f"{count.tolist()}")
        total = start + count
        pages = max(len(row.table) for row in rows)
        if any(len(row.table) * ps < int(t) for row, t in zip(rows, total)):
            raise ValueError(f"rows: every block table must cover start + new tokens "
                             f"({total.tolist()}) with pages of {ps}, got "
                             f"{[len(row.table) for row in rows]} pages")
        tables = torch.zeros((len(rows), pages), dtype=torch.long)
        for b, row in enumerate(rows):
            tables[b, :len(row.table)] = torch.tensor(list(row.table), dtype=torch.long)
        L = int(count.max())
        S = int(total.max())
        self.query_length, self.offset = L, S - L
        token = torch.arange(S) - (S - total)[:, None]  # B x S: token index of each key, < 0 pad
        real = token >= 0
        t = token.clamp(min=0)
        page_index = tables.gather(1, t // ps)
        slot_index = t % ps
        fresh_b, fresh_j = (token >= start[:, None]).nonzero(as_tuple=True)
        self.key_mask = real.to(device)
        self.position_ids = t[:, self.offset:].to(device)
        self.page_index, self.slot_index = page_index.to(device), slot_index.to(device)
        self.tables, self.first = tables.to(device), (S - total).to(device)
        self.fresh = (fresh_b.to(device), (fresh_j - self.offset).to(device),
                      page_index[fresh_b, fresh_j].to(device),
                      slot_index[fresh_b, fresh_j].to(device))
        self.pool = pool
        self.layers = [PagedLayerCache(self, i) for i in range(len(pool.k))]

    @property
    def batch_size(self) -> int:
        return self.key_mask.shape[0]

    def __repr__(self) -> str:
        return (f"PagedKVCache(rows={self.batch_size}, L={self.query_length}, "
                f"offset={self.offset}, layers={len(self.layers)})")


class _ForwardLayer:
    """Layer ``index`` of a one-forward cache; its ``length`` is the cache's ``offset``."""

    def __init__(self, cache: _OneForward, index: int) -> None:
        self.cache, self.index = cache, index

    @property
    def length(self) -> int:
        return self.cache.offset


class PagedLayerCache(_ForwardLayer):
    """Layer ``index`` of a ``PagedKVCache``: ``update(k, v)`` as ``LayerKVCache.update``."""

    cache: PagedKVCache

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the real new keys/values of ``k``, ``v`` (``B x G x L x D``) into their
        pages; return every row's keys and values ``B x G x S x D``, left-padded."""
        c = self.cache
        self._write(k, v)
        # advanced indices on dims 0 and 2 come first: B x S x G x D
        return tuple(store[c.page_index, :, c.slot_index].transpose(1, 2)
                     for store in (c.pool.k[self.index], c.pool.v[self.index]))

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
                  is_causal: bool, scale: float | None, backend: str = "auto") -> Tensor:
        """``update(k, v)``, then ``scaled_dot_product_attention`` of q ``B x H x L x D`` over
        the returned keys (``mask``, ``is_causal``, ``scale``, ``backend`` as there) -> ``B x
        H x L x Dv``. Where ``auto`` would run the native decoding kernel, the keys are not
        gathered: ``paged_native_attention`` reads them in their pages."""
        c = self.cache
        keys, values = c.pool.k[self.index], c.pool.v[self.index]
        if backend == "auto" and q.dtype == keys.dtype and native_decoding(q, k, v, mask,
                                                                        keys=c.max_len):
            self._write(k, v)
            return paged_native_attention(q, keys, values, c.tables, c.first, c.max_len, mask,
                                          is_causal=is_causal, scale=scale)
        k, v = self.update(k, v)
        return scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=scale,
                                            enable_gqa=k.shape[1] != q.shape[1], backend=backend)

    def _write(self, k: Tensor, v: Tensor) -> None:
        """Store the real new keys and values of ``k``, ``v`` ``B x G x L x D`` in their
        pages."""
        c = self.cache
        rows, queries, pages, slots = c.fresh
        for name, new, store in (("k", k, c.pool.k[self.index]), ("v", v, c.pool.v[self.index])):
            if new.dim() != 4 or new.shape[0] != c.batch_size or new.shape[2] != c.query_length \
                    or new.shape[1:2] + new.shape[3:] != store.shape[1:2] + store.shape[3:]:
                raise ValueError(f"{name}: expected shape B x G x L x D = ({c.batch_size}, "
                                 f"{store.shape[1]}, {c.query_length}, {store.shape[3]}), got "
                                 f"{tuple(new.shape)}")
            store[pages, :, slots] = new[rows, :, queries].to(store.dtype)


class PackedPagedKVCache(_OneForward):
    """A ``KVCache`` of batch 1 (by type, so that ``DecoderLM.forward`` takes it) whose one
    sequence is every new token of ``rows``: the one-token rows first (in their order), then
    each longer chunk. ``input_ids`` and ``position_ids`` ``1 x T``; ``last[b]`` the index in
    ``T`` of row ``b``'s last token; ``masks`` each part's (one-token rows, then each chunk),
    with the model's sliding ``window`` (None: none)."""

    def __init__(self, pool: PagePool, rows: Sequence[PagedRow], *, window: int | None,
                 device: torch.device | str | None = None) -> None:
        # KVCache.__init__ would allocate dense buffers; this cache has its own layers.
        if not rows:
            raise ValueError("rows: expected at least one request, got none")
        single = [b for b, row in enumerate(rows) if len(row.new) == 1]
        chunks = [b for b, row in enumerate(rows) if len(row.new) != 1]
        order = single + chunks
        self.decoding = PagedKVCache(pool, [rows[b] for b in single], device=device) \
            if single else None
        self.chunks = [PagedKVCache(pool, [rows[b]], device=device) for b in chunks]
        tokens = [t for b in order for t in rows[b].new]
        positions = [row.start + j for row in (rows[b] for b in order)
                     for j in range(len(row.new))]
        ends = torch.tensor([len(rows[b].new) for b in order]).cumsum(0) - 1
        self.last = torch.empty(len(rows), dtype=torch.long)
        self.last[torch.tensor(order)] = ends
        self.input_ids = torch.tensor([tokens], dtype=torch.long, device=device)
        self.position_ids = torch.tensor([positions], dtype=torch.long, device=device)
        self.query_length, self.offset, self.pool = len(tokens), 0, pool
        # each part's mask, as the model makes it for that part alone (the same every layer)
        self.masks = [decoder_mask(_padded(part.key_mask), part.query_length, part.offset,
                                   window, device=device)
                      for part in ([self.decoding] if single else []) + self.chunks]
        self.layers = [PackedLayerCache(self, i) for i in range(len(pool.k))]

    @property
    def batch_size(self) -> int:
        return 1

    def __repr__(self) -> str:
        rows = (0 if self.decoding is None else self.decoding.batch_size) + len(self.chunks)
        return (f"PackedPagedKVCache(rows={rows}, T={self.query_length}, "
                f"layers={len(self.layers)})")


class PackedLayerCache(_ForwardLayer):
    """Layer ``index`` of a ``PackedPagedKVCache``: ``attention`` only (see the class)."""

    cache: PackedPagedKVCache

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Refused: the rows of a packed step have no common keys to return (a hooked or
        training attention asks for them; run such a step with ``paged_hidden``)."""
        raise NotImplementedError("a packed step attends in its cache (cache.attention); an "
                                  "attention with score hooks needs paged_hidden's rows")

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
                  is_causal: bool, scale: float | None, backend: str = "auto") -> Tensor:
        """q ``1 x H x T x D``, k, v ``1 x G x T x D`` of the packed tokens -> ``1 x H x T x
        Dv``: each row's queries over its own pages, its new keys and values written there
        (the model's ``mask`` and ``is_causal``, made for one sequence, are not used)."""
        c, i, parts, start = self.cache, self.index, [], 0
        masks = iter(c.masks)
        if c.decoding is not None:
            n = c.decoding.batch_size
            one = [t[:, :, start:start + n].transpose(0, 2) for t in (q, k, v)]  # n x . x 1 x D
            parts.append(c.decoding.layers[i].attention(
                *one, next(masks), is_causal=False, scale=scale, backend=backend
            ).transpose(0, 2))
            start += n
        for chunk, chunk_mask in zip(c.chunks, masks):
            n = chunk.query_length
            part = [t[:, :, start:start + n] for t in (q, k, v)]
            parts.append(chunk.layers[i].attention(
                *part, chunk_mask, is_causal=chunk_mask is None and n > 1, scale=scale,
                backend=backend))
            start += n
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _padded(key_mask: Tensor) -> Tensor | None:
    """``key_mask`` when it pads a key, else None (the model's plain causal case)."""
    return None if bool(key_mask.all()) else key_mask
