"""A decoding step through every block of a ``DecoderLM`` in one native call:
:class:`FusedLayers`, the fast module for a decoder's layer list.

A one-token step runs ~7 matrix-vector products per block, which read the weights, and
~100 Python frames and small ATen calls around them, a cost per token that does not shrink with
the model's size (the rule: a step's cost outside the products is paid once per step, so it
goes into one native call; ``python -m devbench qwen2``'s decode against the bandwidth bound
measures it). A step plan (``attnlab.kernels.native.step_plan``, typed structs in C++) runs the
same kernels in the same order: each product the one its module's plan picks, the norms, RoPE
and the attention the native kernels that the fast modules (:mod:`attnlab.kernels.fast_modules`)
call, the residual adds and activations ATen's. So the result is the fast modules' result, bit
for bit (the tests compare them).

The plan is built from the modules once, when first needed for a rows bucket, a dtype and a
thread count (what the modules' kernel plans depend on), and kept on the layer list. It is
built only where it computes what the modules compute: the blocks of the list's
``block_type``, their submodules the fast modules with no hooks (a hook must see its tensor),
every product a module with a ``native_spec`` (``InferenceLinear``, ``QuantizedLinear``)
planned on a kernel that the plan runs (a ``StepKind``: attnlab's GEMVs, PyTorch's packed
int8/int4 ops, the formula); a product on any other kernel means no plan, and the blocks'
modules run. It is taken only for one new position a row, no gradient, a plain ``KVCache`` in
the model's dtype, the native kernels built (``attnlab.kernels.native``).

What each step checks (cheap: no tuple is rebuilt, no module's parts are re-read):

- a stamp of three counters: :func:`invalidate_plans`'s (``optimize_for_inference``,
  ``restore_reference``, ``install_modules`` and ``swap_linears`` bump it),
  ``torch.utils.hooks.RemovableHandle.next_id`` (every hook registered anywhere, forward hooks
  included; while a hook for every module is registered, no plan is built) and one that
  PyTorch's global registration hooks bump whenever a submodule, a Parameter or a buffer is
  assigned to any module (``module.x = ...``, ``register_*``); a changed stamp drops every
  plan of the list;
- the ``training`` flag of each block, its attention, its MLP and its dropout, and each
  attention's ``backend`` (``"auto"``), read per step: a plan is kept across ``train()`` /
  ``eval()`` and taken again after it;
- each layer's cache length and room, and the first cache's shape and dtype (the C++ step
  checks every cache's);
- in C++, that every tensor of the plan still lies where it lay, in its dtype (a weight
  re-stored in another layout or converted by ``model.to`` makes the plan stale: that step
  runs the modules, the next rebuilds).

What is not checked: a module put straight into a ``_modules`` dict (bypassing
``setattr``), a hook put straight into a hook dict, a module's class assigned by hand, a
Parameter's tensor exchanged by ``torch.utils.swap_tensors``, and
other plain attributes read when the plan is built (``eps``, ``scale``, ``num_heads``,
``activation``, ``unit_offset``, ``rope_interleaved``); a quantized module's bias converted to
the activations' dtype is a copy, so an in-place change to that bias is not seen either. A plan
refused because of a hook is not kept (removing a hook leaves no trace to check): each step
then tries again.
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from attnlab.attention.kv_cache import KVCache
from attnlab.hook_point import global_hooks
from attnlab.kernels import native
from attnlab.kernels.fast_modules import (
    FastFeedForward,
    FastGatedMLP,
    FastRMSNorm,
    FastSelfAttention,
)
from attnlab.kernels.rule import ROW_BUCKETS

__all__ = ["FusedLayers", "drop_plans", "fused_layers", "invalidate_plans"]


def fused_layers(blocks: nn.ModuleList, block_type: type, x: Tensor,
                 rotary: tuple[Tensor, Tensor] | None, mask: Tensor | None,
                 cache: KVCache | None) -> Tensor | None:
    """``blocks`` (a ``DecoderLM``'s ``layers``, each exactly a ``block_type``) on x ``B x 1
    x E`` with each block's ``LayerKVCache``, as their forward calls would compute it, in one
    native call -> ``B x 1 x E``; or None, with nothing changed, when the modules must run
    (module docstring). ``rotary``: ``(cos, sin)`` ``(B or 1) x 1 x R`` in x's dtype;
    ``mask`` ``B x 1 x 1 x S`` (or ``1 x S``) bool or None."""
    B, L, E = x.shape
    if (L != 1 or type(cache) is not KVCache or len(cache) != len(blocks) or not blocks
            or torch.is_grad_enabled() or not native.takes(x)
            or (mask is not None and mask.dtype != torch.bool)
            or (rotary is not None and not native.takes(*rotary))):
        return None
    entry = _plan_of(blocks, block_type, B, x.dtype)
    if (entry is None or entry.plan is None or any(map(_TRAINING, entry.modes))
            or tuple(map(_BACKEND, entry.attentions)) != entry.auto):
        return None
    layer_caches = cache.layers
    k = layer_caches[0].k  # a KVCache's layers alike (the C++ step checks every one)
    if k.dtype != x.dtype or (k.shape[0], k.shape[1], k.shape[3]) != (B, entry.G, entry.D):
        return None  # the modules raise their error
    offset = layer_caches[0].length
    for layer_cache in layer_caches:
        if layer_cache.length != offset:
            return None
        if offset >= layer_cache.max_len:  # as reserve(1) would: grow, or refuse a full cache
            layer_cache.reserve(1)
    if mask is not None:
        mask = mask.expand(B, entry.H, 1, offset + 1)
    cos, sin = (None, None) if rotary is None else (t.contiguous() for t in rotary)
    out = native.decode_layers(entry.plan, x.reshape(B, E).contiguous(),
                               [c.k for c in layer_caches], [c.v for c in layer_caches],
                               offset, cos, sin, mask)
    if out is None:  # a stale plan (or a cache of another shape): the modules run this step
        blocks.__dict__.pop(_PLANS, None)
        return None
    for layer_cache in layer_caches:
        layer_cache.length = offset + 1
    return out.view(B, 1, E)


def invalidate_plans() -> None:
    """Drop every layer list's step plan at its next step (the fast modules were installed
    or removed, or modules were swapped without ``setattr``)."""
    _VERSION[0] += 1


def drop_plans(layers: nn.Module) -> None:
    """``layers`` without its kept step plans (``restore_reference`` calls it)."""
    layers.__dict__.pop(_PLANS, None)


class _Entry(NamedTuple):
    """A layer list's plan for one (rows bucket, dtype, threads), or None (the modules run),
    with what each step reads besides: the modules whose ``training`` must be False, the
    attentions whose ``backend`` must be ``"auto"``."""

    plan: object | None
    modes: tuple[nn.Module, ...] = ()
    attentions: tuple[nn.Module, ...] = ()
    auto: tuple[str, ...] = ()
    H: int = 0
    G: int = 0
    D: int = 0


_PLANS = "_step_plans"  # the layer list's __dict__ key: (stamp, {key: _Entry})
_VERSION = [0]  # invalidate_plans
_ASSIGNED = [0]  # submodules, Parameters and buffers assigned to any module (_watch)
_WATCHING: list[bool] = []
_TRAINING, _BACKEND = attrgetter("training"), attrgetter("backend")
_REFUSED = _Entry(None)


def _stamp() -> tuple[int, int, int]:
    return _VERSION[0], RemovableHandle.next_id, _ASSIGNED[0]


def _plan_of(blocks: nn.ModuleList, block_type: type, rows: int,
             dtype: torch.dtype) -> _Entry | None:
    """The list's entry for ``rows`` rows of ``dtype`` at this thread count, built when it has
    none or its stamp changed; None when a hook refused it (then nothing is kept)."""
    stamp = _stamp()
    state = blocks.__dict__.get(_PLANS)
    if state is None or state[0] != stamp:
        state = (stamp, {})
    key = (ROW_BUCKETS[min(rows, len(ROW_BUCKETS)) - 1], dtype, torch.get_num_threads())
    entry = state[1].get(key)
    if entry is None:
        entry = _build(blocks, block_type, rows, dtype)
        if _stamp() != stamp:  # the build itself re-stored a module's buffers
            state = (_stamp(), {})
        if entry is not None:
            state[1][key] = entry
        blocks.__dict__[_PLANS] = state
    return entry


def _watch() -> None:
    """Count every submodule, Parameter and buffer assignment in this process (PyTorch's
    global registration hooks), once: a plan holds the tensors of the modules it was built
    from."""
    if _WATCHING:
        return
    _WATCHING.append(True)

    def assigned(*args: object) -> None:
        _ASSIGNED[0] += 1

    torch_module.register_module_module_registration_hook(assigned)
    torch_module.register_module_parameter_registration_hook(assigned)
    torch_module.register_module_buffer_registration_hook(assigned)


class _Shape(NamedTuple):
    """What a step plan needs to know of a block besides its tensors (every block of the step
    has the same)."""

    norm: str  # a NormKind name
    activation: str  # an Activation name
    H: int
    G: int
    D: int
    eps: float
    scale: float
    gated: bool
    interleaved: bool


def _build(blocks: nn.ModuleList, block_type: type, rows: int, dtype: torch.dtype) -> _Entry | None:
    """The list's plan for ``rows`` rows of ``dtype``: an ``_Entry``, ``_REFUSED`` when the
    plan does not compute what the modules compute, None when a hook must see its call."""
    if global_hooks():  # registering one changed the stamp: asked here, not every step
        return None
    _watch()
    activations = native.step_enum("Activation").__members__
    shape = _shape(blocks[0], activations)
    if shape is None:
        return _REFUSED
    step_blocks, modes, attentions = [], [], []
    for block in blocks:
        if type(block) is not block_type or _shape(block, activations) != shape:
            return _REFUSED
        parts = block._modules
        attn, mlp = parts["self_attn"], parts["mlp"]
        # The modules that the block's forward calls: a hook on any of them must see its call.
        called = [block, *parts.values(), *attn._modules.values(), *mlp._modules.values()]
        if any(m is not None and (m._forward_hooks or m._forward_pre_hooks) for m in called):
            return None
        # Those that drop out in training mode (the others' forward ignores the mode).
        modes += (block, attn, mlp, parts["drop"])
        attentions.append(attn)
        step_block = _block(parts, shape, rows, dtype)
        if step_block is None:
            return _REFUSED
        step_blocks.append(step_block)
    plan = native.step_plan(step_blocks, norm=shape.norm, activation=shape.activation,
                            H=shape.H, G=shape.G, D=shape.D, eps=shape.eps, scale=shape.scale,
                            gated=shape.gated, interleaved=shape.interleaved)
    return _Entry(plan, tuple(modes), tuple(attentions), ("auto",) * len(attentions), shape.H,
                  shape.G, shape.D)


# Submodules, Parameters and buffers are read from the modules' dicts below: nn.Module's
# __getattr__ costs ~0.5 us a name.

def _shape(block: nn.Module, activations: dict) -> _Shape | None:
    """The ``_Shape`` of a block that a step plan computes, or None."""
    parts = block._modules
    attn, mlp, norm = parts.get("self_attn"), parts.get("mlp"), parts.get("input_layernorm")
    if type(attn) is not FastSelfAttention or type(mlp) not in (FastGatedMLP, FastFeedForward):
        return None
    kind = _norm_kind(norm)
    if kind is None or mlp.activation not in activations:
        return None
    D = attn.head_dim
    scale = 1.0 / math.sqrt(D) if attn.scale is None else float(attn.scale)
    return _Shape(kind, mlp.activation, attn.num_heads, attn.num_kv_heads, D, float(norm.eps),
                  scale, type(mlp) is FastGatedMLP, bool(attn.rope_interleaved))


def _norm_kind(norm: nn.Module | None) -> str | None:
    """The ``NormKind`` name of a norm that a step plan computes, or None."""
    if type(norm) is FastRMSNorm:
        return "rms_unit_offset" if norm.unit_offset else "rms"
    if (type(norm) is nn.LayerNorm and norm._parameters.get("weight") is not None
            and len(norm.normalized_shape) == 1):
        return "layer_norm"
    return None


def _block(parts: dict[str, nn.Module], shape: _Shape, rows: int,
           dtype: torch.dtype) -> object | None:
    """A block's ``native.step_block`` from its parts, or None when it is not one of the
    first block's ``shape`` that a plan computes."""
    attn, mlp = parts["self_attn"], parts["mlp"]
    n1, n2 = parts["input_layernorm"], parts["post_attention_layernorm"]
    q_norm, k_norm = attn._modules.get("q_norm"), attn._modules.get("k_norm")
    norms = (n1, n2) if q_norm is None else (n1, n2, q_norm, k_norm)
    for norm in norms:
        if _norm_kind(norm) != shape.norm or norm.eps != shape.eps:
            return None
        weight = norm._parameters["weight"]
        if weight.dtype not in native.DTYPES or not weight.is_cpu:
            return None
    if q_norm is not None and (shape.norm == "layer_norm" or q_norm.dim != shape.D):
        return None
    names = ("gate_proj", "up_proj", "down_proj") if shape.gated else ("linear1", "linear2")
    linears = [attn._modules[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [mlp._modules[n] for n in names]
    products = []
    for linear in linears:
        native_spec = getattr(type(linear), "native_spec", None)
        product = None if native_spec is None else native_spec(linear, rows, dtype)
        if product is None:
            return None
        products.append(product)
    return native.step_block(n1._parameters["weight"], n1._parameters.get("bias"), *products[:4],
                             None if q_norm is None else q_norm._parameters["weight"],
                             None if k_norm is None else k_norm._parameters["weight"],
                             n2._parameters["weight"], n2._parameters.get("bias"), products[4:])


class FusedLayers(nn.ModuleList):
    """Mixed into a decoder's layer list (a ``ModuleList`` whose ``forward`` runs its blocks,
    with a ``block_type``, after asking its ``one_call_step``): a one-token step with a plain
    ``KVCache`` runs every block in one C++ call (:func:`attnlab.kernels.fused_layers.
    fused_layers`, bit-equal to the blocks' fast modules), the blocks' own forwards otherwise.
    Its step plans (module docstring) are kept on it, never copied or pickled with it."""

    def one_call_step(self, x: Tensor, rotary: tuple[Tensor, Tensor] | None,
                      mask: Tensor | None, cache: KVCache | None) -> Tensor | None:
        """:func:`fused_layers` of the list (None in training: the blocks run)."""
        return None if self.training else fused_layers(self, self.block_type, x, rotary, mask,
                                                       cache)

    def __getstate__(self) -> dict:
        # A plan holds C++ objects and the tensors of these modules, not of a copy's.
        state = self.__dict__.copy()
        state.pop(_PLANS, None)
        return state
