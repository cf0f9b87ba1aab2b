"""A decoding step through every block of a ``DecoderLM`` in one native call:
:class:`FusedLayers`, the fast module for a decoder's layer list.

A one-token step runs ~7 matrix-vector products per block, which read the weights, and
~100 Python frames and small ATen calls around them, which on a 2-core CPU cost ~2 ms a token
whatever the model's size (the per-token cost outside the products: ``attnlab bench qwen2``'s
decode). ``attnlab.kernels.native.decode_layers`` runs the same kernels in the same order
from C++: each product the one its module's plan picks, the norms, RoPE and the attention
the native kernels that the fast modules (:mod:`attnlab.kernels.fast_modules`) call, the
residual adds and activations ATen's. So the result is the fast modules' result, bit for bit
(the tests compare them).

It is taken only where that holds, and the modules run otherwise: one new position a row,
no gradient, the blocks and their parts that drop out in eval mode, a plain ``KVCache`` in
the model's dtype, the blocks of the list's ``block_type`` and their submodules the fast
modules with no hooks (a hook must see its tensor), attention on the ``auto`` backend, every
product a module with a ``native_spec`` (``InferenceLinear``, ``QuantizedLinear``) planned on
a kernel that ``decode_layers`` runs (attnlab's GEMVs, PyTorch's packed int8/int4 ops, the
formula), the native kernels built (``attnlab.kernels.native``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnlab.attention.kv_cache import KVCache
from attnlab.hook_point import global_hooks
from attnlab.kernels import native
from attnlab.kernels.fast_modules import (
    FastFeedForward,
    FastGatedMLP,
    FastRMSNorm,
    FastSelfAttention,
)

__all__ = ["FusedLayers", "fused_layers"]

_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "relu": 3}


class _Shape(NamedTuple):
    """What ``decode_layers`` needs to know of a block besides its tensors (every block of
    the step has the same)."""

    norm: int  # 0 RMSNorm, 1 RMSNorm with 1 + w, 2 LayerNorm
    activation: int  # _ACTIVATIONS
    H: int
    G: int
    D: int
    eps: float
    scale: float
    gated: bool
    interleaved: bool


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
            or torch.is_grad_enabled() or not native.takes(x) or global_hooks()
            or (mask is not None and mask.dtype != torch.bool)
            or (rotary is not None and not native.takes(*rotary))):
        return None
    dtype, layer_caches = x.dtype, cache.layers
    offset = layer_caches[0].length
    shape = _shape(blocks[0])
    if shape is None:
        return None
    entries = []
    buffer_shape = (B, shape.G, shape.D)  # B x G x . x D: the modules refuse another
    for block, layer_cache in zip(blocks, layer_caches):
        k = layer_cache.k
        if (k.dtype != dtype or (k.shape[0], k.shape[1], k.shape[3]) != buffer_shape
                or layer_cache.length != offset):
            return None
        entry = _block(block, block_type, shape, B, dtype)
        if entry is None:
            return None
        entries.append(entry)
    for layer_cache in layer_caches:  # may reallocate: the buffers are read after
        layer_cache.reserve(1)
    layers = [(*entry, c.k, c.v) for entry, c in zip(entries, layer_caches)]
    if mask is not None:
        mask = mask.expand(B, shape.H, 1, offset + 1)
    cos, sin = (None, None) if rotary is None else (t.contiguous() for t in rotary)
    out = native.decode_layers(x.reshape(B, E).contiguous(), layers,
                               (*shape[:5], offset, *shape[5:]), cos, sin, mask)
    for layer_cache in layer_caches:
        layer_cache.length = offset + 1
    return out.view(B, 1, E)


# Submodules, Parameters and buffers are read from the modules' dicts below: nn.Module's
# __getattr__ costs ~0.5 us a name, ~100 names a step.

def _shape(block: nn.Module) -> _Shape | None:
    """The ``_Shape`` of a block that ``decode_layers`` computes, or None."""
    parts = block._modules
    attn, mlp, norm = parts.get("self_attn"), parts.get("mlp"), parts.get("input_layernorm")
    if type(attn) is not FastSelfAttention or type(mlp) not in (FastGatedMLP, FastFeedForward):
        return None
    kind, activation = _norm_kind(norm), _ACTIVATIONS.get(mlp.activation)
    if kind is None or activation is None or attn.backend != "auto":
        return None
    D = attn.head_dim
    scale = 1.0 / math.sqrt(D) if attn.scale is None else float(attn.scale)
    return _Shape(kind, activation, attn.num_heads, attn.num_kv_heads, D, float(norm.eps),
                  scale, type(mlp) is FastGatedMLP, bool(attn.rope_interleaved))


def _norm_kind(norm: nn.Module | None) -> int | None:
    """0 RMSNorm, 1 RMSNorm with ``1 + w``, 2 LayerNorm (with a weight), or None."""
    if type(norm) is FastRMSNorm:
        return 1 if norm.unit_offset else 0
    if (type(norm) is nn.LayerNorm and norm._parameters.get("weight") is not None
            and len(norm.normalized_shape) == 1):
        return 2
    return None


def _block(block: nn.Module, block_type: type, shape: _Shape, rows: int,
           dtype: torch.dtype) -> tuple | None:
    """One block's entry of ``decode_layers``'s ``layers`` (without its caches), or None
    when it is not a ``block_type`` of the first block's ``shape`` that it computes."""
    if type(block) is not block_type or _shape(block) != shape:
        return None
    parts = block._modules
    attn, mlp = parts["self_attn"], parts["mlp"]
    # The modules that the block's forward calls: a hook on any of them must see its call.
    called = [block, *parts.values(), *attn._modules.values(), *mlp._modules.values()]
    if any(m is not None and (m._forward_hooks or m._forward_pre_hooks) for m in called):
        return None
    # Those that drop out in training mode (the others' forward ignores the mode).
    if block.training or attn.training or mlp.training or parts["drop"].training:
        return None
    n1, n2 = parts["input_layernorm"], parts["post_attention_layernorm"]
    q_norm, k_norm = attn._modules.get("q_norm"), attn._modules.get("k_norm")
    norms = (n1, n2) if q_norm is None else (n1, n2, q_norm, k_norm)
    for norm in norms:
        if _norm_kind(norm) != shape.norm or norm.eps != shape.eps:
            return None
        weight = norm._parameters["weight"]
        if weight.dtype not in native.DTYPES or not weight.is_cpu:
            return None
    if q_norm is not None and (shape.norm == 2 or q_norm.dim != shape.D):
        return None
    names = ("gate_proj", "up_proj", "down_proj") if shape.gated else ("linear1", "linear2")
    linears = [attn._modules[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [mlp._modules[n] for n in names]
    specs = []
    for linear in linears:
        native_spec = getattr(type(linear), "native_spec", None)
        spec = None if native_spec is None else native_spec(linear, rows, dtype)
        if spec is None:
            return None
        specs.append(spec)
    return (n1._parameters["weight"], n1._parameters.get("bias"), *specs[:4],
            None if q_norm is None else q_norm._parameters["weight"],
            None if k_norm is None else k_norm._parameters["weight"],
            n2._parameters["weight"], n2._parameters.get("bias"), tuple(specs[4:]))


class FusedLayers(nn.ModuleList):
    """Mixed into a decoder's layer list (a ``ModuleList`` whose ``forward`` runs its blocks,
    with a ``block_type``): a one-token step with a plain ``KVCache`` runs every block in one
    C++ call (:func:`attnlab.kernels.fused_layers.fused_layers`, bit-equal to the blocks'
    fast modules), the blocks' own forwards otherwise."""

    def forward(self, x: Tensor, *, rotary: tuple[Tensor, Tensor] | None = None,
                mask: Tensor | None = None, is_causal: bool = True, cache: KVCache | None = None,
                rows: Tensor | None = None) -> Tensor:
        fused = None if self.training else fused_layers(self, self.block_type, x, rotary,
                                                          mask, cache)
        if fused is not None:
            return fused
        return super().forward(x, rotary=rotary, mask=mask, is_causal=is_causal, cache=cache,
                               rows=rows)
