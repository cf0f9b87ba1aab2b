"""A decoding step through every block of a ``DecoderLM`` in one native call.

A one-token step runs ~7 matrix-vector products per block, which read the weights, and
~100 Python frames and small ATen calls around them, which on a 2-core CPU cost ~2 ms a token
whatever the model's size (the per-token cost outside the products: ``attnlab bench qwen2``'s
decode). ``attnlab.kernels.native.decode_layers`` runs the same kernels in the same order
from C++: each product the one its module's calibrated plan picks, the norms, RoPE and the
attention the native kernels that the modules call, the residual adds and activations
ATen's. So the result is the modules' result, bit for bit (the tests compare them).

It is taken only where that holds, and the modules run otherwise: one new position a row,
no gradient, eval mode, a plain ``KVCache`` in the model's dtype, the blocks and their
submodules of the stock classes with no hooks (a hook must see its tensor), attention on the
``auto`` backend, every product planned on a native GEMV (``native_spec``), the native
kernels built (``attnlab.kernels.native``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from attnlab.attention.kv_cache import KVCache
from attnlab.kernels import InferenceLinear, native
from attnlab.layers import FeedForward, GatedMLP, RMSNorm
from attnlab.layers.self_attention import SelfAttention
from attnlab.quantization.modules import QuantizedLinear

__all__ = ["fused_layers"]

_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "relu": 3}
_LINEARS = (InferenceLinear, QuantizedLinear)


def fused_layers(blocks: nn.ModuleList, block_type: type, x: Tensor,
                 rotary: tuple[Tensor, Tensor] | None, mask: Tensor | None,
                 cache: KVCache | None) -> Tensor | None:
    """``blocks`` (a ``DecoderLM``'s ``layers``, each exactly a ``block_type``) on x ``B x 1
    x E`` with each block's ``LayerKVCache``, as their forward calls would compute it, in one
    native call -> ``B x 1 x E``; or None, with nothing changed, when the modules must run
    (module docstring).
    ``rotary``: ``(cos, sin)`` ``(B or 1) x 1 x R`` in x's dtype; ``mask`` ``B x 1 x 1 x S``
    bool or None."""
    B, L, E = x.shape
    if (L != 1 or type(cache) is not KVCache or len(cache) != len(blocks) or not blocks
            or torch.is_grad_enabled() or blocks.training or not native.takes(x)
            or _global_hooks()):
        return None
    if mask is not None and mask.dtype != torch.bool:
        return None
    if rotary is not None and not native.takes(*rotary):
        return None
    first = blocks[0]
    config = _config(first, x.dtype)
    if config is None:
        return None
    layers = []
    for block, layer_cache in zip(blocks, cache.layers):
        if (layer_cache.k.dtype != x.dtype or layer_cache.k.shape[0] != B
                or layer_cache.length != cache.layers[0].length):
            return None
        entry = _block(block, block_type, first, B, x.dtype)
        if entry is None:
            return None
        layers.append(entry)
    offset = cache.layers[0].length
    for layer_cache in cache.layers:
        layer_cache.reserve(1)
    for entry, layer_cache in zip(layers, cache.layers):
        entry.extend((layer_cache.k, layer_cache.v))
    attn = first.self_attn
    if mask is not None:
        mask = mask.expand(B, attn.num_heads, 1, offset + 1)
    cos, sin = (None, None) if rotary is None else (t.contiguous() for t in rotary)
    out = native.decode_layers(x.reshape(B, E).contiguous(), [tuple(e) for e in layers],
                               (*config, offset, *_scales(first, attn)), cos, sin, mask)
    for layer_cache in cache.layers:
        layer_cache.length = offset + 1
    return out.view(B, 1, E)


def _global_hooks() -> bool:
    """Whether a hook registered for every module would see a call."""
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def _config(block: nn.Module, dtype: torch.dtype) -> tuple | None:
    """``(norm kind, activation, H, G, D)`` of the first block, or None when the blocks are
    not what ``decode_layers`` computes."""
    attn, mlp = block.self_attn, block.mlp
    norm = _norm_kind(block.input_layernorm)
    if norm is None or type(attn) is not SelfAttention or attn.backend != "auto":
        return None
    if type(mlp) is GatedMLP or type(mlp) is FeedForward:
        activation = _ACTIVATIONS.get(mlp.activation)
    else:
        return None
    if activation is None:
        return None
    return (norm, activation, attn.num_heads, attn.num_kv_heads, attn.head_dim)


def _scales(block: nn.Module, attn: SelfAttention) -> tuple:
    """``(eps, attention scale, gated, interleaved)``."""
    scale = 1.0 / math.sqrt(attn.head_dim) if attn.scale is None else float(attn.scale)
    return (float(block.input_layernorm.eps), scale, type(block.mlp) is GatedMLP,
            bool(attn.rope_interleaved))


def _norm_kind(norm: nn.Module) -> int | None:
    """0 RMSNorm, 1 RMSNorm with ``1 + w``, 2 LayerNorm (with a weight), or None."""
    if type(norm) is RMSNorm:
        return 1 if norm.unit_offset else 0
    if type(norm) is nn.LayerNorm and norm.weight is not None and len(norm.normalized_shape) == 1:
        return 2
    return None


def _block(block: nn.Module, block_type: type, first: nn.Module, rows: int,
           dtype: torch.dtype) -> list | None:
    """One block's entry of ``decode_layers``'s ``layers`` (without its caches), or None."""
    if type(block) is not block_type:
        return None
    attn, mlp = block.self_attn, block.mlp
    # The modules that the block's forward calls: a hook on any of them must see its call.
    called = [*block._modules.values(), *attn._modules.values(), *mlp._modules.values()]
    if any(m is not None and (m._forward_hooks or m._forward_pre_hooks) for m in called):
        return None
    if (type(attn) is not SelfAttention or attn.backend != "auto"
            or (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                attn.rope_interleaved) != (first.self_attn.num_heads,
                                           first.self_attn.num_kv_heads,
                                           first.self_attn.head_dim, first.self_attn.scale,
                                           first.self_attn.rope_interleaved)
            or type(mlp) is not type(first.mlp) or mlp.activation != first.mlp.activation):
        return None
    norms = [block.input_layernorm, block.post_attention_layernorm]
    if attn.q_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    kind, eps = _norm_kind(first.input_layernorm), first.input_layernorm.eps
    for norm in norms:
        if _norm_kind(norm) != kind or norm.eps != eps or not native.takes(norm.weight):
            return None
    if attn.q_norm is not None and (kind == 2 or attn.q_norm.dim != attn.head_dim):
        return None
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
    linears = projections + ((mlp.gate_proj, mlp.up_proj, mlp.down_proj)
                             if type(mlp) is GatedMLP else (mlp.linear1, mlp.linear2))
    specs = []
    for linear in linears:
        spec = linear.native_spec(rows, dtype) if type(linear) in _LINEARS else None
        if spec is None:
            return None
        specs.append(spec)
    n1, n2 = block.input_layernorm, block.post_attention_layernorm
    return [n1.weight, getattr(n1, "bias", None), *specs[:4],
            None if attn.q_norm is None else attn.q_norm.weight,
            None if attn.k_norm is None else attn.k_norm.weight,
            n2.weight, getattr(n2, "bias", None), tuple(specs[4:])]
