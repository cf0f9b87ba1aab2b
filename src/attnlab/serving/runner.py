"""The runner: the model's side of a serving step. It owns the page tensors and, for the rows
the scheduler planned, builds one ``PagedAttentionMetadata`` and runs the model over them.

A step's rows are requests, each with its block table, ``start`` tokens stored and ``n``
new ones (one while decoding, a prompt chunk while prefilling). The runner packs the new
tokens into one sequence ``1 x T``, the decode rows first, and calls

    model.final_hidden(input_ids 1 x T, paged=[LayerPages(k[i], v[i], metadata) per layer])

so that the linear layers, norms and RoPE run once over all ``T`` rows, and attention
(``attnlab.attention.paged``) writes each layer's new keys and values into their slots and
reads each request's keys from its own pages. The model's code is the same as for
``generate``; only attention reads the metadata.

Batch invariance: a request's decode row must give the same numbers whatever shares its
step. Row-wise modules do; attention reads only the request's pages; a linear layer's kernel
is chosen by its row count (``attnlab.kernels.rule``), one batch-invariant kernel for up to
``DECODING_ROWS`` rows and a GEMM above. So a step of more rows runs as several forwards:
the decode rows in groups of at most ``DECODING_ROWS``, then the prefill chunks together
(their tokens are not a decode row's: a prompt's keys may be computed by another kernel
than a decode row's, as in every engine that chunks prefills).

Every layer's pages: keys and values ``P x G x page x D`` (``P`` pages of ``page`` token
slots, ``G`` key/value heads of size ``D``), in the model's dtype and device.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from attnlab._checks import check_positive
from attnlab.attention.paged import LayerPages, PagedAttentionMetadata
from attnlab.kernels.rule import DECODING_ROWS
from attnlab.models import DecoderLM

__all__ = ["ModelRunner", "PagedRow", "PreparedStep"]


class PagedRow(NamedTuple):
    """One request in a step: its block ``table`` (pages), ``start`` tokens already stored,
    the ``new`` token ids to run (``n >= 1``); ``table`` covers ``start + n`` tokens."""

    table: Sequence[int]
    start: int
    new: Sequence[int]


@dataclass(frozen=True, eq=False)
class PreparedStep:
    """One forward's inputs: ``input_ids`` ``1 x T`` (the rows' new tokens, decode rows
    first), the ``metadata`` attention reads, and ``order``: ``order[j]`` the index, in the
    rows given, of the request whose tokens come ``j``-th."""

    input_ids: Tensor
    metadata: PagedAttentionMetadata
    order: tuple[int, ...]

    @property
    def last(self) -> list[int]:
        """For each request in the rows given, the index in ``T`` of its last token."""
        ends, total = [0] * len(self.order), 0
        for r, n in zip(self.order, self.metadata.query_lens):
            total += n
            ends[r] = total - 1
        return ends


class ModelRunner:
    """The page tensors of ``model`` (``num_pages`` pages of ``page_size`` tokens, every
    layer's keys and values: ``k[i]``, ``v[i]`` ``P x G x page x D``) and the forwards over
    them."""

    def __init__(self, model: DecoderLM, num_pages: int, page_size: int) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            check_positive(name, value)
        c = model.config
        shape = (num_pages, c.kv_heads, page_size, c.head_dim)
        self.model, self.page_size = model, page_size
        self.k = [torch.zeros(shape, dtype=model.dtype, device=model.device)
                  for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, dtype=model.dtype, device=model.device)
                  for _ in range(c.num_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes of all the pages (allocated up front)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def prepare(self, rows: Sequence[PagedRow]) -> PreparedStep:
        """The inputs of one forward over ``rows``: one metadata object for every layer."""
        if not rows:
            raise ValueError("rows: expected at least one request, got none")
        ps, device = self.page_size, self.k[0].device
        for b, row in enumerate(rows):
            if not row.new:
                raise ValueError(f"rows[{b}]: expected at least one new token, got none")
            if len(row.table) * ps < row.start + len(row.new):
                raise ValueError(f"rows[{b}]: its block table of {len(row.table)} pages of "
                                 f"{ps} must cover start + new = {row.start + len(row.new)} "
                                 "tokens")
        order = ([b for b, row in enumerate(rows) if len(row.new) == 1]
                 + [b for b, row in enumerate(rows) if len(row.new) != 1])
        tokens, positions, slots = [], [], []
        for b in order:
            table, start, new = rows[b]
            tokens += new
            for t in range(start, start + len(new)):
                positions.append(t)
                slots.append(table[t // ps] * ps + t % ps)
        pages = max(len(rows[b].table) for b in order)
        tables = torch.tensor([list(rows[b].table) + [0] * (pages - len(rows[b].table))
                               for b in order], dtype=torch.long)
        metadata = PagedAttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long).to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
            block_tables=tables.to(device), starts=tuple(rows[b].start for b in order),
            query_lens=tuple(len(rows[b].new) for b in order),
            num_decode=sum(len(row.new) == 1 for row in rows), page_size=ps,
            window=self.model.config.sliding_window)
        ids = torch.tensor([tokens], dtype=torch.long).to(device)
        return PreparedStep(ids, metadata, tuple(order))

    def forward(self, rows: Sequence[PagedRow]) -> Tensor:
        """One forward over ``rows`` as one packed sequence: the final hidden state of every
        new token, ``T x E`` (``model.final_hidden``), in ``prepare(rows)``'s order."""
        step = self.prepare(rows)
        return self.model.final_hidden(step.input_ids, paged=self.pages(step.metadata))[0]

    def pages(self, metadata: PagedAttentionMetadata) -> list[LayerPages]:
        """Every layer's ``LayerPages`` for a step of ``metadata``."""
        return [LayerPages(k, v, metadata) for k, v in zip(self.k, self.v)]

    def hidden(self, rows: Sequence[PagedRow]) -> Tensor:
        """The final hidden state of each row's last token, ``R x E`` in the order of
        ``rows`` (what ``model.lm_head`` turns into its next token's logits), computed in
        the batch-invariant forwards of the module docstring."""
        return torch.stack([h[-1] for h in self.hidden_states(rows)])

    def hidden_states(self, rows: Sequence[PagedRow], every: Collection[int] = ()
                      ) -> list[Tensor]:
        """``hidden``'s forwards, keeping more: for each row, in the order of ``rows``, the
        final hidden states of all its new tokens ``n x E`` when its index is in ``every``
        (a prompt's log-probabilities), else of its last one ``1 x E``."""
        out: list[Tensor | None] = [None] * len(rows)
        for group in forward_groups([len(row.new) for row in rows]):
            step = self.prepare([rows[b] for b in group])
            hidden = self.model.final_hidden(step.input_ids, paged=self.pages(step.metadata))
            for b, j in zip(group, step.last):
                n = len(rows[b].new) if b in every else 1
                out[b] = hidden[0, j + 1 - n:j + 1]
        return out

    def logits(self, hidden: Tensor) -> Tensor:
        """``model.lm_head`` of hidden ``R x E`` -> ``R x V``, at most ``DECODING_ROWS`` rows
        a call (the batch-invariant kernels' rows)."""
        head = self.model.lm_head
        if hidden.shape[0] <= DECODING_ROWS:
            return head(hidden)
        return torch.cat([head(part) for part in hidden.split(DECODING_ROWS)])


def forward_groups(counts: Sequence[int]) -> list[list[int]]:
    """The forwards of a step whose rows run ``counts`` new tokens (indices into
    ``counts``): all together when they are at most ``DECODING_ROWS`` tokens; else the decode
    rows (count 1) in groups of at most ``DECODING_ROWS``, then the prefill chunks
    together."""
    if sum(counts) <= DECODING_ROWS:
        return [list(range(len(counts)))]
    decode = [b for b, n in enumerate(counts) if n == 1]
    chunks = [b for b, n in enumerate(counts) if n != 1]
    groups = [decode[i:i + DECODING_ROWS] for i in range(0, len(decode), DECODING_ROWS)]
    return groups + ([chunks] if chunks else [])
