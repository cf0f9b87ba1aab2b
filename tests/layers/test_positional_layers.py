"""Sinusoidal and learned position encodings against their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.layers import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from conftest import assert_close


def test_sinusoidal_matches_paper_formula() -> None:
    E, max_len = 6, 12
    pe = SinusoidalPositionalEncoding(E, max_len=max_len)
    expected = torch.zeros(max_len, E)
    for p in range(max_len):
        for i in range(0, E, 2):
            expected[p, i] = math.sin(p / 10000 ** (i / E))
            expected[p, i + 1] = math.cos(p / 10000 ** (i / E))
    x = torch.randn(2, 5, E)
    assert_close(pe(x), x + expected[:5])
    assert_close(pe(x, offset=3), x + expected[3:8])
    assert_close(pe(x, offset=slice(7, 12)), x + expected[7:12])


def test_sinusoidal_dropout_in_training_only() -> None:
    pe = SinusoidalPositionalEncoding(4, max_len=8, dropout=0.5)
    x = torch.ones(1, 8, 4)
    pe.eval()
    assert_close(pe(x), x + pe.pe)
    pe.train()
    torch.manual_seed(0)
    out = pe(x)
    assert ((out == 0) | torch.isclose(out, 2 * (x + pe.pe))).all()


def test_learned_positions_add_table_rows() -> None:
    torch.manual_seed(0)
    emb = LearnedPositionalEmbedding(10, 4)
    x = torch.randn(2, 3, 4)
    assert_close(emb(x), x + emb.weight[:3])
    pos = torch.tensor([[0, 0, 1], [4, 5, 6]])
    assert_close(emb(x, offset=pos), x + emb.weight[pos])


def test_positional_bad_input() -> None:
    with pytest.raises(ValueError, match="d_model"):
        SinusoidalPositionalEncoding(0)
    with pytest.raises(ValueError, match="x: expected shape"):
        SinusoidalPositionalEncoding(4, max_len=8)(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="offset"):
        LearnedPositionalEmbedding(4, 2)(torch.randn(1, 3, 2), offset=2)
    # Too long for the table with no offset: the input's length is named, not the offset.
    for layer in (LearnedPositionalEmbedding(8, 4), SinusoidalPositionalEncoding(4, max_len=8)):
        with pytest.raises(ValueError, match=r"^x: expected a length of at most max_len=8 "
                                             r"positions, got 10$"):
            layer(torch.randn(1, 10, 4))
