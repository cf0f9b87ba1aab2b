"""A GGUF tensor's blocks as an attnlab ``QuantizedWeight`` holding the blocks' own numbers.

The block layouts are llama.cpp's (``gguf.quants`` decodes them; the bit fields below are read
as it reads them). ``d``/``dmin`` are half-precision, ``q`` a block's codes:

- ``Q8_0`` (32 inputs, ``w = d q``, ``q`` int8): grouped int8, group 32, scale ``d``;
- ``Q5_0`` (32, ``w = d (q - 16)``, ``q`` 0..31): grouped int8, group 32, codes ``q - 16``;
- ``Q5_1`` (32, ``w = d q + m``, ``q`` 0..31): grouped int8 with offsets, group 32, codes
  ``q``, scale ``d``, offset ``m``;
- ``Q5_K`` (256 in 8 sub-blocks of 32, ``w = d sc_j q - dmin m_j``, ``sc_j``/``m_j`` 6-bit,
  ``q`` 0..31): grouped int8 with offsets, group 32, codes ``q``, scale ``d sc_j``, offset
  ``-dmin m_j``;
- ``Q6_K`` (256 inputs in 16 sub-blocks of 16, ``w = d s_j (q - 32)``, ``q`` 0..63, ``s_j``
  int8): grouped int8, group 16, scale ``d s_j`` (exact in float32: 11 by 8 bits);
- ``Q4_0`` (32, ``w = d (q - 8)``, ``q`` 0..15): int4 groups of 32, ``s = d``, ``z = 0``;
- ``Q4_1`` (32, ``w = d q + m``): int4 groups of 32, ``s = d``, ``z = m + 8 d``;
- ``Q4_K`` (256 in 8 sub-blocks of 32, ``w = d sc_j q - dmin m_j``, ``sc_j``/``m_j`` 6-bit,
  ``q`` 0..15): int4 groups of 32, ``s = d sc_j``, ``z = 8 s - dmin m_j``.

Scales and zeros are float32. ``gguf.quants.dequantize`` computes ``s q`` (exact: at most
11 + 8 + 6 bits) and, for the types with a minimum, subtracts or adds it, rounding once;
attnlab computes ``(q - 8) s + z`` (int4) or ``q s + z`` (int8 with offsets), also exact then
rounded once, which is the same number whenever ``z`` is exact in float32. For Q8_0, Q5_0,
Q6_K, Q4_0 there is no ``z``; Q5_1's ``m`` and Q5_K's ``-dmin m_j`` (an 11-bit by 6-bit
product) are the very numbers ``gguf`` adds, kept as they are: the 5-bit codes are stored
uncentred (0..31 fits int8) so that no offset has to be folded into another. Q4_1's ``m + 8
d`` (two half-precision numbers) is exact unless their exponents lie 13 apart, which is
checked per tensor: such a Q4_1 tensor raises a ``ValueError`` (its loader dequantizes it,
with a notice). These dequantize to ``gguf``'s weight bit for bit. Q4_K's ``8 d sc_j -
dmin m_j`` (two 17-bit products) is often not exact in float32, and a whole Q4_K_M file
dequantized would hold 8 times its memory: its blocks are kept, bit for bit in every group
whose ``z`` is exact and elsewhere within one float32 rounding of ``z`` and of the result:
``|w' - w| <= 2^-24 (|z| + 2 |w|)``.

Grouped int8 runs attnlab's grouped GEMV (``int8_grouped``) for decoding rows and the formula
(its weight dequantized at each call) for more. Not kept: ``Q2_K``, ``Q3_K`` and the other
types: dequantized by the loader.
"""

from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor

from attnlab.quantization.formats import QuantizedWeight

__all__ = ["KEPT_TYPES", "tensor_weight"]

Q = gguf.GGMLQuantizationType
KEPT_TYPES = (Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.Q4_K)


def tensor_weight(t: Any) -> QuantizedWeight:
    """The GGUF tensor ``t`` (a ``GGUFTensor`` of a ``KEPT_TYPES`` type, ``O x I``) as a
    ``QuantizedWeight`` holding its blocks' own numbers (module docstring); a ValueError when
    a Q4_1 zero is not exact in float32."""
    cols, rows = t.shape[0], math.prod(t.shape[1:])
    kind = Q(t.tensor_type)
    block = gguf.GGML_QUANT_SIZES[kind][0]
    # Read from the mapping into the kept arrays directly: a transient copy of a whole
    # tensor would fragment the heap for the rest of the load.
    blocks = t.data.reshape(rows, cols // block, -1)
    if kind == Q.Q8_0:
        codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
        return QuantizedWeight(8, codes.view(rows, cols), _half(blocks[..., 0:2]), None)
    if kind == Q.Q5_0:
        codes = _five_bits(blocks[..., 2:6], blocks[..., 6:]) - np.int8(16)
        return QuantizedWeight(8, torch.from_numpy(codes).view(rows, cols),
                               _half(blocks[..., 0:2]), None)
    if kind == Q.Q5_1:
        codes = torch.from_numpy(_five_bits(blocks[..., 4:8], blocks[..., 8:]))
        return QuantizedWeight(8, codes.view(rows, cols), _half(blocks[..., 0:2]),
                               _half(blocks[..., 2:4]))
    if kind == Q.Q5_K:
        codes, scales, minimums = _q5_k(blocks)
        return QuantizedWeight(8, codes.view(rows, cols), scales.view(rows, -1),
                               -minimums.view(rows, -1))
    if kind == Q.Q6_K:
        codes, scales = _q6_k(blocks)
        return QuantizedWeight(8, codes.view(rows, cols), scales.view(rows, -1), None)
    if kind == Q.Q4_K:
        codes, scales, minimums = _q4_k(blocks)
        scales, minimums = scales.view(rows, -1), minimums.view(rows, -1)
        return _int4(t.name, codes.reshape(rows, cols), scales, 8 * scales - minimums, None)
    d = _half(blocks[..., 0:2])
    q = blocks[..., (2 if kind == Q.Q4_0 else 4):]  # byte j: input j low, j + 16 high
    codes = np.concatenate((q & 15, q >> 4), axis=-1).reshape(rows, cols)
    if kind == Q.Q4_0:
        return _int4(t.name, codes, d, torch.zeros_like(d), None)
    m = _half(blocks[..., 2:4])
    return _int4(t.name, codes, d, m + 8 * d, m.double() + 8 * d.double())


def _int4(name: str, codes: np.ndarray, scales: Tensor, zeros: Tensor, exact: Tensor | None
          ) -> QuantizedWeight:
    """int4 codes ``O x I`` (0..15) packed in the plain layout with their scales and zeros;
    ``exact`` (when given) the zeros computed in float64, which they must equal."""
    if exact is not None and not torch.equal(zeros.double(), exact):
        raise ValueError(f"tensor {name!r}: a zero is not exact in float32")
    pairs = codes.reshape(codes.shape[0], -1, 2)
    packed = torch.from_numpy(pairs[..., 0] | (pairs[..., 1] << 4))
    return QuantizedWeight(4, packed, scales, zeros)


def _half(pairs: np.ndarray) -> Tensor:
    """Half-precision numbers stored as byte pairs (``R x N x 2`` uint8) -> float32 ``R x
    N``."""
    return torch.from_numpy(np.ascontiguousarray(pairs).view(np.float16)[..., 0]).float()


def _five_bits(high: np.ndarray, nibbles: np.ndarray) -> np.ndarray:
    """The 5-bit codes ``q`` (int8 0..31, ``R x N x 32``) of Q5_0/Q5_1 blocks from their
    ``qh`` (``R x N x 4``: bit ``j`` of the little-endian u32 the fifth bit of input ``j``)
    and their 16 bytes of nibbles (byte ``j``: input ``j`` low, ``j + 16`` high)."""
    # bit j of the u32 is bit j % 8 of byte j // 8 (a byte per input, not a u32); in place
    # after that, so that the transients are two arrays the size of the int8 codes
    fifth = np.unpackbits(high, axis=-1, bitorder="little")
    codes = np.concatenate((nibbles & 15, nibbles >> 4), axis=-1)
    codes |= np.left_shift(fifth, 4, out=fifth)
    return codes.view(np.int8)


def _q6_k(blocks: np.ndarray) -> tuple[Tensor, Tensor]:
    """``(q - 32`` int8 ``R x N x 256``, scales ``d s_j`` float32 ``R x N x 16)`` of Q6_K
    blocks (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 ``s_j``, ``d``)."""
    rows, n = blocks.shape[:2]
    low = blocks[..., :128].reshape(rows, n, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    low = (low & 15).reshape(rows, n, 8, 32)
    high = blocks[..., 128:192].reshape(rows, n, 2, 1, 32) >> np.array([0, 2, 4, 6],
                                                                      np.uint8)[:, None]
    high = (high & 3).reshape(rows, n, 8, 32)
    codes = (low | (high << 4)).astype(np.int8) - np.int8(32)
    s = torch.from_numpy(np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)).float()
    d = _half(blocks[..., 208:210])
    return torch.from_numpy(codes.reshape(rows, n, 256)), d[..., None] * s


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, Tensor, Tensor]:
    """``(q`` uint8 ``R x N x 256``, ``d sc_j``, ``dmin m_j`` float32 ``R x N x 8)`` of Q4_K
    blocks (``d``, ``dmin``, 12 bytes of 6-bit ``sc_j``/``m_j``, 128 bytes of nibbles: in
    each 32 bytes, sub-block ``2i`` low, ``2i + 1`` high)."""
    rows, n = blocks.shape[:2]
    q = blocks[..., 16:].reshape(rows, n, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    return (q & 15).reshape(rows, n, 256), *_k_scales(blocks)


def _q5_k(blocks: np.ndarray) -> tuple[Tensor, Tensor, Tensor]:
    """``(q`` int8 0..31 ``R x N x 256``, ``d sc_j``, ``dmin m_j`` float32 ``R x N x 8)`` of
    Q5_K blocks (``d``, ``dmin``, 12 bytes of 6-bit ``sc_j``/``m_j``, 32 bytes of fifth bits:
    bit ``j`` of byte ``k`` the fifth bit of input ``k`` of sub-block ``j``, 128 bytes of
    nibbles as Q4_K's)."""
    rows, n = blocks.shape[:2]
    # in place after the two shifts: the transients are two arrays the size of the codes
    codes = blocks[..., 48:].reshape(rows, n, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    codes &= 15
    high = blocks[..., 16:48].reshape(rows, n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    high &= 1
    high <<= 4
    codes = codes.reshape(rows, n, 8, 32)
    codes |= high
    return torch.from_numpy(codes.reshape(rows, n, 256).view(np.int8)), *_k_scales(blocks)


def _k_scales(blocks: np.ndarray) -> tuple[Tensor, Tensor]:
    """``(d sc_j, dmin m_j)`` (float32 ``R x N x 8``, each product exact) of Q4_K/Q5_K
    blocks (``d``, ``dmin``, then 12 bytes: ``sc_j``/``m_j`` low 6 bits of bytes ``j`` and
    ``4 + j`` for ``j < 4``; for ``j >= 4`` the low and high nibble of byte ``4 + j`` under
    the top 2 bits of bytes ``j - 4`` and ``j``)."""
    rows, n = blocks.shape[:2]
    packed = blocks[..., 4:16].reshape(rows, n, 3, 4)
    a, b, c = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), axis=-1)
    m = np.concatenate((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), axis=-1)
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    return (d[..., None] * torch.from_numpy(sc).float(),
            dmin[..., None] * torch.from_numpy(m).float())
