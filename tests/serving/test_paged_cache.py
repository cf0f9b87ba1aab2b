"""PagePool: allocation results, reference counts, no fragmentation, prefix table, LRU
eviction; chain hashes."""

from __future__ import annotations

import hashlib

import pytest

from attnlab.serving import Allocation, PagePool, page_hashes


def _pool(pages: int = 6, page: int = 4) -> PagePool:
    return PagePool(pages, page)


def _pages(pool: PagePool, count: int) -> list[int]:
    granted = pool.allocate(count)
    assert granted is not None and granted.shared == 0
    return list(granted.pages)


def test_page_hashes_are_the_chain_formula():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    raw = [b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[i:i + 4])
           for i in (0, 4)]
    h0 = hashlib.sha256(raw[0]).digest()
    h1 = hashlib.sha256(h0 + raw[1]).digest()
    assert page_hashes(tokens, 4) == [h0, h1]  # the partial third page has no hash
    assert page_hashes(tokens, 4, 1) == [h0]
    assert page_hashes(tokens, 4, known=[h0]) == [h0, h1]


def test_a_page_hash_names_the_whole_prefix():
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 3, 4, 5, 6, 7, 8]
    assert page_hashes(a, 4)[1] != page_hashes(b, 4)[1]  # same page 1, other page 0
    assert page_hashes(a, 4) == page_hashes([*a, 1, 2], 4)


def test_allocation_counts_and_release_return_every_page():
    pool = _pool()
    a, b = _pages(pool, 2), _pages(pool, 3)
    assert len(set(a + b)) == 5 and pool.used == 5 and pool.available == 1
    pool.release(a)
    pool.release(b)
    assert pool.used == 0 and pool.available == 6 and set(pool.refcount) == {0}


def test_no_fragmentation_any_free_pages_serve_any_request():
    pool = _pool()
    pages = [_pages(pool, 1)[0] for _ in range(6)]
    pool.release(pages[0::2])  # every other page: scattered holes
    assert sorted(_pages(pool, 3)) == sorted(pages[0::2])


def test_an_allocation_that_does_not_fit_is_none_and_takes_nothing():
    pool = _pool()
    _pages(pool, 5)
    assert pool.allocate(2) is None and pool.available == 1
    assert pool.allocate(1, keep=1) is None  # the last page is kept for another request
    assert pool.allocate(1) == Allocation((5,), 0)
    with pytest.raises(ValueError, match="count: expected a positive int, got 0"):
        pool.allocate(0)


def test_an_allocation_shares_the_prefix_pages_and_counts_them_until_the_last_user():
    pool = _pool()
    hashes = page_hashes(list(range(8)), 4)
    pages = _pages(pool, 2)
    for page, h in zip(pages, hashes):
        pool.register(page, h)
    granted = pool.allocate(3, prefix=hashes)
    assert granted.pages[:2] == tuple(pages) and granted.shared == 2
    assert [pool.refcount[p] for p in pages] == [2, 2] and pool.prefix_hits == 2
    pool.release(pages)
    assert pool.used == 3
    pool.release(granted.pages)
    assert pool.used == 0 and pool.cached == 2
    again = pool.allocate(2, prefix=hashes)  # idle, still findable
    assert again == Allocation(tuple(pages), 2) and pool.used == 2


def test_an_idle_shared_page_is_not_counted_twice():
    """Two idle cached pages and one free: a request that shares both and needs one more
    fits; one that needs two more does not (the shared pages are no longer available)."""
    pool = _pool(pages=3)
    hashes = page_hashes(list(range(8)), 4)
    pages = _pages(pool, 2)
    for page, h in zip(pages, hashes):
        pool.register(page, h)
    pool.release(pages)
    assert pool.available == 3
    assert pool.allocate(4, prefix=hashes) is None and pool.prefix_hits == 0
    assert pool.allocate(3, prefix=hashes).shared == 2 and pool.available == 0


def test_a_prefix_match_stops_at_the_first_unknown_page():
    pool = _pool()
    hashes = page_hashes(list(range(12)), 4)
    pages = _pages(pool, 3)
    pool.register(pages[0], hashes[0])
    pool.register(pages[2], hashes[2])
    assert pool.allocate(3, prefix=hashes).pages[:1] == tuple(pages[:1])
    assert pool.prefix_hits == 1


def test_idle_cached_pages_are_evicted_least_recently_released_first():
    pool = _pool(pages=3)
    hashes = page_hashes(list(range(8)), 4)
    old, new = _pages(pool, 1), _pages(pool, 1)
    pool.register(old[0], hashes[0])
    pool.register(new[0], hashes[1])
    pool.release(old)
    pool.release(new)
    assert _pages(pool, 1) not in (old, new)  # a free page goes first
    assert _pages(pool, 1) == old  # then the least recently released cached one
    assert pool.cached == 1  # old's hash went with it; new is still findable
    assert pool.allocate(1, prefix=hashes[1:]) == Allocation(tuple(new), 1)


def test_register_keeps_the_first_page_of_a_prefix():
    pool = _pool()
    h = page_hashes(list(range(4)), 4)
    first, second = _pages(pool, 2)
    pool.register(first, h[0])
    pool.register(second, h[0])  # the same prefix, computed concurrently
    pool.release([second])
    assert pool.available == 5  # the unregistered copy is simply free
    assert pool.allocate(1, prefix=h).pages == (first,)


@pytest.mark.parametrize("name", ["num_pages", "page_size"])
def test_bad_sizes_are_named(name):
    sizes = dict(num_pages=2, page_size=4)
    sizes[name] = 0
    with pytest.raises(ValueError, match=f"{name}: expected a positive int, got 0"):
        PagePool(**sizes)
