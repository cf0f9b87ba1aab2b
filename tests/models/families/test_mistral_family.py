"""Mistral through the generic decoder, against transformers' MistralForCausalLM: a sliding
window shorter than the sequence, in the full forward, through the KV cache and in greedy
generation."""

from __future__ import annotations

import pytest
import torch
from family_parity import (
    V,
    assert_cache_matches_full,
    assert_cache_matches_transformers,
    assert_greedy_match,
    assert_logits_match,
    left_padded_batch,
    load,
    tiny_checkpoint,
)

transformers = pytest.importorskip("transformers")

SIZES = {"vocab_size": V, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "initializer_range": 0.1}


@pytest.fixture(scope="module", params=[4, None])
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"mistral-{request.param}")
    config = transformers.MistralConfig(**SIZES, sliding_window=request.param)
    hf = tiny_checkpoint(folder, transformers.MistralForCausalLM, config)
    return hf, load(folder)


def test_logits_generation_and_cache_match_transformers(pair) -> None:
    hf, ours = pair
    assert ours.config.family == "mistral"
    assert ours.config.sliding_window == hf.config.sliding_window
    assert_logits_match(hf, ours)  # 13 tokens: a window of 4 cuts most of them off
    assert_greedy_match(hf, ours)  # 29 positions: the window slides through the cache
    assert_cache_matches_full(ours)
    assert_cache_matches_transformers(hf, ours)


def test_the_window_really_cuts(pair) -> None:
    """With the window, the last token's logits do not depend on tokens 4 or more back
    (the window is 4, two layers: 7 back); without it, they do."""
    _, ours = pair
    ids, _ = left_padded_batch(4, lengths=(13,))
    changed = ids.clone()
    changed[0, 0] = (changed[0, 0] + 1) % V
    with torch.no_grad():
        moved = (ours(ids)[0, -1] - ours(changed)[0, -1]).abs().max().item()
    assert (moved == 0.0) == (ours.config.sliding_window is not None)
