"""int4's scales and zeros stored as float16 (GPTQ's default; coded scales, the default
otherwise, are test_coded_scales.py's, but for the kernels, tested on both here): what the
search optimised is
what is stored, the kernels compute the float32 formula from the float16 values, and a saved
folder loads back with its scales still float16 and the same outputs; a record from before
the setting reads as it was written."""

from __future__ import annotations

import pytest
import torch

from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.io import from_pretrained
from attnlab.quantization import QUANTIZED_KERNELS, QuantizedLinear, quantize_model
from attnlab.quantization.convert import DEFAULT_INT8_LAYERS, QuantizationConfig, weight_bytes
from attnlab.quantization.formats import quantize
from conftest import native_lacks


def tiny() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(64, d_model=64, num_layers=2, num_heads=4, d_ff=128,
                                   max_len=128, tie_embeddings=True)
    return DecoderLM(config).eval()


def int4_layers(model: torch.nn.Module) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.bits == 4]


def test_int4_scales_and_zeros_are_float16_and_the_tables_keep_their_dtype():
    model = quantize_model(tiny(), "int4", 32, scale_dtype="float16")
    assert model.quantization.scale_dtype == "float16"
    assert len(int4_layers(model)) == 2 * 7 - 4  # DEFAULT_INT8_LAYERS: v_proj, down_proj
    assert all(m.scales.dtype == m.zeros.dtype == torch.float16 and m.dtype == torch.float32
               for m in int4_layers(model))
    assert model.lm_head.bits == 8 and model.lm_head.scales.dtype == torch.float32
    wide = quantize_model(tiny(), "int4", 32, scale_dtype="float32")
    # 2 bytes less per scale and per zero, one of each per group of 32 inputs
    groups = sum(m.scales.numel() for m in int4_layers(model))
    assert weight_bytes(wide) - weight_bytes(model) == 4 * groups


def test_the_searched_float16_scales_are_what_is_stored_and_never_worse_than_nearest():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g)
    weight[::7, 3] *= 12  # outliers, where the search moves the step
    errors = {}
    for fit in ("nearest", "search"):
        q = quantize(weight, 4, 64, torch.float16, fit=fit)
        assert q.scales.dtype == q.zeros.dtype == torch.float16
        rebuilt = q.dequantize(torch.float32)
        # the float32 formula on the float16 values as stored
        by_hand = ((q.codes().float() - 8).view(64, 4, 64) * q.scales.float()[..., None]
                   + q.zeros.float()[..., None]).view(64, 256)
        torch.testing.assert_close(rebuilt, by_hand, rtol=0, atol=0)
        errors[fit] = ((rebuilt - weight) ** 2).view(64, 4, 64).sum(-1)
    assert (errors["search"] <= errors["nearest"]).all()
    assert errors["search"].sum() < 0.9 * errors["nearest"].sum()


def _stored_scale_cases() -> list:
    """(kernel, activations' dtype, stored scales' dtype) for every int4 kernel that takes
    float16 scales, or coded ones (``torch.int8``: test_coded_scales.py's format)."""
    cases = []
    for kernel in ("int4_native", "native_dequantize", "native_widened", "int4_mm",
                   "int4_native_pairs", "int4_integers", "dequantize"):
        for dtype in (torch.float32, torch.bfloat16):
            for stored in (torch.float16, torch.int8):
                weight = quantize(torch.randn(128, 256), 4, 64, stored)
                if QUANTIZED_KERNELS[kernel].takes(weight.with_layout("blocked"), dtype):
                    cases.append((kernel, dtype, stored))
    return cases or [pytest.param("int4_native", torch.float32, torch.float16,
                                  marks=pytest.mark.skip(reason=native_lacks(None) or
                                                         "no int4 kernel takes these scales"))]


@pytest.mark.parametrize(("kernel", "dtype", "stored"), _stored_scale_cases(), ids=str)
def test_each_int4_kernel_computes_the_formula_from_stored_scales(kernel, dtype, stored):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 128).to(dtype)
    module = QuantizedLinear.from_linear(linear, bits=4, group_size=64, kernel=kernel,
                                         scale_dtype=stored)
    kept = (torch.uint8, torch.bfloat16) if stored == torch.int8 else (stored, None)
    assert module.dtype == dtype and module.weight_format.coded == (stored == torch.int8)
    assert {k.name for k in module.plan(dtype).values()} <= {kernel, "dequantize"}
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        y = module(x)
        one = module(x[:1])
    expected = torch.nn.functional.linear(x.double(), module.dequantize(torch.float64),
                                          module.bias.double())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol * 10)
    torch.testing.assert_close(one.double(), expected[:1], rtol=tol, atol=tol * 10)
    # prepared copies only: what is stored stays as it was
    steps = None if module.steps is None else module.steps.dtype
    assert y.dtype == dtype and (module.scales.dtype, steps) == kept


@pytest.mark.parametrize("kernels", [False, True])
def test_a_saved_folder_loads_with_float16_scales_and_the_same_outputs(tmp_path, kernels):
    model = quantize_model(tiny(), "int4", 32, scale_dtype="float16")
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, kernels=kernels)
    assert loaded.quantization == model.quantization
    assert all(m.scales.dtype == m.zeros.dtype == torch.float16 and m.dtype == torch.float32
               for m in int4_layers(loaded))
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=1e-5, atol=1e-5)
        exact = from_pretrained(tmp_path, kernels=False)(ids)
    torch.testing.assert_close(exact, model(ids), rtol=0, atol=0)


def test_a_bfloat16_load_keeps_the_float16_scales(tmp_path):
    model = quantize_model(tiny(), "int4", 32, scale_dtype="float16")
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, kernels=False, dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert all(m.scales.dtype == torch.float16 and m.dtype == torch.bfloat16
               for m in int4_layers(loaded))
    first = int4_layers(model)[0]
    torch.testing.assert_close(int4_layers(loaded)[0].scales, first.scales, rtol=0, atol=0)


def test_a_record_from_before_the_setting_reads_scales_in_the_weights_dtype():
    old = QuantizationConfig.from_dict({"method": "int4", "group_size": 64, "skip": [],
                                        "table_bits": 8, "fit": "search"})
    assert old.scale_dtype == "weight"
    weight = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert old.scales_for(weight, table=False) == torch.bfloat16
    new = QuantizationConfig("int4", 64, scale_dtype="float16")
    assert new.scales_for(weight, table=False) == torch.float16
    assert QuantizationConfig("int4", 64).scales_for(weight, table=False) == torch.int8
    assert new.scales_for(weight, table=True) == torch.bfloat16
    assert QuantizationConfig.from_dict(new.to_dict()) == new
    assert "scale_dtype" not in QuantizationConfig("int8").to_dict()


def test_an_unknown_scale_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="scale_dtype: expected one of int8, float16"):
        QuantizationConfig("int4", 64, scale_dtype="float8")
    with pytest.raises(ValueError, match="scale_dtype: expected one of None for int8"):
        QuantizationConfig("int8", scale_dtype="float16")


def test_the_default_int8_layers_are_int8_with_their_weights_dtype_and_can_be_none(tmp_path):
    model = quantize_model(tiny(), "int4", 32)
    # the defaults, and one outlier down_proj (of the one layer that is not the last)
    assert model.quantization.int8_layers == (*DEFAULT_INT8_LAYERS, "layers.0.mlp.down_proj")
    for name in ("layers.0.self_attn.v_proj", "layers.1.mlp.down_proj"):
        layer = model.get_submodule(name)
        assert layer.bits == 8 and layer.scales.dtype == torch.float32
    model.save_pretrained(tmp_path / "mixed")
    loaded = from_pretrained(tmp_path / "mixed", kernels=False)
    assert loaded.get_submodule("layers.0.self_attn.v_proj").bits == 8
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    every = quantize_model(tiny(), "int4", 32, int8_layers=[])
    assert len(int4_layers(every)) == 2 * 7 and "int8_layers" not in every.quantization.to_dict()
    with pytest.raises(ValueError, match="int8_layers: int8 quantizes every layer"):
        QuantizationConfig("int8", int8_layers=["*.v_proj"])
