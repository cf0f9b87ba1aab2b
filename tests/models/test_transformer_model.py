"""Transformer config, tying, masks, summary and errors."""

from __future__ import annotations

import pytest
import torch

from attnlab.models import Transformer, TransformerConfig, count_parameters
from conftest import assert_close


def tiny(**overrides) -> TransformerConfig:
    fields = dict(src_vocab_size=12, tgt_vocab_size=12, d_model=16, num_heads=2,
                  num_encoder_layers=1, num_decoder_layers=2, d_ff=32, dropout=0.0, max_len=16)
    fields.update(overrides)
    return TransformerConfig(**fields)


def test_config_json_round_trip(tmp_path) -> None:
    config = tiny(norm_first=True, pad_id=None)
    assert TransformerConfig.from_json(config.to_json()) == config
    config.to_json(tmp_path / "c.json")
    assert TransformerConfig.from_json(tmp_path / "c.json") == config
    assert TransformerConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown"):
        TransformerConfig.from_dict({**config.to_dict(), "colour": 1})
    with pytest.raises(AttributeError):
        config.d_model = 8  # frozen


def test_weight_tying_options() -> None:
    torch.manual_seed(0)
    untied = Transformer(tiny(tie_output=False))
    tied = Transformer(tiny(tie_output=True))
    shared = Transformer(tiny(share_embeddings=True))
    assert tied.output_proj.weight is tied.decoder.embed.weight
    assert untied.output_proj.weight is not untied.decoder.embed.weight
    assert shared.encoder.embed.weight is shared.decoder.embed.weight is shared.output_proj.weight
    n = 12 * 16
    assert count_parameters(untied) - count_parameters(tied) == n
    assert count_parameters(tied) - count_parameters(shared) == n
    manual = sum(p.numel() for p in {id(p): p for p in shared.parameters()}.values())
    assert count_parameters(shared) == manual


def test_padding_does_not_change_real_positions() -> None:
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    src = torch.tensor([[3, 4, 5, 6]])
    tgt = torch.tensor([[1, 7, 8]])
    padded_src = torch.tensor([[3, 4, 5, 6, 0, 0]])
    padded_tgt = torch.tensor([[1, 7, 8, 0]])
    with torch.no_grad():
        assert_close(model(padded_src, padded_tgt)[:, :3], model(src, tgt), atol=1e-5)


def test_summary_lists_modules(capsys) -> None:
    model = Transformer(tiny())
    text = model.summary()
    assert "encoder" in text and "decoder" in text and "output_proj" in text
    assert f"{count_parameters(model):,}" in text
    assert capsys.readouterr().out == ""  # returned, not printed: print(model.summary()) once


def test_deterministic_under_manual_seed() -> None:
    torch.manual_seed(3)
    a = Transformer(tiny())
    torch.manual_seed(3)
    b = Transformer(tiny())
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="d_model"):
        tiny(d_model=15)
    with pytest.raises(ValueError, match="share_embeddings"):
        tiny(share_embeddings=True, tgt_vocab_size=13)
    with pytest.raises(ValueError, match="dropout"):
        tiny(dropout=1.0)
    model = Transformer(tiny())
    src = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="tgt: expected at least one token"):
        model(src, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="src: expected ids in"):
        model(torch.tensor([[12]]), src)
    with pytest.raises(ValueError, match="src_mask: expected a key mask"):
        model(src, src, src_mask=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_len"):
        model(src, torch.ones(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="tgt: expected integer token ids"):
        model(src, torch.ones(1, 3))
