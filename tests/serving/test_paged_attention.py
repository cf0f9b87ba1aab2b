"""Attention over the pages equals dense attention: the logits of every position of a ragged
batch, run in chunks through ``paged_forward``, equal the plain forward of each sequence."""

from __future__ import annotations

import random

import pytest
import torch

from attnlab.kernels import native
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.serving import (
    PackedPagedKVCache,
    PagedKVCache,
    PagedRow,
    PagePool,
    packed_hidden,
    paged_forward,
)
from conftest import assert_close

V = 53
STYLES = {
    "llama-gqa": lambda: DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4,
                                               max_len=64),
    "gpt-learned": lambda: DecoderLMConfig.gpt(V, d_model=32, num_layers=2, num_heads=2,
                                               max_len=64),
    "sliding-qknorm": lambda: DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4,
                                                    num_kv_heads=1, max_len=64,
                                                    sliding_window=5, qk_norm=True),
}


def _model(style: str) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(STYLES[style]()).eval()


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_logits_equal_the_plain_forward_for_ragged_chunked_batches(style, seed):
    model, rng = _model(style), random.Random(seed)
    c, ps = model.config, 4
    pool = PagePool(c.num_layers, 40, ps, c.kv_heads, c.head_dim)
    seqs = [[rng.randrange(V) for _ in range(n)] for n in (1, 6, 13, 23)]
    order = list(range(pool.num_pages))
    rng.shuffle(order)  # pages scattered through the pool
    tables = [[order.pop() for _ in range(-(-len(s) // ps))] for s in seqs]
    done, got = [0] * len(seqs), [[] for _ in seqs]
    with torch.no_grad():
        while any(d < len(s) for d, s in zip(done, seqs)):
            live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
            rng.shuffle(live)
            rows = [PagedRow(tables[i], done[i], seqs[i][done[i]:done[i] + rng.randint(1, 7)])
                    for i in live]
            logits = paged_forward(model, pool, rows, logits_to_keep=0)
            for b, i in enumerate(live):
                n = len(rows[b].new)
                got[i].append(logits[b, logits.shape[1] - n:])
                done[i] += n
        for i, s in enumerate(seqs):
            expected = model(torch.tensor([s]))[0]
            assert_close(torch.cat(got[i]), expected, what=f"{style}: sequence {i}")


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("seed", [0, 1])
def test_a_packed_step_gives_each_row_the_plain_forwards_last_logits(style, seed):
    """Every row's new tokens in one sequence (one-token rows and chunks mixed, in any order):
    each row's last hidden state gives the logits of the plain forward at that position, and
    the pages fill as the plain cache would (later steps read them)."""
    model, rng = _model(style), random.Random(seed)
    c, ps = model.config, 4
    pool = PagePool(c.num_layers, 40, ps, c.kv_heads, c.head_dim)
    seqs = [[rng.randrange(V) for _ in range(n)] for n in (2, 6, 13, 23)]
    order = list(range(pool.num_pages))
    rng.shuffle(order)
    tables = [[order.pop() for _ in range(-(-len(s) // ps))] for s in seqs]
    done, steps = [0] * len(seqs), 0
    with torch.no_grad():
        expected = [model(torch.tensor([s]))[0] for s in seqs]
        while any(d < len(s) for d, s in zip(done, seqs)):
            live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
            rng.shuffle(live)
            rows = [PagedRow(tables[i], done[i],
                             seqs[i][done[i]:done[i] + rng.choice((1, 1, 3, 7))]) for i in live]
            logits = model.lm_head(packed_hidden(model, pool, rows))
            for b, i in enumerate(live):
                done[i] += len(rows[b].new)
                assert_close(logits[b], expected[i][done[i] - 1],
                             what=f"{style}: sequence {i} at {done[i] - 1}")
            steps += 1
    assert steps > 3


def test_a_packed_cache_orders_one_token_rows_first_and_refuses_what_it_cannot_do():
    model = _model("llama-gqa")
    c = model.config
    pool = PagePool(c.num_layers, 8, 4, c.kv_heads, c.head_dim)
    rows = [PagedRow([0, 1], 0, [5, 6, 7]), PagedRow([2], 2, [8]), PagedRow([3], 0, [9, 10])]
    cache = PackedPagedKVCache(pool, rows, window=None)
    assert cache.input_ids.tolist() == [[8, 5, 6, 7, 9, 10]]
    assert cache.position_ids.tolist() == [[2, 0, 1, 2, 0, 1]]
    assert cache.last.tolist() == [3, 0, 5]
    assert (cache.batch_size, cache.length, cache.max_len) == (1, 0, 6)
    with pytest.raises(NotImplementedError, match="attends in its cache"):
        cache[0].update(torch.zeros(1, 1, 6, 8), torch.zeros(1, 1, 6, 8))
    with pytest.raises(NotImplementedError, match="serves one forward"):
        cache.reset()
    with pytest.raises(ValueError, match="rows: expected at least one request"):
        PackedPagedKVCache(pool, [], window=None)


def test_the_pages_hold_the_dense_cache_keys():
    model = _model("llama-gqa")
    c = model.config
    pool = PagePool(c.num_layers, 4, 4, c.kv_heads, c.head_dim)
    ids = [5, 1, 7, 3, 9, 2]
    dense = model.make_cache(1, 8)
    with torch.no_grad():
        model(torch.tensor([ids]), cache=dense)
        paged_forward(model, pool, [PagedRow([2, 0], 0, ids)])
    for layer in range(c.num_layers):
        k = torch.cat([pool.k[layer][2], pool.k[layer][0]], dim=1)[:, :6]  # G x T x D
        assert_close(k, dense[layer].k[0, :, :6])


def test_cache_geometry_left_pads_keys_and_queries():
    pool = PagePool(1, 6, 2, 1, 2)
    cache = PagedKVCache(pool, [PagedRow([0, 1], 1, [4, 5]), PagedRow([2, 3, 4], 4, [6])])
    # row 0: 3 tokens, 2 new; row 1: 5 tokens, 1 new -> L = 2, S = 5, offset 3
    assert (cache.query_length, cache.length, cache.batch_size) == (2, 3, 2)
    assert cache.key_mask.tolist() == [[False, False, True, True, True], [True] * 5]
    assert cache.position_ids.tolist() == [[1, 2], [3, 4]]
    assert cache.page_index[1].tolist() == [2, 2, 3, 3, 4]
    assert cache.slot_index[1].tolist() == [0, 1, 0, 1, 0]


def test_bad_rows_are_refused_by_name():
    pool = PagePool(1, 4, 2, 1, 2)
    with pytest.raises(ValueError, match="rows: expected at least one request"):
        PagedKVCache(pool, [])
    with pytest.raises(ValueError, match="rows: expected at least one new token"):
        PagedKVCache(pool, [PagedRow([0], 0, [])])
    with pytest.raises(ValueError, match=r"rows: every block table must cover .*\[5\]"):
        PagedKVCache(pool, [PagedRow([0, 1], 3, [1, 2])])


def test_a_paged_cache_cannot_be_reset_or_reordered():
    cache = PagedKVCache(PagePool(1, 2, 2, 1, 2), [PagedRow([0], 0, [1])])
    for method, args in ((cache.reset, ()), (cache.truncate, (0,)),
                         (cache.reorder, (torch.zeros(1, dtype=torch.long),))):
        with pytest.raises(NotImplementedError, match="pages belong to the engine"):
            method(*args)


def test_update_refuses_keys_of_the_wrong_shape():
    pool = PagePool(1, 2, 2, 2, 4)
    layer = PagedKVCache(pool, [PagedRow([0], 0, [1, 2])])[0]
    good = torch.zeros(1, 2, 2, 4)
    with pytest.raises(ValueError, match=r"k: expected shape B x G x L x D = \(1, 2, 2, 4\), "
                                         r"got \(1, 1, 2, 4\)"):
        layer.update(torch.zeros(1, 1, 2, 4), good)
    with pytest.raises(ValueError, match=r"v: expected shape .* got \(1, 2, 3, 4\)"):
        layer.update(good, torch.zeros(1, 2, 3, 4))


@pytest.mark.usefixtures("native_kernels")
def test_a_decoding_step_reads_keys_in_their_pages_and_a_hook_sees_them_gathered(monkeypatch):
    """A decoding step runs ``native.paged_attention`` in every layer (no gather); a hook on
    the attention pattern gets its layer's keys gathered and attended by
    ``scaled_dot_product_attention``, which calls it; the logits are the same."""
    model, rng = _model("llama-gqa"), random.Random(0)
    c, ps = model.config, 4
    seqs = [[rng.randrange(V) for _ in range(n)] for n in (3, 9, 14)]
    calls, real = [], native.paged_attention
    monkeypatch.setattr(native, "paged_attention", lambda *a: calls.append(1) or real(*a))
    patterns = []
    results = []
    for hooked in (False, True):
        pool = PagePool(c.num_layers, 16, ps, c.kv_heads, c.head_dim)
        tables = [list(range(5 * i, 5 * i + 4)) for i in range(3)]
        handle = model.layers[0].self_attn.pattern.register_forward_hook(
            lambda module, args, out: patterns.append(tuple(out.shape))) if hooked else None
        with torch.no_grad():
            paged_forward(model, pool, [PagedRow(t, 0, s[:-1]) for t, s in zip(tables, seqs)])
            calls.clear()
            results.append(paged_forward(model, pool, [PagedRow(t, len(s) - 1, s[-1:])
                                                       for t, s in zip(tables, seqs)]))
        if handle is not None:
            handle.remove()
        assert len(calls) == c.num_layers - hooked
    assert patterns[-1] == (3, c.num_heads, 1, 14)
    assert_close(results[1], results[0])
    with torch.no_grad():
        for b, s in enumerate(seqs):
            assert_close(results[0][b, -1], model(torch.tensor([s]))[0, -1], what=f"row {b}")
