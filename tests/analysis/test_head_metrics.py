"""Each head metric on a constructed pattern whose value is known, and head_report."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.analysis import (
    attention_distance,
    broadness,
    capture,
    diagonal_share,
    entropy,
    first_token_share,
    head_report,
    head_similarity,
    js_divergence,
    previous_token_share,
)
from attnlab.masks import causal_mask
from attnlab.models.decoder import DecoderLM, DecoderLMConfig

L = 5
EYE = torch.eye(L)
PREV = torch.diag(torch.ones(L - 1), -1)
PREV[0, 0] = 1.0  # the first query has no previous token: it looks at itself
UNIFORM = torch.full((L, L), 1 / L)
FIRST = torch.zeros(L, L)
FIRST[:, 0] = 1.0
CAUSAL_UNIFORM = causal_mask(L).float() / torch.arange(1, L + 1)[:, None]


def test_entropy_and_broadness():
    assert entropy(EYE) == 0
    assert entropy(UNIFORM).item() == pytest.approx(math.log(L))
    # Causal uniform: row i spreads over i + 1 keys, so H_i = ln(i + 1).
    expected = sum(math.log(i + 1) for i in range(L)) / L
    assert entropy(CAUSAL_UNIFORM).item() == pytest.approx(expected)
    assert broadness(UNIFORM).item() == pytest.approx(1.0)
    assert broadness(EYE).item() == pytest.approx(1 / L)
    assert broadness(CAUSAL_UNIFORM, causal_mask(L)).item() == pytest.approx(1.0)
    # A row split evenly over 2 of 4 keys: exp(ln 2) / 4.
    half = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    assert broadness(half).item() == pytest.approx(0.5)
    assert entropy(torch.stack([EYE, UNIFORM])).shape == (2,)


def test_distance_and_position_shares():
    assert attention_distance(EYE) == 0
    assert attention_distance(FIRST).item() == pytest.approx(sum(range(L)) / L)
    assert attention_distance(PREV).item() == pytest.approx((L - 1) / L)
    assert diagonal_share(EYE) == 1 and diagonal_share(PREV).item() == pytest.approx(1 / L)
    assert previous_token_share(PREV).item() == pytest.approx((L - 1) / L)
    assert previous_token_share(EYE) == 0
    assert first_token_share(FIRST) == 1
    assert first_token_share(UNIFORM).item() == pytest.approx(1 / L)


def test_offsets_for_cache_and_cross_attention():
    # 2 new queries over 5 keys (a cache): bottom-right, query i sits at key 3 + i.
    w = torch.zeros(2, 5)
    w[0, 3] = w[1, 4] = 1.0
    assert diagonal_share(w) == 1 and attention_distance(w) == 0
    # Cross-attention aligned from the start: offset=0.
    w = torch.zeros(3, 6)
    w[0, 0] = w[1, 1] = w[2, 2] = 1.0
    assert diagonal_share(w, offset=0) == 1 and diagonal_share(w) == 0
    assert attention_distance(w).item() == pytest.approx(3.0)


def test_empty_rows_are_left_out():
    w = EYE.clone()
    w[2] = 0  # a query with nothing to attend to
    assert diagonal_share(w) == 1 and entropy(w) == 0


def test_js_divergence_and_head_similarity():
    p, q = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    assert js_divergence(p, q).item() == pytest.approx(math.log(2))
    assert js_divergence(p, p) == 0
    # JS([1, 0], [1/2, 1/2]) = (ln(4/3) + (1/2) ln(2/3) + (1/2) ln 2) / 2
    u = torch.tensor([0.5, 0.5])
    expected = (math.log(4 / 3) + 0.5 * math.log(2 / 3) + 0.5 * math.log(2)) / 2
    assert js_divergence(p, u).item() == pytest.approx(expected)
    sim = head_similarity(torch.stack([EYE, EYE, PREV, FIRST]))
    assert sim.shape == (4, 4)
    assert torch.allclose(sim.diagonal(), torch.ones(4))
    assert sim[0, 1] == pytest.approx(1.0) and torch.allclose(sim, sim.T)
    # EYE and PREV agree on row 0 only (both 1 on key 0): similarity 1/5.
    assert sim[0, 2].item() == pytest.approx(1 / L, abs=1e-6)
    with pytest.raises(ValueError, match="w: expected shape H x L x S"):
        head_similarity(EYE)
    with pytest.raises(ValueError, match="q: expected the shape of p"):
        js_divergence(p, torch.ones(3))
    with pytest.raises(ValueError, match="w: expected float attention weights"):
        entropy(torch.ones(3))


def test_head_report_rows_and_values():
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.gpt(20, d_model=16, num_layers=2, num_heads=2,
                                          max_len=16)).eval()
    result = capture(model, torch.randint(0, 20, (2, 6)))
    table = head_report(result)
    assert len(table) == 4 and table.columns[:3] == ["kind", "layer", "head"]
    rows = table.to_dicts()
    assert [(r["layer"], r["head"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    w0 = result["self"].weights[0, 0, 0]
    w1 = result["self"].weights[1, 0, 0]
    assert rows[0]["entropy"] == pytest.approx(((entropy(w0) + entropy(w1)) / 2).item(),
                                               rel=1e-5)
    assert all(0 < r["broadness"] <= 1 and 0 <= r["max_similarity"] <= 1 for r in rows)
    assert "| self | 0 | 0 |" in str(table)
