"""InferenceLinear: the calibrated kernel when no gradient is needed, the formula otherwise;
one copy of the weight unless asked; a prepared copy is never stale; optimize_for_inference
swaps every nn.Linear and keeps tied weights tied."""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_helpers import (
    own_cache_fixture,  # noqa: F401 (an autouse fixture)
    planted,
    thread_count,
)
from torch import nn

from attnlab.kernels import KERNELS, InferenceLinear, calibration, optimize_for_inference
from attnlab.kernels.calibration import weight_like

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 2e-2)}
ROWS_OF_EACH_BUCKET = (1, 3, 20, 70)


def runnable(name: str, dtype: torch.dtype = torch.float32, rows: int = 1) -> bool:
    return KERNELS[name].available(weight_like(dtype, 32, 8), dtype, rows)


def reference(seed: int = 0, dtype: torch.dtype = torch.float32, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(24, 32, bias=bias).to(dtype)


@pytest.mark.parametrize("kernel", [None, *KERNELS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_equals_nn_linear_for_every_row_count(kernel, dtype, bias):
    """None: the calibrated kernels; a name: that kernel forced (the formula where it
    cannot run), for every rows bucket, 2-D and 3-D inputs."""
    with thread_count(2):
        expected_module = reference(dtype=dtype, bias=bias)
        module = InferenceLinear.from_linear(copy.deepcopy(expected_module), kernel=kernel)
        for rows in ROWS_OF_EACH_BUCKET:
            x = torch.randn(rows, 24).to(dtype)
            with torch.inference_mode():
                expected = expected_module(x)
                for inputs in (x, x.view(1, rows, 24), x.t().contiguous().t()):
                    actual = module(inputs)
                    assert actual.shape == (*inputs.shape[:-1], 32)
                    torch.testing.assert_close(actual.reshape(rows, 32), expected,
                                               rtol=TOLERANCE[dtype][0],
                                               atol=TOLERANCE[dtype][1])


def test_it_is_an_nn_linear_with_the_same_parameters_hooks_and_state_dict():
    linear = reference()
    calls = []
    linear.register_forward_hook(lambda m, args, out: calls.append(out.shape))
    module = InferenceLinear.from_linear(linear, kernel="columns")
    assert isinstance(module, nn.Linear)
    assert module.weight is linear.weight and module.bias is linear.bias
    assert module.weight.requires_grad and module.weight.shape == (32, 24)
    assert list(module.state_dict()) == ["weight", "bias"]
    with torch.no_grad():
        module(torch.randn(2, 24))
    assert calls == [torch.Size([2, 32])]
    assert "kernels=(float32" in repr(module)


def test_a_hook_handle_from_before_the_swap_still_removes_its_hook():
    model, calls = nn.Sequential(reference()), []
    handle = model[0].register_forward_hook(lambda m, args, out: calls.append(type(m).__name__))
    optimize_for_inference(model, kernel="columns")
    with torch.no_grad():
        model(torch.randn(2, 24))
        handle.remove()
        model(torch.randn(2, 24))
    assert calls == ["InferenceLinear"]


def test_gradients_equal_nn_linear_s_with_a_column_major_weight():
    expected_module = reference()
    module = InferenceLinear.from_linear(copy.deepcopy(expected_module), kernel="rows_gemv")
    assert module.weight.t().is_contiguous()  # re-stored for the kernel, still a Parameter
    x = torch.randn(3, 24, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    module(x).square().sum().backward()
    expected_module(x2).square().sum().backward()
    for actual, expected in ((x.grad, x2.grad), (module.weight.grad, expected_module.weight.grad),
                             (module.bias.grad, expected_module.bias.grad)):
        torch.testing.assert_close(actual, expected)


def test_a_loaded_model_trains_after_an_inference_mode_forward():
    """The first forward re-stores the weight inside inference mode; it must stay a normal
    tensor that autograd can save."""
    module = InferenceLinear.from_linear(reference(), kernel="formula")
    module._kernels.clear()
    module._kernel = "columns"
    with torch.inference_mode():
        module(torch.randn(1, 24))
    assert module.weight.t().is_contiguous() and not module.weight.is_inference()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module(torch.randn(4, 24)).sum().backward()
    optimizer.step()


@pytest.mark.parametrize("kernel", ["onednn_packed", "columns", "rows_gemv", "formula"])
@pytest.mark.parametrize("update", ["optimizer step", "in-place under no_grad",
                                    "load_state_dict", "replace the data",
                                    "replace the Parameter", "to bfloat16 and back"])
def test_a_weight_update_is_never_served_from_a_stale_prepared_copy(kernel, update):
    if not runnable(kernel):
        pytest.skip(f"{kernel} cannot run here")
    module = InferenceLinear.from_linear(reference(), kernel=kernel)
    x = torch.randn(1, 24)
    with torch.no_grad():
        module(x)  # prepares the kernel's copy or layout
    new = reference(seed=1)
    if update == "optimizer step":
        optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
        module(x).sum().backward()
        optimizer.step()
        expected = nn.functional.linear(x, module.weight.detach(), module.bias.detach())
    else:
        with torch.no_grad():
            if update == "in-place under no_grad":
                module.weight.copy_(new.weight)
                module.bias.copy_(new.bias)
            elif update == "load_state_dict":
                module.load_state_dict(new.state_dict())
            elif update == "replace the data":
                module.weight.data = new.weight.detach().clone()
                module.bias.data = new.bias.detach().clone()
            elif update == "replace the Parameter":
                module.weight, module.bias = new.weight, new.bias
            else:
                module.to(torch.bfloat16)
                module(x.to(torch.bfloat16))
                module.to(torch.float32)
                module.load_state_dict(new.state_dict())
        expected = new(x)
    with torch.no_grad():
        torch.testing.assert_close(module(x), expected)


def test_the_packed_copy_is_kept_only_with_extra_memory_and_survives_copies():
    with torch.no_grad():
        plain = InferenceLinear.from_linear(reference(), kernel="formula")
        plain(torch.randn(1, 24))
        assert plain._packed is None
        if not runnable("onednn_packed"):
            pytest.skip("oneDNN's packed weight is not available here")
        packed = InferenceLinear.from_linear(reference(), kernel="onednn_packed")
        packed(torch.randn(1, 24))
        assert packed._packed is not None
        twin = copy.deepcopy(packed)  # the opaque copy cannot be deep-copied: re-made later
        torch.testing.assert_close(twin(torch.ones(2, 24)), packed(torch.ones(2, 24)))


def test_without_extra_memory_a_calibrated_plan_never_keeps_a_second_copy(monkeypatch):
    fast = dict.fromkeys(KERNELS, 10.0) | {"onednn_packed": 1.0}
    monkeypatch.setattr(calibration, "cached", planted(fast))
    module = InferenceLinear.from_linear(reference())
    with torch.no_grad():
        module(torch.randn(1, 24))
    assert module._packed is None
    assert all(k.layout != "packed" for k in next(iter(module._kernels.values())).values())


def test_the_formula_runs_off_the_cpu_fast_paths():
    """Other dtypes, a grad-requiring input, an empty batch: the formula, same results."""
    module = InferenceLinear.from_linear(reference(), kernel="rows_gemv")
    expected_module = reference()
    with torch.no_grad():
        empty = module(torch.randn(0, 24))
    assert empty.shape == (0, 32)
    x = torch.randn(2, 24, requires_grad=True)
    torch.testing.assert_close(module(x), expected_module(x))
    for kernel in ("rows_gemv", None):
        double = InferenceLinear.from_linear(reference().double(), kernel=kernel)
        with torch.no_grad():
            torch.testing.assert_close(double(x.double()), expected_module.double()(x.double()))


@pytest.mark.parametrize("x", [torch.randn(2, 23), torch.tensor(1.0)])
def test_a_wrong_input_is_refused_as_the_formula_refuses_it(x):
    module = InferenceLinear.from_linear(reference(), kernel="columns")
    with torch.no_grad(), pytest.raises(ValueError, match="weight: expected shape O x"):
        module(x)


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(TypeError, match=r"module: expected a torch\.nn\.Linear, got Conv1d"):
        InferenceLinear.from_linear(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match=r"kernel: expected one of .* got 'turbo'"):
        InferenceLinear.from_linear(reference(), kernel="turbo")
    with pytest.raises(TypeError, match="extra_memory, keep_layout: expected bools"):
        InferenceLinear.from_linear(reference(), extra_memory="yes")
    with pytest.raises(TypeError, match=r"model: expected a torch\.nn\.Module, got dict"):
        optimize_for_inference({})
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="kernel: expected one of"):
        optimize_for_inference(model, kernel="turbo")
    with pytest.raises(TypeError, match="extra_memory: expected a bool, got 1"):
        optimize_for_inference(model, extra_memory=1)
    assert type(model[0]) is nn.Linear  # nothing swapped before the error


class TiedLM(nn.Module):
    """An embedding and an lm_head sharing one weight, a block in between, a subclass of
    nn.Linear whose forward optimize_for_inference does not know."""

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 24)
        self.block = nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 24))
        self.scaled = self.Scaled(24, 24)
        self.lm_head = nn.Linear(24, 50, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(self.scaled(self.block(self.embed(ids))))


@pytest.mark.parametrize("kernel", [None, "columns"])
def test_optimize_for_inference_swaps_linears_and_keeps_tied_weights_tied(kernel, monkeypatch):
    """Calibrated with column-major kernels measured fastest: every weight takes that layout,
    the one tied to the embedding too (a lookup reads rows in any layout). Forced: the
    forced kernel everywhere, still tied."""
    fast = dict.fromkeys(KERNELS, 10.0) | {"columns": 1.0}
    monkeypatch.setattr(calibration, "cached", planted(fast))
    torch.manual_seed(0)
    expected_model = TiedLM()
    model = copy.deepcopy(expected_model)
    keys = list(model.state_dict())
    assert optimize_for_inference(model, kernel=kernel) is model
    assert type(model.lm_head) is InferenceLinear and type(model.block[0]) is InferenceLinear
    assert type(model.scaled) is TiedLM.Scaled
    assert model.lm_head.weight is model.embed.weight
    assert list(model.state_dict()) == keys
    assert model.block[0].weight.t().is_contiguous()
    if kernel is None:  # calibrated: the embedding reads the kernel's layout
        assert model.embed.weight.t().is_contiguous()
    ids = torch.tensor([[1, 7, 3, 49]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), expected_model(ids))
    with torch.no_grad():  # still tied: a change to one is a change to the other
        model.embed.weight[7].fill_(1.0)
        expected_model.embed.weight[7].fill_(1.0)
        torch.testing.assert_close(model(ids), expected_model(ids))


def test_optimize_for_inference_swaps_a_shared_module_once_and_a_bare_linear():
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    optimize_for_inference(model, kernel="formula")
    assert model[0] is model[2] and type(model[0]) is InferenceLinear
    bare = optimize_for_inference(nn.Linear(8, 8), kernel="formula")
    assert type(bare) is InferenceLinear


@pytest.mark.parametrize("kernel", [None, "columns", "onednn_packed"])
def test_a_module_made_under_inference_mode_runs_in_and_out_of_it(kernel):
    """Its weight is an inference tensor: no version counter, no views outside inference
    mode. It still gives nn.Linear's results (re-stored as an inference tensor)."""
    if kernel is not None and not runnable(kernel):
        pytest.skip(f"{kernel} cannot run here")
    with torch.inference_mode():
        expected_module = reference()
    module = InferenceLinear.from_linear(expected_module, kernel=kernel)
    x = torch.randn(3, 24)
    expected = expected_module(x)
    with torch.inference_mode():
        torch.testing.assert_close(module(x), expected)
    with torch.no_grad():
        torch.testing.assert_close(module(x), expected)
    torch.testing.assert_close(module(x), expected)
