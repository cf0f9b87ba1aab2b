"""``InferenceLinear``: an ``nn.Linear`` that runs the chosen kernel (the rule's, or a plan
that ``attnlab calibrate`` measured; :mod:`attnlab.kernels.calibration`) when no gradient is
needed, and ``swap_linears``, which swaps one in for every ``nn.Linear`` of a model.

Memory: the weight is kept once. A kernel that wants the column-major layout gets it by
re-storing the weight Parameter itself (same object, shape ``O x I`` and values; only its
strides change), so ties, ``state_dict`` names and optimizers keep working. Only with
``extra_memory=True`` may a module keep a second copy, oneDNN's packed weight, and then only
where the rule or the measured plan names it. A copy is re-made when the weight changed in place
(optimizer step, ``load_state_dict``) or was replaced, as PyTorch's version counter and data
pointer show; an update through ``weight.data`` bypasses the version counter and cannot be
seen, so use ``with torch.no_grad(): weight.copy_(...)`` as optimizers do.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from attnlab.formulas import linear
from attnlab.hook_point import share_hooks
from attnlab.kernels import native
from attnlab.kernels.calibration import forced_kernel, plan
from attnlab.kernels.catalog import KERNELS, Kernel, to_layout
from attnlab.kernels.fused_layers import invalidate_plans
from attnlab.kernels.rule import ROW_BUCKETS

__all__ = ["InferenceLinear", "swap_linears"]


def swap_linears(model: nn.Module, *, kernel: str | None = None,
                 extra_memory: bool = False) -> nn.Module:
    """``model`` with every ``nn.Linear`` (exactly that class, not a subclass whose forward
    it does not know) replaced by an :class:`InferenceLinear` that shares its Parameters and
    hooks (``optimize_for_inference`` calls it); returned for chaining (``model`` itself is
    changed, or, when it is an ``nn.Linear``, the new module is returned). A weight that
    another module also uses keeps its row-major storage, which the other module reads too,
    except where that module is an ``nn.Embedding`` (a tied ``lm_head``): a lookup reads its
    rows in any layout.
    ``kernel`` forces one kernel; ``extra_memory`` allows oneDNN's packed copies where they
    win (up to twice the weights' memory). The kernels are chosen here, by the rule or a
    measured plan; nothing is timed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    # Wrong arguments fail before any module is changed.
    forced_kernel(kernel)
    if not isinstance(extra_memory, bool):
        raise TypeError(f"extra_memory: expected a bool, got {extra_memory!r}")
    if type(model) is nn.Linear:
        return InferenceLinear.from_linear(model, kernel=kernel, extra_memory=extra_memory)
    uses: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):  # a lookup reads rows in any layout: a tied
            continue  # head may still be re-stored for its kernel
        for parameter in module._parameters.values():
            if parameter is not None:
                uses[id(parameter)] = uses.get(id(parameter), 0) + 1
    swapped: dict[int, InferenceLinear] = {}
    for parent in list(model.modules()):
        for name, child in parent._modules.items():
            if type(child) is not nn.Linear:
                continue
            if id(child) not in swapped:
                swapped[id(child)] = InferenceLinear.from_linear(
                    child, kernel=kernel, extra_memory=extra_memory,
                    keep_layout=uses[id(child.weight)] > 1)
            parent._modules[name] = swapped[id(child)]
    invalidate_plans()  # a layer list's step plan may hold the modules swapped out
    return model


class InferenceLinear(nn.Linear):
    """``y = x W^T + b`` (x ``N.. x I``, weight ``O x I``, bias ``O`` -> ``N.. x O``), as
    ``nn.Linear``, whose forward, on a CPU with no gradient needed (``torch.no_grad``,
    ``torch.inference_mode`` or nothing requiring grad), runs the kernel chosen for the
    weight's dtype, shape and the call's row count (the rule's, or the plan that ``attnlab
    calibrate`` measured on this machine);
    otherwise the formula, so the module stays trainable. See the module docstring for the
    memory it keeps."""

    @classmethod
    def from_linear(cls, module: nn.Linear, *, kernel: str | None = None,
                    extra_memory: bool = False, keep_layout: bool = False) -> InferenceLinear:
        """An ``InferenceLinear`` sharing ``module``'s Parameters and hooks, its kernels
        chosen now for its weight's dtype. ``kernel`` forces one kernel; ``extra_memory`` allows a
        packed copy where it wins; ``keep_layout`` keeps the weight row-major (it is shared
        with a module that reads it so)."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"module: expected a torch.nn.Linear, got {type(module).__name__}")
        if parametrize.is_parametrized(module):
            raise TypeError("module: expected an nn.Linear without parametrizations (register "
                            "them on the InferenceLinear instead), got one with "
                            f"{sorted(module.parametrizations)}")
        if not isinstance(extra_memory, bool) or not isinstance(keep_layout, bool):
            raise TypeError(f"extra_memory, keep_layout: expected bools, got {extra_memory!r}, "
                            f"{keep_layout!r}")
        forced_kernel(kernel)
        new = cls.__new__(cls)
        # Dicts copied (not shared), so the two modules can diverge, with the same
        # Parameters, buffers and submodules; but the hooks' dicts are shared: a handle from
        # before the swap must still remove its hook.
        new.__dict__.update({k: v.copy() if isinstance(v, dict) else v
                             for k, v in module.__dict__.items()})
        share_hooks(module, new)
        new._kernel, new._extra_memory, new._keep_layout = kernel, extra_memory, keep_layout
        new._kernels = {}
        new._packed, new._packed_of = None, None
        if new.weight.device.type == "cpu":
            new._choose()
        return new

    def forward(self, x: Tensor) -> Tensor:
        """x ``N.. x I`` -> ``N.. x O``: the chosen kernel for ``N..``'s row count, or
        the formula (see the class docstring)."""
        # _parameters directly: nn.Module's __getattr__ costs ~0.6 us per name, per call.
        weight, bias = self._parameters.get("weight"), self._parameters.get("bias", _ABSENT)
        if weight is None or bias is _ABSENT:
            # Parametrized (torch.nn.utils.parametrize): the weight is computed per call, so
            # there is no stored tensor to lay out for a kernel.
            return linear(x, self.weight, self.bias)
        if (x.dtype != weight.dtype or x.dim() == 0 or x.shape[-1] != self.in_features
                or x.numel() == 0 or not (x.is_cpu and weight.is_cpu)
                or (bias is not None and bias.dtype != weight.dtype)
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                 or (bias is not None and bias.requires_grad)))):
            return linear(x, weight, bias)  # the formula: gradients, and its error messages
        if weight.is_inference() and not torch.is_inference_mode_enabled():
            # A weight made under inference mode cannot even be viewed outside it (no
            # version counter), which the kernels and our formula do; torch's linear can.
            return torch.nn.functional.linear(x, weight, bias)
        kernel = self._kernel_for(x.numel() // self.in_features, weight.dtype)
        if kernel is _FORMULA:
            # The same formula in one C++ call (addmm), without this file's reshapes; it
            # takes the weight in any layout, so no re-storing.
            return torch.nn.functional.linear(x, weight, bias)
        stored = self._stored(kernel, weight)
        flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
        y = kernel.run(flat, stored, bias)
        return y if flat is x else y.view(*x.shape[:-1], self.out_features)

    def native_spec(self, rows: int, dtype: torch.dtype) -> object | None:
        """What ``forward`` runs for ``rows`` rows of ``dtype`` on the CPU with no gradient, as
        a product of ``attnlab.kernels.native.step_plan`` (``native.step_linear``: the planned
        kernel on the weight as that kernel reads it, a kernel that runs the formula as the
        step's ``formula``); None when ``forward`` would not run the plan (another dtype, an
        inference weight outside inference mode) or runs a kernel that the step does not (it
        has no ``StepKind`` of that name: then the modules run)."""
        weight, bias = self._parameters.get("weight"), self._parameters.get("bias", _ABSENT)
        if (weight is None or bias is _ABSENT or dtype != weight.dtype or not weight.is_cpu
                or (bias is not None and bias.dtype != dtype)
                or (weight.is_inference() and not torch.is_inference_mode_enabled())):
            return None
        kernel = self._kernel_for(rows, dtype)
        kind = native.step_kind("formula" if kernel.run is _FORMULA.run else kernel.name)
        if kind is None:
            return None
        # As forward: the formula on the weight in any layout, another kernel on its storage.
        stored = weight if kernel is _FORMULA else self._stored(kernel, weight)
        return native.step_linear(kind, stored, None, None, 0, bias)

    def extra_repr(self) -> str:
        plans = ", ".join(f"{str(dtype).removeprefix('torch.')}, {threads} threads: "
                          + " ".join(f"{b}={k.name}" for b, k in kernels.items())
                          for (dtype, threads), kernels in self._kernels.items())
        return super().extra_repr() + (f", kernels=({plans})" if plans else "")

    def __getstate__(self) -> dict:
        # oneDNN's opaque tensor cannot be copied or pickled; it is re-made on first use.
        return {**self.__dict__, "_packed": None, "_packed_of": None}

    def _choose(self) -> dict[str, Kernel]:
        """This weight's kernel per rows bucket, for its dtype and the thread count now
        (:func:`~attnlab.kernels.calibration.plan`: a measured plan or the rule), with the
        weight re-stored to the layout they run on."""
        weight = self.weight
        layouts = ("rows",) if self._keep_layout else ("rows", "columns")
        layout, picks = plan(weight.dtype, self.out_features, self.in_features, layouts=layouts,
                             extra_memory=self._extra_memory and not weight.is_inference(),
                             kernel=self._kernel, bias=self.bias is not None)
        if not _has_layout(weight, layout):
            self._restore(layout)
        kernels = {bucket: KERNELS[name] for bucket, name in picks.items()}
        self._kernels[weight.dtype, torch.get_num_threads()] = kernels
        return kernels

    def _kernel_for(self, rows: int, dtype: torch.dtype) -> Kernel:
        """The planned kernel for ``rows`` rows of ``dtype`` (chosen on first need). Each
        bucket's kernel runs every row count of the bucket: the plan checked that."""
        kernels = self._kernels.get((dtype, torch.get_num_threads())) or self._choose()
        return kernels[ROW_BUCKETS[min(rows, len(ROW_BUCKETS)) - 1]]

    def _stored(self, kernel: Kernel, weight: Tensor) -> Tensor:
        """``weight`` as ``kernel`` reads it: its packed copy, or itself, re-stored in the
        kernel's layout when it is not in it."""
        if kernel.layout == "packed":
            return self._packed_weight(weight)
        return weight if _has_layout(weight, kernel.layout) else self._restore(kernel.layout)

    def _restore(self, layout: str) -> Tensor:
        """The weight Parameter re-stored in ``layout`` (same object and values); done outside
        inference mode (unless the weight was made in it) so that the module stays
        trainable."""
        weight = self.weight
        # An inference tensor (made under inference mode) can only be re-stored as one.
        with torch.inference_mode(weight.is_inference()), torch.no_grad():
            weight.data = to_layout(weight.detach(), layout)
        return self.weight

    def _packed_weight(self, weight: Tensor) -> Tensor:
        """oneDNN's packed copy of ``weight``, re-made when the weight was replaced or changed
        in place since it was made (an inference tensor has no version counter: then every
        call re-makes it)."""
        version = None if weight.is_inference() else weight._version
        state = (id(weight), weight.data_ptr(), version, weight.dtype, weight.shape)
        if self._packed is None or version is None or state != self._packed_of:
            with torch.no_grad():
                self._packed = to_layout(weight.detach(), "packed")
            self._packed_of = state
        return self._packed


_FORMULA = KERNELS["formula"]
_ABSENT = object()  # a name missing from _parameters: moved out by a parametrization


def _has_layout(weight: Tensor, layout: str) -> bool:
    """Whether ``weight`` (``O x I``) is stored as ``layout`` (``rows`` or ``columns``). By
    strides, not ``weight.t()``: an inference tensor cannot be viewed outside inference mode."""
    if layout == "rows":
        return weight.is_contiguous()
    (outs, ins), (step_out, step_in) = weight.shape, weight.stride()
    return (outs <= 1 or step_out == 1) and (ins <= 1 or step_in == outs)


def to_linear(module: InferenceLinear) -> None:
    """``module`` back to an ``nn.Linear`` in place: its weight row-major again, its plans
    and packed copy dropped (``restore_reference`` calls it)."""
    if "weight" in module._parameters and not module.weight.is_contiguous():
        module._restore("rows")
    for name in ("_kernel", "_extra_memory", "_keep_layout", "_kernels", "_packed",
                 "_packed_of"):
        module.__dict__.pop(name, None)
    module.__class__ = nn.Linear
