"""The two weight formats, as formulas: int8 per output channel and int4 in groups.

**int8** (symmetric, one scale per output row): ``s_o = max_i |W_oi| / 127``,
``q_oi = clamp(round(W_oi / s_o), -127, 127)`` stored as ``int8``, ``W'_oi = q_oi s_o``.
The error of each weight is at most ``s_o / 2``. A **grouped** int8 weight (as GGUF's Q8_0
stores one) has a scale per group of ``g`` consecutive inputs instead, ``scales`` ``O x I/g``:
``W'_oi = q_oi s_o,[i/g]``, and may have an offset per group too, ``zeros`` ``O x I/g``:
``W'_oi = q_oi s_o,[i/g] + z_o,[i/g]`` (as GGUF's Q5_1 and Q5_K store one: codes 0..31 and
the value that code 0 stands for); ``quantize`` makes only the per-row kind.

**int4** (asymmetric, groups of ``g`` consecutive inputs): for the group ``W_o,[kg:(k+1)g]``
with minimum ``lo`` and maximum ``hi``, ``s = (hi - lo) / 15`` and the zero point ``z = lo +
8 s``, the value that the middle code 8 stands for; ``q = clamp(round((W - z) / s) + 8, 0,
15)`` and ``W' = (q - 8) s + z``. The error is at most ``s / 2`` (plus the rounding of ``s``
and ``z`` to the dtype they are stored in). Two codes share a byte: code ``2j`` in the low
nibble of byte ``j``, code ``2j + 1`` in the high nibble (the "plain" layout, the one written
to disk). ``z`` as a value (not an integer code) is what PyTorch's int4 CPU kernel takes, so
that kernel computes exactly this formula.

The **blocked** layout is the byte order PyTorch's int4 CPU kernel reads (rows in blocks of
64; for each block and input ``i``, 32 bytes holding row ``r`` of the block in the low nibble
and row ``r + 32`` in the high one). It holds the same codes as the plain layout, only
permuted, so a weight is kept in one layout, never both.

**Coded** int4 scales (``scale_dtype=torch.int8``; 4.5 bits a weight at groups of 32, as
llama.cpp's Q4_0 and Q4_K, against 5.0 with float16 scales and zeros): each group's scale and
zero are themselves stored in 8 bits, against two bfloat16 steps ``(d_s, d_z)`` per block of
``STEP_ROWS`` (16) rows: ``s = c_s d_s`` (``c_s`` uint8 1..255) and ``z = c_z d_z`` (``c_z``
int8 -127..127), with ``d_s = max s / 255`` and ``d_z = max |z| / 127`` over the block's
fitted groups, rounded up to bfloat16 (so no code overflows; a code times a bfloat16 step is
exact in float32). The formula is then the one above with those ``s`` and ``z``. Each
group's two codes are the nearest ones, or a neighbour (+-1 each) where that lowers its
squared error (``attnlab.quantization.search.code_scales``). A step per row would measure a
little better and cost 4 bytes a row, 1 MiB on a 135M model: the size of a layer kept in
int8. Where a block's zero points are many times its scales (weights offset far from zero;
SmolLM2's groups are not), ``d_z`` is coarse against ``s`` and the codes clip: float16 scales
and zeros (``scale_dtype=torch.float16``) keep such weights.

How an int4 group's scale and zero are chosen is the ``fit``: ``"nearest"`` (round-to-nearest,
the formula above) or ``"search"`` (``attnlab.quantization.search``: the scale and minimum of
least squared error among candidates, never worse than round-to-nearest's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab._checks import is_int
from attnlab.quantization.search import code_scales, search_int4

__all__ = [
    "BITS",
    "FITS",
    "GROUP_SIZES",
    "LAYOUTS",
    "STEP_ROWS",
    "QuantizedWeight",
    "blocked_int4",
    "decode_scales",
    "dequantize_int4",
    "dequantize_int8",
    "pack_int4",
    "quantize",
    "quantize_int4",
    "quantize_int8",
    "unblocked_int4",
    "unpack_int4",
]

BITS = (8, 4)
GROUP_SIZES = (32, 64, 128, 256)
LAYOUTS = ("plain", "blocked")
FITS = ("nearest", "search")
BLOCK_ROWS = 64  # rows per block of the blocked int4 layout
STEP_ROWS = 16  # rows sharing the steps of coded int4 scales


def quantize_int8(weight: Tensor, scale_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``weight`` (``O x I``) -> ``(q, scales)``: ``q`` ``O x I`` int8, ``scales`` ``O`` in
    ``scale_dtype`` (default the weight's), ``W ~ q * scales[:, None]`` (module docstring). A row
    of zeros gets scale 1."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    scales = scales.to(scale_dtype or weight.dtype)
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor, dtype: torch.dtype | None = None,
                    zeros: Tensor | None = None) -> Tensor:
    """``q`` (``O x I`` int8), ``scales`` (``O``, or ``O x I/g`` grouped), ``zeros`` (None,
    or ``O x I/g`` beside grouped scales) -> ``q * scales (+ zeros)`` per row or group (``O x
    I``) in ``dtype`` (default the scales'), as computed in float32 (the product, then the sum)
    and rounded once to ``dtype``. Without zeros this is done in ``dtype`` directly when the
    scales are in it (an int8 code and a 16-bit scale multiply exactly in float32, which
    torch's 16-bit multiply computes in); with zeros a block of rows at a time, as int4's."""
    dtype = dtype or scales.dtype
    rows, cols = q.shape
    groups = 1 if scales.dim() == 1 else scales.shape[-1]
    q = q.view(rows, groups, cols // groups)
    s = scales.view(rows, groups)[..., None]
    if zeros is not None:
        out = torch.empty(rows, cols, dtype=dtype, device=q.device)
        s, z = s.float(), zeros.float().view(rows, groups)[..., None]
        for start in range(0, rows, _DEQUANTIZE_ROWS):
            end = min(rows, start + _DEQUANTIZE_ROWS)
            block = (q[start:end].float() * s[start:end]).add_(z[start:end])
            out[start:end] = block.view(end - start, cols)
        return out
    if scales.dtype == dtype:
        return (q.to(dtype) * s).view(rows, cols)
    return (q.float() * s.float()).to(dtype).view(rows, cols)


def quantize_int4(weight: Tensor, group_size: int, scale_dtype: torch.dtype | None = None,
                  fit: str = "nearest") -> tuple[Tensor, Tensor, Tensor]:
    """``weight`` (``O x I``, ``I`` a multiple of ``group_size``) -> ``(packed, scales,
    zeros)``: ``packed`` ``O x I/2`` uint8 (plain layout), ``scales`` and ``zeros`` ``O x
    I/g`` in ``scale_dtype`` (default the weight's), chosen by ``fit`` (module docstring).
    The codes are computed from the stored (rounded) scales and zeros, so the round trip
    error is that of what is kept."""
    rows, cols = weight.shape
    w = weight.detach().float().view(rows, cols // group_size, group_size)
    scales, zeros = _fit_int4(w, scale_dtype or weight.dtype, fit)
    return _packed_codes(w, scales, zeros), scales, zeros


def _fit_int4(w: Tensor, scale_dtype: torch.dtype, fit: str) -> tuple[Tensor, Tensor]:
    """Each group's scale and zero (``O x G`` each, in ``scale_dtype``) of ``w`` (``O x G x
    g`` float32) by ``fit``: the search, or round-to-nearest (module docstring)."""
    if fit == "search":
        rows, _, size = w.shape
        return tuple(t.view(rows, -1) for t in search_int4(w.reshape(-1, size), scale_dtype))
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = (hi - lo) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales)).to(scale_dtype)
    return scales, (lo + 8 * scales.float()).to(scales.dtype)


def _packed_codes(w: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """The nearest int4 codes of ``w`` (``O x G x g`` float32) on the groups' ``scales`` and
    ``zeros`` (``O x G``, as stored), packed (``O x I/2``, plain layout)."""
    rows, groups, size = w.shape
    codes = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None]) + 8
    return pack_int4(codes.clamp_(0, 15).to(torch.uint8).view(rows, groups * size))


def dequantize_int4(codes: Tensor, scales: Tensor, zeros: Tensor,
                    dtype: torch.dtype | None = None) -> Tensor:
    """``codes`` (``O x I`` values 0..15, unpacked), ``scales``/``zeros`` (``O x I/g``) ->
    ``(codes - 8) * scales + zeros`` per group (``O x I``) in ``dtype`` (default the
    scales'), computed in float32, a block of rows at a time (float32 temporaries of a whole
    weight cost more than the arithmetic)."""
    rows, cols = codes.shape
    groups = scales.shape[-1]
    out = torch.empty(rows, cols, dtype=dtype or scales.dtype, device=codes.device)
    c = codes.view(rows, groups, cols // groups)
    s, z = scales.float()[..., None], zeros.float()[..., None]
    for start in range(0, rows, _DEQUANTIZE_ROWS):
        end = min(rows, start + _DEQUANTIZE_ROWS)
        block = torch.addcmul(z[start:end], c[start:end].float() - 8, s[start:end])
        out[start:end] = block.view(end - start, cols)
    return out


_DEQUANTIZE_ROWS = 256


def pack_int4(codes: Tensor) -> Tensor:
    """``codes`` (``O x I`` integers 0..15, ``I`` even) -> ``O x I/2`` uint8, code ``2j`` in
    the low nibble of byte ``j`` and ``2j + 1`` in the high one."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """``pack_int4``'s inverse: ``O x I/2`` uint8 -> ``O x I`` uint8 codes 0..15."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).view(packed.shape[0], -1)


def blocked_int4(codes: Tensor) -> Tensor:
    """``codes`` (``O x I`` 0..15, ``O`` a multiple of 64) -> ``O x I/2`` uint8 in the
    blocked layout (module docstring): byte ``(b, i, r)`` holds row ``64 b + r`` in its low
    nibble and row ``64 b + 32 + r`` in its high one, at input ``i``."""
    rows, cols = codes.shape
    halves = codes.to(torch.uint8).view(rows // BLOCK_ROWS, 2, BLOCK_ROWS // 2, cols)
    halves = halves.permute(0, 3, 1, 2)  # block, input, half, row
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()


def unblocked_int4(blocked: Tensor) -> Tensor:
    """``blocked_int4``'s inverse: ``O x I/2`` uint8 (blocked) -> ``O x I`` uint8 codes."""
    rows, half = blocked.shape
    b = blocked.view(rows // BLOCK_ROWS, 2 * half, BLOCK_ROWS // 2)  # block, input, row
    halves = torch.stack((b & 15, b >> 4), dim=2)  # block, input, half, row
    return halves.permute(0, 2, 3, 1).reshape(rows, 2 * half)


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized ``O x I`` weight as stored: ``data`` (int8 ``O x I``, or uint8 ``O x I/2``
    int4 codes in ``layout``), ``scales`` (``O`` for int8 per row, ``O x I/g`` for int4 and
    grouped int8) and ``zeros`` (``O x I/g``: int4's, or a grouped int8's offsets; else
    None)."""

    bits: int
    data: Tensor
    scales: Tensor
    zeros: Tensor | None
    layout: str = "plain"
    steps: Tensor | None = None

    @property
    def coded(self) -> bool:
        """Whether int4's scales and zeros are 8-bit codes (``scales`` uint8, ``zeros`` int8,
        ``O x I/g``) against the bfloat16 ``steps`` (``ceil(O / STEP_ROWS) x 2``: ``d_s``,
        ``d_z`` per block of rows; module docstring)."""
        return self.steps is not None

    def group_scales(self) -> tuple[Tensor, Tensor | None]:
        """``(scales, zeros)`` as values: the stored ones, or coded ones decoded in float32
        (``c_s d_s``, ``c_z d_z``)."""
        if self.steps is None:
            return self.scales, self.zeros
        return decode_scales(self.scales, self.zeros, self.steps)

    @property
    def shape(self) -> tuple[int, int]:
        """``(O, I)`` of the weight this stands for."""
        rows, n = self.data.shape
        return rows, n * 8 // self.bits

    @property
    def group_size(self) -> int:
        """Inputs per scale: ``I`` for int8 per row, else ``g``."""
        return self.shape[1] if self.scales.dim() == 1 else self.shape[1] // self.scales.shape[-1]

    @property
    def per_row(self) -> bool:
        """Whether this is int8 with one scale per row and no offset (the kind int8 kernels
        take)."""
        return self.bits == 8 and self.scales.dim() == 1 and self.zeros is None

    def codes(self) -> Tensor:
        """The int4 codes ``O x I`` (uint8 0..15) whatever the layout; int8's ``q``."""
        if self.bits == 8:
            return self.data
        return unpack_int4(self.data) if self.layout == "plain" else unblocked_int4(self.data)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """``W'`` (``O x I``) in ``dtype`` (default the scales')."""
        if self.bits == 8:
            return dequantize_int8(self.data, self.scales, dtype, self.zeros)
        scales, zeros = self.group_scales()
        return dequantize_int4(self.codes(), scales, zeros, dtype or scales.dtype)

    def rows(self, index: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """``W'[index]`` (``index`` ``N..`` of row numbers -> ``N.. x I``), dequantizing only
        those rows: an embedding lookup."""
        flat = index.reshape(-1)
        scales = self.scales[flat]
        if self.bits == 8:
            w = dequantize_int8(self.data[flat], scales, dtype,
                                None if self.zeros is None else self.zeros[flat])
        elif self.steps is not None:
            s, z = decode_scales(scales, self.zeros[flat], self.steps[flat // STEP_ROWS],
                                 per_row=True)
            w = dequantize_int4(self._int4_rows(flat), s, z, dtype or s.dtype)
        else:
            w = dequantize_int4(self._int4_rows(flat), scales, self.zeros[flat], dtype)
        return w.view(*index.shape, w.shape[-1])

    def with_layout(self, layout: str) -> QuantizedWeight:
        """The same weight with its int4 codes in ``layout`` (itself when already so)."""
        if layout == self.layout or self.bits == 8:
            return self
        data = blocked_int4(self.codes()) if layout == "blocked" else pack_int4(self.codes())
        return QuantizedWeight(self.bits, data, self.scales, self.zeros, layout, self.steps)

    def _int4_rows(self, flat: Tensor) -> Tensor:
        if self.layout == "plain":
            return unpack_int4(self.data[flat])
        rows, half = self.data.shape
        b = self.data.view(rows // BLOCK_ROWS, 2 * half, BLOCK_ROWS // 2)
        lanes = b[flat // BLOCK_ROWS, :, flat % (BLOCK_ROWS // 2)]  # N x I
        shift = ((flat % BLOCK_ROWS) // (BLOCK_ROWS // 2) * 4).to(torch.uint8)[:, None]
        return (lanes >> shift) & 15


def decode_scales(codes: Tensor, zero_codes: Tensor, steps: Tensor, *,
                  per_row: bool = False) -> tuple[Tensor, Tensor]:
    """Coded int4 scales (``codes`` uint8 and ``zero_codes`` int8, ``O x G``; ``steps``
    ``ceil(O / STEP_ROWS) x 2``, or ``O x 2`` when ``per_row``: each row's block's) ->
    float32 ``(c_s d_s, c_z d_z)`` (``O x G`` each; module docstring)."""
    steps = steps.float()
    if not per_row:
        steps = steps.repeat_interleave(STEP_ROWS, dim=0)[:codes.shape[0]]
    return codes.float() * steps[:, :1], zero_codes.float() * steps[:, 1:]


def quantize(weight: Tensor, bits: int, group_size: int | None = None,
             scale_dtype: torch.dtype | None = None, fit: str = "nearest") -> QuantizedWeight:
    """``weight`` (``O x I``) in the plain layout of ``bits`` (8: one scale per row, so
    ``group_size`` is None or ``I``; 4: groups of ``group_size`` along ``I``, one of
    ``GROUP_SIZES`` dividing ``I``, scales and zeros chosen by ``fit``, one of ``FITS``),
    scales in ``scale_dtype`` (default the weight's; ``torch.int8`` for int4: coded scales,
    module docstring)."""
    if fit not in FITS:
        raise ValueError(f"fit: expected one of {', '.join(FITS)}, got {fit!r}")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        got = (f"{weight.dtype} of shape {tuple(weight.shape)}" if isinstance(weight, Tensor)
               else type(weight).__name__)
        raise ValueError(f"weight: expected a 2-d floating-point tensor O x I, got {got}")
    if bits == 8:
        if group_size is not None and (not is_int(group_size) or group_size != weight.shape[1]):
            raise ValueError(f"group_size: int8 has one scale per row, so None or the "
                             f"weight's {weight.shape[1]} inputs, got {group_size!r}")
        q, scales = quantize_int8(weight, scale_dtype)
        return QuantizedWeight(8, q, scales, None)
    if bits != 4:
        raise ValueError(f"bits: expected 8 or 4, got {bits!r}")
    if not is_int(group_size) or group_size not in GROUP_SIZES or weight.shape[1] % group_size:
        raise ValueError(f"group_size: expected one of {GROUP_SIZES} dividing the weight's "
                         f"{weight.shape[1]} inputs, got {group_size!r}")
    if scale_dtype == torch.int8:
        return _quantize_coded(weight, group_size, fit)
    packed, scales, zeros = quantize_int4(weight, group_size, scale_dtype, fit)
    return QuantizedWeight(4, packed, scales, zeros)


def _quantize_coded(weight: Tensor, group_size: int, fit: str) -> QuantizedWeight:
    """int4 with coded scales: each group fitted in float32 by ``fit``, its scale and zero
    then coded per row (``code_scales``), the codes computed from the decoded values."""
    rows, cols = weight.shape
    w = weight.detach().float().view(rows, cols // group_size, group_size)
    codes, zero_codes, steps = code_scales(w, *_fit_int4(w, torch.float32, fit), STEP_ROWS)
    return QuantizedWeight(4, _packed_codes(w, *decode_scales(codes, zero_codes, steps)), codes,
                           zero_codes, steps=steps)
