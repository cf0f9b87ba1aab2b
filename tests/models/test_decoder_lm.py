"""DecoderLM: styles chosen by config, JSON config, tying, causality, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab.layers import FeedForward, GatedMLP, LearnedPositionalEmbedding, RMSNorm
from attnlab.layers.rotary import RotaryEmbedding
from attnlab.models import DecoderLM, DecoderLMConfig, count_parameters


def test_styles_pick_their_components() -> None:
    gpt = DecoderLM(DecoderLMConfig.gpt(30, d_model=32, num_layers=1, num_heads=4))
    llama = DecoderLM(DecoderLMConfig.llama(30, d_model=32, num_layers=1, num_heads=4))
    assert isinstance(gpt.embed_positions, LearnedPositionalEmbedding) and gpt.rotary is None
    assert isinstance(gpt.norm, nn.LayerNorm) and isinstance(gpt.layers[0].mlp, FeedForward)
    assert isinstance(llama.rotary, RotaryEmbedding) and llama.embed_positions is None
    assert isinstance(llama.norm, RMSNorm) and isinstance(llama.layers[0].mlp, GatedMLP)
    assert llama.layers[0].mlp.activation == "silu"  # SwiGLU
    attn = llama.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (4, 2)
    assert all(getattr(attn, f"{p}_proj").bias is None for p in "qkvo")
    assert llama.config.ff_dim == 88  # 8 * 32 / 3 rounded up to a multiple of 8


def test_config_json_round_trip(tmp_path) -> None:
    config = DecoderLMConfig.llama(30, d_model=32, num_heads=4, num_kv_heads=1)
    assert DecoderLMConfig.from_json(config.to_json()) == config
    config.to_json(tmp_path / "lm.json")
    assert DecoderLMConfig.from_json(str(tmp_path / "lm.json")) == config


def test_tying_and_gqa_parameter_counts() -> None:
    tied = DecoderLM(DecoderLMConfig.gpt(30, d_model=32, num_layers=1, num_heads=4))
    untied = DecoderLM(DecoderLMConfig.gpt(30, d_model=32, num_layers=1, num_heads=4,
                                           tie_embeddings=False))
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert count_parameters(untied) - count_parameters(tied) == 30 * 32
    mha = DecoderLM(DecoderLMConfig.llama(30, d_model=32, num_layers=1, num_heads=4,
                                          num_kv_heads=4))
    mqa = DecoderLM(DecoderLMConfig.llama(30, d_model=32, num_layers=1, num_heads=4,
                                          num_kv_heads=1))
    assert count_parameters(mha) - count_parameters(mqa) == 2 * 3 * 8 * 32  # K, V: 3 heads fewer


@pytest.mark.parametrize("factory", [DecoderLMConfig.gpt, DecoderLMConfig.llama])
def test_causal_future_tokens_do_not_change_the_past(factory) -> None:
    torch.manual_seed(0)
    model = DecoderLM(factory(30, d_model=32, num_layers=2, num_heads=4)).eval()
    ids = torch.randint(0, 30, (2, 6))
    changed = ids.clone()
    changed[:, 4:] = (changed[:, 4:] + 1) % 30
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_bad_config_and_input() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        DecoderLMConfig(30, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="position"):
        DecoderLMConfig(30, position="alibi")
    with pytest.raises(ValueError, match="mlp"):
        DecoderLMConfig(30, mlp="tanh")
    with pytest.raises(ValueError, match="d_model"):
        DecoderLMConfig(30, d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="unknown"):
        DecoderLMConfig.from_dict({"vocab_size": 3, "heads": 2})
    model = DecoderLM(DecoderLMConfig.gpt(30, d_model=32, num_layers=1, max_len=8))
    with pytest.raises(ValueError, match="input_ids: expected at least one token"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="max_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask: expected shape"):
        model(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4))
