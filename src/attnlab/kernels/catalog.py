"""The CPU kernels for ``y = x W^T + b`` that the rule (or a measured plan) chooses among.

Each kernel (:class:`Kernel`, the one protocol of float and quantized kernels) is a pure
function ``run(x, stored, bias)``: x ``M x I`` (contiguous), ``stored`` what its
``prepare(weight, dtype)`` made of a weight ``O x I``, bias ``O`` or None -> ``M x O``.
They differ in speed, which depends on the CPU, the shape and the row count, and in the
order of their sums, so none is chosen here: :mod:`attnlab.kernels.rule` names one per
case and :mod:`attnlab.kernels.calibration` applies it (or a plan that ``attnlab
calibrate`` measured). A kernel that cannot run a
call (dtype, device, a private op missing from this torch build) says so through its
``takes`` predicate, which asks torch and the native build, never a CPU family.

``layout`` says what ``prepare`` keeps: ``"rows"`` the weight as stored (row-major, no
copy), ``"columns"`` the same values column-major (``W^T`` contiguous; it can replace the
weight's storage, so no second copy), ``"packed"`` oneDNN's opaque blocked copy (a second
copy beside the weight).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from attnlab.kernels import native
from attnlab.kernels.rule import DECODING_ROWS

__all__ = ["KERNELS", "LAYOUTS", "Kernel", "to_layout", "widened_product"]

LAYOUTS = ("rows", "columns", "packed")
# The dtypes the fast paths are written and tested for; the formula takes every dtype.
_FAST_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Kernel:
    """One way to compute ``y = x W^T + b``, for float weights (:data:`KERNELS`) and quantized
    ones (``attnlab.quantization.QUANTIZED_KERNELS``) alike:

    - ``prepare(weight, dtype) -> stored``: what ``run`` reads, made once per weight and
      activations' ``dtype`` (``weight`` a float ``O x I`` tensor in the activations' dtype,
      or a ``QuantizedWeight``);
    - ``run(x M x I, stored, bias O | None) -> M x O`` in x's dtype;
    - ``takes(weight, dtype) -> bool``: whether it runs ``weight`` with ``dtype``
      activations on this machine and build (it reads the weight's shape, dtype and format,
      never its values: a ``meta`` tensor will do);
    - ``max_rows``: the most rows of x it is offered (None: any);
    - ``layout``: how ``prepare`` keeps the weight (float: ``rows``, ``columns``,
      ``packed``; int4 codes: ``plain``, ``blocked``; None: as it is);
    - ``exact``: whether it computes the formula's numbers bit for bit.
    """

    name: str
    layout: str | None
    prepare: Callable[[Any, torch.dtype], Any]
    run: Callable[[Tensor, Any, Tensor | None], Tensor]
    takes: Callable[[Any, torch.dtype], bool]
    max_rows: int | None = None
    exact: bool = False

    def available(self, weight: Any, dtype: torch.dtype, rows: int) -> bool:
        """Whether it runs ``rows`` rows of ``dtype`` activations against ``weight``."""
        return (self.max_rows is None or rows <= self.max_rows) and self.takes(weight, dtype)


def to_layout(weight: Tensor, layout: str) -> Tensor:
    """``weight`` (``O x I``) stored as ``layout``: ``"rows"`` row-major, ``"columns"``
    column-major (same shape and values, ``W^T`` contiguous), ``"packed"`` oneDNN's blocked
    copy. No copy when it is already so stored."""
    if layout == "rows":
        return weight.contiguous()
    if layout == "columns":
        return weight if weight.t().is_contiguous() else weight.t().contiguous().t()
    if layout == "packed":
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def _formula(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` by BLAS: addmm folds the bias into the GEMM (one pass over the output)."""
    return torch.addmm(bias, x, weight.t()) if bias is not None else x.matmul(weight.t())


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` by oneDNN's inner-product primitive (a private op), on a plain weight
    in either layout or on its packed copy."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _blocks_gemv(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``y = x W^T`` for one row ``x`` (``1 x I``) as ``n`` products ``W_b x^T``, ``W_b`` the
    ``b``-th block of ``O / n`` contiguous rows of ``W``, ``n`` a multiple of the thread
    count ``T`` (up to ``4 T``): each thread streams its own blocks row by row (the rule: a
    plain GEMV reads faster than the transposed product ``x W_b^T``, and several blocks per
    thread read a cold matrix faster than one; ``python -m devbench gemv`` measures both).
    -> ``1 x O``."""
    n = _block_count(weight.shape[0], torch.get_num_threads())
    blocks = weight.view(n, -1, weight.shape[1])  # n x O/n x I
    y = torch.bmm(blocks, x.t().expand(n, -1, 1)).view(1, -1)
    return y if bias is None else y + bias


def _block_count(out_features: int, threads: int) -> int:
    """The most blocks, ``4 T``, ``2 T`` or ``T``, that divide ``out_features`` rows evenly."""
    return next(k * threads for k in (4, 2, 1) if out_features % (k * threads) == 0)


# (I, cuts) -> the index 0..I-1 and the bag offsets of one row, kept for decoding.
_ONE_ROW_BAGS: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}


def _rows_gemv(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``y_m = x_m W^T = sum_i x_mi W^T[i, :]``: for each row ``m`` of ``x`` (``M x I``), a
    weighted sum of the rows of ``W^T`` (``I x O``, contiguous: a column-major weight),
    computed as an ``embedding_bag`` over all ``I`` rows with ``x_m`` as the weights. Its CPU
    kernel streams the matrix close to memory bandwidth, where some BLAS GEMVs read it at half
    that. With fewer rows than threads, each row is cut into one bag per thread so that the
    threads share the work; the partial sums are added in float32. -> ``M x O``."""
    rows = weight.t()
    M, n = x.shape
    cuts = max(1, min(torch.get_num_threads() // M, n // 64))
    if (n, cuts) not in _ONE_ROW_BAGS:
        # Made outside inference mode, so that the cached index also serves autograd-free
        # calls made later in normal mode.
        with torch.inference_mode(False):
            _ONE_ROW_BAGS[n, cuts] = (torch.arange(n), torch.arange(0, n, -(-n // cuts)))
    index, offsets = _ONE_ROW_BAGS[n, cuts]
    if M > 1:
        index = index.repeat(M)
        offsets = (torch.arange(0, M * n, n)[:, None] + offsets).reshape(-1)
    parts = torch.nn.functional.embedding_bag(
        index, rows, offsets, mode="sum", per_sample_weights=x.reshape(-1)
    )
    if cuts > 1:
        parts = parts.view(M, -1, parts.shape[-1]).sum(1, dtype=torch.float32).to(x.dtype)
    return parts + bias if bias is not None else parts


# Bounds the float32 copy a widened call holds (a 151936 x 896 head widened at once is 544
# MB); blocks of 1-16 MiB and none ran alike on a CPU held to 256-bit vectors.
_WIDEN_BYTES = 16 * 2**20


def widened_product(x: Tensor, out_features: int, block: Callable[[int, int], Tensor],
                    bias: Tensor | None) -> Tensor:
    """``x W^T + b`` by float32 BLAS with ``W`` made a block of output rows at a time:
    ``block(o0, o1)`` gives the rows ``[o0, o1)`` of ``W`` in float32 (``_WIDEN_BYTES`` of
    them), x (``M x I``) is widened once and each sum rounded once to x's dtype. -> ``M x O``."""
    wide = x.float()
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    step = max(1, _WIDEN_BYTES // (4 * x.shape[1]))
    for o in range(0, out_features, step):
        rows = block(o, min(o + step, out_features)).t()
        y[:, o:o + step] = (wide.matmul(rows) if bias is None
                            else torch.addmm(bias[o:o + step].float(), wide, rows))
    return y


def _widened(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` with a bfloat16 ``W`` widened to float32 a block of output rows at a
    time and multiplied by float32 BLAS (:func:`widened_product`). Where BLAS has no bfloat16
    arithmetic its bfloat16 GEMM is the slow one (on a CPU without AVX-512, ~5x float32's):
    widening costs a read and a write of the weight per call, which a product of many rows
    repays. -> ``M x O``."""
    return widened_product(x, weight.shape[0], lambda o0, o1: weight[o0:o1].float(), bias)


def _onednn_takes(dtype: torch.dtype, ops: tuple[str, ...]) -> bool:
    """Whether this torch build has oneDNN's private ``ops`` and runs ``dtype`` through them
    on this CPU (bfloat16 needs CPU support, which torch reports)."""
    if not torch.backends.mkldnn.is_available() or dtype not in _FAST_DTYPES:
        return False
    if not all(hasattr(torch.ops.mkldnn, op) for op in ops):
        return False
    return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _fast_dtype(weight: Tensor, dtype: torch.dtype) -> bool:
    return dtype in _FAST_DTYPES


def _over_threads(weight: Tensor, dtype: torch.dtype) -> bool:
    T = torch.get_num_threads()
    return dtype in _FAST_DTYPES and T > 1 and weight.shape[0] % T == 0


def _bfloat16(weight: Tensor, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16


# The GEMVs sum each row alike whatever the rows: offered for every decoding bucket
# (DECODING_ROWS), so that the rule can run one loop for any decoding batch.
def _native(weight: Tensor, dtype: torch.dtype) -> bool:
    return dtype in _FAST_DTYPES and native.available()


def _native_pairs_takes(weight: Tensor, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and native.pairs_available()


def _native_tiles_takes(weight: Tensor, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and native.tiles_available()


def _onednn_plain(weight: Tensor, dtype: torch.dtype) -> bool:
    return _onednn_takes(dtype, ("_linear_pointwise",))


def _onednn_packed(weight: Tensor, dtype: torch.dtype) -> bool:
    return _onednn_takes(dtype, ("_linear_pointwise", "_reorder_linear_weight"))


def _every_dtype(weight: Tensor, dtype: torch.dtype) -> bool:
    return True


def _rows(weight: Tensor, dtype: torch.dtype) -> Tensor:
    return to_layout(weight, "rows")


def _columns(weight: Tensor, dtype: torch.dtype) -> Tensor:
    return to_layout(weight, "columns")


def _packed(weight: Tensor, dtype: torch.dtype) -> Tensor:
    return to_layout(weight, "packed")


KERNELS: dict[str, Kernel] = {
    kernel.name: kernel
    for kernel in (
        Kernel("formula", "rows", _rows, _formula, _every_dtype, exact=True),
        Kernel("columns", "columns", _columns, _formula, _fast_dtype),
        Kernel("onednn", "rows", _rows, _onednn, _onednn_plain),
        Kernel("onednn_columns", "columns", _columns, _onednn, _onednn_plain),
        Kernel("onednn_packed", "packed", _packed, _onednn, _onednn_packed),
        Kernel("rows_gemv", "columns", _columns, _rows_gemv, _fast_dtype),
        Kernel("blocks_gemv", "rows", _rows, _blocks_gemv, _over_threads, max_rows=1),
        Kernel("widened", "rows", _rows, _widened, _bfloat16),
        # attnlab's own C++ products, called as they are: native.gemv reads each weight row
        # once for all rows of x, converted to float32 in registers (or, pairs=True, takes
        # its bfloat16 products two at a time instead of widening the weight);
        # native.gemv_tiles reads the row-major weight once for up to 32 rows of x, in
        # 16 x 16 x 32 multiply-adds a matrix-tile product.
        Kernel("native_gemv", "rows", _rows, native.gemv, _native, DECODING_ROWS),
        Kernel("native_pairs", "rows", _rows, partial(native.gemv, pairs=True),
               _native_pairs_takes, DECODING_ROWS),
        Kernel("native_tiles", "rows", _rows, native.gemv_tiles, _native_tiles_takes,
               DECODING_ROWS),
    )
}
