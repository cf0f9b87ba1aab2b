"""Coded int4 scales (the default int4 format): each group's scale and zero as 8-bit codes
against two bfloat16 steps per block of 16 rows, 4.5 bits a weight at groups of 32. The
stored codes decode to the formula by hand, the coding loses little against float32 scales
(every int4 kernel computes the formula from them: test_int4_scale_dtype.py), a saved
folder loads back to the same outputs in float32 and bfloat16 (the steps never cast), GPTQ
keeps float16 scales, and ``{last}`` in an int8 pattern names the model's last layer."""

from __future__ import annotations

import pytest
import torch

from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.io import from_pretrained
from attnlab.quantization import QuantizedLinear, quantize_model
from attnlab.quantization.convert import QuantizationConfig, last_layer, weight_bytes
from attnlab.quantization.formats import STEP_ROWS, decode_scales, quantize
from attnlab.quantization.search import code_scales


def tiny(layers: int = 2) -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(64, d_model=64, num_layers=layers, num_heads=4, d_ff=128,
                                   max_len=128, tie_embeddings=True)
    return DecoderLM(config).eval()


def int4_layers(model: torch.nn.Module) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.bits == 4]


def outliers(rows: int = 64, cols: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)
    weight[::7, 3] *= 12
    return weight


def test_coded_weights_decode_to_the_formula_by_hand():
    weight = outliers()
    q = quantize(weight, 4, 32, torch.int8, fit="search")
    assert q.coded and q.scales.dtype == torch.uint8 and q.zeros.dtype == torch.int8
    assert q.steps.dtype == torch.bfloat16 and q.steps.shape == (64 // STEP_ROWS, 2)
    assert int(q.scales.min()) >= 1 and int(q.zeros.abs().max()) <= 127
    steps = q.steps.float().repeat_interleave(STEP_ROWS, dim=0)  # each row's block's
    s = q.scales.float() * steps[:, :1]
    z = q.zeros.float() * steps[:, 1:]
    # the steps were rounded up: the largest code of each block is near the top, none over
    top = q.scales.view(-1, STEP_ROWS * 8).amax(dim=1)
    assert (top >= 250).all() and (top <= 255).all()
    by_hand = ((q.codes().float() - 8).view(64, 8, 32) * s[..., None] + z[..., None])
    torch.testing.assert_close(q.dequantize(torch.float32), by_hand.view(64, 256), rtol=0, atol=0)
    torch.testing.assert_close(decode_scales(q.scales, q.zeros, q.steps), (s, z), rtol=0, atol=0)
    # the rows of an embedding lookup are the same rows
    index = torch.tensor([[5, 0], [63, 5]])
    torch.testing.assert_close(q.rows(index, torch.float32), by_hand.view(64, 256)[index],
                               rtol=0, atol=0)
    blocked = q.with_layout("blocked")
    assert blocked.coded and torch.equal(blocked.dequantize(torch.float32), q.dequantize())


def test_coding_costs_little_against_float32_scales_and_its_search_never_loses():
    weight = outliers()
    error = {}
    for name, dtype in (("float32", torch.float32), ("float16", torch.float16),
                        ("coded", torch.int8)):
        q = quantize(weight, 4, 32, dtype, fit="search")
        error[name] = ((q.dequantize(torch.float32) - weight) ** 2).sum()
    assert error["coded"] < 1.02 * error["float32"]
    # the neighbours are tried only where they help: never worse than the nearest codes
    w = weight.view(64, 8, 32)
    fitted = quantize(weight, 4, 32, torch.float32, fit="search")
    codes, zero_codes, steps = code_scales(w, fitted.scales, fitted.zeros, STEP_ROWS)
    steps = steps.float().repeat_interleave(STEP_ROWS, dim=0)
    nearest_s = torch.round(fitted.scales / steps[:, :1]).clamp(1, 255)
    nearest_z = torch.round(fitted.zeros / steps[:, 1:]).clamp(-127, 127)

    def group_error(c_s, c_z):
        s, z = c_s * steps[:, :1], c_z * steps[:, 1:]
        q = (torch.round((w - z[..., None]) / s[..., None]) + 8).clamp(0, 15)
        return (((q - 8) * s[..., None] + z[..., None] - w) ** 2).sum(-1)

    chosen = group_error(codes.float(), zero_codes.float())
    assert (chosen <= group_error(nearest_s, nearest_z)).all()
    assert (codes.float() - nearest_s).abs().max() <= 1
    assert (codes.float() != nearest_s).any()  # the search moved some


def test_the_default_is_coded_at_groups_of_32_and_costs_4_5_bits_a_weight():
    model = quantize_model(tiny(), "int4")
    config = model.quantization
    assert (config.group_size, config.scale_dtype, config.fit) == (32, "int8", "search")
    layers = int4_layers(model)
    assert layers and all(m.weight_format.coded for m in layers)
    assert "coded scales" in repr(layers[0])
    f16 = quantize_model(tiny(), "int4", scale_dtype="float16")
    # per group: 2 bytes (two codes) against 4 (two float16); per 16 rows: 4 bytes of steps
    groups = sum(m.scales.numel() for m in layers)
    blocks = sum(-(-m.out_features // STEP_ROWS) for m in layers)
    assert weight_bytes(f16) - weight_bytes(model) == 2 * groups - 4 * blocks
    codes = sum(m.qweight.numel() + m.scales.numel() + m.zeros.numel() for m in layers)
    assert codes * 8 == 4.5 * sum(m.in_features * m.out_features for m in layers)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_saved_coded_folder_loads_back_to_the_same_outputs(tmp_path, dtype):
    model = quantize_model(tiny(), "int4")
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, kernels=False, dtype=dtype)
    assert loaded.quantization == model.quantization
    for ours, theirs in zip(int4_layers(loaded), int4_layers(model), strict=True):
        assert ours.steps.dtype == torch.bfloat16 and torch.equal(ours.steps, theirs.steps)
        assert torch.equal(ours.scales, theirs.scales) and torch.equal(ours.zeros, theirs.zeros)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        if dtype is None:
            torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
            fast = from_pretrained(tmp_path)(ids)
            torch.testing.assert_close(fast, model(ids), rtol=1e-5, atol=1e-5)
        else:
            reference = model.to(torch.bfloat16)(ids).float()
            torch.testing.assert_close(loaded(ids).float(), reference, rtol=0, atol=0)
    # .to() moves and casts the activations' dtype, never the steps
    cast = int4_layers(model.to(torch.float16))[0]
    assert cast.steps.dtype == torch.bfloat16 and cast.dtype == torch.float16


def test_gptq_keeps_float16_scales_and_refuses_coded_ones():
    assert QuantizationConfig("int4", 32, fit="gptq").scale_dtype == "float16"
    with pytest.raises(ValueError, match="scale_dtype: GPTQ writes float scales"):
        QuantizationConfig("int4", 32, fit="gptq", scale_dtype="int8")
    with pytest.raises(ValueError, match=r"scale_dtype: int8 \(coded scales\) is int4's"):
        QuantizedLinear(64, 32, bits=8, scale_dtype=torch.int8)


def test_last_in_an_int8_pattern_names_the_models_last_layer():
    model = tiny(layers=4)
    assert last_layer(model) == 3
    quantize_model(model, "int4", int8_layers=["layers.{last}.mlp.down_proj"])
    bits = {i: model.get_submodule(f"layers.{i}.mlp.down_proj").bits for i in range(4)}
    assert bits == {0: 4, 1: 4, 2: 4, 3: 8}
    assert model.quantization.int8_layers == ("layers.{last}.mlp.down_proj",)
    config = QuantizationConfig("int4", 32)
    assert "layers.{last}.mlp.down_proj" in config.int8_layers
    assert config.bits_of("layers.7.mlp.down_proj", table=False, last=7) == 8
    assert config.bits_of("layers.7.mlp.down_proj", table=False, last=8) == 4
    assert config.bits_of("layers.7.mlp.down_proj", table=False) == 4  # no last: no match
    assert last_layer(torch.nn.Linear(2, 2)) is None
