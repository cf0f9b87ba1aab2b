"""Qwen3 through the generic decoder, against transformers' Qwen3ForCausalLM: q/k RMSNorm
per head, an explicit head_dim other than hidden_size / heads, attention_bias."""

from __future__ import annotations

import pytest
import torch
from family_parity import (
    V,
    assert_cache_matches_full,
    assert_greedy_match,
    assert_logits_match,
    load,
    tiny_checkpoint,
)

from attnlab.models.families import family_for

transformers = pytest.importorskip("transformers")

SIZES = {"vocab_size": V, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "initializer_range": 0.1, "head_dim": 16}
CASES = {"untied": {}, "tied-attention-bias": {"tie_word_embeddings": True,
                                               "attention_bias": True}}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    config = transformers.Qwen3Config(**SIZES, **CASES[request.param])
    return tiny_checkpoint(folder, transformers.Qwen3ForCausalLM, config), load(folder)


def test_logits_generation_and_cache_match_transformers(pair) -> None:
    hf, ours = pair
    c = ours.config
    assert (c.family, c.qk_norm, c.head_dim) == ("qwen3", True, 16)  # 16 != 48 / 4
    attn = ours.layers[1].self_attn
    assert torch.equal(attn.k_norm.weight, hf.model.layers[1].self_attn.k_norm.weight)
    assert (attn.o_proj.bias is not None) == hf.config.attention_bias
    assert_logits_match(hf, ours)
    assert_greedy_match(hf, ours)
    assert_cache_matches_full(ours)


def test_head_dim_defaults_to_128_as_transformers_reads_it() -> None:
    config = {k: v for k, v in SIZES.items() if k != "head_dim"}
    assert family_for("qwen3").config_from_hf(config).head_dim == 128
    assert transformers.Qwen3Config(**config).head_dim == 128
