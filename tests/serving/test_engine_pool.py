"""The page pool's bounds: the default pool stays within ``DEFAULT_POOL_BYTES`` whatever the
context (``max_position_embeddings: 10**9`` asked for 64 GB), a pool that cannot hold one
request of a useful length is refused by name, and requests ask for what the pool holds."""

from __future__ import annotations

import pytest
import torch

from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.serving import Engine, SamplingParams
from attnlab.serving import engine as engine_module
from attnlab.serving.engine import (
    DEFAULT_POOL_BYTES,
    MIN_REQUEST_TOKENS,
    default_pages,
    token_bytes,
)

V = 61


def _model(max_len: int) -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4, max_len=max_len)
    return DecoderLM(config).eval()


def test_the_default_pool_of_a_huge_context_stays_within_default_pool_bytes():
    model = _model(10**9)  # 256 bytes a token: one context alone would take 256 GB
    pages = default_pages(model, 8, 16)
    assert pages * 16 * token_bytes(model) <= DEFAULT_POOL_BYTES
    assert pages == DEFAULT_POOL_BYTES // (16 * 256)


def test_a_small_context_takes_max_batch_contexts():
    assert default_pages(_model(48), 3, 4) == 3 * 48 // 4


def test_requests_ask_for_what_the_bounded_pool_holds(monkeypatch):
    # a pool cap of 100 tokens of this model, under its context of 10**9
    monkeypatch.setattr(engine_module, "DEFAULT_POOL_BYTES", 100 * 256)
    engine = Engine(_model(10**9), page_size=4)
    assert engine.pool.num_pages == 25 and engine.max_request_tokens == 100
    with pytest.raises(ValueError, match=r"max_tokens: the prompt has 10 tokens and the KV "
                                         r"cache holds 100 tokens \(25 pages of 4\), so at "
                                         r"most 90 new tokens fit; got 91"):
        engine.add_request([1] * 10, SamplingParams(91))
    engine.add_request([1] * 10, SamplingParams(90, temperature=0))
    made = 0
    while engine.has_work():
        made += sum(e.token_id is not None for e in engine.step())
    assert made == 90 and engine.stats()["pages_used"] == 0


def test_a_default_pool_too_small_for_one_request_names_the_model_and_kv_pages(monkeypatch):
    monkeypatch.setattr(engine_module, "DEFAULT_POOL_BYTES", 8 * 256)  # 8 tokens
    with pytest.raises(ValueError, match=r"^model: its keys and values take 256 bytes a token "
                                         r"\(2 x num_layers=2 x kv_heads=2 x head_dim=8 in "
                                         r"torch.float32\), so the default pool of 2048 bytes "
                                         r"holds 8 tokens; expected room for one request of "
                                         r"16 tokens: set kv_pages"):
        Engine(_model(10**9), page_size=4)


def test_a_default_pool_without_room_for_one_page_is_refused(monkeypatch):
    monkeypatch.setattr(engine_module, "DEFAULT_POOL_BYTES", 100)  # under one page
    with pytest.raises(ValueError, match=r"^model: .* holds 0 tokens"):
        Engine(_model(48), page_size=4)


@pytest.mark.parametrize(("max_len", "kv_pages", "need"), [
    (48, 3, MIN_REQUEST_TOKENS),  # 12 tokens: under the useful minimum
    (12, 2, 12),                  # a context shorter than the minimum: the whole context
])
def test_kv_pages_that_cannot_hold_one_request_are_refused_by_name(max_len, kv_pages, need):
    with pytest.raises(ValueError, match=rf"^kv_pages: {kv_pages} pages of 4 tokens hold "
                                         rf"{kv_pages * 4} tokens; expected at least "
                                         rf"{-(-need // 4)} pages \(one request of {need} "):
        Engine(_model(max_len), page_size=4, kv_pages=kv_pages)
    Engine(_model(max_len), page_size=4, kv_pages=-(-need // 4))  # just enough


def test_a_context_of_one_token_is_refused_naming_max_position_embeddings():
    with pytest.raises(ValueError, match=r"^model: its context max_len=1 \(config.json's "
                                         r"max_position_embeddings\) holds no prompt token"):
        Engine(_model(1), page_size=1)
