"""The default int4 scheme keeps in int8, besides every ``v_proj`` and the last layer's
``down_proj``, the ``down_proj`` whose weights hold the largest outliers (``max |W| /
std(W)``): chosen from the weights alone, the same by a streamed load as by quantizing the
loaded model, and recorded by name, so the saved folder loads as it was written."""

from __future__ import annotations

import pytest
import torch

from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.io import from_pretrained, save_pretrained
from attnlab.quantization import quantize_model
from attnlab.quantization.convert import (
    OUTLIERS_EVERY,
    QuantizationConfig,
    outlier_ratio,
    outliers_asked,
    with_outliers,
)


def model_with_a_super_weight(layers: int = 6, spiked: int = 2) -> DecoderLM:
    """A tiny Llama whose layer ``spiked`` has one ``down_proj`` weight 40 standard
    deviations out: its outlier."""
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(64, d_model=64, num_layers=layers, num_heads=4, d_ff=128,
                                   max_len=64)
    model = DecoderLM(config).eval()
    with torch.no_grad():
        w = model.layers[spiked].mlp.down_proj.weight
        w[5, 7] = 40 * w.std()
    return model


def test_outlier_ratio_is_the_largest_weight_over_the_standard_deviation():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 70, generator=g)
    w[3, 4] = -25.0
    expected = (w.abs().max() / w.std()).item()
    assert outlier_ratio(w) == pytest.approx(expected, rel=1e-6)
    assert outlier_ratio(w.bfloat16()) == pytest.approx(
        (w.bfloat16().double().abs().max() / w.bfloat16().double().std()).item(), rel=1e-6)
    assert outlier_ratio(torch.ones(4, 4)) == 0.0


def test_with_outliers_names_the_largest_in_layer_order_and_counts_one_in_fifteen():
    config = QuantizationConfig("int4", 32)
    assert config.int8_outliers is None  # the default: chosen when the model is quantized
    ratios = {f"layers.{i}.mlp.down_proj": float(i % 7) for i in range(30)}
    resolved = with_outliers(config, ratios)
    assert round(30 / OUTLIERS_EVERY) == 2
    assert resolved.int8_layers == (*config.int8_layers, "layers.6.mlp.down_proj",
                                    "layers.13.mlp.down_proj")
    assert resolved.int8_outliers == 0 and "int8_outliers" not in resolved.to_dict()
    assert QuantizationConfig.from_dict(resolved.to_dict()) == resolved
    three = with_outliers(QuantizationConfig("int4", 32, int8_outliers=3), ratios)
    assert three.int8_layers[-3:] == ("layers.6.mlp.down_proj", "layers.13.mlp.down_proj",
                                      "layers.20.mlp.down_proj")
    # a few candidates still give one; none give none
    assert len(with_outliers(config, dict(list(ratios.items())[:3])).int8_layers) == 3
    assert with_outliers(config, {}).int8_layers == config.int8_layers
    # a list of int8 layers given by hand chooses no outliers unless asked
    assert outliers_asked(["*.v_proj"], None) == 0 and outliers_asked([], None) == 0
    assert outliers_asked(None, None) is None and outliers_asked([], 2) == 2
    with pytest.raises(ValueError, match="int8_outliers: expected a number of layers >= 0"):
        QuantizationConfig("int4", 32, int8_outliers=-1)
    with pytest.raises(ValueError, match="int8_outliers: int8 quantizes every layer"):
        QuantizationConfig("int8", int8_outliers=2)


def test_the_default_keeps_the_spiked_down_proj_and_the_last_one_in_int8():
    model = quantize_model(model_with_a_super_weight(), "int4")
    bits = {i: model.layers[i].mlp.down_proj.bits for i in range(6)}
    # 5 candidates (the last layer's is int8 already): round(5 / 15) = 0, at least 1
    assert bits == {0: 4, 1: 4, 2: 8, 3: 4, 4: 4, 5: 8}
    assert model.quantization.int8_layers == ("*.v_proj", "layers.{last}.mlp.down_proj",
                                              "layers.2.mlp.down_proj")
    assert model.quantization.int8_outliers == 0
    elsewhere = quantize_model(model_with_a_super_weight(spiked=4), "int4")
    assert elsewhere.quantization.int8_layers[-1] == "layers.4.mlp.down_proj"
    none = quantize_model(model_with_a_super_weight(), "int4", int8_layers=["*.v_proj"])
    assert [none.layers[i].mlp.down_proj.bits for i in range(6)] == [4] * 6


def test_a_streamed_load_chooses_the_same_outliers_and_the_folder_keeps_them(tmp_path):
    float_folder = tmp_path / "float"
    save_pretrained(model_with_a_super_weight(spiked=3), float_folder)
    streamed = from_pretrained(float_folder, quantize="int4", kernels=False)
    reference = quantize_model(from_pretrained(float_folder, kernels=False), "int4")
    assert streamed.quantization == reference.quantization
    assert streamed.quantization.int8_layers[-1] == "layers.3.mlp.down_proj"
    assert streamed.layers[3].mlp.down_proj.bits == 8
    for (name, ours), theirs in zip(streamed.state_dict().items(),
                                    reference.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name
    streamed.save_pretrained(tmp_path / "q")
    loaded = from_pretrained(tmp_path / "q", kernels=False)
    assert loaded.quantization == streamed.quantization
    assert loaded.layers[3].mlp.down_proj.bits == 8
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), streamed(ids), rtol=0, atol=0)
