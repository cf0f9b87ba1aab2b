"""The functional core: the formulas ``linear`` and ``softmax``.

These are the lowest layer of the package (everything else may import them; they import
nothing of attnlab's but ``_checks``). ``scaled_dot_product_attention``, which chooses among
the attention backends, lives one layer up in :mod:`attnlab.attention.sdpa`.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["linear", "softmax"]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``y = x W^T + b``.

    x ``N.. x I``, weight ``O x I`` (stored ``out x in`` like ``torch.nn.Linear``),
    bias ``O`` -> ``N.. x O``.
    """
    if x.shape[-1:] != weight.shape[-1:] or weight.dim() != 2:
        raise ValueError(
            f"weight: expected shape O x {x.shape[-1] if x.dim() else '?'} to match x's last "
            f"dim, got {tuple(weight.shape)} for x of shape {tuple(x.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    flat = x.reshape(-1, x.shape[-1])
    # Column-major weights are the inference layout (attnlab.models.qwen2): one row is a
    # bandwidth-bound GEMV, several float32 rows use oneDNN's GEMM (~2x MKL's on AMD CPUs
    # with AVX-512; on AVX2 ones only up to a few rows, see _ONEDNN_MAX_ROWS_AVX2).
    # Without a native bfloat16 GEMM (AVX2 CPUs), PyTorch's fallback for this layout is ~20x
    # slower than for row-major weights, and one embedding_bag per row is ~3x faster still.
    fast = _fast_path(flat, weight)
    inference = fast and weight.shape[1] > 1 and weight.t().is_contiguous()
    if fast and _splits_over_threads(flat, weight, inference):
        y = _blocks_gemv(flat, weight, bias)
    elif inference and (flat.shape[0] == 1
                        or (weight.dtype == torch.bfloat16 and not _NATIVE_BF16_GEMM)):
        y = _rows_gemv(flat, weight, bias)
    elif (inference and weight.dtype == torch.float32 and _ONEDNN_LINEAR is not None
          and (_AVX512 or flat.shape[0] <= _ONEDNN_MAX_ROWS_AVX2)):
        y = _ONEDNN_LINEAR(flat, weight, bias, "none", [], "")
    else:
        # addmm folds the bias into the GEMM: one pass over the output instead of two.
        y = torch.addmm(bias, flat, weight.t()) if bias is not None else flat.matmul(weight.t())
    return y.view(*x.shape[:-1], weight.shape[0])


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """``softmax(x)_i = exp(x_i - max x) / sum_j exp(x_j - max x)`` along ``dim``.

    Subtracting the max keeps ``exp`` from overflowing. A slice that is all ``-inf`` (nothing
    to attend to) gives zeros, not NaN. Any shape.
    """
    if x.shape[dim] == 0:
        return x.clone()
    # The max only stabilises: softmax is shift-invariant, so it needs no gradient.
    m = x.detach().amax(dim=dim, keepdim=True)
    m = m.masked_fill(m == float("-inf"), 0.0)
    e = torch.exp(x - m)
    total = e.sum(dim=dim, keepdim=True)
    # total >= 1 whenever one entry is finite (the max contributes exp(0)); 0 means all -inf.
    return e / total.masked_fill(total == 0, 1.0)


# oneDNN's linear on plain (not prepacked) tensors; a private op, so only when present.
_ONEDNN_LINEAR = (getattr(torch.ops.mkldnn, "_linear_pointwise", None)
                  if torch.backends.mkldnn.is_available() else None)
# On AVX2 CPUs oneDNN wins only for a few rows (decoding); from ~64 rows on (prefill) MKL's
# GEMM on the same column-major weight is ~1.3x faster. On AVX-512 CPUs oneDNN wins throughout.
_AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
_ONEDNN_MAX_ROWS_AVX2 = 32
# Whether bfloat16 matmuls run on oneDNN (AVX-512, AMX or ARM bf16) rather than the fallback.
_NATIVE_BF16_GEMM = bool(torch.backends.mkldnn.is_available()
                         and getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", bool)())


def _fast_path(flat: Tensor, weight: Tensor) -> bool:
    """Whether the CPU fast paths apply: a float32 or bfloat16 CPU weight of ``x``'s dtype,
    and no gradient asked for (they compute none)."""
    return (weight.device.type == "cpu" and flat.dtype == weight.dtype
            and weight.dtype in (torch.float32, torch.bfloat16)
            and not (torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)))


def _splits_over_threads(flat: Tensor, weight: Tensor, column_major: bool) -> bool:
    """Whether one row times ``weight`` runs faster as :func:`_blocks_gemv`: on AVX2 CPUs
    MKL's own GEMV threading and the embedding_bag product stream a large float32 matrix at
    ~10-15 GB/s where per-thread blocks reach ~25 (measured on an AMD EPYC; on AVX-512 ones
    the embedding_bag product is already near bandwidth, so they keep it). One row, a
    row- or column-major float32 weight of at least 4 MiB whose outputs split evenly over
    the threads."""
    T = torch.get_num_threads()
    return (not _AVX512 and flat.shape[0] == 1 and T > 1 and weight.dtype == torch.float32
            and weight.numel() >= 2**20 and weight.shape[0] % T == 0
            and (column_major or weight.is_contiguous()))


def _blocks_gemv(flat: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``y = x W^T`` for one row ``x`` (``1 x I``) as ``T`` products ``x W_t^T``, ``W_t`` the
    ``t``-th block of ``O / T`` rows of ``W``: one per thread, so each thread streams its own
    part of the matrix (either layout) into an output that stays in its cache. -> ``1 x O``."""
    T = torch.get_num_threads()
    blocks = weight.view(T, -1, weight.shape[1]).transpose(1, 2)  # T x I x O/T
    y = torch.bmm(flat.expand(T, 1, -1), blocks).view(1, -1)
    return y if bias is None else y + bias


# (I, cuts) -> the index 0..I-1 and the bag offsets of one row, kept for decoding.
_ONE_ROW_BAGS: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}


def _rows_gemv(flat: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``y_m = x_m W^T = sum_i x_mi W^T[i, :]``: for each row ``m`` of ``flat`` (``M x I``), a
    weighted sum of the rows of ``W^T`` (``I x O``, contiguous), computed as an
    ``embedding_bag`` over all ``I`` rows with ``x_m`` as the weights. Its CPU kernel streams
    the matrix at close to memory bandwidth, where BLAS's GEMV can read it at half that (MKL
    on AMD CPUs). With fewer rows than threads, each row is cut into one bag per thread so
    that the threads share the work; the partial sums are added in float32. -> ``M x O``."""
    rows = weight.t()
    M, n = flat.shape
    cuts = max(1, min(torch.get_num_threads() // M, n // 64))
    if (n, cuts) not in _ONE_ROW_BAGS:
        _ONE_ROW_BAGS[n, cuts] = (torch.arange(n), torch.arange(0, n, -(-n // cuts)))
    index, offsets = _ONE_ROW_BAGS[n, cuts]
    if M > 1:
        index = index.repeat(M)
        offsets = (torch.arange(0, M * n, n)[:, None] + offsets).reshape(-1)
    parts = torch.nn.functional.embedding_bag(
        index, rows, offsets, mode="sum", per_sample_weights=flat.reshape(-1)
    )
    if cuts > 1:
        parts = parts.view(M, -1, parts.shape[-1]).sum(1, dtype=torch.float32).to(weight.dtype)
    return parts + bias if bias is not None else parts
