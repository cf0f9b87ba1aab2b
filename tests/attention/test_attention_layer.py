"""One attention-layer path: ``MultiHeadAttention`` and the decoders' ``SelfAttention`` run
the same ``AttentionLayer.heads`` (RoPE with one ``(cos, sin)`` convention, hooks, cache,
attention), so with the same weights they give the same outputs, hooks and cached steps."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import KVCache, MultiHeadAttention
from attnlab.attention.layer import HOOK_POINTS, AttentionLayer
from attnlab.formulas import apply_rotary
from attnlab.layers import RotaryEmbedding
from attnlab.layers.self_attention import SelfAttention
from conftest import assert_close

E, H, G, D = 32, 4, 2, 8


def _pair(interleaved: bool = False) -> tuple[SelfAttention, MultiHeadAttention]:
    """A ``SelfAttention`` and a ``MultiHeadAttention`` with the same weights."""
    torch.manual_seed(0)
    sa = SelfAttention(E, H, G, D, rope_interleaved=interleaved).eval()
    mha = MultiHeadAttention(E, H, num_kv_heads=G, bias=False,
                             rope_interleaved=interleaved).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([sa.q_proj.weight, sa.k_proj.weight,
                                            sa.v_proj.weight]))
        mha.out_proj.weight.copy_(sa.o_proj.weight)
    return sa, mha


def _rotary(length: int, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return RotaryEmbedding(D, max_len=16, interleaved=interleaved)(torch.arange(length))


def test_both_modules_are_attention_layers_with_the_same_hook_points():
    for module in _pair():
        assert isinstance(module, AttentionLayer)
        assert all(hasattr(module, point) for point in HOOK_POINTS)


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_same_weights_give_the_same_causal_rotary_output(interleaved):
    sa, mha = _pair(interleaved)
    x = torch.randn(2, 7, E)
    rotary = _rotary(7, interleaved)
    with torch.no_grad():
        assert_close(mha(x, rotary=rotary, is_causal=True), sa(x, rotary=rotary))


def test_mha_rotary_is_the_cos_sin_rotation_of_its_projections():
    _, mha = _pair()
    x = torch.randn(1, 5, E)
    cos, sin = _rotary(5)
    seen = {}
    mha.q.register_forward_hook(lambda m, a, out: seen.setdefault("q", out))
    with torch.no_grad():
        mha(x, rotary=(cos, sin), is_causal=True)
        q = (x @ mha.in_proj_weight[:H * D].T).view(1, 5, H, D)
    assert_close(seen["q"], apply_rotary(q, cos, sin).transpose(1, 2))


def test_hooks_see_the_same_tensors_in_both():
    sa, mha = _pair()
    x = torch.randn(2, 6, E)
    rotary = _rotary(6)
    seen: dict[str, list[torch.Tensor]] = {point: [] for point in HOOK_POINTS}
    for module in (sa, mha):
        for point in HOOK_POINTS:
            getattr(module, point).register_forward_hook(
                lambda m, a, out, point=point: seen[point].append(out))
    with torch.no_grad():
        sa(x, rotary=rotary)
        mha(x, rotary=rotary, is_causal=True)
    for point in HOOK_POINTS:
        assert len(seen[point]) == 2, point
        assert_close(seen[point][1], seen[point][0], what=point)


def test_a_cached_step_by_step_decode_equals_the_full_forward_in_both():
    sa, mha = _pair()
    x = torch.randn(1, 6, E)
    cos, sin = _rotary(6)
    with torch.no_grad():
        full = sa(x, rotary=(cos, sin))
        for module, causal in ((sa, {}), (mha, {"is_causal": True})):
            cache = KVCache(1, 1, G, 8, D)
            prefix = module(x[:, :4], rotary=(cos[:, :4], sin[:, :4]), cache=cache[0], **causal)
            steps = [module(x[:, t:t + 1], rotary=(cos[:, t:t + 1], sin[:, t:t + 1]),
                            cache=cache[0]) for t in (4, 5)]
            assert_close(torch.cat([prefix, *steps], dim=1), full,
                         what=type(module).__name__)


def test_weights_are_returned_by_the_shared_path():
    _, mha = _pair()
    x = torch.randn(1, 4, E)
    with torch.no_grad():
        out, weights = mha(x, is_causal=True, return_weights=True)
    assert out.shape == (1, 4, E)
    assert weights.shape == (1, H, 4, 4)
    assert_close(weights.sum(-1), torch.ones(1, H, 4))
    assert bool((weights[0, :, 0, 1:] == 0).all())
