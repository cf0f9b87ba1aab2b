"""The kernels for ``y = x W'^T + b`` with a quantized ``W'``, and the measuring that picks one.

``dequantize`` is the formula (``W'`` made in ``x``'s dtype, then ``linear``): it runs every
case and is the reference the others are tested against. ``int8_mm`` is PyTorch's
``_weight_int8pack_mm`` (int8 codes and per-row scales read directly), ``int4_mm`` its
``_weight_int4pack_mm_for_cpu`` on the blocked layout (``attnlab.quantization.formats``);
``native_dequantize`` the formula with ``W'`` made by attnlab's C++ dequantization,
``native_widened`` the same ``W'`` made in float32 a block at a time for float32 BLAS (bfloat16
x, where BLAS has no fast bfloat16 GEMM), and
``int8_native``, ``int4_native``, ``int4_native_pairs`` and ``int8_integers``,
``int4_integers`` (x rounded to 16-bit integers, exact integer products) attnlab's C++ GEMVs
(:mod:`attnlab.kernels.native`) for a few rows, ``int8_grouped`` its GEMV for grouped int8
(GGUF's Q8_0, Q5_*, Q6_K: a scale, and maybe an offset, per group of 16 or 32 inputs), and
``int8_tiles`` its AMX tile kernel (on a CPU that has AMX-BF16) for up to 32.
Reading 1-2 bytes less per weight matters when a weight is read once per token (decoding);
with many rows (prefill) the formula's one dequantization and a BLAS GEMM usually win, so the
choice is made per rows bucket, by the same chooser as float weights' (one bucket table, one
cache file, one environment switch; :mod:`attnlab.kernels.calibration`): the fixed rule
(:func:`attnlab.kernels.rule.rule`) unless ``attnlab calibrate`` measured a plan for the exact
key. ``$ATTNLAB_KERNELS`` (or a ``kernel`` argument) forces one kernel, ``dequantize``
falling in where the forced one cannot run; ``$ATTNLAB_QUANTIZED_KERNELS`` is its old name.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from attnlab.kernels import BUCKETS, calibration, native
from attnlab.kernels import cache as kernel_cache
from attnlab.kernels.calibration import cold_copies, forced_by_environment
from attnlab.kernels.catalog import Kernel, widened_product
from attnlab.kernels.rule import DECODING_ROWS, features, largest, rule
from attnlab.quantization.formats import BLOCK_ROWS, QuantizedWeight, blocked_int4, quantize

__all__ = ["QUANTIZED_KERNELS", "cached", "forced_quantized_kernel",
           "measure", "plan", "rule_plan", "step_product"]

_MARGIN = 1.1  # how much faster than the formula a kernel must measure to be chosen
# The native GEMVs take any row count at a cost linear in it; offered up to the "9-32"
# bucket (DECODING_ROWS), so that one loop serves every decoding batch (batch invariance) and
# the layout they need is not lost for decoding to a bucket that no kernel on it was offered
# (one layout is kept for every bucket: see ``plan``).


def forced_quantized_kernel(kernel: str | None = None) -> str | None:
    """The kernel forced everywhere: ``kernel`` when given (one of
    :data:`QUANTIZED_KERNELS`), else ``$ATTNLAB_KERNELS``'s where it names a quantized kernel
    (``formula``, the float formula, means ``dequantize``), else None (plan or rule)."""
    if kernel is not None:
        if not isinstance(kernel, str) or kernel.strip() not in QUANTIZED_KERNELS:
            raise ValueError(f"kernel: expected one of {', '.join(QUANTIZED_KERNELS)}, got "
                             f"{kernel!r}")
        return kernel.strip()
    name = forced_by_environment()
    name = "dequantize" if name == "formula" else name
    return name if name in QUANTIZED_KERNELS else None


def plan(weight: QuantizedWeight, dtype: torch.dtype, *, kernel: str | None = None,
         bias: bool = True, measure_now: bool = False) -> dict[str, str]:
    """``{rows bucket: kernel name}`` for ``weight`` with activations in ``dtype``, for a
    module that adds a bias or not (``bias``): the forced kernel where it can run; else,
    when the cache holds timings for every bucket (``attnlab calibrate`` wrote them; with
    ``measure_now`` what is missing is measured now), the fastest measured (the formula
    unless another is faster by ``_MARGIN``, or an exact kernel faster at all); else the
    rule (:func:`rule_plan`). Without ``measure_now`` nothing is timed; nor is a weight that
    only the formula runs: there is nothing to choose."""
    forced = forced_quantized_kernel(kernel)
    names = [n for n, k in QUANTIZED_KERNELS.items() if k.takes(weight, dtype)]
    if forced is not None:
        return {b: forced if QUANTIZED_KERNELS[forced].available(weight, dtype, BUCKETS[b][1])
                else "dequantize" for b in BUCKETS}
    if names == ["dequantize"]:
        return dict.fromkeys(BUCKETS, "dequantize")
    lookup = measure if measure_now else cached
    timings = {b: lookup(weight, dtype, b, [n for n in names if QUANTIZED_KERNELS[n].available(
        weight, dtype, BUCKETS[b][1])], bias=bias) for b in BUCKETS}
    if not all(timings.values()):
        return rule_plan(weight, dtype)
    best = {b: min(t.values()) for b, t in timings.items()}
    # The codes are kept in one layout: the layout whose kernels lose least against each
    # bucket's fastest, summed over the buckets (the one kept now unless another is better
    # by _MARGIN); within it, per bucket, the formula unless a kernel beats it by _MARGIN
    # (an exact kernel gives the same numbers, so any gain counts).
    options = {}
    for layout in dict.fromkeys((weight.layout, "plain", "blocked")):
        picks = {}
        for b, t in timings.items():
            fits = {n: us for n, us in t.items() if QUANTIZED_KERNELS[n].layout in (None, layout)}
            fastest = min(fits, key=fits.__getitem__)
            margin = 1.0 if QUANTIZED_KERNELS[fastest].exact else _MARGIN
            picks[b] = fastest if margin * fits[fastest] <= fits["dequantize"] else "dequantize"
        options[layout] = (sum(timings[b][n] / best[b] for b, n in picks.items()), picks)
    chosen = min(options, key=lambda name: options[name][0])
    if options[weight.layout][0] <= _MARGIN * options[chosen][0]:
        chosen = weight.layout
    return options[chosen][1]


def rule_plan(weight: QuantizedWeight, dtype: torch.dtype) -> dict[str, str]:
    """The rule's plan (:func:`attnlab.kernels.rule.rule` for ``int8``, ``int8 grouped`` or
    ``int4`` on this machine's features): per bucket the first of the rule's kernels that can
    run ``weight`` with ``dtype`` activations for the bucket's every row count, else
    ``dequantize``."""
    ruled = rule(_scheme(weight), dtype, features())
    return {b: next((n for n in names if QUANTIZED_KERNELS[n].available(weight, dtype,
                                                                       largest(b))),
                    "dequantize") for b, names in ruled.items()}


def _scheme(weight: QuantizedWeight) -> str:
    """The rule's scheme of ``weight``: ``int4``, ``int8`` (a scale per row) or ``int8
    grouped`` (a scale, and maybe an offset, per group)."""
    return "int8 grouped" if weight.bits == 8 and not weight.per_row else f"int{weight.bits}"


def cached(weight: QuantizedWeight, dtype: torch.dtype, bucket: str, names: list[str], *,
           bias: bool = True) -> dict[str, float]:
    """The timings of ``names`` that the cache holds for a weight of ``weight``'s format and
    shape in ``bucket`` (``{}`` when none, or none of the formula); never times anything."""
    stored = calibration.stored_timings(_key(weight, dtype, bucket, bias))
    if "dequantize" not in stored:
        return {}
    return {n: stored[n] for n in names if n in stored and math.isfinite(stored[n])}


def measure(weight: QuantizedWeight, dtype: torch.dtype, bucket: str,
            names: list[str], *, bias: bool = True) -> dict[str, float]:
    """Median microseconds per call of each kernel in ``names`` for a weight of ``weight``'s
    format and shape, at the bucket's representative row count, with a bias or not
    (``bias``): read from the cache file, else timed now on random weights (each checked
    against the formula) and added to it (what ``attnlab calibrate`` runs; a load never
    does)."""
    key = _key(weight, dtype, bucket, bias)
    known = calibration.stored_timings(key)
    missing = [n for n in names if n not in known]
    if missing:
        timed = _time_kernels(weight, dtype, BUCKETS[bucket][1], missing, bias=bias)
        known.update({n: timed.get(n, math.inf) for n in missing})
        calibration.write_timings(key, known)
    return {n: known[n] for n in names if math.isfinite(known[n])}


def _key(weight: QuantizedWeight, dtype: torch.dtype, bucket: str, bias: bool) -> str:
    """The cache key: the scheme (``int8``, ``int4 g64``) before the float key's parts."""
    rows, cols = weight.shape
    scheme = (f"int{weight.bits}" + ("" if weight.per_row else f" g{weight.group_size}")
              + (" coded" if weight.coded else ""))
    entry = kernel_cache.entry_key(dtype, rows, cols, bucket, bias=bias, build=native.build_id())
    return f"{scheme} | {entry}"


def _time_kernels(like: QuantizedWeight, dtype: torch.dtype, rows: int,
                  names: list[str], *, bias: bool) -> dict[str, float]:
    """Median microseconds per call of each kernel (with a random bias when ``bias``) on
    copies of a random weight of ``like``'s format and shape that together exceed the caches,
    by the float kernels' timing (:func:`attnlab.kernels.calibration.time_kernels`)."""
    n_out, n_in = like.shape
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        if like.bits == 8 and not like.per_row:
            base = _random_grouped_int8(like, g)
        else:
            dense = torch.randn(n_out, n_in, generator=g) / n_in**0.5
            base = quantize(dense, like.bits, like.group_size,
                            torch.int8 if like.coded else like.scales.dtype)
        x = torch.randn(rows, n_in, generator=g).to(dtype)
        b = torch.randn(n_out, generator=g).to(dtype) if bias else None
        expected = QUANTIZED_KERNELS["dequantize"].run(x, _prepare("dequantize", base, dtype),
                                                       b)
        count = cold_copies(base.data.numel() * base.data.element_size())
        # One set of copies per layout, shared by the kernels that read it as it is.
        copies: dict[str, list[QuantizedWeight]] = {}
        prepared: dict[str, tuple[Kernel, list[tuple]]] = {}
        for name in names:
            layout = QUANTIZED_KERNELS[name].layout or base.layout
            if layout not in copies:
                weight = base.with_layout(layout)
                copies[layout] = [weight, *(_copy(weight) for _ in range(count - 1))]
            try:
                states = [_prepare(name, copy, dtype) for copy in copies[layout]]
            except RuntimeError as error:
                warnings.warn(f"quantized kernel {name}: left out, it raised {error}",
                              stacklevel=4)
                continue
            prepared[name] = (QUANTIZED_KERNELS[name], states)
        return calibration.time_kernels(prepared, x, b, expected, (3e-2, 3e-2))


def _random_grouped_int8(like: QuantizedWeight, g: torch.Generator) -> QuantizedWeight:
    """A random grouped int8 weight of ``like``'s shape, groups, dtypes and offsets (or
    none): ``quantize`` makes only the per-row kind."""
    n_out, n_in = like.shape
    q = torch.randint(-127, 128, (n_out, n_in), dtype=torch.int8, generator=g)
    scale = 1 / (127 * n_in**0.5)
    scales = (torch.rand(like.scales.shape, generator=g) * scale).to(like.scales.dtype)
    zeros = (None if like.zeros is None else
             (torch.randn(like.zeros.shape, generator=g) * scale).to(like.zeros.dtype))
    return QuantizedWeight(8, q, scales, zeros)


def _prepare(name: str, weight: QuantizedWeight, dtype: torch.dtype) -> tuple:
    return QUANTIZED_KERNELS[name].prepare(weight, dtype)


def _copy(weight: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(weight.bits, weight.data.clone(), weight.scales.clone(),
                           None if weight.zeros is None else weight.zeros.clone(), weight.layout,
                           None if weight.steps is None else weight.steps.clone())


def _dequantize_prepare(weight: QuantizedWeight, dtype: torch.dtype) -> tuple:
    return (weight, dtype)


def _dequantize_run(x: Tensor, state: tuple, bias: Tensor | None) -> Tensor:
    """The formula: ``x W'^T + b`` with ``W'`` dequantized in ``x``'s dtype."""
    weight, dtype = state
    return torch.nn.functional.linear(x, weight.dequantize(dtype), bias)


def _int8_prepare(weight: QuantizedWeight, dtype: torch.dtype) -> tuple:
    return (weight.data.contiguous(), weight.scales.to(dtype))


def _int8_run(x: Tensor, state: tuple, bias: Tensor | None) -> Tensor:
    """``(x q^T) * s`` in one pass over the int8 codes."""
    y = torch.ops.aten._weight_int8pack_mm(x, *state)
    return y if bias is None else y + bias


def _int4_prepare(weight: QuantizedWeight, dtype: torch.dtype) -> tuple:
    # The kernel takes (scale, zero) pairs as groups x O x 2, in the activations' dtype.
    pairs = torch.stack(weight.group_scales(), dim=-1).transpose(0, 1)
    return (weight.data.contiguous(), weight.group_size, pairs.to(dtype).contiguous())


def _int4_run(x: Tensor, state: tuple, bias: Tensor | None) -> Tensor:
    """``x ((q - 8) s + z)^T`` per group, reading the 4-bit codes directly."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, *state)
    return y if bias is None else y + bias


def _int8_native_prepare(weight: QuantizedWeight, dtype: torch.dtype) -> tuple:
    return (weight.data.contiguous(), weight.scales.contiguous())


def _int8_native_run(x: Tensor, state: tuple, bias: Tensor | None) -> Tensor:
    """``x (q s)^T``: attnlab's C++ GEMV, the codes converted in registers."""
    return native.gemv_int8(x, *state, bias)


def _int8_integers_run(x: Tensor, state: tuple, bias: Tensor | None) -> Tensor:
    """``x (q s)^T`` with x rounded to 16-bit integers per block, multiplied with the codes
    exactly in int32 (``vpdpwssd``): half the instructions of widening the codes to float."""
    return native.gemv_int8(x, *state, bias, integers=True)


def _int8_tiles_run(x: Tensor, state: tuple, bias: Tensor | None) -> Tensor:
    """``x (q s)^T`` on AMX tiles: the codes widened to bfloat16 beside each tile product."""
    return native.gemv_int8_tiles(x, *state, bias)


def _native_codes(weight: QuantizedWeight, dtype: torch.dtype | None = None) -> tuple:
    """What the C++ kernels read: codes, scales, zeros (None for int8), group size; the same
    for every activation dtype. float16 scales and zeros are widened to float32 here,
    exactly, and coded ones decoded to float32 (the loops read float32 or bfloat16): a
    prepared copy of 4 bytes a group beside the stored 2 or 1, the codes shared."""
    scales, zeros = weight.group_scales()
    if scales.dtype == torch.float16:
        scales, zeros = scales.float(), None if zeros is None else zeros.float()
    zeros = None if zeros is None else zeros.contiguous()
    return (weight.data.contiguous(), scales.contiguous(), zeros, weight.group_size)


def _int8_grouped_prepare(weight: QuantizedWeight, dtype: torch.dtype) -> tuple:
    zeros = None if weight.zeros is None else weight.zeros.contiguous()
    return (weight.data.contiguous(), weight.scales.contiguous(), zeros, weight.group_size)


def _int8_grouped_run(x: Tensor, state: tuple, bias: Tensor | None) -> Tensor:
    """``x (q s + z)^T`` per group: attnlab's C++ GEMV, each group's float32 dot product
    scaled into the output's sum (and ``z`` times the group's sum of x)."""
    return native.gemv_int8_grouped(x, *state, bias)


def _int8_grouped_takes(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    return (weight.bits == 8 and weight.scales.dim() == 2 and weight.data.is_cpu
            and dtype in native.DTYPES and weight.scales.dtype in native.DTYPES
            and (weight.zeros is None or weight.zeros.dtype == weight.scales.dtype)
            and weight.group_size % 16 == 0 and native.available())


def _int4_native_run(x: Tensor, state: tuple, bias: Tensor | None) -> Tensor:
    """``x ((q - 8) s + z)^T`` per group: attnlab's C++ GEMV on the plain layout."""
    return native.gemv_int4(x, *state, bias)


def _int4_pairs_run(x: Tensor, state: tuple, bias: Tensor | None) -> Tensor:
    """The same, the codes read as bfloat16 and multiplied with x in pairs (``vdpbf16ps``)."""
    return native.gemv_int4(x, *state, bias, pairs=True)


def _int4_integers_run(x: Tensor, state: tuple, bias: Tensor | None) -> Tensor:
    """The same, x rounded to 16-bit integers a row and multiplied with the codes exactly in
    int32 (``vpdpwssd``), each 128 codes' sums scaled in float32."""
    return native.gemv_int4(x, *state, bias, integers=True)


def _native_dequantize_prepare(weight: QuantizedWeight, dtype: torch.dtype) -> tuple:
    return (*_native_codes(weight), dtype)


def _native_dequantize_run(x: Tensor, state: tuple, bias: Tensor | None) -> Tensor:
    """The formula with ``W'`` made by attnlab's C++ dequantization (one pass, all threads,
    the same numbers): for many rows, where a BLAS GEMM on ``W'`` wins."""
    data, scales, zeros, group_size, dtype = state
    return torch.nn.functional.linear(x, _dequantized(data, scales, zeros, group_size, dtype),
                                      bias)


def _dequantized(data: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                 dtype: torch.dtype) -> Tensor:
    """``W'`` (``O x I``, in ``dtype``) from what the C++ kernels read (``_native_codes``):
    int8 when ``zeros`` is None, else int4; any block of output rows alike."""
    if zeros is None:
        return native.dequantize_int8(data, scales, dtype)
    return native.dequantize_int4(data, scales, zeros, group_size, dtype)


def _native_widened_run(x: Tensor, state: tuple, bias: Tensor | None) -> Tensor:
    """The formula's product by float32 BLAS: ``W'`` made in float32 by attnlab's C++
    dequantization a block of output rows at a time (:func:`widened_product`), each sum
    rounded once to x's dtype. For bfloat16 x where BLAS has no bfloat16 arithmetic (there
    its bfloat16 GEMM is slower than float32's: ``python -m devbench gemv`` measures it on a
    machine), many rows repay it. ``W'`` is not rounded to bfloat16 first, so its sums differ
    from the formula's by that rounding."""
    data, scales, zeros, group_size = state

    def block(o0: int, o1: int) -> Tensor:
        return _dequantized(data[o0:o1], scales[o0:o1], None if zeros is None else zeros[o0:o1],
                            group_size, torch.float32)

    return widened_product(x, data.shape[0], block, bias)


def step_product(kernel: Kernel, state: tuple, bias: Tensor | None) -> object | None:
    """``kernel`` with its prepared ``state`` as a product of
    ``attnlab.kernels.native.step_plan`` (``native.step_linear``), or None for a kernel that
    the step does not run (it has no ``StepKind`` of that name: then the modules run)."""
    kind = native.step_kind(kernel.name)
    if kind is None:
        return None
    if kernel.name == "int4_mm":  # _int4_prepare: (codes, group size, scale/zero pairs)
        return native.step_linear(kind, state[0], state[2], None, state[1], bias)
    if len(state) == 2:  # int8: (codes, scales)
        return native.step_linear(kind, *state, None, 0, bias)
    # _native_codes: (codes, scales, zeros, group size)
    return native.step_linear(kind, *state, bias)


def _any(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    return True


def _int8_takes(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    # PyTorch's bfloat16 loop reads x 16 inputs at a time with no remainder: another input
    # count gives wrong sums for one row and a crash for two or more (torch 2.13).
    return (weight.per_row and weight.data.is_cpu and dtype in _KERNEL_DTYPES
            and (dtype != torch.bfloat16 or weight.shape[1] % 16 == 0)
            and hasattr(torch.ops.aten, "_weight_int8pack_mm"))


def _int4_takes(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    return (weight.bits == 4 and weight.data.is_cpu and dtype in _KERNEL_DTYPES
            and weight.shape[0] % BLOCK_ROWS == 0 and weight.shape[1] % 2 == 0
            and weight.group_size in (32, 64, 128, 256) and _blocked_layout_is_torchs())


def _native_takes(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    # These C++ loops take int8 with a scale per row only: grouped int8 has int8_grouped.
    return (weight.data.is_cpu and dtype in native.DTYPES
            and (weight.bits == 4 or weight.per_row)
            and (weight.scales.dtype in native.DTYPES or (weight.bits == 4 and (
                weight.scales.dtype == torch.float16 or weight.coded)))
            and (weight.bits == 8 or weight.group_size % 32 == 0) and native.available())


def _bfloat16_native(bits: int, built: Callable[[], bool], *, groups_of: int = 1
                     ) -> Callable[[QuantizedWeight, torch.dtype], bool]:
    """``takes`` of a C++ kernel that takes ``bits``-bit codes (int4 in groups of a
    multiple of ``groups_of``) and bfloat16 x, in a build that has its loop (``built()``)."""
    return lambda w, d: (w.bits == bits and d == torch.bfloat16 and _native_takes(w, d)
                         and (bits == 8 or w.group_size % groups_of == 0) and built())


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCKED_CHECKED: list[bool] = []


def _blocked_layout_is_torchs() -> bool:
    """Whether this torch build's int4 CPU packing is our blocked layout (checked once on a
    random 128 x 64 weight): the kernel is used only on codes laid out as it reads them."""
    if not _BLOCKED_CHECKED:
        ops = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
        same = all(hasattr(torch.ops.aten, op) for op in ops)
        if same:
            codes = torch.randint(0, 16, (2 * BLOCK_ROWS, 64), dtype=torch.int32,
                                  generator=torch.Generator().manual_seed(0))
            try:
                theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
                same = torch.equal(theirs, blocked_int4(codes))
            except RuntimeError:
                same = False
        _BLOCKED_CHECKED.append(same)
    return _BLOCKED_CHECKED[0]


QUANTIZED_KERNELS: dict[str, Kernel] = {
    k.name: k for k in (
        Kernel("dequantize", None, _dequantize_prepare, _dequantize_run, _any),
        Kernel("int8_mm", None, _int8_prepare, _int8_run, _int8_takes),
        Kernel("int4_mm", "blocked", _int4_prepare, _int4_run, _int4_takes),
        Kernel("native_dequantize", "plain", _native_dequantize_prepare,
               _native_dequantize_run, _native_takes, exact=True),
        Kernel("native_widened", "plain", _native_codes, _native_widened_run,
               lambda w, d: d == torch.bfloat16 and _native_takes(w, d)),
        Kernel("int8_native", None, _int8_native_prepare, _int8_native_run,
               lambda w, d: w.bits == 8 and _native_takes(w, d), DECODING_ROWS),
        # bfloat16 x only: its own rounding (2^-9) is far above the integers' 2^-16 of a
        # block's largest input; a float32 x would lose digits it has.
        Kernel("int8_integers", None, _int8_native_prepare, _int8_integers_run,
               _bfloat16_native(8, native.integers_available), DECODING_ROWS),
        Kernel("int8_tiles", None, _int8_native_prepare, _int8_tiles_run,
               _bfloat16_native(8, native.tiles_available), DECODING_ROWS),
        Kernel("int8_grouped", None, _int8_grouped_prepare, _int8_grouped_run,
               _int8_grouped_takes, DECODING_ROWS),
        Kernel("int4_native", "plain", _native_codes, _int4_native_run,
               lambda w, d: w.bits == 4 and _native_takes(w, d), DECODING_ROWS),
        Kernel("int4_native_pairs", "plain", _native_codes, _int4_pairs_run,
               _bfloat16_native(4, native.pairs_available), DECODING_ROWS),
        Kernel("int4_integers", "plain", _native_codes, _int4_integers_run,
               _bfloat16_native(4, native.integers_available, groups_of=64),
               DECODING_ROWS),
    )
}
