"""Attention over the pages equals dense attention: the logits of every position of a ragged
batch, run in chunks through the runner's packed forwards, equal the plain forward of each
sequence; the runner's metadata says what each row is."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from attnlab.attention.paged import LayerPages, PagedAttentionMetadata, paged_attention
from attnlab.kernels import native
from attnlab.kernels.install import install_modules
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.serving import ModelRunner, PagedRow
from attnlab.serving.runner import forward_groups
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


def _logits_per_row(runner: ModelRunner, rows: list[PagedRow]) -> list[torch.Tensor]:
    """Each row's logits ``n_b x V`` from one packed forward (``runner.forward``)."""
    step = runner.prepare(rows)
    logits = runner.model.lm_head(runner.forward(rows))
    out, start = [None] * len(rows), 0
    for b, n in zip(step.order, step.metadata.query_lens):
        out[b] = logits[start:start + n]
        start += n
    return out


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_logits_equal_the_plain_forward_for_ragged_chunked_batches(style, seed):
    """One-token rows and chunks mixed, in any order, pages scattered through the pool: every
    position's logits are the plain forward's, so every page holds the right keys."""
    model, rng = _model(style), random.Random(seed)
    ps = 4
    runner = ModelRunner(model, 40, ps)
    seqs = [[rng.randrange(V) for _ in range(n)] for n in (1, 6, 13, 23)]
    order = list(range(40))
    rng.shuffle(order)
    tables = [[order.pop() for _ in range(-(-len(s) // ps))] for s in seqs]
    done, got, steps = [0] * len(seqs), [[] for _ in seqs], 0
    with torch.no_grad():
        while any(d < len(s) for d, s in zip(done, seqs)):
            live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
            rng.shuffle(live)
            rows = [PagedRow(tables[i], done[i],
                             seqs[i][done[i]:done[i] + rng.choice((1, 1, 3, 7))]) for i in live]
            for i, logits in zip(live, _logits_per_row(runner, rows)):
                got[i].append(logits)
                done[i] += len(logits)
            steps += 1
        for i, s in enumerate(seqs):
            expected = model(torch.tensor([s]))[0]
            assert_close(torch.cat(got[i]), expected, what=f"{style}: sequence {i}")
    assert steps > 3


@pytest.mark.parametrize("style", ["llama-gqa", "sliding-qknorm"])
def test_hidden_gives_each_row_its_last_tokens_state_in_the_rows_order(style):
    model, rng = _model(style), random.Random(2)
    runner = ModelRunner(model, 24, 4)
    seqs = [[rng.randrange(V) for _ in range(n)] for n in (9, 2, 14)]
    tables = [[0, 1, 2], [3], [4, 5, 6, 7]]
    with torch.no_grad():
        runner.hidden([PagedRow(t, 0, s[:-1]) for t, s in zip(tables, seqs)])
        rows = [PagedRow(tables[0], 8, seqs[0][8:]), PagedRow(tables[2], 13, seqs[2][13:]),
                PagedRow(tables[1], 1, seqs[1][1:])]
        logits = runner.logits(runner.hidden(rows))
        for b, s in zip(range(3), (seqs[0], seqs[2], seqs[1])):
            assert_close(logits[b], model(torch.tensor([s]))[0, -1], what=f"row {b}")


def test_the_metadata_of_a_step_orders_decode_rows_first():
    runner = ModelRunner(_model("llama-gqa"), 8, 4)
    rows = [PagedRow([0, 1], 0, [5, 6, 7]), PagedRow([2], 2, [8]), PagedRow([3], 0, [9, 10])]
    step = runner.prepare(rows)
    m = step.metadata
    assert step.input_ids.tolist() == [[8, 5, 6, 7, 9, 10]]
    assert step.order == (1, 0, 2) and step.last == [3, 0, 5]
    assert m.positions.tolist() == [2, 0, 1, 2, 0, 1]
    assert m.slot_mapping.tolist() == [2 * 4 + 2, 0, 1, 2, 3 * 4, 3 * 4 + 1]
    assert m.block_tables.tolist() == [[2, 0], [0, 1], [3, 0]]
    assert (m.starts, m.query_lens, m.num_decode) == ((2, 0, 0), (1, 3, 2), 1)
    assert m.context_lens == (3, 3, 2) and m.num_rows == 6 and m.page_size == 4
    assert m.window is None and m.decode_keys == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.num_decode = 0


def test_decode_rows_gather_their_keys_left_padded():
    runner = ModelRunner(_model("llama-gqa"), 6, 2)
    # two decode rows: 3 tokens (pages 0, 1) and 5 tokens (pages 2, 3, 4) -> S = 5
    m = runner.prepare([PagedRow([0, 1], 2, [4]), PagedRow([2, 3, 4], 4, [6])]).metadata
    assert m.decode_first.tolist() == [2, 0]
    page, slot = m.decode_gather
    assert page[1].tolist() == [2, 2, 3, 3, 4] and slot[1].tolist() == [0, 1, 0, 1, 0]
    assert page[0, 2:].tolist() == [0, 0, 1] and slot[0, 2:].tolist() == [0, 1, 0]
    assert m.decode_mask[:, 0, 0].tolist() == [[False, False, True, True, True], [True] * 5]
    assert m.window_mask is None


def test_the_pages_hold_the_dense_cache_keys():
    model = _model("llama-gqa")
    c = model.config
    runner = ModelRunner(model, 4, 4)
    ids = [5, 1, 7, 3, 9, 2]
    dense = model.make_cache(1, 8)
    with torch.no_grad():
        model(torch.tensor([ids]), cache=dense)
        runner.forward([PagedRow([2, 0], 0, ids)])
    for layer in range(c.num_layers):
        k = torch.cat([runner.k[layer][2], runner.k[layer][0]], dim=1)[:, :6]  # G x T x D
        assert_close(k, dense[layer].k[0, :, :6])
    assert runner.k[0].shape == (4, c.kv_heads, 4, c.head_dim)
    assert runner.nbytes == 2 * c.num_layers * 4 * c.kv_heads * 4 * c.head_dim * 4


def test_bad_rows_and_metadata_are_refused_by_name():
    model = _model("llama-gqa")
    runner = ModelRunner(model, 4, 2)
    with pytest.raises(ValueError, match="rows: expected at least one request"):
        runner.prepare([])
    with pytest.raises(ValueError, match=r"rows\[0\]: expected at least one new token"):
        runner.prepare([PagedRow([0], 0, [])])
    with pytest.raises(ValueError, match=r"rows\[0\]: .* cover start \+ new = 5 tokens"):
        runner.prepare([PagedRow([0, 1], 3, [1, 2])])
    t = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="query_lens: expected 1 for the first num_decode"):
        PagedAttentionMetadata(t, t, torch.zeros(1, 1, dtype=torch.long), (0,), (2,), 1, 2)
    with pytest.raises(ValueError, match=r"positions, slot_mapping: expected shape \(3,\)"):
        PagedAttentionMetadata(t, t, torch.zeros(1, 1, dtype=torch.long), (0,), (3,), 0, 2)
    step = runner.prepare([PagedRow([0], 0, [1, 2])])
    with pytest.raises(ValueError, match="paged: expected 2 layers' pages"):
        model.final_hidden(step.input_ids, paged=runner.pages(step.metadata)[:1])


def test_a_layer_refuses_keys_of_the_wrong_shape():
    model = _model("llama-gqa")
    runner = ModelRunner(model, 2, 2)
    pages = runner.pages(runner.prepare([PagedRow([0], 0, [1, 2])]).metadata)[0]
    layer = model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"k: expected shape 1 x G x T x D = \(1, 2, 2, 8\), "
                                         r"got \(1, 2, 3, 8\)"):
        layer(torch.zeros(1, 3, 32), paged=pages)


def test_forward_groups_keep_decode_rows_within_the_decoding_kernels_rows():
    assert forward_groups([1, 1, 20]) == [[0, 1, 2]]  # 22 rows: one forward
    assert forward_groups([1, 40, 1, 3]) == [[0, 2], [1, 3]]
    assert forward_groups([1] * 70) == [list(range(32)), list(range(32, 64)),
                                        list(range(64, 70))]
    assert forward_groups([33]) == [[0]]


@pytest.mark.usefixtures("native_kernels")
def test_a_decoding_step_reads_keys_in_their_pages_and_a_hook_sees_them_gathered(monkeypatch):
    """With the fast modules, a decoding step runs ``native.paged_attention`` in every layer
    (no gather); a hook on the attention pattern gets its layer's keys gathered and attended
    by the formula (``paged_attention``), which calls it; the logits are the same."""
    model, rng = copy.deepcopy(_model("llama-gqa")), random.Random(0)
    install_modules(model)
    c, ps = model.config, 4
    seqs = [[rng.randrange(V) for _ in range(n)] for n in (3, 9, 14)]
    calls, real = [], native.paged_attention
    monkeypatch.setattr(native, "paged_attention", lambda *a: calls.append(1) or real(*a))
    patterns, results = [], []
    for hooked in (False, True):
        runner = ModelRunner(model, 16, ps)
        tables = [list(range(5 * i, 5 * i + 4)) for i in range(3)]
        handle = model.layers[0].self_attn.pattern.register_forward_hook(
            lambda module, args, out: patterns.append(tuple(out.shape))) if hooked else None
        with torch.no_grad():
            runner.hidden([PagedRow(t, 0, s[:-1]) for t, s in zip(tables, seqs)])
            calls.clear()
            results.append(runner.logits(runner.hidden(
                [PagedRow(t, len(s) - 1, s[-1:]) for t, s in zip(tables, seqs)])))
        if handle is not None:
            handle.remove()
        assert len(calls) == c.num_layers - hooked
    assert patterns[-1] == (3, c.num_heads, 1, 14)
    assert_close(results[1], results[0])
    with torch.no_grad():
        for b, s in enumerate(seqs):
            assert_close(results[0][b], model(torch.tensor([s]))[0, -1], what=f"row {b}")


def test_the_formula_attends_each_chunk_alone_under_the_window():
    """``paged_attention`` of a chunk equals the dense formula over the request's keys."""
    torch.manual_seed(0)
    G, H, D, ps = 1, 2, 4, 2
    k_pages, v_pages = torch.randn(4, G, ps, D), torch.randn(4, G, ps, D)
    m = PagedAttentionMetadata(torch.arange(2, 5), torch.tensor([2, 3, 0]),
                               torch.tensor([[3, 1, 0]]), (2,), (3,), 0, ps, window=2)
    q = torch.randn(1, H, 3, D)
    z = paged_attention(q, LayerPages(k_pages, v_pages, m))
    keys = torch.cat([k_pages[3], k_pages[1], k_pages[0]], dim=1)[:, :5]  # G x 5 x D
    values = torch.cat([v_pages[3], v_pages[1], v_pages[0]], dim=1)[:, :5]
    scores = (q[0] @ keys.transpose(1, 2)) / D**0.5  # H x 3 x 5
    i, j = torch.arange(2, 5)[:, None], torch.arange(5)
    scores = scores.masked_fill(~((j <= i) & (j > i - 2)), float("-inf"))
    assert_close(z[0], scores.softmax(-1) @ values)
