"""Phi-3 through the generic decoder, against ``transformers.Phi3ForCausalLM`` (tiny random
checkpoints made here): fused qkv_proj and gate_up_proj, partial rotary, sliding window,
longrope."""

from __future__ import annotations

import json

import pytest
import torch
from family_parity import (
    V,
    assert_cache_matches_full,
    assert_greedy_match,
    assert_logits_match,
    assert_save_round_trip,
    load,
    tiny_checkpoint,
)

from attnlab.models.decoder import DecoderLM
from attnlab.models.families import phi3

transformers = pytest.importorskip("transformers")


def _config(**overrides: object) -> object:
    # head_dim 12 with partial_rotary_factor 0.5: 6 of 12 features turn.
    fields = {"vocab_size": V, "hidden_size": 48, "intermediate_size": 80,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "initializer_range": 0.1,
              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5}}
    return transformers.Phi3Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("phi3")
    hf = tiny_checkpoint(folder, transformers.Phi3ForCausalLM, _config())
    return folder, hf, load(folder)


def test_phi3_config_and_fused_weights_map(pair) -> None:
    _, hf, ours = pair
    c = ours.config
    assert (c.family, c.head_dim, c.rotary_size, c.kv_heads, c.tie_embeddings) == (
        "phi3", 12, 6, 2, False)
    qkv = hf.model.layers[1].self_attn.qkv_proj.weight  # (4 + 2 + 2) heads of 12 rows
    attn = ours.layers[1].self_attn
    assert torch.equal(torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                  attn.v_proj.weight]), qkv)
    assert torch.equal(attn.k_proj.weight, qkv[48:72])
    gate_up = hf.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(ours.layers[0].mlp.gate_proj.weight, gate_up[:80])
    assert torch.equal(ours.layers[0].mlp.up_proj.weight, gate_up[80:])


def test_phi3_logits_generation_and_cache_match_transformers(pair) -> None:
    _, hf, ours = pair
    assert_logits_match(hf, ours)
    assert_greedy_match(hf, ours)
    assert_cache_matches_full(ours)


def test_phi3_sliding_window_shorter_than_the_sequence(tmp_path) -> None:
    hf = tiny_checkpoint(tmp_path, transformers.Phi3ForCausalLM, _config(sliding_window=4))
    ours = load(tmp_path)
    assert ours.config.sliding_window == 4
    assert_logits_match(hf, ours)
    assert_greedy_match(hf, ours)
    assert_cache_matches_full(ours)


def _longrope(original: int) -> dict:
    g = torch.Generator().manual_seed(4)
    short, long = (1 + torch.rand(2, 3, generator=g) * 3).tolist()  # rotary_dim/2 = 3 each
    return {"original_max_position_embeddings": original,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5, "short_factor": short,
                                "long_factor": long}}


@pytest.mark.parametrize("lengths", [(13, 7, 10), (40, 35, 38)],
                         ids=["short factors", "long factors"])
def test_phi3_longrope_matches_transformers(tmp_path, lengths) -> None:
    # original 32 of 128 positions: factor 4, attention factor sqrt(1 + ln 4 / ln 32).
    hf = tiny_checkpoint(tmp_path, transformers.Phi3ForCausalLM, _config(**_longrope(32)))
    ours = load(tmp_path)
    s = ours.config.rope_scaling
    assert (s.rope_type, s.original_max_position_embeddings) == ("longrope", 32)
    assert_logits_match(hf, ours, lengths=lengths)
    assert_greedy_match(hf, ours, lengths=lengths, new_tokens=8)


@pytest.mark.parametrize("use_cache", [True, False])
def test_phi3_longrope_crossing_the_original_length_matches(tmp_path, use_cache) -> None:
    # 13 + 16 tokens cross 20: transformers then recomputes its cache with the long factors
    # (our generate asks model.cache_expires), which generation without a cache does at
    # every step.
    hf = tiny_checkpoint(tmp_path, transformers.Phi3ForCausalLM, _config(**_longrope(20)))
    ours = load(tmp_path)
    assert ours.cache_expires(20) and not ours.cache_expires(19)
    assert_greedy_match(hf, ours, use_cache=use_cache)


def test_phi3_save_pretrained_is_read_by_transformers(pair, tmp_path) -> None:
    _, _, ours = pair
    hf = assert_save_round_trip(ours, transformers.Phi3ForCausalLM, tmp_path)
    assert hf.config.rope_parameters["partial_rotary_factor"] == 0.5
    assert load(tmp_path).config == ours.config


def test_phi3_longrope_and_window_save_round_trip(tmp_path) -> None:
    source, saved = tmp_path / "source", tmp_path / "saved"
    tiny_checkpoint(source, transformers.Phi3ForCausalLM,
                    _config(sliding_window=6, **_longrope(20)))
    ours = load(source)
    hf = assert_save_round_trip(ours, transformers.Phi3ForCausalLM, saved,
                                lengths=(30, 12, 25))
    assert hf.config.original_max_position_embeddings == 20
    assert load(saved).config == ours.config


def test_phi3_old_rope_scaling_spelling_su_reads_as_longrope(pair) -> None:
    folder, _, _ = pair
    d = json.loads((folder / "config.json").read_text())
    rope = _longrope(20)["rope_parameters"]
    del d["rope_parameters"], rope["rope_theta"]
    c = phi3.read_phi3({**d, "rope_theta": 500.0, "partial_rotary_factor": 0.5,
                        "rope_scaling": {**rope, "rope_type": None, "type": "su"}})
    assert c.rope_scaling.rope_type == "longrope" and c.rope_base == 500.0
    assert c.rope_scaling.original_max_position_embeddings == 4096  # transformers' default


@pytest.mark.parametrize(("changes", "words"), [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     "rope_parameters.rope_type 'linear' is not supported for phi3"),
    ({"rope_parameters": {"partial_rotary_factor": 0.3}},
     r"partial_rotary_factor: expected .* got 0.3 \(3 features\)"),
    ({"rope_parameters": {"partial_rotary_factor": 1.5}}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                          "long_factor": [1.0] * 3}},
     r"rope_parameters.short_factor: expected rotary_dim/2 = 3 numbers"),
    ({"rope_parameters": {"type": [1]}}, r"rope_parameters.rope_type \[1\] is not supported"),
    ({"sliding_window": 0}, "sliding_window: expected a positive int, got 0"),
    ({"sliding_window": "4"}, "sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported for phi3"),
    ({"original_max_position_embeddings": "x", "rope_parameters": {
        "rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}},
     "original_max_position_embeddings"),
])
def test_phi3_refuses_unsupported_options_naming_the_key(pair, tmp_path, changes,
                                                         words) -> None:
    folder, _, _ = pair
    d = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        d[key] = {**d[key], **value} if isinstance(value, dict) else value
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises((ValueError, TypeError), match=words) as info:
        load(tmp_path)
    assert "config.json" in str(info.value)


def test_phi3_tiny_config_builds_a_model() -> None:
    model = DecoderLM(phi3.tiny_config(sliding_window=4))
    assert model(torch.tensor([[1, 2, 3, 4, 5, 6]])).shape == (1, 6, V)
    assert model.config.rotary_size == 4 and model.config.sliding_window == 4
