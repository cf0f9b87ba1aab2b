"""Checks of tutorial 10's exercises (``attnlab exercises check 10``)."""

import torch
from torch import nn

from attnlab.exercises.checks import assert_close, assert_equal, learner
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.quantization import quantize


def chapter():
    return learner(__file__)


def test_10_1_per_tensor_int8():
    torch.manual_seed(0)
    W = torch.randn(16, 32) * torch.logspace(-2, 0, 16)[:, None]
    s = W.abs().max() / 127
    assert_close(chapter().per_tensor_int8(W), torch.round(W / s).clamp(-127, 127) * s,
                 name="per_tensor_int8(W)")
    mine = chapter().per_tensor_int8(W)
    per_row = quantize(W, 8).dequantize()
    assert (W[0] - mine[0]).norm() > (W[0] - per_row[0]).norm(), (
        "the smallest row should lose more with one scale than with one per row")


def test_10_2_unpack_int4():
    torch.manual_seed(0)
    for rows, cols, g in [(3, 64, 32), (5, 128, 64)]:
        weight = quantize(torch.randn(rows, cols), 4, g)
        codes, W = chapter().unpack_int4(weight.data, weight.scales, weight.zeros, g)
        assert_equal(codes, weight.codes(),
                     name=f"the codes of a {rows} x {cols} int4 weight (g={g})")
        assert_close(W, weight.dequantize().float(), atol=1e-6,
                     name=f"the weight of a {rows} x {cols} int4 weight (g={g})")


def test_10_3_bytes_per_weight():
    for kind, size, expected in [("int8", 896, 1 + 2 / 896), ("int4", 32, 0.625),
                                 ("int4", 128, 0.53125)]:
        got = chapter().bytes_per_weight(kind, size)
        assert abs(got - expected) < 1e-12, (
            f"bytes_per_weight({kind!r}, {size}) = {got}, expected {expected}")


def test_10_4_quantize_keeping_head():
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama(64, d_model=32, num_layers=1, num_heads=4,
                                            num_kv_heads=2, d_ff=64, max_len=32)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kept = chapter().quantize_keeping_head(model, 32)
    assert type(kept.lm_head) is nn.Linear and type(kept.embed_tokens) is nn.Embedding, (
        f"the head and the embedding stay float: got {type(kept.lm_head).__name__} and "
        f"{type(kept.embed_tokens).__name__}")
    assert kept.embed_tokens.weight is kept.lm_head.weight, "the tied table stays one table"
    assert type(kept.layers[0].self_attn.q_proj) is not nn.Linear, (
        "the layers inside the blocks should be quantized")
    for name, value in model.state_dict().items():
        assert_close(value, before[name], name=f"the original model's {name} (unchanged)")
    assert kept is not model, "return a copy"
