"""GPT-2 through the generic decoder, against ``transformers.GPT2LMHeadModel`` (tiny random
checkpoints made here): Conv1D weights, fused c_attn, learned positions, LayerNorm with bias,
gelu_new, tied head; names with and without ``transformer.``, old mask buffers skipped."""

from __future__ import annotations

import json
from dataclasses import replace

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
from safetensors.torch import load_file, save_file

from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.families import gpt2
from attnlab.models.io import save_pretrained

transformers = pytest.importorskip("transformers")


def _config(**overrides: object) -> object:
    fields = {"vocab_size": V, "n_embd": 48, "n_layer": 2, "n_head": 4, "n_positions": 64,
              "n_inner": 80, "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2,
              "layer_norm_epsilon": 1e-5}
    return transformers.GPT2Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    hf = tiny_checkpoint(folder, transformers.GPT2LMHeadModel, _config())
    return folder, hf, load(folder)


def test_gpt2_config_and_weights_map(pair) -> None:
    _, hf, ours = pair
    c = ours.config
    assert (c.family, c.position, c.norm, c.mlp, c.max_len, c.ff_dim) == (
        "gpt2", "learned", "layernorm", "gelu_tanh", 64, 80)
    assert ours.lm_head.weight is ours.embed_tokens.weight
    # Conv1D is in x out: c_attn (48 x 144) is q, k, v side by side, transposed to ours.
    c_attn = hf.transformer.h[1].attn.c_attn
    attn = ours.layers[1].self_attn
    assert torch.equal(attn.k_proj.weight, c_attn.weight[:, 48:96].t())
    assert torch.equal(attn.v_proj.bias, c_attn.bias[96:])
    assert torch.equal(ours.embed_positions.weight, hf.transformer.wpe.weight)
    assert torch.equal(ours.layers[0].input_layernorm.bias, hf.transformer.h[0].ln_1.bias)


def test_gpt2_logits_generation_and_cache_match_transformers(pair) -> None:
    _, hf, ours = pair
    assert_logits_match(hf, ours, hf_positions_from_mask=True)
    assert_greedy_match(hf, ours)
    assert_cache_matches_full(ours)


def test_gpt2_names_without_the_transformer_prefix_and_old_mask_buffers(pair, tmp_path
                                                                         ) -> None:
    # The original `gpt2` upload: GPT2Model names and the causal-mask buffers of its time.
    folder, hf, _ = pair
    stored = load_file(folder / "model.safetensors")
    bare = {k.removeprefix("transformer."): v for k, v in stored.items()}
    for i in range(2):
        bare[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64))[None, None]
        bare[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(bare, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    ours = load(tmp_path)
    assert_logits_match(hf, ours, hf_positions_from_mask=True)


def test_gpt2_mask_buffers_are_skipped_only_under_their_own_names(pair, tmp_path) -> None:
    folder, _, ours = pair
    weights = gpt2.gpt2_weights(ours.config).matching(["h.0.ln_1.weight"])
    buffers = {"h.1.attn.bias": torch.ones(1), "h.1.attn.masked_bias": torch.ones(1)}
    assert weights.skipped([*buffers, "h.1.ln_1.bias"]) == list(buffers)
    assert weights.to_ours(buffers, {}) == {}
    stored = load_file(folder / "model.safetensors")
    save_file({**stored, "transformer.h.0.attn.extra": torch.zeros(1)},
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"unexpected tensor 'transformer\.h\.0\.attn\.extra'"):
        load(tmp_path)


@pytest.mark.parametrize("overrides", [
    {"activation_function": "gelu", "tie_word_embeddings": False},
    {"activation_function": "relu", "scale_attn_weights": False, "n_inner": None},
])
def test_gpt2_variants_match_transformers(tmp_path, overrides) -> None:
    # The first also sharded: the prefix is found through the index.
    shard = "20KB" if overrides.get("activation_function") == "gelu" else None
    hf = tiny_checkpoint(tmp_path, transformers.GPT2LMHeadModel, _config(**overrides),
                         shard=shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    ours = load(tmp_path)
    assert ours.config.tie_embeddings == overrides.get("tie_word_embeddings", True)
    assert_logits_match(hf, ours, hf_positions_from_mask=True)


def test_gpt2_save_pretrained_is_read_by_transformers(pair, tmp_path) -> None:
    _, _, ours = pair
    hf = assert_save_round_trip(ours, transformers.GPT2LMHeadModel, tmp_path,
                                hf_positions_from_mask=True)
    assert hf.config.n_inner == 80 and hf.config.activation_function == "gelu_new"
    again = load(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                 ours.state_dict().values()))


def test_gpt2_save_refuses_a_config_the_format_cannot_hold(tmp_path) -> None:
    c = DecoderLMConfig(vocab_size=V, d_model=32, num_layers=1, num_heads=4,
                        position="rope", family="gpt2")
    with pytest.raises(ValueError, match="position: the gpt2 format cannot hold 'rope'"):
        save_pretrained(DecoderLM(c), tmp_path)
    c = replace(gpt2.tiny_config(), qkv_bias=False)
    with pytest.raises(ValueError, match="qkv_bias: the gpt2 format cannot hold False"):
        save_pretrained(DecoderLM(c), tmp_path)


@pytest.mark.parametrize(("key", "value", "words"), [
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx=true is not"),
    ("reorder_and_upcast_attn", True, "reorder_and_upcast_attn=true is not supported"),
    ("add_cross_attention", True, "add_cross_attention=true is not supported"),
    ("activation_function", "quick_gelu", "activation_function 'quick_gelu' is not"),
    ("n_embd", "48", "n_embd: expected a positive int, got '48'"),
    ("layer_norm_epsilon", "x", "layer_norm_epsilon"),
    ("hidden_size", 32, "hidden_size 32 and n_embd 48 disagree"),
    ("n_positions", None, "n_positions: expected a positive int, got None"),
    ("n_head", 5, r"n_embd \(d_model\): expected a multiple of num_heads=5"),
    ("n_inner", 0, r"n_inner \(d_ff\): expected a positive int, got 0"),
    ("layer_norm_epsilon", -1.0, r"layer_norm_epsilon \(norm_eps\): expected a positive"),
])
def test_gpt2_refuses_unsupported_options_naming_the_key(pair, tmp_path, key, value,
                                                         words) -> None:
    folder, _, _ = pair
    d = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**d, key: value}))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises((ValueError, TypeError), match=words) as info:
        load(tmp_path)
    assert "config.json" in str(info.value)


def test_gpt2_reads_the_common_key_names(pair) -> None:
    folder, _, ours = pair
    d = json.loads((folder / "config.json").read_text())
    for ours_key, common in (("n_embd", "hidden_size"), ("n_layer", "num_hidden_layers"),
                             ("n_head", "num_attention_heads"),
                             ("n_positions", "max_position_embeddings")):
        d[common] = d.pop(ours_key)
    assert gpt2.read_gpt2(d) == ours.config


def test_gpt2_tiny_config_builds_a_model() -> None:
    model = DecoderLM(gpt2.tiny_config())
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, V)
    assert model.embed_positions is not None and model.rotary is None
