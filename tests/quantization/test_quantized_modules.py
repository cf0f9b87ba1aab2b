"""QuantizedLinear / QuantizedEmbedding and ``quantize_model``: equal to the float modules
holding the dequantized weights, gradients through the formula, state dicts in the plain
layout, one table for a tied head, and bad input refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab.quantization import (
    QuantizationConfig,
    QuantizedEmbedding,
    QuantizedLinear,
    quantize_model,
    weight_bytes,
)
from attnlab.quantization.convert import with_outliers
from attnlab.quantization.formats import pack_int4


class _Tiny(nn.Module):
    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(128, 64)
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 128, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.embed(ids))))


def _dequantized_copy(model: nn.Module, reference: nn.Module) -> nn.Module:
    """``reference`` with every weight that ``model`` quantized replaced by the dequantized one."""
    for name, module in model.named_modules():
        if name.endswith(".table"):  # an embedding's own table: done with the embedding
            continue
        if isinstance(module, QuantizedLinear):
            reference.get_submodule(name).weight = nn.Parameter(module.dequantize())
        elif isinstance(module, QuantizedEmbedding):
            reference.get_submodule(name).weight = nn.Parameter(module.source.dequantize())
    return reference


@pytest.mark.parametrize(("method", "group_size"), [("int8", None), ("int4", 32), ("int4", 64)])
def test_quantized_model_equals_the_float_model_with_dequantized_weights(
        method: str, group_size: int | None) -> None:
    model = quantize_model(_Tiny(), method, group_size)
    assert isinstance(model.embed, QuantizedEmbedding) and isinstance(model.head, QuantizedLinear)
    assert isinstance(model.norm, nn.LayerNorm)
    # recorded as asked, the outlier layers chosen (none: this model has no down_proj)
    assert model.quantization == with_outliers(QuantizationConfig(method, group_size), {})
    assert model.quantization.int8_outliers == 0
    reference = _dequantized_copy(model, _Tiny(tie=False))
    ids = torch.randint(0, 128, (3, 7))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)
    float_model = _Tiny()
    with torch.inference_mode():
        expected = float_model(ids)
        gap = (model(ids) - expected).norm() / expected.norm()
    assert 0 < gap < (0.03 if method == "int8" else 0.3), gap


@pytest.mark.parametrize("training", [False, True])
def test_quantized_modules_keep_the_mode_of_the_modules_they_replace(training: bool) -> None:
    model = quantize_model(_Tiny().train(training), "int4", 64)
    assert {m.training for m in model.modules()} == {training}


def test_forward_hooks_move_to_the_quantized_modules() -> None:
    model, seen = _Tiny(), []
    handles = [model.get_submodule(name).register_forward_hook(
        lambda m, args, out, name=name: seen.append((name, type(m).__name__, out.shape)))
        for name in ("embed", "body.0", "head")]
    quantize_model(model, "int8")
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]))
    assert seen == [("embed", "QuantizedEmbedding", (1, 2, 64)),
                    ("body.0", "QuantizedLinear", (1, 2, 128)),
                    ("head", "QuantizedLinear", (1, 2, 128))]
    for handle in handles:  # the handles from before the swap still remove them
        handle.remove()
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]))
    assert len(seen) == 3


def test_backward_hooks_move_to_the_quantized_modules() -> None:
    model, grads = _Tiny(), []
    model.body[2].register_full_backward_hook(
        lambda m, grad_in, grad_out: grads.append((type(m).__name__, grad_out[0].shape)))
    quantize_model(model, "int4", 64)
    x = torch.randn(3, 128, requires_grad=True)
    model.body[2](x).sum().backward()
    assert grads == [("QuantizedLinear", (3, 64))] and x.grad is not None


def test_tied_head_and_embedding_share_one_table() -> None:
    model = quantize_model(_Tiny(), "int4", 64)
    assert model.embed.source is model.head
    assert not list(model.embed.state_dict())  # saved once, under the head
    float_bytes = weight_bytes(_Tiny())
    # 128 x 64 table at half a byte plus scales, the two linears, the norm
    assert weight_bytes(model) < 0.25 * float_bytes
    untied = quantize_model(_Tiny(tie=False), "int4", 64)
    assert weight_bytes(untied) > weight_bytes(model)


def test_gradients_flow_to_the_input_and_the_bias() -> None:
    linear = nn.Linear(64, 32).double()
    q = QuantizedLinear.from_linear(linear, bits=4, group_size=32)
    x = torch.randn(5, 64, dtype=torch.float64, requires_grad=True)
    q(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    bias = q.bias.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2, q.dequantize(), bias).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(q.bias.grad, bias.grad)
    assert not q.qweight.requires_grad and not q.scales.requires_grad


def test_state_dict_is_plain_whatever_the_layout_kept() -> None:
    q = QuantizedLinear.from_linear(nn.Linear(64, 128), bits=4, group_size=32, kernel="int4_mm")
    if q.layout != "blocked":
        pytest.skip("the int4 kernel does not run on this torch build")
    state = q.state_dict()
    assert torch.equal(state["qweight"], pack_int4(q.weight_format.codes()))
    fresh = QuantizedLinear(64, 128, bits=4, group_size=32, kernel="int4_mm")
    fresh.load_state_dict(state)
    x = torch.randn(2, 64)
    with torch.inference_mode():
        torch.testing.assert_close(fresh(x), q(x))
        assert fresh.layout == "blocked"  # re-blocked at its first call
        torch.testing.assert_close(fresh(x), q(x))


def test_bfloat16_model_keeps_bfloat16_scales_and_activations() -> None:
    model = quantize_model(_Tiny().to(torch.bfloat16), "int4", 64)
    assert model.head.scales.dtype == torch.bfloat16
    with torch.inference_mode():
        assert model(torch.tensor([[1, 2]])).dtype == torch.bfloat16


@pytest.mark.parametrize("skipped", ["head", "embed"])
def test_skipping_one_reader_of_a_tied_table_keeps_it_float_for_both(skipped: str) -> None:
    reference = _Tiny(tie=True)
    model = quantize_model(_Tiny(tie=True), "int8", skip=[skipped])
    assert type(model.head) is nn.Linear and type(model.embed) is nn.Embedding
    assert model.embed.weight is model.head.weight
    assert isinstance(model.body[0], QuantizedLinear)
    ids = torch.arange(10)
    assert torch.equal(model.head(model.embed(ids)), reference.head(reference.embed(ids)))


def test_skip_patterns_keep_modules_float() -> None:
    model = quantize_model(_Tiny(tie=False), "int8", skip=["head", "body.*"])
    assert type(model.head) is nn.Linear and type(model.body[0]) is nn.Linear
    assert isinstance(model.embed, QuantizedEmbedding)
    assert model.quantization.skip == ("head", "body.*")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"method": "int3"}, ValueError, "quantize: expected one of int8, int4"),
    ({"method": "int4", "group_size": 48}, ValueError, "group_size: expected one of 32, 64"),
    ({"method": "int4", "group_size": 64.0}, ValueError, "group_size: expected one of"),
    ({"method": "int8", "group_size": 64}, ValueError, "group_size: int8 scales whole rows"),
    ({"method": "int8", "skip": "head"}, TypeError, "skip: expected a list"),
])
def test_bad_arguments_are_refused_by_name(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        quantize_model(_Tiny(), **kwargs)


def test_group_size_that_does_not_divide_a_layer_names_it() -> None:
    model = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 96))
    with pytest.raises(ValueError, match=r"32 does not divide 1's in_features 8.*skip=\['1'\]"):
        quantize_model(model, "int4", 32)
    assert type(model[0]) is nn.Linear  # nothing changed
    quantize_model(model, "int4", 32, skip=["1"])
    assert isinstance(model[0], QuantizedLinear) and type(model[1]) is nn.Linear


def test_non_finite_weights_and_requantizing_are_refused() -> None:
    model = _Tiny(tie=False)
    with torch.no_grad():
        model.body[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"body\.0: its weight is not all finite"):
        quantize_model(model, "int8")
    good = quantize_model(_Tiny(), "int8")
    with pytest.raises(ValueError, match="model: already quantized"):
        quantize_model(good, "int4")


def test_config_round_trips_and_refuses_bad_records() -> None:
    config = QuantizationConfig("int4", 128, ("lm_head",))
    assert QuantizationConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="quantization: expected the keys"):
        QuantizationConfig.from_dict({"method": "int4", "group_size": 64, "bits": 4})
    with pytest.raises(TypeError, match="quantization: expected an object"):
        QuantizationConfig.from_dict(["int4"])
