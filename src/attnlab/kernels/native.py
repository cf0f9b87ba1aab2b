"""attnlab's own C++ kernels for decoding, compiled on this machine: ``y = x W^T + b`` for a
few rows ``x``, reading each weight once (float32, bfloat16, int8 and 4-bit codes); the
dequantization of int8/int4 weights; attention of a few queries over cached keys; the greedy
argmax; RMSNorm; RoPE.

A decoding step reads every weight once for one or a few rows, so its speed is the rate at
which the weight streams from memory; PyTorch's CPU GEMV for these shapes (and its int8/int4
ops, with one row) runs at a fraction of it, and its attention and argmax cost more in set-up
than in arithmetic on a step's small tensors. ``native_gemv.cpp`` and ``native_decode.cpp``,
beside this file, convert each weight to float32 in registers and accumulate in float32
(AVX-512 where the compiler targets it, else 256-bit fused multiply-add loops where it has
them, else plain loops that it vectorises);
``native_tiles.cpp`` runs up to 32 bfloat16 rows on the matrix tiles of a CPU with AMX-BF16
(:func:`gemv_tiles`, :func:`gemv_int8_tiles`), where the vector loops would run out of
arithmetic before memory. They are
compiled only by :func:`build` (``attnlab build``, which ``make test`` and ``make demo`` run),
with ``torch.utils.cpp_extension`` for this CPU (``-march=native``; 1-3 min, once: the build is
kept under ``$ATTNLAB_CACHE_DIR/native``, else ``~/.cache/attnlab/native``, keyed by the
sources' content, the torch version and the CPU model, so two checkouts share it; ninja comes
from the ``ninja`` package when it is not on the PATH); asking for them (:func:`available`)
only loads that build. Nothing requires them: not built (or with ``ATTNLAB_NATIVE=0``)
:func:`available` is False, :func:`unavailable_reason` says why, and the callers use
PyTorch's kernels. ``ATTNLAB_NATIVE_MARCH`` (e.g. ``x86-64-v3``) builds for that target
instead of ``native``: a CPU family's lowest common set, or a lesser CPU measured on this one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

import torch
from torch import Tensor

from attnlab.durable import write_file_atomic, write_text_atomic
from attnlab.kernels import cache

__all__ = ["ACTIVATIONS", "DTYPES", "MAX_ROWS",
           "BuildError", "MissingToolError", "activation", "activation_available", "argmax_rows",
           "available", "build", "build_flags", "build_id",
           "decode_attention", "decode_layers", "dequantize_int4", "dequantize_int8", "gemv",
           "gemv_int4", "gemv_int8", "gemv_int8_grouped", "gemv_int8_tiles", "gemv_tiles",
           "integers_available",
           "library_file", "paged_attention",
           "pairs_available", "rms_norm", "rotary", "step_block", "step_enum", "step_kind",
           "step_linear", "step_plan", "takes", "tiles_available", "unavailable_reason"]

# The most queries a row that decode_attention takes (a decoding step, or a few speculated
# tokens); the GEMVs' rows are the rule's (attnlab.kernels.rule.DECODING_ROWS).
MAX_ROWS = 8
DTYPES = (torch.float32, torch.bfloat16)  # the activations' dtypes the kernels take
# The activations that :func:`activation` computes in one pass, by their name in
# attnlab.layers (its codes are the extension's ``Activation`` enum: :func:`step_enum`).
ACTIVATIONS = ("silu", "gelu_tanh")

_SOURCES = tuple(Path(__file__).with_name(name)
                 for name in ("native_gemv.cpp", "native_decode.cpp", "native_step.cpp",
                              "native_tiles.cpp"))
_HEADERS = (Path(__file__).with_name("native_lanes.h"),)  # in the build digest, not compiled
_ENV = "ATTNLAB_NATIVE"
# -ffp-contract=off: a * b + c stays two roundings unless the source asks for a fused
# multiply-add, so the kernels round as the formulas they replace do.
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
_MARCH_ENV = "ATTNLAB_NATIVE_MARCH"
_FAILED = "build-failed.txt"  # the compiler's output of a failed build, in its folder
# The loaded extension and None, or None and why it is not loaded (unavailable_reason).
_BUILT: list[tuple[ModuleType | None, str | None]] = []


def takes(*tensors: Tensor) -> bool:
    """Whether the kernels can stand in for a formula on ``tensors``: each on the CPU in
    float32 or bfloat16, no gradient needed (grad mode off, or none requires one), and the
    build present (:func:`available`)."""
    if not all(t.is_cpu and t.dtype in DTYPES for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return available()


def available() -> bool:
    """Whether the native kernels run in this process: the library that :func:`build`
    (``attnlab build``) compiled for these sources, this CPU and this torch, loaded the first
    time they are asked for (once per process; nothing is ever compiled here). False when it
    is not built, or ``$ATTNLAB_NATIVE`` is ``0``: :func:`unavailable_reason` says why."""
    return _extension() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False, in one line (``"not built: run `attnlab build`"``,
    ``"ATTNLAB_NATIVE=0"``, ``"build failed: ..."``, ``"cannot load ..."``); None when it is
    True."""
    _extension()
    return _BUILT[0][1]


def pairs_available() -> bool:
    """Whether the build has the bfloat16 pair-product loops that ``pairs=True`` asks for
    (the dot-product instruction ``vdpbf16ps``, built when the compiler targets a CPU that
    has it)."""
    extension = _extension()
    return extension is not None and extension.has_pairs()


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
         pairs: bool = False) -> Tensor:
    """``x W^T + b`` with x ``M x I`` and weight ``O x I`` (both contiguous, float32 or both
    bfloat16), bias ``O`` (x's dtype) -> ``M x O`` in x's dtype, accumulated in float32 and
    rounded once. For small ``M``. ``pairs``: bfloat16 products taken two at a time by
    ``vdpbf16ps`` instead of widening the weight to float32 (see :func:`pairs_available`)."""
    return _require().gemv(x, weight, bias, pairs)


def activation_available() -> bool:
    """Whether :func:`activation` has a vector loop here (16 lanes in a build for a CPU with
    AVX-512, 8 in one with 256-bit vectors and FMA); elsewhere PyTorch's kernels are faster
    than its plain loop."""
    extension = _extension()
    return extension is not None and extension.has_vector_activation()


def activation(gate: Tensor, up: Tensor | None, name: str) -> Tensor:
    """``act(gate)``, or ``act(gate) * up`` with ``act(gate)`` rounded to the dtype first as
    that product rounds, in one pass: ``silu(g) = g / (1 + exp(-g))``, ``gelu_tanh(g) = 0.5 g
    (1 + tanh(a)) = g / (1 + exp(-2a))`` with ``a = sqrt(2/pi) (g + 0.044715 g^3)``, in
    float32 (within 2e-6 of float64; PyTorch's tanh GELU is within 2e-4, losing digits where
    ``1 + tanh`` cancels). gate (and up, gate's shape) contiguous float32 or bfloat16 ->
    gate's shape and dtype."""
    if name not in ACTIVATIONS:
        raise ValueError(f"name: expected one of {ACTIVATIONS}, got {name!r}")
    extension = _require()
    return extension.activation(gate, up, int(_codes(extension, "Activation")[name]))


def tiles_available() -> bool:
    """Whether :func:`gemv_tiles` runs here: the build targets a CPU with AMX-BF16 matrix
    tiles and the operating system lends them to this process (asked once)."""
    extension = _extension()
    return extension is not None and extension.has_tiles()


def gemv_tiles(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x W^T + b`` with x ``M x I`` and weight ``O x I`` bfloat16 (contiguous), bias ``O``
    bfloat16 -> ``M x O`` bfloat16, on AMX tiles: each weight read once, where it lies, for
    up to 32 rows of x at a time (16 x 16 x 32 multiply-adds a tile product, so arithmetic
    never bounds a decoding step's rows); sums in float32, rounded once (see
    :func:`tiles_available`)."""
    return _require().gemv_tiles(x, weight, bias)


def gemv_int8_tiles(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x (q s)^T + b`` as :func:`gemv_int8` (q ``O x I`` int8, scales ``O``), x bfloat16, on
    AMX tiles as :func:`gemv_tiles`: each 32 codes widened to bfloat16 (exactly) just before
    their tile product, the scale applied to each row's float32 sum."""
    return _require().gemv_int8_tiles(x, q, scales, bias)


def gemv_int8(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None = None, *,
              integers: bool = False) -> Tensor:
    """``x (q s)^T + b``: q ``O x I`` int8, scales ``O`` (float32 or bfloat16), x ``M x I``
    (float32 or bfloat16, contiguous) -> ``M x O`` in x's dtype; the scale applied to each
    float32 dot product. ``integers`` (bfloat16 x, see :func:`integers_available`): per row
    and block of 256 inputs, x scaled by ``2^-e`` with ``e = floor(log2 a) - 14`` (``a`` the
    block's largest ``|x|``) and rounded to integers ``c``, then ``y = s sum_b 2^e sum_k q c``
    with the inner sums exact in int32 (``vpdpwssd``): an input is held to within ``2^(e-1)
    <= 2^-15 a``, exactly if within ``2^7`` of ``a``; an x with an infinity or NaN runs the
    float32 loop."""
    return _require().gemv_int8(x, q, scales, bias, integers)


def gemv_int8_grouped(x: Tensor, q: Tensor, scales: Tensor, zeros: Tensor | None,
                      group_size: int, bias: Tensor | None = None) -> Tensor:
    """``x (q s + z)^T + b`` per group of ``group_size`` inputs (a multiple of 16 dividing
    ``I``): q ``O x I`` int8, scales and zeros (None: no offsets) ``O x I/g`` float32 or
    bfloat16 (one dtype), x ``M x I`` (float32 or bfloat16) -> ``M x O`` in x's dtype. Per
    output, ``sum_j s_j (sum_(k in j) q_k x_k) + sum_j z_j (sum_(k in j) x_k)`` in float32,
    the groups in order whatever the rows of x (batch-invariant), rounded once."""
    return _require().gemv_int8_grouped(x, q, scales, zeros, group_size, bias)


def integers_available() -> bool:
    """Whether the build has the integer-product loops that ``gemv_int8`` and ``gemv_int4``
    ask for with ``integers=True`` (the integer dot product ``vpdpwssd``, built when the compiler
    targets a CPU that has it)."""
    extension = _extension()
    return extension is not None and extension.has_integers()


def gemv_int4(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor,
              group_size: int, bias: Tensor | None = None, *, pairs: bool = False,
              integers: bool = False) -> Tensor:
    """``x ((q - 8) s + z)^T + b`` per group of ``group_size`` inputs: packed ``O x I/2``
    uint8 (code ``2j`` in the low nibble of byte ``j``), scales and zeros ``O x I/g`` (float32
    or bfloat16, one dtype), x ``M x I`` -> ``M x O`` in x's dtype. ``group_size`` a multiple
    of 32. ``pairs`` (bfloat16 x): the codes read as the bfloat16 numbers ``128 + q`` and
    multiplied with x two at a time by ``vdpbf16ps``. ``integers`` (bfloat16 x, groups of a
    multiple of 64, see :func:`integers_available`): each row of x rounded to integers as
    :func:`gemv_int8`'s, with one scale a row (a 4-bit weight's rounding dwarfs its 2^-15),
    and ``q c`` summed exactly in int32 (``vpdpwssd``) per 128 codes; the ``8 s`` and ``z``
    terms take the rounded x's group sums."""
    if pairs and integers:
        raise ValueError("pairs, integers: expected at most one of them")
    return _require().gemv_int4(x, packed, scales, zeros, group_size, bias, pairs, integers)


def dequantize_int4(packed: Tensor, scales: Tensor, zeros: Tensor, group_size: int,
                    dtype: torch.dtype) -> Tensor:
    """``W' = (q - 8) s + z`` per group (packed ``O x I/2`` as :func:`gemv_int4` reads it,
    scales and zeros ``O x I/g``) -> ``O x I`` in ``dtype`` (float32 or bfloat16), computed
    in float32 and rounded once."""
    return _require().dequantize_int4(packed, scales, zeros, group_size,
                                      _bfloat16("dtype", dtype))


def dequantize_int8(q: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """``W' = q s`` per row (q ``O x I`` int8, scales ``O``) -> ``O x I`` in ``dtype``
    (float32 or bfloat16), computed in float32 and rounded once."""
    return _require().dequantize_int8(q, scales, _bfloat16("dtype", dtype))


def decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                     scale: float, is_causal: bool) -> Tensor:
    """``softmax(q k^T * scale + mask) v`` for a few queries: query ``B x H x L x D``, key
    ``B x G x S x D`` and value ``B x G x S x Dv`` (``G`` dividing ``H``, head ``h`` reading
    kv head ``h // (H/G)``; any strides with a contiguous last dim, as a cache's views are),
    mask None or ``B x H x L x S`` (bool, True = may attend, or additive float32; an expanded
    view is fine) -> ``B x H x L x Dv`` in query's dtype (float32 or bfloat16), a view of a
    ``B x L x H x Dv`` tensor. ``is_causal``: query ``i`` sees keys up to ``S - L + i``. A
    query with no key to attend to gets zeros. Scores, softmax and sums in float32."""
    return _require().decode_attention(query, key, value, mask, float(scale), bool(is_causal))


def paged_attention(query: Tensor, key_pages: Tensor, value_pages: Tensor, tables: Tensor,
                    first: Tensor, keys: int, mask: Tensor | None, scale: float,
                    is_causal: bool) -> Tensor:
    """``decode_attention`` over ``keys = S`` keys kept in pages, read where they lie: key
    ``j >= first[b]`` of row ``b`` is its token ``t = j - first[b]``, in slot ``t % P`` of page
    ``tables[b, t // P]`` of key_pages ``N x G x P x D`` (value_pages ``N x G x P x Dv``);
    keys ``j < first[b]`` do not exist for the row (left padding). query ``B x H x L x D``,
    tables ``B x pages`` and first ``B`` contiguous int64, mask as ``decode_attention``'s over
    the ``S`` keys -> ``B x H x L x Dv``."""
    return _require().paged_attention(query, key_pages, value_pages, tables, first, int(keys),
                                      mask, float(scale), bool(is_causal))


def argmax_rows(x: Tensor) -> Tensor:
    """The first index of each row's maximum (of its first NaN, if any, as ``torch.argmax``):
    x ``N x V`` contiguous float32 or bfloat16 -> ``N`` int64. Every thread takes a share of
    a row."""
    return _require().argmax_rows(x)


def rms_norm(x: Tensor, weight: Tensor, eps: float, unit_offset: bool = False) -> Tensor:
    """RMSNorm of each row: x ``N x E`` contiguous (float32 or bfloat16), weight ``E``
    (float32 or bfloat16) -> ``N x E`` in x's dtype; ``n = x / sqrt(mean(x^2) + eps)`` in
    float32, then ``n * (1 + w)`` rounded once (``unit_offset``, Gemma) or ``n`` rounded to
    x's dtype and times ``w``, rounded again (Llama, Qwen), as ``attnlab.layers.RMSNorm``."""
    return _require().rms_norm(x, weight, float(eps), bool(unit_offset))


def rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """RoPE: x ``B x L x H x D`` (float32 or bfloat16, last dim contiguous), cos and sin
    ``(B or 1) x L x R`` contiguous in x's dtype (``R`` even, ``<= D``) -> ``x_r * cos +
    turn(x_r) * sin`` on the first ``R`` features of each head, the rest passed through, as
    ``attnlab.layers.rotary.apply_rotary`` computes and rounds it; ``turn`` is ``(a, b) ->
    (-b, a)`` on the halves, or on neighbours when ``interleaved``. A new contiguous tensor."""
    return _require().rotary(x, cos, sin, bool(interleaved))


def step_enum(name: str) -> type:
    """The extension's enum ``name``, whose members name the codes of a :func:`step_plan`:
    ``"StepKind"`` (a product's kernel, each member named as the kernel of attnlab's catalogs
    whose result it computes: ``native_gemv``, ``native_pairs``, ``native_tiles``,
    ``int8_native``, ``int8_integers``, ``int8_tiles``, ``int8_mm``, ``int4_native``,
    ``int4_native_pairs``, ``int4_integers``, ``int4_mm``, ``int8_grouped``, ``formula``),
    ``"NormKind"`` (``rms``, ``rms_unit_offset``, ``layer_norm``) or ``"Activation"``
    (``silu``, ``gelu_tanh``, ``gelu``, ``relu``, as ``attnlab.layers.ACTIVATIONS`` names
    them). Defined in ``native_step.cpp`` and exported from there: Python holds no copy of
    the codes."""
    if name not in _ENUMS:
        raise ValueError(f"name: expected one of {_ENUMS}, got {name!r}")
    return getattr(_require(), name)


def step_kind(kernel: str) -> object | None:
    """The ``StepKind`` member named ``kernel`` (a kernel's name in attnlab's catalogs): the
    product that a :func:`step_plan` runs for it; None when the step does not run that
    kernel."""
    return _codes(_require(), "StepKind").get(kernel)


def step_linear(kind: object, weight: Tensor, scales: Tensor | None, zeros: Tensor | None,
                group_size: int, bias: Tensor | None) -> object:
    """One product of a :func:`step_plan`: ``kind`` (:func:`step_kind`) on what its kernel
    reads, ``weight`` (or codes), ``scales`` (``int4_mm``: its scale/zero pairs), ``zeros``,
    ``group_size`` and ``bias`` (None: none). Raises a ``RuntimeError`` when the kind needs
    scales or zeros that are None."""
    return _require().StepLinear(kind, weight, scales, zeros, int(group_size), bias)


def step_block(norm1_weight: Tensor, norm1_bias: Tensor | None, q: object, k: object,
               v: object, o: object, q_norm: Tensor | None, k_norm: Tensor | None,
               norm2_weight: Tensor, norm2_bias: Tensor | None, mlp: list) -> object:
    """One block of a :func:`step_plan`: its norms' weights and biases (None: no bias), its
    q/k/v/o products (:func:`step_linear`), its q/k norms' weights (both or neither), and
    ``mlp``, the products ``[gate, up, down]`` or ``[linear1, linear2]``."""
    return _require().StepBlock(norm1_weight, norm1_bias, q, k, v, o, q_norm, k_norm,
                                norm2_weight, norm2_bias, mlp)


def step_plan(blocks: list, *, norm: str, activation: str, H: int, G: int, D: int,
              eps: float, scale: float, gated: bool, interleaved: bool) -> object:
    """A pre-norm decoder's one-token step through ``blocks`` (:func:`step_block`), held in
    C++ as typed structs, for :func:`decode_layers`: every block with ``H`` query heads and
    ``G`` key/value heads of ``D``, its norms ``norm`` (a ``NormKind`` name) with ``eps``, its
    attention scores scaled by ``scale``, RoPE on neighbours when ``interleaved`` (else on
    halves), its MLP gated (``down(act(gate h) * up h)``) or not (``W2 act(W1 h)``) with
    ``activation`` (an ``Activation`` name). ``attnlab.kernels.fused_layers`` builds one from a
    model's modules."""
    extension = _require()
    return extension.StepPlan(blocks, getattr(extension.NormKind, norm),
                              getattr(extension.Activation, activation), int(H), int(G), int(D),
                              float(eps), float(scale), bool(gated), bool(interleaved))


def decode_layers(plan: object, x: Tensor, k_caches: list[Tensor], v_caches: list[Tensor],
                  offset: int, cos: Tensor | None, sin: Tensor | None,
                  mask: Tensor | None) -> Tensor | None:
    """One decoding step through every block of ``plan`` (:func:`step_plan`): x ``B x E`` (one
    new position a row, contiguous) -> the last block's output ``B x E``, block ``i``'s keys
    and values written at ``offset`` of ``k_caches[i]`` and ``v_caches[i]`` (``B x G x
    max_len x D`` in x's dtype, ``max_len > offset``); cos and sin ``(B or 1) x 1 x R`` in x's
    dtype or None (no RoPE); mask ``B x H x 1 x (offset + 1)`` bool or None. None, with
    nothing written, when a tensor of the plan lies elsewhere or in another dtype than when
    the plan was built (a weight re-stored or converted since: the plan is stale) or a cache
    has another shape or dtype: the modules must run. Runs without holding the GIL."""
    return plan.run(x, k_caches, v_caches, offset, cos, sin, mask)


_ENUMS = ("StepKind", "NormKind", "Activation")


@functools.cache
def _codes(extension: ModuleType, name: str) -> dict[str, object]:
    """The members of ``extension``'s enum ``name`` by their names (pybind11 builds its
    ``__members__`` afresh at each read: a kernel call must not)."""
    return dict(getattr(extension, name).__members__)


def _bfloat16(name: str, dtype: torch.dtype) -> bool:
    if dtype not in DTYPES:
        raise ValueError(f"{name}: expected torch.float32 or torch.bfloat16, got {dtype}")
    return dtype == torch.bfloat16


def _require() -> ModuleType:
    extension = _extension()
    if extension is None:
        raise RuntimeError(f"attnlab's native kernels are not available: {unavailable_reason()}")
    return extension


def _extension() -> ModuleType | None:
    # $ATTNLAB_NATIVE and the build folder are read once, with the load: this runs for every
    # kernel call, and an environment lookup (~1 us) there cost ~0.1 ms a decoded token.
    if not _BUILT:
        _BUILT.append(_load())
    return _BUILT[0][0]


def _load() -> tuple[ModuleType | None, str | None]:
    """The built library of :func:`library_file` imported as it lies (no compiler, no ninja),
    or None and why not."""
    if os.environ.get(_ENV, "").strip() == "0":
        return None, f"{_ENV}=0"
    library = library_file()
    if not library.is_file():
        failed = library.with_name(_FAILED)
        if failed.is_file():
            lines = failed.read_text(encoding="utf-8", errors="replace").strip().splitlines()
            return None, (f"build failed: {lines[-1] if lines else 'see ' + str(failed)} "
                          f"(`attnlab build` tries again)")
        return None, "not built: run `attnlab build`"
    try:
        loader = importlib.machinery.ExtensionFileLoader(_module_name(library), str(library))
        spec = importlib.util.spec_from_file_location(loader.name, library, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError) as error:  # a library for another torch, or a damaged file
        return None, (f"cannot load {library} ({error}); delete {library.parent} and run "
                      f"`attnlab build`")
    return module, None


def build_flags() -> tuple[str, ...]:
    """The compiler flags of the build: ``-march=native``, or ``-march=$ATTNLAB_NATIVE_MARCH``
    when that is set (a target name: letters, digits, ``-``, ``_``, ``.``)."""
    march = os.environ.get(_MARCH_ENV, "").strip()
    if not march:
        return _FLAGS
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", march):
        raise ValueError(f"{_MARCH_ENV}: expected a -march target such as x86-64-v3, got "
                         f"{march!r}")
    return tuple(f"-march={march}" if f.startswith("-march=") else f for f in _FLAGS)


def build_id() -> str:
    """Which native kernels this process runs: ``"off"`` when ``ATTNLAB_NATIVE=0``, else the
    digest of their sources, compiler flags, torch version and CPU model (the build folder's
    name), whether or not built yet; part of every calibration key, so that timings of one
    build are never taken for another's."""
    if os.environ.get(_ENV, "").strip() == "0":
        return "off"
    return library_file().parent.name


def library_file() -> Path:
    """Where the built library of these sources lies (whether built yet or not):
    ``$ATTNLAB_CACHE_DIR/native/<digest>/attnlab_native_<digest>.so`` (else under
    ``~/.cache/attnlab``), the digest of the sources' content, the compiler flags, the torch
    version and the CPU model, never of the sources' folder: two checkouts of one version
    share it."""
    digest = _digest(_SOURCES + _HEADERS, build_flags(), cache.cpu_model(), torch.__version__)
    return cache.cache_file().parent / "native" / digest / f"attnlab_native_{digest}.so"


def build() -> Path:
    """Compile the native kernels for this CPU into :func:`library_file`'s folder, unless they
    are built there already, and load them in this process -> the folder. One line on stderr
    before the compile starts and one when it ends (or "already built" at once). Only one
    process compiles in a folder at a time (the others wait, and then find it built); a build
    killed midway leaves no library, and the next one starts afresh. Raises
    :class:`MissingToolError` (before compiling) without a C++ compiler or ninja,
    :class:`BuildError` when the compile fails (its output kept in the folder's
    ``build-failed.txt``)."""
    if os.environ.get(_ENV, "").strip() == "0":
        raise MissingToolError(f"{_ENV}=0 switches the native kernels off: unset it to build them")
    library = library_file()
    folder = library.parent
    if not library.is_file():
        ninja = _tools()
        folder.mkdir(parents=True, exist_ok=True)
        with _only_builder(folder):
            if not library.is_file():  # else another process built it while this one waited
                return _compile(library, ninja)
    if _BUILT and _BUILT[0][0] is None:
        _BUILT.clear()  # built by another process since this one asked: load when next asked
    _say(f"already built: {folder}")
    return folder


class BuildError(RuntimeError):
    """The native kernels' compile failed: the message ends with the compiler's last line."""


class MissingToolError(BuildError):
    """The native kernels cannot be compiled here: no C++ compiler or no ninja (or
    ``ATTNLAB_NATIVE=0``); the message names what is missing."""


def _tools() -> str:
    """The folder to put before the PATH for ninja ("" when it is on the PATH already); raises
    :class:`MissingToolError` naming the compiler or ninja that is not there."""
    compiler = os.environ.get("CXX", "c++")  # the compiler torch's cpp_extension runs
    if shutil.which(compiler) is None:
        raise MissingToolError(f"no C++ compiler: {compiler!r} is not on the PATH (install "
                               "g++ or clang, or set CXX to one); without the native kernels "
                               "attnlab runs the reference modules")
    if shutil.which("ninja") is not None:
        return ""
    folder = _ninja_folder()  # torch builds with ninja: the `ninja` dependency ships one
    if not folder or shutil.which("ninja", path=folder) is None:
        raise MissingToolError("no ninja: not on the PATH and the `ninja` package is not "
                               "installed (pip install ninja)")
    return folder


def _compile(library: Path, ninja: str) -> Path:
    """Compile into ``library``'s folder from copies of the sources kept there (so that the
    build records no checkout's path), then publish the library in one step."""
    from torch.utils import cpp_extension  # imports setuptools (~0.5 s): for a build only

    folder = library.parent
    copies, work = folder / "src", folder / "build"
    # Whatever a killed build left (objects, torch's `lock` that its next load would wait
    # for forever, a half-written library) goes: a compile starts from nothing.
    for leftover in (copies, work, folder / _FAILED):
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink(missing_ok=True)
    copies.mkdir()
    work.mkdir()
    for source in _SOURCES + _HEADERS:
        shutil.copyfile(source, copies / source.name)
    _say(f"compiling the native kernels for {cache.cpu_model()} (once per CPU and torch, "
         f"about 1-3 min) in {folder}")
    start = time.monotonic()
    path = os.environ.get("PATH")
    if ninja:
        os.environ["PATH"] = os.pathsep.join((ninja, path or ""))
    try:
        module = cpp_extension.load(
            name=_module_name(library), sources=[str(copies / p.name) for p in _SOURCES],
            build_directory=str(work), extra_cflags=list(build_flags()),
            extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # the compiler's or the linker's complaint
        text = str(error).strip() or type(error).__name__
        write_text_atomic(folder / _FAILED, text + "\n")
        raise BuildError(f"the native kernels did not build: {text.splitlines()[-1]} (the "
                         f"whole output: {folder / _FAILED})") from None
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path
    write_file_atomic(library, lambda tmp: shutil.copyfile(module.__file__, tmp))
    _BUILT[:] = [(module, None)]
    _say(f"built in {time.monotonic() - start:.0f} s: {folder}")
    return folder


def _module_name(library: Path) -> str:
    # The name the library's PyInit_ function carries (TORCH_EXTENSION_NAME): its file's.
    return library.name.removesuffix(".so")


def _say(text: str) -> None:
    print(f"attnlab build: {text}", file=sys.stderr, flush=True)


@functools.cache
def _digest(files: tuple[Path, ...], flags: tuple[str, ...], cpu: str,
            torch_version: str) -> str:
    # -march=native: a build is for this CPU model only (a home folder shared between
    # machines must not hand one CPU's instructions to another). The files' content, never
    # their paths: two checkouts of one version share one build.
    key = f"{torch_version} | {cpu} | {' '.join(flags)}".encode()
    text = b"".join(p.read_bytes() for p in files)
    return hashlib.sha256(text + key).hexdigest()[:16]


@contextlib.contextmanager
def _only_builder(folder: Path) -> Iterator[None]:
    """This process alone in ``folder`` for the block, saying so once on stderr when it waits
    for another. An OS lock (``flock``), released when its process dies however it dies, so
    that a killed build never blocks the next (torch's own ``lock`` file would, forever)."""
    if fcntl is None:  # no flock on this system: one builder at a time is the user's care
        yield
        return
    with open(folder / "attnlab-build.lock", "w") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process that is building in {folder}")
            fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _ninja_folder() -> str:
    """The folder of the ``ninja`` program that the ``ninja`` package installs ("" without
    it)."""
    try:
        import ninja
    except ImportError:
        return ""
    return str(getattr(ninja, "BIN_DIR", ""))
