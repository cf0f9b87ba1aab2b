"""GQA/MQA accounting against real modules and real caches."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import MultiHeadAttention
from attnlab.attention.accounting import attention_parameter_count, gqa_table, kv_cache_bytes


@pytest.mark.parametrize(
    ("E", "H", "G", "kwargs"),
    [
        (64, 8, None, {}),
        (64, 8, 2, {}),
        (64, 8, 1, {"bias": False}),
        (48, 4, 2, {"head_dim": 20}),
        (48, 4, 4, {"kdim": 10, "vdim": 7}),
    ],
)
def test_parameter_count_matches_a_real_module(E, H, G, kwargs):
    module = MultiHeadAttention(E, H, num_kv_heads=G, **kwargs)
    real = sum(p.numel() for p in module.parameters())
    assert attention_parameter_count(E, H, G, **kwargs) == real


def test_kv_cache_bytes_match_real_tensors():
    layers, B, G, S, D = 3, 2, 4, 17, 8
    caches = [torch.zeros(B, G, S, D, dtype=torch.bfloat16) for _ in range(2 * layers)]
    real = sum(t.numel() * t.element_size() for t in caches)
    assert kv_cache_bytes(S, G, D, num_layers=layers, batch_size=B, dtype=torch.bfloat16) == real


def test_table_shrinks_cache_by_h_over_g():
    rows = gqa_table(512, 8, seq_len=1024, num_layers=2)
    assert [r["num_kv_heads"] for r in rows] == [8, 4, 2, 1]
    for r in rows:
        assert r["kv_cache_vs_mha"] == pytest.approx(r["num_kv_heads"] / 8)
        module = MultiHeadAttention(512, 8, num_kv_heads=int(r["num_kv_heads"]), bias=False)
        assert r["params"] == sum(p.numel() for p in module.parameters())


def test_bad_heads_raise():
    with pytest.raises(ValueError, match="num_kv_heads"):
        attention_parameter_count(64, 8, 3)
    with pytest.raises(ValueError, match="seq_len"):
        kv_cache_bytes(-1, 2, 8)
