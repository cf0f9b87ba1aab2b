"""Choosing an int4 group's scale and minimum by a search, instead of from its extremes.

Round-to-nearest (``formats.quantize_int4``) spans each group's range with the 16 codes:
``s = (hi - lo) / 15``, minimum ``m = lo`` (the value of code 0). One outlier then stretches
the step for the whole group. The search (the idea of llama.cpp's k-quants, written afresh)
tries, for each group ``w`` (``g`` values), the steps ``s_k = (hi - lo) / n_k`` for
``n_k`` in ``STEPS`` (15 is round-to-nearest's); for each it rounds the codes
``q = clamp(round((w - lo) / s_k), 0, 15)``, then fits the scale and minimum to those codes by
least squares (the line through the points ``(q_i, w_i)``:

    s = sum (q_i - mean q)(w_i - mean w) / sum (q_i - mean q)^2,   m = mean w - s mean q

), rounds ``s`` and ``z = m + 8 s`` to the stored dtype, re-rounds the codes to the nearest
of the fitted grid and refits (``REFITS`` times), and keeps, per group, the candidate whose
squared error ``sum_i ((q_i - 8) s + z - w_i)^2`` is least. Round-to-nearest's own scale and
zero are a candidate, and a candidate replaces them only when its error is smaller, so the
search never increases a group's squared error.

``code_scales`` then codes the chosen scales and zeros in 8 bits (the coded format of
``formats``): the nearest codes, or the neighbours where those lower a group's error.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["REFITS", "STEPS", "code_scales", "search_int4"]

# Steps across a group's range tried: below 15 clips the ends (an outlier's code then
# saturates), above 15 leaves codes unused at the ends and refines the step inside.
STEPS = tuple(15 + k / 4 for k in range(-8, 9))
REFITS = 2


def search_int4(w: Tensor, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``w`` (``N x g`` groups, float32) -> ``(scales, zeros)`` (``N`` each, in
    ``scale_dtype``) of least squared error among round-to-nearest's and the candidates of
    the module docstring; the codes of a group are then ``clamp(round((w - z) / s) + 8, 0,
    15)``."""
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    span = hi - lo
    rtn = torch.where(span > 0, span / 15, torch.ones_like(span)).to(scale_dtype)
    best_s, best_z = rtn, (lo + 8 * rtn.float()).to(scale_dtype)
    best = _error(w, best_s, best_z)
    for n in STEPS:
        step = torch.where(span > 0, span / n, torch.ones_like(span))
        codes = torch.round((w - lo[:, None]) / step[:, None]).clamp_(0, 15)
        for _ in range(REFITS):
            s, z = _fit(w, codes, scale_dtype)
            codes = _codes(w, s, z)
        s, z = _fit(w, codes, scale_dtype)
        error = _error(w, s, z)
        better = error < best
        best = torch.where(better, error, best)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    return best_s, best_z


def code_scales(w: Tensor, scales: Tensor, zeros: Tensor, rows_per_step: int
                ) -> tuple[Tensor, Tensor, Tensor]:
    """The fitted ``scales`` and ``zeros`` of the groups ``w`` (``O x G x g``, float32;
    ``O x G`` each) as 8-bit codes against two steps per block of ``rows_per_step`` rows ->
    ``(codes, zero_codes, steps)``: ``codes`` uint8 1..255 and ``zero_codes`` int8 -127..127
    (``O x G``), ``steps`` ``ceil(O / rows_per_step) x 2`` bfloat16 = ``(max s / 255,
    max |z| / 127)`` over each block, rounded up (1 where that is 0). Each group takes the
    nearest codes, or the neighbours (+-1 in either) whose decoded scale and zero give it the
    least squared error with its nearest int4 codes."""
    rows, groups, size = w.shape
    scales, zeros = scales.float(), zeros.float()
    blocks = -(-rows // rows_per_step)
    pad = blocks * rows_per_step - rows

    def step(x: Tensor, top: int) -> Tensor:
        largest = torch.nn.functional.pad(x.abs().amax(dim=1), (0, pad))
        d = _bfloat16_up(largest.view(blocks, rows_per_step).amax(dim=1) / top)
        return torch.where(d > 0, d, torch.ones_like(d))

    steps = torch.stack((step(scales, 255), step(zeros, 127)), dim=1)
    d_s, d_z = steps.repeat_interleave(rows_per_step, dim=0)[:rows].unbind(dim=1)
    near_s = torch.round(scales / d_s[:, None]).clamp_(1, 255)
    near_z = torch.round(zeros / d_z[:, None]).clamp_(-127, 127)
    flat = w.reshape(-1, size)

    def error(c_s: Tensor, c_z: Tensor) -> Tensor:
        return _error(flat, (c_s * d_s[:, None]).reshape(-1),
                      (c_z * d_z[:, None]).reshape(-1)).view(rows, groups)

    best_s, best_z, best = near_s, near_z, error(near_s, near_z)
    for ds in (-1, 0, 1):
        for dz in (-1, 0, 1):
            if ds or dz:
                c_s, c_z = (near_s + ds).clamp_(1, 255), (near_z + dz).clamp_(-127, 127)
                e = error(c_s, c_z)
                better = e < best
                best = torch.where(better, e, best)
                best_s, best_z = torch.where(better, c_s, best_s), torch.where(better, c_z, best_z)
    return best_s.to(torch.uint8), best_z.to(torch.int8), steps.to(torch.bfloat16)


def _bfloat16_up(x: Tensor) -> Tensor:
    """Non-negative float32 ``x`` rounded up to the nearest bfloat16 (as float32): the upper
    16 bits of the float32, plus one unit where any lower bit is set."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32)


def _fit(w: Tensor, codes: Tensor, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The least-squares scale and zero of ``w`` on ``codes``, rounded to ``scale_dtype``;
    a group whose codes are all one value (no line) gets scale 1 (its error is then that of
    its mean, never chosen over a fitted candidate)."""
    qc = codes - codes.mean(dim=-1, keepdim=True)
    wc = w - w.mean(dim=-1, keepdim=True)
    var = (qc * qc).sum(dim=-1)
    s = (qc * wc).sum(dim=-1) / torch.where(var > 0, var, torch.ones_like(var))
    s = torch.where((var > 0) & (s > 0), s, torch.ones_like(s)).to(scale_dtype)
    m = w.mean(dim=-1) - s.float() * codes.mean(dim=-1)
    return s, (m + 8 * s.float()).to(scale_dtype)


def _codes(w: Tensor, s: Tensor, z: Tensor) -> Tensor:
    return (torch.round((w - z.float()[:, None]) / s.float()[:, None]) + 8).clamp_(0, 15)


def _error(w: Tensor, s: Tensor, z: Tensor) -> Tensor:
    """Each group's squared error with the nearest codes of ``(s, z)`` (``N``)."""
    rebuilt = (_codes(w, s, z) - 8) * s.float()[:, None] + z.float()[:, None]
    return ((rebuilt - w) ** 2).sum(dim=-1)
