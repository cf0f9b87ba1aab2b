"""The rule that chooses a kernel for ``x W^T + b``, with no timing: from the weight's scheme
(float32, bfloat16, int8, grouped int8, int4), the activations' dtype, the rows bucket and the CPU's
features as the native build reports them, as llama.cpp chooses by tensor type and CPU
feature. One machine always runs the same kernels, so one input always gives the same
output, across loads and processes.

Rows come in buckets, each with one representative row count (what ``attnlab calibrate``
times; a bucket's kernel must run every row count in it):

=========  =============  ===========================================================
bucket     representative  who calls with it
=========  =============  ===========================================================
``1``      1              one sequence decoding
``2-8``    8              a few sequences decoded together
``9-32``   16             a server's batch of decoding requests
``33+``    512            prefill: a prompt chunk (a quantized kernel's cost grows with
                          the rows while the formula's dequantization is paid once, so a
                          kernel that wins at 128 rows can lose 2x at 512)
=========  =============  ===========================================================

Batch invariance: a request's output must not depend on how many other rows share its
step, so for the three decoding buckets the rule names ONE kernel (the same loop for 1 to 32
rows) wherever a kernel exists whose per-row sums are added in the same order whatever the
row count. Where none does, :func:`rule`'s docstring says so, case by case.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from attnlab.kernels import native

__all__ = ["BATCH_INVARIANT", "BUCKETS", "DECODING", "DECODING_ROWS", "QUANTIZED_NAMES",
           "ROW_BUCKETS", "Features", "batch_invariant", "bucket_of", "features", "largest",
           "rule"]

# name -> (smallest row count, representative row count)
BUCKETS: dict[str, tuple[int, int]] = {"1": (1, 1), "2-8": (2, 8), "9-32": (9, 16),
                                       "33+": (33, 512)}
DECODING = ("1", "2-8", "9-32")  # the buckets that one batch-invariant kernel covers
# The most rows a decoding kernel is offered: the top of the last decoding bucket.
DECODING_ROWS = BUCKETS["33+"][0] - 1
# The kernels of attnlab.quantization.kernels (a layer above this package, so named here;
# a test checks that the two lists agree): ATTNLAB_KERNELS may name any of them.
QUANTIZED_NAMES = ("dequantize", "int8_mm", "int4_mm", "native_dequantize", "native_widened",
                   "int8_native", "int8_integers", "int8_tiles", "int8_grouped", "int4_native",
                   "int4_native_pairs", "int4_integers")

# The kernels that add each row's products in the same order whatever the rows beside it: the
# C++ loops keep one chain of sums per output and row of x, whatever the block of rows or the
# threads' split of the outputs (native_gemv, int8_native: each sum one chain over 16 inputs
# on an AVX-512 build, over 8 on a 256-bit (x86-64-v3) build, one `omp simd` loop without
# either; the 256-bit build's bfloat16 weights are the exception, the two halves of a load
# summed apart or together as the registers allow, so the rule does not count on native_gemv
# for bfloat16); x padded to a tile; PyTorch's int8/int4 ops as measured on the EPYC, 1 and 2
# threads, 1-33 rows; int8_grouped, each output's groups added in order into two alternating
# sums whatever the rows (tests/kernels/test_rule.py proves it). Not here: BLAS (the formula,
# its GEMM blocking follows the rows), rows_gemv and blocks_gemv (their split follows rows and
# threads).
BATCH_INVARIANT = frozenset({"native_gemv", "native_tiles", "native_pairs", "int8_native",
                             "int8_integers", "int8_grouped", "int4_integers",
                             "int4_native_pairs", "int4_native", "int8_mm", "int4_mm"})


@dataclass(frozen=True)
class Features:
    """What this machine's build and torch can run: ``native`` attnlab's C++ kernels are
    built and loaded; ``pairs`` their bfloat16 pair products (``vdpbf16ps``, AVX-512 BF16);
    ``tiles`` their AMX tile kernels; ``integers`` their exact integer products
    (``vpdpwssd``, AVX-512 VNNI); ``bfloat16_gemm`` torch's GEMM has bfloat16 arithmetic
    (oneDNN where torch reports bfloat16 support on this CPU; elsewhere it runs ~5x
    slower than float32's)."""

    native: bool
    pairs: bool
    tiles: bool
    integers: bool
    bfloat16_gemm: bool


@functools.cache
def features() -> Features:
    """This machine's :class:`Features`, asked once per process (loading the native build if
    it is there; nothing is timed)."""
    built = native.available()
    bf16 = (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    return Features(native=built, pairs=built and native.pairs_available(),
                    tiles=built and native.tiles_available(),
                    integers=built and native.integers_available(), bfloat16_gemm=bf16)


def rule(scheme: str, dtype: torch.dtype, cpu: Features, *, extra_memory: bool = False
         ) -> dict[str, tuple[str, ...]]:
    """``{bucket: kernels}``: for a weight of ``scheme`` (``"float32"``, ``"bfloat16"``: a
    float weight, activations in its dtype; ``"int8"``, ``"int8 grouped"``, ``"int4"``: a
    quantized weight) and
    activations in ``dtype``, on a machine with ``cpu``'s features, the kernels to run per
    rows bucket in order of preference; the caller takes the first that can run the weight's
    shape, else the formula (``formula``, or ``dequantize`` for a quantized weight).

    Why each case (GB/s and % of the read bandwidth from ``benchmarks/gemv.md``, a decoding
    step streams every weight once; Xeon: AVX-512 with AMX, EPYC: AVX-512 BF16 and VNNI, v3:
    the Xeon held to 256-bit vectors, x86-64-v3, in the benchmarks folder beside them):

    - float32, native: ``native_gemv`` for 1-32 rows (Xeon 103-119% at one row, 100% at
      eight, where BLAS reads 48%; EPYC 84%; v3 122% / 87%), batch-invariant (each output a
      single chain of sums whatever the rows); from 9 rows it reads each weight once per 8
      rows where a BLAS GEMM reads it once, the price of one order of sums for every
      decoding batch (``extra_memory`` trades it back). From 33 rows oneDNN's GEMM
      (``onednn``, where torch has it; else BLAS, the formula), the faster of the two on
      prefill-sized products (``python -m devbench qwen2``'s prefill and the plans of
      ``attnlab calibrate`` measure it on each CPU); the weight stays as stored.
    - bfloat16 with AMX tiles: ``native_tiles`` for 1-32 rows (109% at one row, 105% at
      eight) and batch-invariant: a tile sums each row's products in the same order
      whatever the rows (x is padded to 16).
    - bfloat16 with pair products: ``native_pairs`` for 1-32 rows, batch-invariant (each
      row's two chains the same whatever the rows): the fastest at one row (EPYC 100%, Xeon
      118%); at eight ~15% behind ``native_gemv`` (Xeon 66% vs 78%), the price of
      invariance.
    - bfloat16, native without either: ``native_gemv`` for 1-8 (v3 110% / 59%; BLAS 53% /
      17%); not counted batch-invariant (the 256-bit build sums the two halves of a bfloat16
      load apart or together as its registers allow, which depends on the rows).
    - bfloat16 from 9 rows (from 33 with tiles or pairs): the formula where torch's GEMM
      has bfloat16 arithmetic, else ``widened`` (float32 BLAS on the weight widened 16 MiB
      at a time: v3 prefill 0.99x -> 4.67x of transformers).
    - int8, bfloat16 x: ``int8_integers`` for 1-32 rows with VNNI (106% at one row, 47% at
      eight vs ``int8_native``'s 53%), batch-invariant (x rounded per row, exact integer
      sums); else ``int8_native`` (90%; v3 82%), batch-invariant as float32's ``native_gemv``.
    - int4, bfloat16 x: ``int4_integers`` (77% / 24% of the bandwidth at one / eight rows,
      the best at both; groups of a multiple of 64), else ``int4_native_pairs`` (72%), else
      ``int4_native`` (56%; v3 47%), all three batch-invariant, for 1-32 rows.
    - int8 / int4, float32 x: ``int8_native`` / ``int4_native`` for 1-32 (integers and
      pairs take bfloat16 x only), both batch-invariant.
    - int8 / int4 without native kernels: PyTorch's ``int8_mm`` / ``int4_mm`` for 1-32
      (61% / 51%, vs the formula's 12% / 2%), batch-invariant as measured.
    - int8 / int4 from 33 rows: the formula, its ``W'`` made by the C++ dequantization
      (``native_dequantize``: the same numbers, one pass) for a BLAS GEMM; for bfloat16 x
      without bfloat16 GEMM arithmetic, ``native_widened`` (float32 BLAS).
    - grouped int8 (a scale, maybe an offset, per group: GGUF's Q8_0, Q5_*, Q6_K), native:
      ``int8_grouped`` for 1-32 rows, batch-invariant (each output's groups summed in
      order whatever the rows); no other kernel takes it, so the formula everywhere else.
    - ``extra_memory``: oneDNN's packed copy (``onednn_packed``) first for a float weight's
      9-32 rows (its rows in ``benchmarks/gemv.md``: the best at eight rows), giving up
      batch invariance for a server's batches; prefill keeps the formula.
    """
    if scheme not in ("float32", "bfloat16", "int8", "int8 grouped", "int4"):
        raise ValueError(f"scheme: expected 'float32', 'bfloat16', 'int8', 'int8 grouped' or "
                         f"'int4', got {scheme!r}")
    if scheme in ("float32", "bfloat16"):
        return _float_rule(scheme, cpu, extra_memory)
    if scheme == "int8 grouped":
        decoding = ("int8_grouped",) if cpu.native else ("dequantize",)
        return {**dict.fromkeys(DECODING, decoding), "33+": ("dequantize",)}
    return _quantized_rule(int(scheme[3:]), dtype, cpu)


def batch_invariant(plan: dict[str, str]) -> bool:
    """Whether a plan (``{bucket: kernel}``) gives a row the same output whatever the rows
    beside it, from 1 to 32: one kernel for the three decoding buckets, and one of
    :data:`BATCH_INVARIANT`."""
    kernels = {plan[b] for b in DECODING}
    return len(kernels) == 1 and kernels <= BATCH_INVARIANT


def bucket_of(rows: int) -> str:
    """The rows bucket that ``rows`` (>= 1) falls in."""
    for name, (lowest, _) in reversed(BUCKETS.items()):
        if rows >= lowest:
            return name
    raise ValueError(f"rows: expected a positive int, got {rows!r}")


# The bucket of each row count, entry ``rows - 1``, the last for every count from the open-ended
# bucket's lowest up: ``ROW_BUCKETS[min(rows, len(ROW_BUCKETS)) - 1]`` is ``bucket_of(rows)``
# for the code that runs on every token, which reads a tuple instead of calling.
ROW_BUCKETS = tuple(bucket_of(rows) for rows in range(1, BUCKETS["33+"][0] + 1))


def largest(bucket: str) -> int:
    """The most rows a kernel must take to serve ``bucket``: its top (1, 8, 32), or the
    representative row count of the open-ended ``33+``."""
    names = list(BUCKETS)
    if bucket not in BUCKETS:
        raise ValueError(f"bucket: expected one of {', '.join(BUCKETS)}, got {bucket!r}")
    at = names.index(bucket)
    return BUCKETS[names[at + 1]][0] - 1 if at + 1 < len(names) else BUCKETS[bucket][1]


def _float_rule(scheme: str, cpu: Features, extra_memory: bool) -> dict[str, tuple[str, ...]]:
    gemm = ("formula",) if scheme == "float32" or cpu.bfloat16_gemm else ("widened",)
    prefill = ("onednn", *gemm) if scheme == "float32" else gemm
    if scheme == "bfloat16" and cpu.tiles:
        decoding = ("native_tiles",)
    elif scheme == "bfloat16" and cpu.pairs:
        decoding = ("native_pairs",)
    elif cpu.native and scheme == "float32":
        decoding = ("native_gemv",)
        if extra_memory:
            return {"1": decoding, "2-8": decoding, "9-32": ("onednn_packed", *decoding),
                    "33+": prefill}
    elif cpu.native:
        few = {"1": ("native_gemv",), "2-8": ("native_gemv",)}
        batch = ("onednn_packed", *gemm) if extra_memory else gemm
        return {**few, "9-32": batch, "33+": prefill}
    else:
        few = ("formula",)
        batch = ("onednn_packed", *gemm) if extra_memory else gemm
        return {"1": few, "2-8": few, "9-32": batch, "33+": prefill}
    return {**dict.fromkeys(DECODING, decoding), "33+": prefill}


def _quantized_rule(bits: int, dtype: torch.dtype, cpu: Features) -> dict[str, tuple[str, ...]]:
    bf16 = dtype == torch.bfloat16
    torchs = f"int{bits}_mm"  # PyTorch's op: where no native kernel takes the weight or dtype
    if not cpu.native:
        return {**dict.fromkeys(DECODING, (torchs,)), "33+": ("dequantize",)}
    # Integer and pair products take bfloat16 x only (float32 x would lose digits it has).
    integers = bf16 and cpu.integers
    if bits == 8:
        decoding = ("int8_integers",) if integers else ()
    else:
        decoding = (("int4_integers",) if integers else ()) + (
            ("int4_native_pairs",) if bf16 and cpu.pairs else ())
    decoding += (f"int{bits}_native", torchs)
    prefill = ("native_widened",) if bf16 and not cpu.bfloat16_gemm else ("native_dequantize",)
    return {**dict.fromkeys(DECODING, decoding), "33+": prefill}
