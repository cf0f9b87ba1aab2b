"""scaled_dot_product_attention broadcasts query, key, value and mask like PyTorch's
``torch.nn.functional.scaled_dot_product_attention`` (matmul rules on every dim before the
last two), on every backend, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention import SimpleMultiHeadAttention, scaled_dot_product_attention
from attnlab.attention.flash import _Tiling
from conftest import assert_close

BACKENDS = ["math", "flash", "fused", "auto"]

CASES = {
    # name: (query shape, key shape, value shape, mask shape or None, enable_gqa)
    "query_lacks_a_batch_dim": ((4, 3, 8), (4, 4, 6, 8), (4, 4, 6, 8), None, False),
    "key_value_lack_a_batch_dim": ((4, 4, 3, 8), (4, 6, 8), (4, 6, 8), None, False),
    "query_rank2_kv_rank4": ((3, 8), (2, 4, 6, 8), (2, 4, 6, 8), None, False),
    "kv_batch_of_one": ((2, 4, 3, 8), (1, 4, 6, 8), (1, 4, 6, 8), (3, 6), False),
    "query_batch_of_one": ((1, 4, 3, 8), (2, 4, 6, 8), (2, 4, 6, 8), (2, 1, 1, 6), False),
    "query_one_head": ((2, 1, 3, 8), (2, 4, 6, 8), (2, 4, 6, 8), None, False),
    "kv_one_head": ((2, 4, 3, 8), (2, 1, 6, 8), (2, 1, 6, 8), (2, 4, 3, 6), False),
    "value_alone_broadcasts": ((4, 3, 8), (4, 6, 8), (2, 4, 6, 8), None, False),
    "key_one_head_value_four": ((2, 4, 3, 8), (2, 1, 6, 8), (2, 4, 6, 8), None, False),
    "rank5_two_way": ((2, 1, 4, 3, 8), (1, 3, 4, 6, 8), (1, 3, 4, 6, 8), (3, 1, 3, 6), False),
    "rank5_query_rank4_kv": ((2, 2, 4, 3, 8), (2, 4, 6, 8), (2, 4, 6, 8), (6,), False),
    "gqa_on_broadcast": ((2, 1, 4, 5, 8), (3, 2, 7, 8), (3, 2, 7, 8), (5, 7), True),
    "gqa_kv_batch_of_one": ((3, 4, 5, 8), (1, 2, 7, 8), (1, 2, 7, 4), (3, 1, 5, 7), True),
    "gqa_query_rank3": ((4, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8), None, True),
    "one_d_key_mask": ((2, 2, 3, 8), (2, 2, 6, 8), (2, 2, 6, 8), (6,), False),
    "rank2_everything": ((3, 8), (6, 8), (6, 8), (6,), False),
}


def _inputs(case, dtype=torch.float64):
    shape_q, shape_k, shape_v, shape_m, gqa = CASES[case]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g, dtype=dtype).requires_grad_()
               for s in (shape_q, shape_k, shape_v))
    mask = None
    if shape_m is not None:
        mask = torch.rand(*shape_m, generator=g) > 0.3
        mask[..., 0] = True
    return q, k, v, mask, gqa


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_broadcasting_matches_pytorch_forward_and_backward(case, backend, causal):
    q, k, v, mask, gqa = _inputs(case)
    out = scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa,
                                       backend=backend)
    # PyTorch takes no mask with is_causal, and its causal mask is top-left: the reference
    # gets ours (bottom-right) spelled out, and 2-D at least (it indexes the mask's dim -2).
    L, S = q.shape[-2], k.shape[-2]
    ref_mask = None if mask is None else mask.view(1, -1) if mask.dim() == 1 else mask
    if causal:
        below = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        ref_mask = below if ref_mask is None else ref_mask & below
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask, enable_gqa=gqa)
    assert out.shape == ref.shape
    assert_close(out, ref, what=f"{backend} output")
    grad = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b, x in zip("qkv", grads, ref_grads, (q, k, v)):
        assert a.shape == x.shape
        assert_close(a, b, what=f"{backend} grad {name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_mask_shape_that_broadcasts_gives_one_answer(backend):
    # A 1-D key mask crashed fused/auto with a bare IndexError from torch.
    q, k, v, _, _ = _inputs("one_d_key_mask")
    keep = torch.tensor([True, False, True, True, False, True])
    full = keep.expand(2, 2, 3, 6)
    ref = scaled_dot_product_attention(q, k, v, full, backend="math")
    for mask in (keep, keep.view(1, 6), keep.view(1, 1, 6), keep.view(1, 1, 1, 6), full,
                 torch.zeros(6, dtype=torch.float64).masked_fill(~keep, float("-inf"))):
        out = scaled_dot_product_attention(q, k, v, mask, backend=backend)
        assert_close(out, ref, what=f"mask shape {tuple(mask.shape)}")


def test_flash_folds_broadcast_key_value_dims_into_query_rows():
    # K/V of batch 1 against a query batch of 3: the 3 is folded into the rows of the one
    # K/V batch (as GQA heads are), so no K/V copy per query batch is made.
    q = torch.randn(3, 4, 5, 8)
    k = torch.randn(1, 2, 7, 8)
    t = _Tiling(q, k, k, None, False, 4, 4)
    assert (t.B, t.F, t.G, t.R) == (1, 3, 2, 2)
    assert t.kv_rows(k).data_ptr() == k.data_ptr()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"key": torch.randn(3, 4, 6, 8), "value": torch.randn(3, 4, 6, 8)}, ValueError,
         "leading dims"),
        ({"key": torch.randn(2, 3, 6, 8), "value": torch.randn(2, 3, 6, 8)}, ValueError,
         "key: expected 4 heads"),
        ({"value": torch.randn(2, 4, 7, 8)}, ValueError, "value: expected S=6"),
        ({"enable_gqa": True, "key": torch.randn(2, 2, 6, 8), "value": torch.randn(2, 1, 6, 8)},
         ValueError, "value: with enable_gqa"),
        ({"mask": torch.ones(2, 2, 4, 5, 6, dtype=torch.bool)}, ValueError, "mask"),
        ({"query": torch.randn(8)}, ValueError, "query: expected shape"),
        ({"query": torch.randn(2, 4, 5, 0), "key": torch.randn(2, 4, 6, 0)}, ValueError,
         "head dim D >= 1"),
        ({"value": torch.randn(2, 4, 6, 8, dtype=torch.float64)}, TypeError,
         "value: expected query's dtype torch.float32, got torch.float64"),
        ({"key": torch.randn(2, 4, 6, 8, dtype=torch.bfloat16)}, TypeError,
         "key: expected query's dtype torch.float32, got torch.bfloat16"),
        ({"key": torch.randn(2, 4, 6, 8, device="meta")}, ValueError,
         "key: expected query's device cpu"),
        ({"mask": torch.ones(5, 6, dtype=torch.bool, device="meta")}, ValueError,
         "mask: expected query's device"),
        ({"scale": float("nan")}, ValueError, "scale: expected a finite float"),
        ({"dropout_p": "0.1"}, TypeError, "dropout_p"),
    ],
)
def test_inputs_that_do_not_broadcast_or_differ_are_refused(kwargs, error, match):
    args = {"query": torch.randn(2, 4, 5, 8), "key": torch.randn(2, 4, 6, 8),
            "value": torch.randn(2, 4, 6, 8), **kwargs}
    for backend in BACKENDS:
        with pytest.raises(error, match=match):
            scaled_dot_product_attention(**args, backend=backend)


def test_simple_multi_head_attention_broadcasts_one_memory_over_a_batch():
    # float64: the broadcast and the expanded memory run products of other shapes, which a
    # BLAS may sum in another order (float32 differed by 2e-5 relative on an Intel Xeon).
    g = torch.Generator().manual_seed(0)
    wq, wk, wv, wo = (torch.randn(8, 8, generator=g, dtype=torch.float64) for _ in range(4))
    mha = SimpleMultiHeadAttention(8, 2, wq, wk, wv, wo)
    x = torch.randn(3, 4, 8, generator=g, dtype=torch.float64)
    memory = torch.randn(5, 8, generator=g, dtype=torch.float64)
    out = mha(x, memory, memory)
    assert out.shape == (3, 4, 8)
    assert_close(out, mha(x, memory.expand(3, 5, 8), memory.expand(3, 5, 8)))
