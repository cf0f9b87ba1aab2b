"""Gemma through the generic decoder, against ``transformers.GemmaForCausalLM`` (tiny random
checkpoints made here): sqrt(E) embedding scale, ``1 + w`` RMSNorm, GeGLU, explicit head_dim,
tied head."""

from __future__ import annotations

import copy
import json
import math
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

from attnlab.models.decoder import DecoderLM
from attnlab.models.families import gemma
from attnlab.models.io import save_pretrained

transformers = pytest.importorskip("transformers")


def _config(**overrides: object) -> object:
    # head_dim 16 with 4 heads in a 48-wide model: q_proj is 64 x 48, not square.
    fields = {"vocab_size": V, "hidden_size": 48, "intermediate_size": 80,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 128, "initializer_range": 0.1,
              "rms_norm_eps": 1e-6}
    return transformers.GemmaConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma")
    hf = tiny_checkpoint(folder, transformers.GemmaForCausalLM, _config())
    return folder, hf, load(folder)


def test_gemma_config_maps_every_difference(pair) -> None:
    _, _, ours = pair
    c = ours.config
    assert (c.family, c.norm, c.mlp, c.head_dim, c.tie_embeddings) == (
        "gemma", "rmsnorm_unit_offset", "geglu", 16, True)
    assert c.embedding_scale == math.sqrt(48)
    assert ours.lm_head.weight is ours.embed_tokens.weight
    assert ours.layers[0].self_attn.q_proj.weight.shape == (64, 48)


def test_gemma_logits_generation_and_cache_match_transformers(pair) -> None:
    _, hf, ours = pair
    assert_logits_match(hf, ours)
    assert_greedy_match(hf, ours)
    assert_cache_matches_full(ours)


def test_gemma_norm_matches_transformers_in_bfloat16(pair) -> None:
    # Gemma multiplies by (1 + w) in float32 before rounding: a Llama-order norm differs here.
    _, hf, ours = pair
    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    theirs = copy.deepcopy(hf.model.layers[0].input_layernorm).to(torch.bfloat16)
    mine = copy.deepcopy(ours.layers[0].input_layernorm).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(mine(x), theirs(x))


def test_gemma_bfloat16_checkpoint_matches_transformers(tmp_path) -> None:
    # sqrt(48) in bfloat16 is 6.9375, not 6.9282: the scaled embeddings must be equal bit for
    # bit, which holds only if the scale is rounded to the weights' dtype first, as Gemma does.
    hf = tiny_checkpoint(tmp_path, transformers.GemmaForCausalLM, _config(),
                         dtype=torch.bfloat16)
    ours = load(tmp_path)
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    seen = []
    ours.layers[0].resid_pre.register_forward_hook(lambda m, i, out: seen.append(out))
    ids = torch.arange(V)[None]
    with torch.no_grad():
        ours(ids)
        assert torch.equal(seen[0], hf.model.embed_tokens(ids))
    assert_logits_match(hf, ours, atol=0.05)


def test_gemma_untied_head_and_attention_bias(tmp_path) -> None:
    config = _config(tie_word_embeddings=False, attention_bias=True)
    hf = tiny_checkpoint(tmp_path, transformers.GemmaForCausalLM, config)
    ours = load(tmp_path)
    assert ours.lm_head.weight is not ours.embed_tokens.weight
    assert ours.layers[1].self_attn.o_proj.bias is not None
    assert_logits_match(hf, ours)


def test_gemma_save_pretrained_is_read_by_transformers(pair, tmp_path) -> None:
    _, _, ours = pair
    hf = assert_save_round_trip(ours, transformers.GemmaForCausalLM, tmp_path)
    assert hf.config.head_dim == 16 and hf.config.hidden_act == "gelu_pytorch_tanh"
    assert torch.equal(load(tmp_path).layers[1].input_layernorm.weight,
                       ours.layers[1].input_layernorm.weight)


@pytest.mark.parametrize(("change", "words"), [
    ({"norm": "rmsnorm"}, "norm: the gemma format cannot hold 'rmsnorm'"),
    ({"embedding_scale": 2.0}, "embedding_scale: the gemma format cannot hold 2.0"),
    ({"mlp_bias": True}, "mlp_bias: the gemma format cannot hold True"),
])
def test_gemma_save_refuses_a_config_the_format_cannot_hold(tmp_path, change, words) -> None:
    c = replace(gemma.tiny_config(), **change)
    with pytest.raises(ValueError, match=words):
        save_pretrained(DecoderLM(c), tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_gemma_legacy_gelu_reads_as_the_tanh_approximation(pair, tmp_path) -> None:
    folder, _, _ = pair
    d = json.loads((folder / "config.json").read_text())
    assert gemma.read_gemma({**d, "hidden_act": "gelu"}).mlp == "geglu"


@pytest.mark.parametrize(("key", "value", "words"), [
    ("hidden_act", "relu", "hidden_act 'relu' is not supported"),
    ("hidden_activation", "gelu", "hidden_activation 'gelu' is not supported"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=true"),
    ("head_dim", 0, "head_dim: expected a positive int, got 0"),
    ("hidden_size", 10**400, "hidden_size: expected at most"),
    ("head_dim", 10**400, r"head_dim 10+ is more than the \d+ values the weights hold"),
])
def test_gemma_refuses_unsupported_options_naming_the_key(pair, tmp_path, key, value,
                                                          words) -> None:
    folder, _, _ = pair
    d = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**d, key: value}))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises((ValueError, TypeError), match=words) as info:
        load(tmp_path)
    assert "config.json" in str(info.value)


def test_gemma_tiny_config_builds_a_model() -> None:
    model = DecoderLM(gemma.tiny_config())
    logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, V) and model.config.embedding_scale == math.sqrt(32)
