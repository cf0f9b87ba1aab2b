"""Checks of tutorial 3's exercises (``attnlab exercises check 3``)."""

import math

import torch

from attnlab import MultiHeadAttention
from attnlab.attention import scaled_dot_product_attention
from attnlab.attention.accounting import kv_cache_bytes
from attnlab.exercises.checks import assert_close, assert_equal, learner


def chapter():
    return learner(__file__)


def test_3_1_projection_shapes():
    for E, H, head_dim in [(32, 4, None), (10, 3, 4), (48, 6, 16)]:
        module = MultiHeadAttention(E, H, head_dim=head_dim)
        shapes = chapter().projection_shapes(E, H, head_dim)
        for name, weight in [("in_proj_weight", module.in_proj_weight),
                             ("out_proj.weight", module.out_proj.weight)]:
            assert_equal(tuple(shapes.get(name, ())), tuple(weight.shape),
                         name=f"projection_shapes({E}, {H}, {head_dim})[{name!r}]")
    try:
        chapter().projection_shapes(10, 3)
    except ValueError as error:
        assert "num_heads" in str(error), f"the message should name num_heads: {error!r}"
    else:
        raise AssertionError("projection_shapes(10, 3) should raise ValueError (10 / 3)")


def test_3_2_offset_read_by_heads():
    H, L, K = 4, 12, 5
    reads = [3, 1, 5, 2]
    weights = torch.full((H, L, L), 0.01)
    for h, k in enumerate(reads):
        for i in range(k, L):
            weights[h, i, i - k] = 0.9
    weights[0, 2, 0] = 5.0  # a query before max_offset: it must not count
    assert_equal(chapter().offset_read_by_heads(weights, K), reads,
                 name=f"offset_read_by_heads of heads that read offsets {reads}")


def test_3_3_gqa_by_repeat():
    torch.manual_seed(0)
    for H, G in [(8, 2), (4, 4), (6, 1)]:
        q, k, v = torch.randn(2, H, 5, 8), torch.randn(2, G, 7, 8), torch.randn(2, G, 7, 8)
        assert_close(chapter().gqa_by_repeat(q, k, v),
                     scaled_dot_product_attention(q, k, v, enable_gqa=True), atol=1e-5,
                     name=f"gqa_by_repeat with H={H}, G={G} (repeat_interleave, not repeat)")


def test_3_4_kv_cache_gib():
    for G in (8, 32):
        expected = kv_cache_bytes(8192, G, 128, num_layers=32, dtype=torch.bfloat16) / 2**30
        got = chapter().kv_cache_gib(8192, 32, G, 128, 2)
        assert abs(got - expected) < 1e-9, (
            f"kv_cache_gib(8192, 32, {G}, 128, 2) = {got}, expected {expected} GiB")


def test_3_5_simple_from_module():
    torch.manual_seed(0)
    module = MultiHeadAttention(32, 4, bias=False).eval()
    simple = chapter().simple_from_module(module)
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    mask = torch.rand(5, 7) > 0.3
    mask[:, 0] = True
    with torch.no_grad():
        assert_close(simple(x, x, x), module(x), atol=1e-5,
                     name="SimpleMultiHeadAttention from the module, self-attention")
        assert_close(simple(x, memory, memory, mask=mask), module(x, memory, mask=mask),
                     atol=1e-5, name="SimpleMultiHeadAttention from the module, with a mask")


def test_3_6_xavier_uniform_bound():
    for fan_in, fan_out in [(64, 64), (64, 192), (10, 30)]:
        got = chapter().xavier_uniform_bound(fan_in, fan_out)
        assert abs(got - math.sqrt(6 / (fan_in + fan_out))) < 1e-12, (
            f"xavier_uniform_bound({fan_in}, {fan_out}) = {got}")
    torch.manual_seed(0)
    module = MultiHeadAttention(64, 4)
    # The fused in-projection is initialised as ONE 3E x E matrix: fan_out = 3E.
    bound = chapter().xavier_uniform_bound(64, 192)
    largest = module.in_proj_weight.abs().max().item()
    assert 0.95 * bound < largest <= bound, (
        f"MultiHeadAttention(64, 4).in_proj_weight lies in +-{largest:.4f}, "
        f"expected just under xavier_uniform_bound(64, 192) = {bound:.4f}")
