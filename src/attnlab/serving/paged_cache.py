"""The bookkeeping of fixed-size KV pages shared by every request a model serves, with prefix
caching.

The pool says which of ``P`` pages of ``page`` token slots each request holds; the tensors
themselves, per layer keys and values ``P x G x page x D``, belong to the runner
(``attnlab.serving.runner``). A request owns a *block table*, the list of its pages in
order: token ``t`` of the request lives in page ``table[t // page]`` at slot ``t % page``.
Any free page serves any request, so the pool never fragments: a request needs ``ceil(T /
page)`` pages, wherever they are. ``allocate`` answers with an ``Allocation`` (the pages
granted, the first ``shared`` of them from the prefix cache) or None when the pool cannot
grant them: the scheduler needs nothing else of the pool's state.

    request A  tokens 0..39, page 16:  table [7, 2, 9]   (page 9 holds tokens 32..39)
    request B  same first 32 tokens:   table [7, 2, 4]   (pages 7 and 2 shared, refcount 2)

Pages are reference counted. A *full* page is also registered under the chain hash of every
token up to its end (``page_hashes``): a later request whose prompt starts with the same
tokens takes those pages instead of computing them again (prefix caching). A page whose count
falls to zero is free; a registered one stays findable until its slot is needed, the least
recently released first (LRU eviction).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from attnlab._checks import check_positive

__all__ = ["Allocation", "PagePool", "page_hashes"]


@dataclass(frozen=True)
class Allocation:
    """Pages granted by ``PagePool.allocate``: ``pages`` in block-table order, the first
    ``shared`` of them found in the prefix cache (their tokens computed already)."""

    pages: tuple[int, ...]
    shared: int = 0


def page_hashes(tokens: Sequence[int], page_size: int, count: int | None = None, *,
                known: Sequence[bytes] = ()) -> list[bytes]:
    """Chain hashes of the first ``count`` full pages of ``tokens`` (all full pages if
    ``None``): ``h_i = sha256(h_(i-1) || tokens[i*page : (i+1)*page])``, so ``h_i`` names
    the whole prefix ``tokens[: (i+1)*page]``, not only page ``i``'s tokens. ``known``: the
    first hashes, computed before (only the pages after them are hashed)."""
    full = len(tokens) // page_size if count is None else min(count, len(tokens) // page_size)
    hashes = list(known[:full])
    previous = hashes[-1] if hashes else b""
    for i in range(len(hashes), full):
        chunk = tokens[i * page_size:(i + 1) * page_size]
        previous = hashlib.sha256(
            previous + b"".join(int(t).to_bytes(8, "little", signed=True) for t in chunk)
        ).digest()
        hashes.append(previous)
    return hashes


class PagePool:
    """``num_pages`` pages of ``page_size`` slots: reference counts (``refcount``, to look
    at), free list, prefix table, LRU of cached pages.

    ``available`` pages (free or cached with no user) can be allocated; ``used`` pages have a
    user. ``allocate`` takes a free page first and evicts the least recently released cached
    page only when none is left.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            check_positive(name, value)
        self.num_pages, self.page_size = num_pages, page_size
        self.refcount = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        # cached pages that nobody uses, least recently released first
        self._idle: OrderedDict[int, None] = OrderedDict()
        self.prefix_hits = 0

    @property
    def available(self) -> int:
        """Pages that ``allocate`` can hand out now (free ones and idle cached ones)."""
        return len(self._free) + len(self._idle)

    @property
    def used(self) -> int:
        """Pages held by at least one request."""
        return self.num_pages - self.available

    @property
    def cached(self) -> int:
        """Pages registered in the prefix table (used or not)."""
        return len(self._hash_of)

    def allocate(self, count: int, *, prefix: Sequence[bytes] = (),
                 keep: int = 0) -> Allocation | None:
        """``count`` pages for one block table, or None when the pool cannot grant them and
        still leave ``keep`` pages available (for requests that need one this step).

        The pages registered under the longest run of the ``prefix`` hashes (from the
        first; ``page_hashes``) come first, shared (one more reference each, counted in
        ``prefix_hits``); the rest are new, each with reference count 1."""
        check_positive("count", count)
        shared = self._match(prefix[:count])
        needed = count - len(shared)
        # an idle shared page stops being available once shared
        idle = sum(page in self._idle for page in shared)
        if self.available - idle - keep < needed:
            return None
        self._share(shared)
        return Allocation((*shared, *self._take(needed)), len(shared))

    def _take(self, count: int) -> list[int]:
        """``count`` pages (``count <= available``), each with reference count 1: free pages
        first, then the least recently released cached ones (evicted from the table)."""
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._idle.popitem(last=False)
                del self._by_hash[self._hash_of.pop(page)]
            self.refcount[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; a page nobody holds becomes free, or idle (still
        findable by its hash) when registered. Released last to first, so that a request's
        later pages, the least likely to be shared, are evicted first."""
        for page in reversed(pages):
            assert self.refcount[page] > 0, f"page {page} released more often than taken"
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                if page in self._hash_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def _match(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages registered under the longest run of ``hashes`` from the first."""
        pages = []
        for h in hashes:
            page = self._by_hash.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def _share(self, pages: Sequence[int]) -> None:
        """Take one more reference to each of ``pages`` (found by ``_match``), counted in
        ``prefix_hits``."""
        for page in pages:
            self._idle.pop(page, None)
            self.refcount[page] += 1
        self.prefix_hits += len(pages)

    def register(self, page: int, page_hash: bytes) -> None:
        """Make a full, used ``page`` findable under ``page_hash``; a no-op when the page is
        registered already or another page holds the same prefix (computed concurrently)."""
        if page in self._hash_of or page_hash in self._by_hash:
            return
        self._by_hash[page_hash] = page
        self._hash_of[page] = page_hash
