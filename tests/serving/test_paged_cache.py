"""PagePool: reference counts, no fragmentation, prefix table, LRU eviction; chain hashes."""

from __future__ import annotations

import hashlib

import pytest
import torch

from attnlab.serving import PagePool, page_hashes


def _pool(pages: int = 6, page: int = 4) -> PagePool:
    return PagePool(2, pages, page, 2, 8, dtype=torch.float64)


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


def test_buffers_have_the_documented_shape_and_dtype():
    pool = _pool()
    assert len(pool.k) == len(pool.v) == 2
    assert pool.k[0].shape == (6, 2, 4, 8) and pool.v[1].dtype == torch.float64


def test_allocation_counts_and_release_return_every_page():
    pool = _pool()
    a, b = pool.allocate(2), pool.allocate(3)
    assert len(set(a + b)) == 5 and pool.used == 5 and pool.available == 1
    pool.release(a)
    pool.release(b)
    assert pool.used == 0 and pool.available == 6 and set(pool.refcount) == {0}


def test_no_fragmentation_any_free_pages_serve_any_request():
    pool = _pool()
    pages = [pool.allocate(1)[0] for _ in range(6)]
    pool.release(pages[0::2])  # every other page: scattered holes
    assert sorted(pool.allocate(3)) == sorted(pages[0::2])


def test_allocating_more_than_available_raises():
    pool = _pool()
    pool.allocate(5)
    with pytest.raises(RuntimeError, match="count: 2 pages asked for, only 1"):
        pool.allocate(2)


def test_shared_pages_are_counted_and_kept_until_the_last_user():
    pool = _pool()
    hashes = page_hashes(list(range(8)), 4)
    pages = pool.allocate(2)
    for page, h in zip(pages, hashes):
        pool.register(page, h)
    assert pool.match(hashes) == pages
    pool.share(pages)
    assert [pool.refcount[p] for p in pages] == [2, 2] and pool.prefix_hits == 2
    pool.release(pages)
    assert pool.used == 2
    pool.release(pages)
    assert pool.used == 0 and pool.cached == 2
    assert pool.match(hashes) == pages  # idle, still findable


def test_match_stops_at_the_first_unknown_page():
    pool = _pool()
    hashes = page_hashes(list(range(12)), 4)
    pages = pool.allocate(3)
    pool.register(pages[0], hashes[0])
    pool.register(pages[2], hashes[2])
    assert pool.match(hashes) == pages[:1]


def test_idle_cached_pages_are_evicted_least_recently_released_first():
    pool = _pool(pages=3)
    hashes = page_hashes(list(range(8)), 4)
    old, new = pool.allocate(1), pool.allocate(1)
    pool.register(old[0], hashes[0])
    pool.register(new[0], hashes[1])
    pool.release(old)
    pool.release(new)
    assert pool.allocate(1) not in (old, new)  # a free page goes first
    assert pool.allocate(1) == old  # then the least recently released cached one
    assert pool.match(hashes[:1]) == [] and pool.cached == 1
    assert pool.match(page_hashes(list(range(8)), 4)[1:]) == new


def test_register_keeps_the_first_page_of_a_prefix():
    pool = _pool()
    h = page_hashes(list(range(4)), 4)
    first, second = pool.allocate(2)
    pool.register(first, h[0])
    pool.register(second, h[0])  # the same prefix, computed concurrently
    assert pool.match(h) == [first]
    pool.release([second])
    assert pool.available == 5  # the unregistered copy is simply free


@pytest.mark.parametrize("name", ["num_layers", "num_pages", "page_size", "num_kv_heads",
                                  "head_dim"])
def test_bad_sizes_are_named(name):
    sizes = dict(num_layers=1, num_pages=2, page_size=4, num_kv_heads=1, head_dim=2)
    sizes[name] = 0
    with pytest.raises(ValueError, match=f"{name}: expected a positive int, got 0"):
        PagePool(**sizes)
