"""GPTQ lowers a layer's output error on its calibration inputs against round-to-nearest and
the search; on a model it quantizes every linear layer but the token table, which stays
int8, in order, each from the inputs that the quantized layers before it produce, lowering
the model's output error against round-to-nearest; the folder it writes loads back with the
same outputs."""

from __future__ import annotations

import pytest
import torch

from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.io import from_pretrained
from attnlab.quantization import QuantizedEmbedding, QuantizedLinear, quantize_model
from attnlab.quantization import gptq as gptq_module
from attnlab.quantization.convert import QuantizationConfig, outliers_chosen
from attnlab.quantization.formats import quantize
from attnlab.quantization.gptq import gptq_quantize, gptq_weight


def correlated_inputs(n: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(width, width, generator=g) / width**0.5
    return torch.randn(n, width, generator=g) @ mix + 0.2 * torch.randn(n, width, generator=g)


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_gptq_lowers_the_output_error_on_its_calibration_inputs(group_size, act_order):
    x = correlated_inputs(1024, 256, 0)
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    hessian = x.T.double() @ x.double() / len(x)

    def output_error(w):
        return ((x @ (weight - w).T) ** 2).mean().item()

    gptq = gptq_weight(weight, hessian, group_size, act_order=act_order)
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
    # the default int8 layers: v_proj, the last down_proj and an outlier one (here layer 0's)
    wide = {"layers.0.self_attn.v_proj", "layers.1.self_attn.v_proj", "layers.0.mlp.down_proj",
            "layers.1.mlp.down_proj"}
    assert len(layers) == 1 + 2 * 7 and all(
        m.bits == (8 if name in wide else 4) for name, m in model.named_modules()
        if isinstance(m, QuantizedLinear) and m is not model.lm_head)
    # each computes in the model's dtype: float16 scales are storage (a float16 module dtype
    # made GPTQ's models decode 20x slower than the search's in `bench quantization --model`)
    assert {m.dtype for m in layers} == {torch.float32}
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


def test_act_order_keeps_static_groups_of_consecutive_inputs():
    x = correlated_inputs(512, 128, 5)
    x[:, 100:] *= 10  # the last inputs first in act order
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(6))
    q = gptq_weight(weight, x.T.double() @ x.double() / len(x), 32, act_order=True)
    searched = quantize(weight, 4, 32, fit="search")
    # each group's scale and zero: the search's on the weights before any update
    torch.testing.assert_close(q.scales, searched.scales, rtol=0, atol=0)
    torch.testing.assert_close(q.zeros, searched.zeros, rtol=0, atol=0)


def test_each_layer_is_quantized_from_the_inputs_of_the_quantized_layers_before_it(
        monkeypatch):
    """The Hessian each layer got equals X^T X / n of its inputs in the finished (quantized)
    model on the calibration chunks: every layer before it was already quantized then."""
    seen = []  # (weight, hessian): a freed weight's address may be reused, so match by value

    def recording(weight, hessian, group_size, **kwargs):
        seen.append((weight.detach().clone(), hessian))
        return gptq_weight(weight, hessian, group_size, **kwargs)

    monkeypatch.setattr(gptq_module, "gptq_weight", recording)
    model = tiny()
    # the int8 layers GPTQ reads as int8: the defaults and the outlier down_proj it picks
    int8 = outliers_chosen(model, QuantizationConfig("int4", 32, fit="gptq")).int8_layers
    weights = {name: m.weight.detach().clone() for name, m in gptq_module.gptq_layers(
        model, group_size=32, int8_layers=int8).items()}
    ids = torch.randint(0, 64, (192,), generator=torch.Generator().manual_seed(7))
    gptq_quantize(model, ids, group_size=32, context=64, kernel="dequantize")
    sums = {}

    def hook(name):
        def accumulate(module, args):
            x = args[0].reshape(-1, module.in_features).double()
            total, n = sums.get(name, (0, 0))
            sums[name] = (total + x.T @ x, n + len(x))
        return accumulate

    for name in weights:
        model.get_submodule(name).register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for chunk in ids.split(64):
            model(chunk.view(1, -1))
    assert len(seen) == len(weights) == 2 * 7 - 4  # the int8 layers: read as int8
    for name, weight in weights.items():
        (hessian,) = [h for w, h in seen if torch.equal(w, weight)]
        total, n = sums[name]
        torch.testing.assert_close(hessian, total / n, rtol=1e-4, atol=1e-6, msg=name)


def test_gptq_lowers_the_models_output_error_against_round_to_nearest():
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(256, d_model=128, num_layers=3, num_heads=4, d_ff=256,
                                   max_len=256, tie_embeddings=True)
    reference = DecoderLM(config).eval()
    state = reference.state_dict()
    g = torch.Generator().manual_seed(8)
    # correlated token sequences: a few repeating phrases, as text is
    phrases = torch.randint(0, 256, (12, 16), generator=g)
    ids = phrases[torch.randint(0, 12, (96,), generator=g)].flatten()
    calibration, held_out = ids[:1024], ids[1024:1536]

    def output_error(model):
        with torch.no_grad():
            out = torch.cat([model(c.view(1, -1)) for c in held_out.split(128)], dim=1)
            want = torch.cat([reference(c.view(1, -1)) for c in held_out.split(128)], dim=1)
        return ((out - want) ** 2).mean().item()

    def fresh():
        model = DecoderLM(config).eval()
        model.load_state_dict(state)
        return model

    nearest = output_error(quantize_model(fresh(), "int4", 32, fit="nearest"))
    gptq = output_error(gptq_quantize(fresh(), calibration, group_size=32, context=128))
    assert gptq < 0.8 * nearest
