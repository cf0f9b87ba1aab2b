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


@pytest.mark.parametrize("grad", [False, True])
def test_rotary_and_mask_are_made_once_per_forward_and_shared_by_the_blocks(monkeypatch,
                                                                            grad) -> None:
    # The blocks take RoPE's cos/sin and the mask from the model: made once a forward, not
    # once a layer (left padding and a sliding window, so that there is a mask to make).
    import attnlab.models.decoder as decoder

    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama(50, d_model=32, num_heads=4, num_layers=3,
                                            max_len=32, sliding_window=3)).eval()
    made = {"rotary": 0, "mask": 0}
    rotary_forward, decoder_mask = RotaryEmbedding.forward, decoder.decoder_mask

    def counted_rotary(self, *args, **kwargs):
        made["rotary"] += 1
        return rotary_forward(self, *args, **kwargs)

    def counted_mask(*args, **kwargs):
        made["mask"] += 1
        return decoder_mask(*args, **kwargs)

    monkeypatch.setattr(RotaryEmbedding, "forward", counted_rotary)
    monkeypatch.setattr(decoder, "decoder_mask", counted_mask)
    seen = []
    for layer in model.layers:
        layer.register_forward_pre_hook(
            lambda _, args, kwargs: seen.append((kwargs["rotary"], kwargs["mask"])),
            with_kwargs=True)
    ids = torch.randint(1, 50, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.set_grad_enabled(grad):
        model(ids, mask)
    assert made == {"rotary": 1, "mask": 1}
    assert len(seen) == 3 and seen[0][1] is not None
    assert all(r is seen[0][0] and m is seen[0][1] for r, m in seen)
