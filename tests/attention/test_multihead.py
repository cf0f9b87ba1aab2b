"""MultiHeadAttention against torch.nn.MultiheadAttention and a loop-over-heads reference."""

import pytest
import torch
from torch import nn

from attnlab import MultiHeadAttention, SimpleMultiHeadAttention
from attnlab.functional import softmax
from attnlab.masks import causal_mask
from conftest import assert_close


def loop_over_heads(mha: MultiHeadAttention, query, key, value, allowed):
    """One head at a time with plain matmuls, heads concatenated: the textbook definition.

    ``allowed``: bool ``B x L x S`` (True = may attend) or None.
    """
    H, G, D = mha.num_heads, mha.num_kv_heads, mha.head_dim
    if mha.in_proj_weight is not None:
        wq, wk, wv = mha.in_proj_weight.split([H * D, G * D, G * D])
    else:
        wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    bq, bk, bv = (
        mha.in_proj_bias.split([H * D, G * D, G * D]) if mha.in_proj_bias is not None else (0, 0, 0)
    )
    q, k, v = query @ wq.T + bq, key @ wk.T + bk, value @ wv.T + bv
    heads = []
    for h in range(H):
        g = h // (H // G)
        qh, kh, vh = (
            q[..., h * D : (h + 1) * D],
            k[..., g * D : (g + 1) * D],
            v[..., g * D : (g + 1) * D],
        )
        scores = qh @ kh.transpose(-2, -1) / D**0.5
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        heads.append(softmax(scores) @ vh)
    out = torch.cat(heads, dim=-1) @ mha.out_proj.weight.T
    return out + mha.out_proj.bias if mha.out_proj.bias is not None else out


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_matches_pytorch_self_attention_with_masks(batch_first, bias):
    torch.manual_seed(0)
    E, H, B, L = 16, 4, 3, 6
    ref = nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first).eval()
    ours = MultiHeadAttention.from_torch(ref).eval()
    x = torch.randn(B, L, E)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 4:] = True  # PyTorch: True = ignore
    attn_mask = ~causal_mask(L)  # PyTorch: True = not allowed
    xin = x if batch_first else x.transpose(0, 1)
    expected, _ = ref(xin, xin, xin, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
    expected = expected if batch_first else expected.transpose(0, 1)
    got = ours(x, mask=~attn_mask, key_mask=~kpm)
    assert_close(got, expected, atol=1e-5)
    # and with is_causal instead of a mask
    assert_close(ours(x, key_mask=~kpm, is_causal=True), expected, atol=1e-5)


def test_from_torch_float_and_per_head_masks_and_weights():
    torch.manual_seed(1)
    E, H, B, L, S = 12, 3, 2, 4, 5
    ref = nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(ref).eval()
    q, kv = torch.randn(B, L, E), torch.randn(B, S, E)
    float_mask = torch.randn(B * H, L, S)  # PyTorch's per-head B*H x L x S additive mask
    expected, w = ref(
        q, kv, kv, attn_mask=float_mask, need_weights=True, average_attn_weights=False
    )
    got, our_w = ours(q, kv, kv, mask=float_mask.view(B, H, L, S), return_weights=True)
    assert_close(got, expected, atol=1e-5)
    assert_close(our_w, w, atol=1e-6)


def test_from_torch_cross_attention_with_different_kdim_vdim():
    torch.manual_seed(2)
    ref = nn.MultiheadAttention(16, 2, kdim=10, vdim=7, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(ref).eval()
    assert ours.in_proj_weight is None
    q, k, v = torch.randn(2, 3, 16), torch.randn(2, 5, 10), torch.randn(2, 5, 7)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]])
    expected, _ = ref(q, k, v, key_padding_mask=kpm)
    assert_close(ours(q, k, v, key_mask=~kpm), expected, atol=1e-5)


def test_from_torch_gradients_match():
    torch.manual_seed(3)
    ref = nn.MultiheadAttention(8, 2, batch_first=True)
    ours = MultiHeadAttention.from_torch(ref)
    x = torch.randn(2, 5, 8)
    ref(x, x, x, need_weights=False)[0].square().sum().backward()
    ours(x).square().sum().backward()
    for name, p in ref.named_parameters():
        assert_close(ours.get_parameter(name).grad, p.grad, atol=1e-5, what=name)


@pytest.mark.parametrize(
    ("H", "G", "D", "E"),
    [(4, 4, 8, 32), (8, 2, 4, 16), (6, 1, 5, 12), (4, 2, 6, 10)],  # MHA, GQA, MQA, H*D != E
)
@pytest.mark.parametrize("backend", ["math", "flash", "fused", "auto"])
def test_batched_heads_equal_the_loop_over_heads(H, G, D, E, backend):
    torch.manual_seed(4)
    mha = MultiHeadAttention(E, H, head_dim=D, num_kv_heads=G, backend=backend).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    x, memory = torch.randn(2, 5, E), torch.randn(2, 7, E)
    key_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    expected = loop_over_heads(mha, x, x, x, causal_mask(5).expand(2, 5, 5))
    assert_close(mha(x, is_causal=True), expected, atol=1e-5)
    allowed = key_mask[:, None, :].expand(2, 5, 7)
    assert_close(
        mha(x, memory, key_mask=key_mask),
        loop_over_heads(mha, x, memory, memory, allowed),
        atol=1e-5,
    )
    other = torch.randn(2, 7, E)
    assert_close(mha(x, memory, other), loop_over_heads(mha, x, memory, other, None), atol=1e-5)


def test_weights_shape_and_gqa_parameter_count():
    mha = MultiHeadAttention(32, 8, num_kv_heads=2)
    out, w = mha(torch.randn(3, 4, 32), torch.randn(3, 6, 32), return_weights=True)
    assert out.shape == (3, 4, 32)
    assert w.shape == (3, 8, 4, 6)
    D = 4
    assert mha.in_proj_weight.shape == ((8 + 2 * 2) * D, 32)
    assert sum(p.numel() for p in mha.parameters()) == (8 + 4) * D * 32 + (8 + 4) * D + 32 * 32 + 32


def test_xavier_init_and_zero_biases_are_seeded():
    torch.manual_seed(0)
    a = MultiHeadAttention(64, 4)
    torch.manual_seed(0)
    b = MultiHeadAttention(64, 4)
    assert torch.equal(a.in_proj_weight, b.in_proj_weight)
    bound = (6 / (64 + 3 * 64)) ** 0.5
    assert a.in_proj_weight.abs().max() <= bound
    assert a.in_proj_weight.abs().max() > 0.9 * bound
    assert torch.equal(a.in_proj_bias, torch.zeros(3 * 64))


def test_dropout_only_in_training():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, dropout=0.5)
    x = torch.randn(2, 6, 16)
    mha.eval()
    assert torch.equal(mha(x), mha(x))
    mha.train()
    assert not torch.equal(mha(x), mha(x))


def test_simple_multihead_attention_tiny_llm_style():
    torch.manual_seed(5)
    E, H = 12, 3
    wq, wk, wv, wo = (torch.randn(E, E) * 0.3 for _ in range(4))
    mha = SimpleMultiHeadAttention(E, H, wq, wk, wv, wo)
    q, k, v = torch.randn(2, 4, E), torch.randn(2, 5, E), torch.randn(2, 5, E)
    mask = causal_mask(4, 5)
    ref = MultiHeadAttention(E, H, bias=False).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([wq, wk, wv]))
        ref.out_proj.weight.copy_(wo)
    assert_close(mha(q, k, v, mask), ref(q, k, v, mask=mask), atol=1e-5)
    assert_close(mha(q, k, v), loop_over_heads(ref, q, k, v, None), atol=1e-5)
    with pytest.raises(ValueError, match="wo"):
        SimpleMultiHeadAttention(E, H, wq, wk, wv, torch.randn(E, E + 1))


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: MultiHeadAttention(10, 3), "embed_dim"),
        (lambda: MultiHeadAttention(12, 4, num_kv_heads=3), "num_kv_heads"),
        (lambda: MultiHeadAttention(12, 0), "num_heads"),
        (lambda: MultiHeadAttention(12, 4, dropout=1.0), "dropout"),
        (lambda: MultiHeadAttention(12, 4, backend="fast"), "backend"),
        (lambda: MultiHeadAttention(12, 4, head_dim=-2), "head_dim"),
    ],
)
def test_bad_construction_names_the_argument(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_bad_forward_input_names_the_argument():
    mha = MultiHeadAttention(12, 4)
    x = torch.randn(2, 5, 12)
    with pytest.raises(ValueError, match="query"):
        mha(torch.randn(5, 12))
    with pytest.raises(ValueError, match="key"):
        mha(x, torch.randn(2, 5, 11))
    with pytest.raises(ValueError, match="key_mask"):
        mha(x, key_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        mha(x, mask=torch.ones(3, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="return_weights"):
        MultiHeadAttention(12, 4, backend="flash")(x, return_weights=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(12, 4, add_bias_kv=True))


@pytest.mark.parametrize("backend", ["auto", "fused", "flash", "math"])
def test_hook_points_see_every_tensor_on_the_modules_backend(backend, backend_calls):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, backend=backend).eval()
    assert [n for n, _ in mha.named_children()] == ["out_proj", "q", "k", "v", "scores",
                                                    "pattern", "z"]
    x, mem = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    seen = {}
    handles = [getattr(mha, p).register_forward_hook(
        lambda m, a, out, p=p: seen.__setitem__(p, out)) for p in ("q", "k", "v", "z")]
    calls = backend_calls
    with torch.no_grad():
        out = mha(x, mem)
    for h in handles:
        h.remove()
    ran = {"auto": "fused"}.get(backend, backend)  # a reference module: no C++ kernel
    assert calls == {k: int(k == ran) for k in calls}  # q/k/v/z hooks keep the backend
    assert {p: tuple(t.shape) for p, t in seen.items()} == {
        "q": (2, 4, 5, 4), "k": (2, 2, 7, 4), "v": (2, 2, 7, 4), "z": (2, 4, 5, 4)}
    # z is what out_proj receives: the output recomputed from the hooked z
    assert_close(mha.out_proj(seen["z"].transpose(1, 2).reshape(2, 5, 16)), out)
    # and the heads are the textbook ones, from the hooked q, k and v
    k, v = (t.repeat_interleave(2, dim=1) for t in (seen["k"], seen["v"]))
    assert_close(seen["z"], softmax(seen["q"] @ k.transpose(-1, -2) / 2.0) @ v, atol=1e-6)


def test_scores_and_pattern_hooks_run_math_or_raise_naming_the_backend(backend_calls):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(1, 5, 16)
    uniform = mha.scores.register_forward_hook(lambda m, a, s: torch.zeros_like(s))
    kept = {}
    mha.pattern.register_forward_hook(lambda m, a, w: kept.setdefault("w", w))
    calls = backend_calls
    with torch.no_grad():
        out, weights = mha(x, return_weights=True)
    assert calls["math"] == 1 and calls["fused"] == 0  # auto -> math while hooked
    assert torch.equal(weights, kept["w"])
    assert torch.allclose(weights, torch.full_like(weights, 0.2))
    _, _, v = mha._project(x, x, x, True)  # uniform attention: every query gets mean(v)
    expected = mha.out_proj(v.mean(1, keepdim=True).expand(1, 5, 16))
    assert_close(out, expected, atol=1e-6)
    uniform.remove()
    for backend in ("flash", "fused"):
        mha.backend = backend
        with pytest.raises(ValueError, match=f"hook: backend '{backend}' forms no scores"):
            mha(x)


def test_out_proj_is_called_as_a_module():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(1, 3, 16)
    mha.out_proj.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    assert torch.equal(mha(x), torch.zeros(1, 3, 16))
