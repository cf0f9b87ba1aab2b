"""GPTQ lowers a layer's output error on its calibration inputs against round-to-nearest and
the search; on a model it quantizes every linear layer but the token table, which stays
int8, and the folder it writes loads back with the same outputs."""

from __future__ import annotations

import pytest
import torch

from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.io import from_pretrained
from attnlab.quantization import QuantizedEmbedding, QuantizedLinear
from attnlab.quantization.formats import quantize
from attnlab.quantization.gptq import gptq_quantize, gptq_weight


def correlated_inputs(n: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(width, width, generator=g) / width**0.5
    return torch.randn(n, width, generator=g) @ mix + 0.2 * torch.randn(n, width, generator=g)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_gptq_lowers_the_output_error_on_its_calibration_inputs(group_size):
    x = correlated_inputs(1024, 256, 0)
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    hessian = x.T.double() @ x.double() / len(x)

    def output_error(w):
        return ((x @ (weight - w).T) ** 2).mean().item()

    gptq = gptq_weight(weight, hessian, group_size)
    assert gptq.bits == 4 and gptq.shape == (96, 256) and gptq.group_size == group_size
    nearest = output_error(quantize(weight, 4, group_size).dequantize(torch.float32))
    searched = output_error(quantize(weight, 4, group_size, fit="search").dequantize(
        torch.float32))
    assert output_error(gptq.dequantize(torch.float32)) < 0.8 * min(nearest, searched)


def test_an_input_that_is_always_zero_moves_nothing():
    x = correlated_inputs(512, 64, 2)
    x[:, 5] = 0
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    q = gptq_weight(weight, x.T.double() @ x.double() / len(x), 32)
    assert torch.isfinite(q.dequantize(torch.float32)).all()


def tiny() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(64, d_model=64, num_layers=2, num_heads=4, d_ff=128,
                                   max_len=128, tie_embeddings=True)
    return DecoderLM(config).eval()


def test_gptq_quantize_swaps_every_linear_layer_and_keeps_the_table_int8(tmp_path):
    ids = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(4))
    model = gptq_quantize(tiny(), ids, group_size=32, context=64)
    assert (model.quantization.fit, model.quantization.table_bits) == ("gptq", 8)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert model.lm_head.bits == 8 and model.embed_tokens.source is model.lm_head
    assert len(layers) == 1 + 2 * 7 and all(m.bits == 4 for m in layers if m is not
                                            model.lm_head)
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, kernels=False)
    assert loaded.quantization == model.quantization
    x = ids[:32].view(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


def test_gptq_refuses_float_ids_by_name():
    with pytest.raises(ValueError, match="ids: expected a 1-d integer tensor"):
        gptq_quantize(tiny(), torch.zeros(10))
