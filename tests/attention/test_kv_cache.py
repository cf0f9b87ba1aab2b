"""Cached decoding gives the logits of full recomputation, at every step."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import MultiHeadAttention
from attnlab.generation import KVCache
from attnlab.models import DecoderLM, DecoderLMConfig, Transformer, TransformerConfig
from conftest import assert_close

V = 23
TOL = {"rtol": 1e-5, "atol": 1e-5}

STYLES = {
    "gpt": DecoderLMConfig.gpt(V, d_model=32, num_layers=2, num_heads=4, max_len=24),
    "llama-gqa": DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4, max_len=24),
    "llama-mqa-traditional": DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4,
                                                   num_kv_heads=1, rope_traditional=True,
                                                   max_len=24),
    "math-backend": DecoderLMConfig.llama(V, d_model=32, num_layers=1, num_heads=2,
                                          max_len=24, backend="math"),
}


def lm(style: str) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(STYLES[style]).eval()


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("chunks", [(1,) * 9, (4, 1, 1, 3), (5, 4)])
def test_decoder_lm_cached_equals_uncached(style: str, chunks: tuple[int, ...]) -> None:
    """One-token steps, multi-token prefill and multi-token chunks."""
    model = lm(style)
    ids = torch.randint(0, V, (2, sum(chunks)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.make_cache(2, max_len=12)
        start = 0
        for n in chunks:
            step = model(ids[:, start:start + n], cache=cache)
            full = model(ids[:, :start + n])
            assert cache.length == start + n
            assert_close(step, full[:, start:], **TOL, what=f"{style} at positions {start}..")
            start += n


@pytest.mark.parametrize("style", list(STYLES))
def test_left_padding_cached_equals_uncached_and_unpadded(style: str) -> None:
    model = lm(style)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, V, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        cache = model.make_cache(3)
        prefill = model(ids[:, :5], attention_mask=mask[:, :5], cache=cache)
        steps = [model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], cache=cache)
                 for i in range(5, 8)]
        full = model(ids, attention_mask=mask)
        cached = torch.cat([prefill, *steps], dim=1)
        real = mask.bool()
        assert_close(cached[real], full[real], **TOL, what="cached vs full, real tokens")
        # A padded row gives the same logits as its prompt alone, unpadded.
        for row in range(3):
            alone = model(ids[row:row + 1, mask[row].bool()])
            assert_close(full[row, mask[row].bool()], alone[0], **TOL, what=f"row {row}")


def test_transformer_decoder_cached_equals_uncached() -> None:
    torch.manual_seed(0)
    for norm_first in (False, True):
        config = TransformerConfig(V, V, d_model=16, num_heads=2, num_encoder_layers=1,
                                   num_decoder_layers=2, d_ff=32, dropout=0.0, max_len=16,
                                   norm_first=norm_first, pad_id=0)
        model = Transformer(config).eval()
        src = torch.randint(1, V, (2, 6))
        src[1, 4:] = 0
        tgt = torch.randint(1, V, (2, 7))
        with torch.no_grad():
            memory = model.encode(src)
            full = model(src, tgt)
            cache = model.make_cache(2)
            out = [model.decode(tgt[:, :3], memory, src != 0, cache=cache)]
            out += [model.decode(tgt[:, i:i + 1], memory, src != 0, cache=cache)
                    for i in range(3, 7)]
        assert_close(torch.cat(out, dim=1), full, **TOL, what=f"norm_first={norm_first}")


def test_cache_sizes_follow_gqa() -> None:
    model = lm("llama-gqa")
    c = model.config
    cache = model.make_cache(3, max_len=10)
    assert len(cache) == c.num_layers
    assert tuple(cache[0].k.shape) == (3, c.kv_heads, 10, c.head_dim)
    assert cache.nbytes == 2 * c.num_layers * 3 * c.kv_heads * 10 * c.head_dim * 4
    mha_cache = lm("gpt").make_cache(3, max_len=10)
    assert cache.nbytes * (c.num_heads // c.kv_heads) == mha_cache.nbytes


def test_cache_reorder_truncate_reset() -> None:
    cache = KVCache(1, 3, 1, 4, 2)
    k = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 2, 2)
    cache[0].update(k, k)
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache[0].k[:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0]
    cache.truncate(1)
    assert cache.length == 1
    cache.reset()
    assert cache.length == 0


def test_cache_errors() -> None:
    cache = KVCache(1, 2, 2, 4, 8)
    with pytest.raises(ValueError, match="k: expected shape"):
        cache[0].update(torch.zeros(2, 3, 1, 8), torch.zeros(2, 3, 1, 8))
    cache[0].update(torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 8))
    with pytest.raises(ValueError, match="cannot take 2 more"):
        cache[0].update(torch.zeros(2, 2, 2, 8), torch.zeros(2, 2, 2, 8))
    with pytest.raises(ValueError, match="num_layers"):
        KVCache(0, 1, 1, 1, 1)


def test_attention_raises_when_query_plus_offset_is_not_key_length() -> None:
    class BrokenCache:
        length = 2

        def update(self, k, v):  # forgets the cached positions
            return k, v

    mha = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match="query length \\+ offset"):
        mha(torch.randn(1, 1, 8), cache=BrokenCache())


def test_model_cache_errors() -> None:
    model = lm("llama-gqa")
    cache = model.make_cache(2, max_len=4)
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask: expected shape"):
        model(ids, attention_mask=torch.ones(2, 2), cache=cache)
    model(ids, cache=cache)
    with pytest.raises(ValueError, match="attention_mask: expected shape B x \\(offset \\+ L\\)"):
        model(ids[:, :1], attention_mask=torch.ones(2, 1), cache=cache)
    with pytest.raises(ValueError, match="cache: expected"):
        model(ids[:1, :1], cache=cache)
    with pytest.raises(ValueError, match="cannot take"):
        model(ids[:, :2], cache=cache)
    with pytest.raises(ValueError, match="max_len"):
        model(torch.ones(1, 25, dtype=torch.long))


def test_truncate_and_reorder_refuse_bad_arguments() -> None:
    cache = KVCache(2, 2, 1, 4, 2)
    cache[0].update(torch.zeros(2, 1, 3, 2), torch.zeros(2, 1, 3, 2))
    cache[1].update(torch.zeros(2, 1, 3, 2), torch.zeros(2, 1, 3, 2))
    for bad in (1.5, True, -1, 4):
        with pytest.raises(ValueError, match=r"length: expected an int in \[0, 3\]"):
            cache.truncate(bad)
    for bad in (torch.tensor([0, 2]), torch.tensor([-1, 0]), torch.tensor([0.0, 1.0]),
                torch.tensor([True, False])):
        with pytest.raises(ValueError, match=r"index: expected integer rows in \[0, 2\)"):
            cache.reorder(bad)
    assert cache.length == 3


def test_growing_cache_reallocates_and_keeps_what_it_holds() -> None:
    """A ``grow=True`` cache sized for 2 positions takes 2 + 1 + 4 of them (room 2, 4, 8:
    doubling), and returns exactly the keys and values it was given;
    a fixed cache refuses the same overflow."""
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 3, n, 4, generator=g) for n in (2, 1, 4)]
    cache = KVCache(1, 2, 3, 2, 4, grow=True)
    for i, room in enumerate((2, 4, 8)):
        k, v = cache[0].update(chunks[i], -chunks[i])
        assert cache.max_len == room
        assert_close(k, torch.cat(chunks[:i + 1], dim=2), rtol=0, atol=0)
        assert_close(v, -k, rtol=0, atol=0)
    assert cache.length == 7
    fixed = KVCache(1, 2, 3, 2, 4)
    fixed[0].update(chunks[0], chunks[0])
    with pytest.raises(ValueError, match="max_len=2"):
        fixed[0].update(chunks[1], chunks[1])
    with pytest.raises(TypeError, match="grow: expected a bool, got 'yes'"):
        KVCache(1, 2, 3, 2, 4, grow="yes")
