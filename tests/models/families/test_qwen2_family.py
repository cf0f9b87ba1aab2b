"""Qwen2 through the generic decoder, against transformers (a first family test; the
families' full suites live beside it)."""

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

transformers = pytest.importorskip("transformers")


def test_qwen2_logits_generation_and_cache_match_transformers(tmp_path) -> None:
    config = transformers.Qwen2Config(
        vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.1)
    hf = tiny_checkpoint(tmp_path, transformers.Qwen2ForCausalLM, config)
    ours = load(tmp_path)
    assert ours.config.family == "qwen2" and ours.layers[0].self_attn.q_proj.bias is not None
    assert_logits_match(hf, ours)
    assert_greedy_match(hf, ours)
    assert_cache_matches_full(ours)
    assert all(p.requires_grad for p in ours.parameters())
    assert ours.embed_tokens.weight.dtype == torch.float32
