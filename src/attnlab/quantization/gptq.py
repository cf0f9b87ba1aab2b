"""GPTQ: int4 codes chosen with calibration text, each column's rounding error compensated
by the columns not yet quantized.

For a linear layer ``y = x W^T`` (``W`` ``O x I``) that sees the calibration inputs ``X``
(``n x I``, every position of every calibration chunk), quantizing ``W`` to ``W'`` changes the
outputs by ``||X (W - W')^T||^2 = sum_o (w_o - w'_o)^T H (w_o - w'_o)`` with the Hessian
``H = X^T X / n`` (``I x I``, shared by the rows). GPTQ (Frantar et al., 2022) quantizes the
columns ``i = 0 .. I-1`` in order; after rounding column ``i`` (error ``e = w_i - w'_i``,
``O``) it moves the columns not yet quantized by the least-squares correction

    W[:, j] -= e U[i, j] / U[i, i]    for j > i,

``U`` the upper Cholesky factor of ``H^-1`` (which holds, row by row, the inverse Hessians of
the columns still free). Done in blocks of ``BLOCK`` columns: inside a block at once, to the
columns after it in one matrix product. ``H`` gets ``damp`` times its mean diagonal added
(it is singular when an input never varies), and an input that is always zero is dropped
(its column quantized as it is, moving nothing). Each group of ``g`` columns takes its scale
and zero when its first column comes up, from the group's weights as they are then, by the
search of ``attnlab.quantization.search``.

``gptq_quantize(model, ids)`` collects ``H`` of every chosen linear layer in one pass of the
float model over the calibration ids (chunks of ``context`` tokens), quantizes each with
GPTQ and swaps them in (``quantize_model(..., weights=...)``); the token tables (an
embedding and a head tied to it) are not linear layers that calibration sees the inputs of,
and take the search (int8 by default).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from tqdm import tqdm

from attnlab._checks import is_int
from attnlab.quantization.convert import (
    DEFAULT_GROUP_SIZE,
    QuantizationConfig,
    chosen_modules,
    quantize_model,
)
from attnlab.quantization.formats import QuantizedWeight, pack_int4
from attnlab.quantization.search import search_int4

__all__ = ["BLOCK", "calibration_hessians", "gptq_layers", "gptq_quantize", "gptq_weight"]

BLOCK = 128  # columns a block (a multiple of every group size up to 128)


def gptq_quantize(model: nn.Module, ids: Tensor | None, *, group_size: int | None = None,
                  context: int = 512, skip: Iterable[str] = (), table_bits: int | None = None,
                  damp: float = 0.01, kernel: str | None = None, progress: bool = False,
                  hessians: dict[str, Tensor] | None = None) -> nn.Module:
    """``model`` (float) quantized in place to int4 in groups of ``group_size`` (default
    ``DEFAULT_GROUP_SIZE``) by GPTQ on the calibration token ``ids`` (``T``), cut into
    chunks of ``context`` tokens (the last, shorter one too); ``skip``, ``table_bits`` and
    ``kernel`` as in ``quantize_model``, whose ``QuantizationConfig`` it records with
    ``fit="gptq"``. ``model(input_ids)`` is called on each chunk (``1 x N``). ``progress``
    draws progress bars on stderr. ``hessians``: ``calibration_hessians``' result for this
    model (or a copy of it) and ``skip``, used instead of ``ids`` (None then). Returned for
    chaining."""
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    config = QuantizationConfig("int4", group_size, tuple(skip), table_bits, "gptq")
    layers = gptq_layers(model, config.skip, group_size)
    if hessians is None:
        hessians = calibration_hessians(model, ids, context=context, skip=config.skip,
                                        group_size=group_size, progress=progress)
    weights = {}
    for name, m in tqdm(layers.items(), desc="gptq", unit="layer", disable=not progress):
        weights[name] = gptq_weight(m.weight, hessians[name], group_size, damp=damp)
    return quantize_model(model, "int4", group_size, skip=config.skip, kernel=kernel,
                          table_bits=config.table_bits, fit="gptq", weights=weights)


def gptq_layers(model: nn.Module, skip: Iterable[str] = (),
                group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, nn.Linear]:
    """``{name: layer}`` of the linear layers that GPTQ quantizes: those ``quantize_model``
    chooses (not skipped; ``group_size`` dividing their inputs), but for a head tied to an
    embedding."""
    config = QuantizationConfig("int4", group_size, tuple(skip))
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {name: m for name, m in chosen_modules(model, config).items()
            if isinstance(m, nn.Linear) and id(m.weight) not in tables}


def calibration_hessians(model: nn.Module, ids: Tensor, *, context: int = 512,
                         skip: Iterable[str] = (), group_size: int = DEFAULT_GROUP_SIZE,
                         progress: bool = False) -> dict[str, Tensor]:
    """``{name: X^T X / n}`` (float64 ``I x I``) of each of ``gptq_layers(model, skip,
    group_size)``
    over its inputs when ``model`` runs on the token ``ids`` (``T``) in chunks of
    ``context`` tokens."""
    if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.is_floating_point() or \
            ids.numel() < 2:
        got = (f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, Tensor)
               else type(ids).__name__)
        raise ValueError(f"ids: expected a 1-d integer tensor of at least 2 calibration token "
                         f"ids, got {got}")
    if not is_int(context) or context < 2:
        raise ValueError(f"context: expected a number of tokens >= 2, got {context!r}")
    return _hessians(model, gptq_layers(model, skip, group_size), ids, context, progress)


def gptq_weight(weight: Tensor, hessian: Tensor, group_size: int, *,
                damp: float = 0.01) -> QuantizedWeight:
    """``weight`` (``O x I``) as int4 in groups of ``group_size`` (scales and zeros in the
    weight's dtype) by GPTQ against ``hessian`` (``I x I``, ``X^T X / n``; module
    docstring), adding ``damp`` times its mean diagonal."""
    rows, cols = weight.shape
    if cols % group_size or BLOCK % group_size:
        raise ValueError(f"group_size: expected a divisor of {BLOCK} dividing the weight's "
                         f"{cols} inputs, got {group_size!r}")
    scale_dtype = weight.dtype
    w = weight.detach().float().clone()
    h = hessian.detach().double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diagonal(h).mean() * torch.eye(cols, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    u = u.float()
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    groups = cols // group_size
    scales = torch.empty(rows, groups, dtype=scale_dtype)
    zeros = torch.empty(rows, groups, dtype=scale_dtype)
    for start in range(0, cols, BLOCK):
        end = min(cols, start + BLOCK)
        block, errors, ub = w[:, start:end].clone(), torch.zeros(rows, end - start), \
            u[start:end, start:end]
        for j in range(end - start):
            column = start + j
            if column % group_size == 0:
                k = column // group_size
                s, z = search_int4(block[:, j:j + group_size], scale_dtype)
                scales[:, k], zeros[:, k] = s, z
                sf, zf = s.float(), z.float()
            q = (torch.round((block[:, j] - zf) / sf) + 8).clamp_(0, 15)
            codes[:, column] = q.to(torch.uint8)
            error = (block[:, j] - ((q - 8) * sf + zf)) / ub[j, j]
            block[:, j:] -= error[:, None] * ub[j, j:][None, :]
            errors[:, j] = error
        w[:, end:] -= errors @ u[start:end, end:]
    return QuantizedWeight(4, pack_int4(codes), scales, zeros)


def _hessians(model: nn.Module, layers: dict[str, nn.Linear], ids: Tensor, context: int,
              progress: bool) -> dict[str, Tensor]:
    """``X^T X / n`` of each layer's inputs over the calibration chunks (float64)."""
    sums = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64)
            for name, m in layers.items()}
    counts = dict.fromkeys(layers, 0)
    # q/k/v (and gate/up) read one input: its product is computed once a forward.
    products: dict[tuple, Tensor] = {}

    def hook(name: str):
        def accumulate(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, module.in_features)
            key = (x.data_ptr(), x.shape, x.dtype)
            if key not in products:
                products.clear()
                xf = x.float()
                products[key] = (xf.T @ xf).double()  # float32 per chunk, summed in float64
            sums[name] += products[key]
            counts[name] += x.shape[0]
        return accumulate

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in layers.items()]
    try:
        chunks = ids.split(context)
        with torch.no_grad():
            for chunk in tqdm(chunks, desc="calibration", unit="chunk", disable=not progress):
                model(chunk.view(1, -1))
                products.clear()
    finally:
        for handle in handles:
            handle.remove()
    unseen = [name for name, n in counts.items() if n == 0]
    if unseen:
        raise ValueError(f"model: the calibration never called {', '.join(unseen[:3])}"
                         f"{' ...' if len(unseen) > 3 else ''} through its module (a fused "
                         "inference step skips hooks); load it with kernels=False")
    return {name: sums[name] / counts[name] for name in layers}
