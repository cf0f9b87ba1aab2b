"""Llama through the generic decoder, against transformers' LlamaForCausalLM: every RoPE
scaling type, the biases, an explicit head_dim, tied and untied heads, a sharded checkpoint,
bfloat16 checkpoints and dtype conversion on load."""

from __future__ import annotations

import json

import pytest
import torch
from family_parity import (
    V,
    assert_cache_matches_full,
    assert_cache_matches_transformers,
    assert_greedy_match,
    assert_logits_match,
    load,
    tiny_checkpoint,
)

transformers = pytest.importorskip("transformers")

SIZES = {"vocab_size": V, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "initializer_range": 0.1}
# The left-padded batch is 13 tokens long and generation adds 16: positions up to 28, so
# every scaling acts (dynamic from 8 positions on, the others from their original 8).
ROPE = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
    "linear": {"rope_type": "linear", "factor": 3.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 8.0, "beta_slow": 1.0},
}
CASES = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    "attention-and-mlp-bias": {"attention_bias": True, "mlp_bias": True},
    "explicit-head-dim": {"head_dim": 16},
    **{f"rope-{name}": {"rope_parameters": {"rope_theta": 500.0, **rope},
                        **({"max_position_embeddings": 8} if name == "dynamic" else {})}
       for name, rope in ROPE.items()},
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    config = transformers.LlamaConfig(**{**SIZES, **CASES[request.param]})
    hf = tiny_checkpoint(folder, transformers.LlamaForCausalLM, config)
    return request.param, folder, hf, load(folder)


def test_logits_generation_and_cache_match_transformers(case) -> None:
    name, _, hf, ours = case
    assert ours.config.family == "llama"
    assert_logits_match(hf, ours)
    assert_greedy_match(hf, ours)
    if name == "rope-dynamic":  # cached keys keep their step's frequencies, as in transformers
        assert_cache_matches_transformers(hf, ours)
    else:
        assert_cache_matches_full(ours)


def test_config_reads_what_transformers_reads(case) -> None:
    _, _, hf, ours = case
    c, ref = ours.config, hf.config
    assert (c.vocab_size, c.d_model, c.num_layers, c.num_heads, c.kv_heads, c.head_dim) == (
        ref.vocab_size, ref.hidden_size, ref.num_hidden_layers, ref.num_attention_heads,
        ref.num_key_value_heads, ref.head_dim)
    assert c.tie_embeddings == ref.tie_word_embeddings
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == c.tie_embeddings
    assert c.resolved_bias("qkv_bias") == c.resolved_bias("o_bias") == ref.attention_bias
    assert c.resolved_bias("mlp_bias") == ref.mlp_bias
    rope_type = ref.rope_parameters["rope_type"]
    assert (c.rope_scaling.rope_type if c.rope_scaling else "default") == rope_type
    for stored, (mine, theirs) in {
            "model.layers.1.self_attn.q_proj.weight": (ours.layers[1].self_attn.q_proj.weight,
                                                       hf.model.layers[1].self_attn.q_proj.weight),
            "lm_head.weight": (ours.lm_head.weight, hf.lm_head.weight)}.items():
        assert torch.equal(mine, theirs), stored  # raw weights: only renamed


def test_dynamic_scaling_acts_past_max_position_embeddings(tmp_path) -> None:
    """The dynamic case really scales: the same weights without the scaling differ there."""
    rope = {"rope_parameters": {"rope_theta": 500.0, **ROPE["dynamic"]},
            "max_position_embeddings": 8}
    config = transformers.LlamaConfig(**{**SIZES, **rope})
    hf = tiny_checkpoint(tmp_path, transformers.LlamaForCausalLM, config)
    ours = load(tmp_path)
    assert ours.config.max_len == 32 and ours.rotary.max_position_embeddings == 8
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    raw["max_position_embeddings"] = 32
    (tmp_path / "config.json").write_text(json.dumps(raw))
    plain = load(tmp_path)
    ids = torch.arange(20).remainder(V)[None]
    with torch.no_grad():
        scaled, unscaled, reference = ours(ids), plain(ids), hf(ids).logits
    assert (scaled - reference).abs().max() < 1e-4
    assert (unscaled - reference).abs().max() > 1e-2


def test_sharded_checkpoint(tmp_path) -> None:
    config = transformers.LlamaConfig(**SIZES)
    hf = tiny_checkpoint(tmp_path, transformers.LlamaForCausalLM, config, shard="30KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours = load(tmp_path)
    assert_logits_match(hf, ours)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16")
    config = transformers.LlamaConfig(**SIZES)
    return folder, tiny_checkpoint(folder, transformers.LlamaForCausalLM, config,
                                   dtype=torch.bfloat16)


def test_bfloat16_checkpoint_loads_in_bfloat16(bf16) -> None:
    folder, hf = bf16
    ours = load(folder)
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(ours.layers[0].mlp.up_proj.weight, hf.model.layers[0].mlp.up_proj.weight)
    # A few bfloat16 roundings differ in order (RMSNorm's weight product, the rotary cast):
    # logits of size ~1 agree to a few bf16 ulps.
    assert_logits_match(hf, ours, atol=0.1)
    # Greedy decoding through those roundings gives the same tokens on this checkpoint; a
    # near-tie could flip one on another, which is why the logits carry the real check.
    assert_greedy_match(hf, ours)


def test_float32_checkpoint_loaded_as_bfloat16_and_back(tmp_path) -> None:
    hf = tiny_checkpoint(tmp_path, transformers.LlamaForCausalLM,
                         transformers.LlamaConfig(**SIZES))
    folder = tmp_path
    half = load(folder, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert torch.equal(half.lm_head.weight, hf.lm_head.weight.to(torch.bfloat16))
    assert_logits_match(hf.to(torch.bfloat16), half, atol=0.1)
    hf.float()
    assert load(folder, dtype=torch.float32).lm_head.weight.dtype == torch.float32
