"""Where speed comes in: :func:`optimize_for_inference` swaps the fast inference modules in for
the reference ones, :func:`restore_reference` takes a model back.

The fast modules are :class:`~attnlab.kernels.InferenceLinear` for ``nn.Linear`` (a planned
kernel per weight shape and row count), those of :mod:`.fast_modules` for ``RMSNorm``,
``GatedMLP``, ``FeedForward`` and ``SelfAttention``, and
:class:`~attnlab.kernels.fused_layers.FusedLayers` for a decoder's layer list. Each is a
subclass of the module it replaces, with its arguments, Parameters and ``state_dict``; each
runs the reference's forward for training, gradients and hooks that need the reference's
intermediate values. A module is swapped only when its class is exactly the reference (a
subclass's forward is not known); for all but ``InferenceLinear`` only the instance's class
changes, so its Parameters, buffers, hooks and submodules stay the same objects, and
``print(model)`` names the fast classes.
"""

from __future__ import annotations

import sys

from torch import nn

from attnlab.generation.sampling import GreedyTokens
from attnlab.kernels import native
from attnlab.kernels.fast_modules import (
    FastFeedForward,
    FastGatedMLP,
    FastGreedyTokens,
    FastRMSNorm,
    FastSelfAttention,
)
from attnlab.kernels.fused_layers import FusedLayers, drop_plans, invalidate_plans
from attnlab.kernels.inference_linear import InferenceLinear, swap_linears, to_linear
from attnlab.layers import FeedForward, GatedMLP, RMSNorm
from attnlab.layers.self_attention import SelfAttention

__all__ = ["FAST", "install_modules", "optimize_for_inference", "restore_reference"]

FAST: dict[type[nn.Module], type[nn.Module]] = {
    RMSNorm: FastRMSNorm, GatedMLP: FastGatedMLP, FeedForward: FastFeedForward,
    SelfAttention: FastSelfAttention, GreedyTokens: FastGreedyTokens}
REFERENCE: dict[type[nn.Module], type[nn.Module]] = {fast: ref for ref, fast in FAST.items()}


def optimize_for_inference(model: nn.Module, *, kernel: str | None = None,
                           extra_memory: bool = False) -> nn.Module:
    """``model`` with its modules swapped for the fast inference modules (module docstring),
    in place, and returned (when ``model`` is itself an ``nn.Linear``, the new module is
    returned). ``kernel`` forces one kernel for every Linear; ``extra_memory`` allows
    oneDNN's packed copies of the weights where they win (up to twice the weights' memory).
    Without the native kernels built (``attnlab build``), the modules that need them stay
    the reference ones, and a line on stderr says so, once a process."""
    model = swap_linears(model, kernel=kernel, extra_memory=extra_memory)
    install_modules(model)
    return model


def restore_reference(model: nn.Module) -> nn.Module:
    """``model`` with every fast module of :func:`optimize_for_inference` back to the
    reference class it replaced (``InferenceLinear`` to ``nn.Linear``, its weight row-major
    again), in place; returned for chaining."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    invalidate_plans()
    for module in model.modules():
        if type(module) is InferenceLinear:
            to_linear(module)
        reference = REFERENCE.get(type(module))
        if reference is not None:
            if isinstance(module, FusedLayers):
                drop_plans(module)  # the reference list keeps no C++ objects
            module.__class__ = reference
    return model


_TOLD: list[bool] = []  # the stderr line of a missing build, said once a process


def install_modules(model: nn.Module) -> list[str]:
    """Swap every module of ``model`` but its Linears whose class is exactly a reference that
    a fast module stands in for (``RMSNorm``, ``GatedMLP``, ``FeedForward``,
    ``SelfAttention``, ``GreedyTokens``, a decoder's layer list) for that fast module, in
    place (``optimize_for_inference`` calls it after swapping the Linears). Returns the names
    of the fast classes that could not be installed because the C++ kernels are not available
    (empty when they are): the model then runs the reference modules, unchanged, and a line
    on stderr says so, once a process."""
    if not native.available():
        found = {FAST[type(m)].__name__ for m in model.modules() if type(m) in FAST}
        found |= {f"Fused{type(m).__name__}" for m in model.modules() if _is_layer_list(m)}
        if found and not _TOLD:
            _TOLD.append(True)
            print(f"attnlab: the native kernels are not available "
                  f"({native.unavailable_reason()}): {', '.join(sorted(found))} not "
                  "installed, the reference modules run", file=sys.stderr)
        return sorted(found)
    invalidate_plans()  # a layer list's step plans hold the modules' tensors and kernels
    for module in model.modules():
        if type(module) in FAST:
            module.__class__ = FAST[type(module)]
        elif _is_layer_list(module):
            module.__class__ = _fused_class(type(module))
    return []


def _is_layer_list(module: nn.Module) -> bool:
    """A decoder's layer list: a ``ModuleList`` subclass with its own ``forward`` over blocks
    of a declared ``block_type`` that asks ``one_call_step`` first
    (``attnlab.models.DecoderLayers``)."""
    kind = type(module)
    return (isinstance(module, nn.ModuleList) and kind not in REFERENCE
            and getattr(kind, "block_type", None) is not None
            and callable(getattr(kind, "one_call_step", None))
            and kind.forward is not nn.ModuleList.forward)


def _fused_class(reference: type[nn.Module]) -> type[nn.Module]:
    """``Fused<Name>``: :class:`FusedLayers` mixed into the layer list's class (made once)."""
    fast = _FUSED.get(reference)
    if fast is None:
        fast = _FUSED[reference] = type(f"Fused{reference.__name__}", (FusedLayers, reference),
                                        {"__module__": __name__,
                                         "__doc__": FusedLayers.__doc__})
        REFERENCE[fast] = reference
    return fast


_FUSED: dict[type[nn.Module], type[nn.Module]] = {}  # a layer list's class -> its fused class
