"""GPTQ: int4 codes chosen with calibration text, each column's rounding error compensated
by the columns not yet quantized, the layers quantized in order.

For a linear layer ``y = x W^T`` (``W`` ``O x I``) that sees the calibration inputs ``X``
(``n x I``, every position of every calibration chunk), quantizing ``W`` to ``W'`` changes the
outputs by ``||X (W - W')^T||^2 = sum_o (w_o - w'_o)^T H (w_o - w'_o)`` with the Hessian
``H = X^T X / n`` (``I x I``, shared by the rows). GPTQ (Frantar et al., 2022) quantizes the
columns one at a time; after rounding column ``i`` (error ``e = w_i - w'_i``, ``O``) it moves
the columns not yet quantized by the least-squares correction

    W[:, j] -= e U[i, j] / U[i, i]    for the columns j after i,

``U`` the upper Cholesky factor of ``H^-1`` (which holds, row by row, the inverse Hessians of
the columns still free). Done lazily in blocks of ``BLOCK`` columns: inside a block at once,
to the columns after it in one matrix product. ``H`` gets ``damp`` times its mean diagonal
added (it is singular when an input never varies), and an input that is always zero is
dropped (its column quantized as it is, moving nothing).

The order of the columns (``act_order``): by descending ``H_ii`` (the inputs of most energy
first, while many columns are left to take their error), with **static groups**: each group
of ``g`` consecutive inputs keeps the scale and zero that the search of
``attnlab.quantization.search`` chose for it from the weights before any update, so that the
stored format (a scale and zero per group of consecutive inputs) is unchanged. Without
``act_order`` the columns go in input order and each group takes the search's scale and zero
from its weights as they are when its first column comes up.

The layers go in the order the model runs them (``gptq_quantize``): the inputs of the first
block of the model's stack of blocks (its ``nn.ModuleList``) are kept for each calibration
chunk, and block by block, the linear layers reading one input (q/k/v; gate/up) are
quantized together from the Hessian of that input as the already-quantized layers before
them produce it; the block's outputs, quantized, are the next block's inputs. Linear layers
outside the stack (an untied LM head) take their Hessian from one last pass of the whole
model. The token tables (an embedding and a head tied to it) are not linear layers that
calibration sees the inputs of, and take the search (int8 by default); the embedding, and the
layers kept in int8 (``int8_layers``), are read as so quantized while the others are
calibrated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from tqdm import tqdm

from attnlab._checks import is_int
from attnlab.quantization.convert import (
    DEFAULT_GROUP_SIZE,
    QuantizationConfig,
    chosen_modules,
    last_layer,
    outliers_asked,
    outliers_chosen,
    quantize_model,
)
from attnlab.quantization.formats import QuantizedWeight, pack_int4
from attnlab.quantization.modules import QuantizedEmbedding, QuantizedLinear
from attnlab.quantization.search import search_int4

__all__ = ["BLOCK", "gptq_layers", "gptq_quantize", "gptq_weight"]

BLOCK = 128  # columns a block (a multiple of every group size up to 128)


def gptq_quantize(model: nn.Module, ids: Tensor, *, group_size: int | None = None,
                  context: int = 512, skip: Iterable[str] = (), table_bits: int | None = None,
                  scale_dtype: str | None = None, int8_layers: Iterable[str] | None = None,
                  int8_outliers: int | None = None, damp: float = 0.01, act_order: bool = True,
                  kernel: str | None = None, progress: bool = False) -> nn.Module:
    """``model`` (float) quantized in place to int4 in groups of ``group_size`` (default
    ``DEFAULT_GROUP_SIZE``) by GPTQ, layer by layer in order (module docstring), on the
    calibration token ``ids`` (``T``), cut into chunks of ``context`` tokens (the last,
    shorter one too); ``skip``, ``table_bits``, ``scale_dtype``, ``int8_layers`` and
    ``int8_outliers`` (int8 by round-to-nearest, read so while the others are calibrated)
    and ``kernel`` as in
    ``quantize_model``, whose ``QuantizationConfig`` it records with ``fit="gptq"``.
    ``model(input_ids)`` is called on each chunk (``1 x N``). ``progress`` draws progress
    bars on stderr. Returned for chaining."""
    if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.is_floating_point() or \
            ids.numel() < 2:
        got = (f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, Tensor)
               else type(ids).__name__)
        raise ValueError(f"ids: expected a 1-d integer tensor of at least 2 calibration token "
                         f"ids, got {got}")
    if not is_int(context) or context < 2:
        raise ValueError(f"context: expected a number of tokens >= 2, got {context!r}")
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    config = outliers_chosen(model, QuantizationConfig(
        "int4", group_size, tuple(skip), table_bits, "gptq", scale_dtype,
        None if int8_layers is None else tuple(int8_layers),
        outliers_asked(int8_layers, int8_outliers)))
    layers = gptq_layers(model, config.skip, group_size, config.int8_layers)

    def quantized(name: str, hessian: Tensor) -> QuantizedWeight:
        weight = layers[name].weight
        q = gptq_weight(weight, hessian, group_size, damp=damp, act_order=act_order,
                        scale_dtype=config.scales_for(weight, table=False))
        # What the layer computes from now on, for the layers after it to see.
        layers[name].weight = nn.Parameter(q.dequantize(weight.dtype), requires_grad=False)
        return q

    # The token tables (int8 by default) and the int8 layers as they will be while the
    # others are calibrated: their inputs are then the quantized model's.
    last = last_layer(model)
    others = {name: m for name, m in chosen_modules(model, config).items()
              if isinstance(m, nn.Embedding) or config.bits_of(name, table=False, last=last) == 8}
    floats = {name: m.weight for name, m in others.items()}
    try:
        for m in others.values():
            m.weight = nn.Parameter(_as_quantized(m, config), requires_grad=False)
        with torch.no_grad():
            weights = _in_order(model, layers, ids.split(context), quantized, progress)
    finally:
        for name, m in others.items():
            m.weight = floats[name]
    return quantize_model(model, "int4", group_size, skip=config.skip, kernel=kernel,
                          table_bits=config.table_bits, fit="gptq",
                          scale_dtype=config.scale_dtype, int8_layers=config.int8_layers,
                          weights=weights)


def gptq_layers(model: nn.Module, skip: Iterable[str] = (),
                group_size: int = DEFAULT_GROUP_SIZE, int8_layers: Iterable[str] | None = None
                ) -> dict[str, nn.Linear]:
    """``{name: layer}`` of the linear layers that GPTQ quantizes: those ``quantize_model``
    chooses in int4 (not skipped, not ``int8_layers``; ``group_size`` dividing their
    inputs; ``int8_layers`` None: ``DEFAULT_INT8_LAYERS``, without the outlier layers that
    ``gptq_quantize`` adds to them), but for a head tied to an embedding."""
    config = QuantizationConfig("int4", group_size, tuple(skip), int8_layers=None
                                if int8_layers is None else tuple(int8_layers))
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    last = last_layer(model)
    return {name: m for name, m in chosen_modules(model, config).items()
            if isinstance(m, nn.Linear) and id(m.weight) not in tables
            and config.bits_of(name, table=False, last=last) == 4}


def _as_quantized(module: nn.Module, config: QuantizationConfig) -> Tensor:
    """The weight of ``module`` (a token table or an int8 layer) as ``config`` quantizes it
    without calibration, dequantized to its dtype."""
    if isinstance(module, nn.Embedding):
        quantized = QuantizedEmbedding.from_embedding(
            module, bits=config.table_bits, group_size=config.group_size, fit="search").source
    else:
        quantized = QuantizedLinear.from_linear(module, bits=8, kernel="dequantize")
    return quantized.dequantize(module.weight.dtype)


def gptq_weight(weight: Tensor, hessian: Tensor, group_size: int, *, damp: float = 0.01,
                act_order: bool = True, scale_dtype: torch.dtype | None = None
                ) -> QuantizedWeight:
    """``weight`` (``O x I``) as int4 in groups of ``group_size`` (scales and zeros in
    ``scale_dtype``, default the weight's) by GPTQ against ``hessian`` (``I x I``, ``X^T X /
    n``), adding ``damp`` times its mean diagonal, the columns in ``act_order`` with static
    groups or in input order (module docstring)."""
    rows, cols = weight.shape
    if cols % group_size or BLOCK % group_size:
        raise ValueError(f"group_size: expected a divisor of {BLOCK} dividing the weight's "
                         f"{cols} inputs, got {group_size!r}")
    scale_dtype = scale_dtype or weight.dtype
    w = weight.detach().float().clone()
    h = hessian.detach().double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    groups = cols // group_size
    scales = torch.empty(rows, groups, dtype=scale_dtype)
    zeros = torch.empty(rows, groups, dtype=scale_dtype)
    order = torch.arange(cols)
    if act_order:
        s, z = search_int4(w.reshape(-1, group_size), scale_dtype)
        scales.copy_(s.view(rows, groups))
        zeros.copy_(z.view(rows, groups))
        order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w, h = w[:, order], h[order][:, order]
    h += damp * torch.diagonal(h).mean() * torch.eye(cols, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    u = u.float()
    codes = torch.empty(rows, cols, dtype=torch.uint8)  # in the order quantized
    for start in range(0, cols, BLOCK):
        end = min(cols, start + BLOCK)
        block, errors, ub = w[:, start:end].clone(), torch.zeros(rows, end - start), \
            u[start:end, start:end]
        for j in range(end - start):
            column = int(order[start + j])
            k = column // group_size
            if not act_order and column % group_size == 0:
                s, z = search_int4(block[:, j:j + group_size], scale_dtype)
                scales[:, k], zeros[:, k] = s, z
            sf, zf = scales[:, k].float(), zeros[:, k].float()
            q = (torch.round((block[:, j] - zf) / sf) + 8).clamp_(0, 15)
            codes[:, start + j] = q.to(torch.uint8)
            error = (block[:, j] - ((q - 8) * sf + zf)) / ub[j, j]
            block[:, j:] -= error[:, None] * ub[j, j:][None, :]
            errors[:, j] = error
        w[:, end:] -= errors @ u[start:end, end:]
    in_place = torch.empty_like(codes)
    in_place[:, order] = codes
    return QuantizedWeight(4, pack_int4(in_place), scales, zeros)


class _StopError(Exception):
    """Raised by a hook once a forward has given what was wanted of it."""


def _in_order(model: nn.Module, layers: dict[str, nn.Linear], chunks: tuple[Tensor, ...],
              quantized: Callable[[str, Tensor], QuantizedWeight],
              progress: bool) -> dict[str, QuantizedWeight]:
    """``{name: quantized(name, H)}`` for every one of ``layers``, in the order the model
    runs them, ``H`` from the inputs that the layers quantized before produce (module
    docstring)."""
    weights: dict[str, QuantizedWeight] = {}
    blocks = _blocks(model, layers)
    if blocks:
        inputs = _first_block_inputs(model, blocks[0], chunks)
        for block in tqdm(blocks, desc="gptq", unit="block", disable=not progress):
            names = {n: m for n, m in layers.items() if any(m is b for b in block.modules())}
            for stage in _stages(block, names, inputs[0]):
                hessian = _hessian(block, stage, inputs)
                for name in stage:
                    weights[name] = quantized(name, hessian)
            inputs = [((block(*args, **kwargs), *args[1:]), kwargs) for args, kwargs in inputs]
    rest = {n: m for n, m in layers.items() if n not in weights}
    for name in rest:  # one pass of the model, its blocks quantized
        hessian = _hessian(model, {name: rest[name]}, [((c.view(1, -1),), {}) for c in chunks])
        weights[name] = quantized(name, hessian)
    return weights


def _blocks(model: nn.Module, layers: dict[str, nn.Linear]) -> list[nn.Module]:
    """The model's stack of blocks: the first ``nn.ModuleList`` each of whose modules holds
    some of ``layers`` (none: [])."""
    chosen = {id(m) for m in layers.values()}
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(
                any(id(m) in chosen for m in block.modules()) for block in module):
            return list(module)
    return []


def _first_block_inputs(model: nn.Module, block: nn.Module, chunks: tuple[Tensor, ...]
                        ) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` of ``block``'s call in a forward of the model on each chunk."""
    seen: list[tuple[tuple, dict]] = []

    def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append((args, kwargs))
        raise _StopError

    handle = block.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        for chunk in chunks:
            with contextlib.suppress(_StopError):
                model(chunk.view(1, -1))
    finally:
        handle.remove()
    if len(seen) != len(chunks):
        raise ValueError("model: its first block was not called through its module (a fused "
                         "inference step skips hooks); load it with kernels=False")
    return seen


def _stages(block: nn.Module, layers: dict[str, nn.Linear], first: tuple[tuple, dict]
            ) -> list[dict[str, nn.Linear]]:
    """``layers`` (those of ``block``) in the order ``block`` calls them on the inputs
    ``first``, those reading one input (q/k/v) together."""
    # each call's input itself, kept alive until grouped: an address could be reused by a
    # later input once the first is freed, so inputs are told apart by identity
    calls: list[tuple[str, Tensor]] = []

    def record(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            calls.append((name, args[0]))
        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in layers.items()]
    try:
        block(*first[0], **first[1])
    finally:
        for handle in handles:
            handle.remove()
    unseen = sorted(set(layers) - {name for name, _ in calls})
    if unseen:
        raise ValueError(f"model: the calibration never called {', '.join(unseen[:3])} "
                         "through its module (a fused inference step skips hooks); load it "
                         "with kernels=False")
    stages: list[dict[str, nn.Linear]] = []
    last = None
    for name, x in calls:
        if x is not last:
            stages.append({})
        stages[-1][name] = layers[name]
        last = x
    return stages


def _hessian(runner: nn.Module, stage: dict[str, nn.Linear],
             inputs: list[tuple[tuple, dict]]) -> Tensor:
    """``X^T X / n`` (float64) of the one input of the ``stage``'s layers, over ``runner``'s
    calls on ``inputs``; each call stops once every layer of the stage read its input."""
    width = next(iter(stage.values())).in_features
    total, count = torch.zeros(width, width, dtype=torch.float64), 0
    pending: set[str] = set()

    def hook(name: str) -> Callable:
        def accumulate(module: nn.Module, args: tuple) -> None:
            nonlocal total, count
            if len(pending) == len(stage):  # the first of the stage this call
                x = args[0].detach().reshape(-1, width).float()
                total += (x.T @ x).double()  # float32 per chunk, summed in float64
                count += x.shape[0]
            pending.discard(name)
            if not pending:
                raise _StopError
        return accumulate

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in stage.items()]
    try:
        for args, kwargs in inputs:
            pending.update(stage)
            with contextlib.suppress(_StopError):
                runner(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    if count == 0:
        raise ValueError(f"model: the calibration never called {', '.join(stage)} through "
                         "its module (a fused inference step skips hooks); load it with "
                         "kernels=False")
    return total / count
