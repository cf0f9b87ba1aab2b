"""Tutorial 10, quantization: the exercises.

Fill in each function, then run ``attnlab exercises check 10`` (or ``pytest exercises/``).
"""

from __future__ import annotations

# --8<-- [start:imports]
import copy

import torch
from torch import Tensor, nn

from attnlab.quantization import quantize_model

# --8<-- [end:imports]

EXERCISES = {
    "10.1": "per_tensor_int8",
    "10.2": "unpack_int4",
    "10.3": "bytes_per_weight",
    "10.4": "quantize_keeping_head",
}


# --8<-- [start:per_tensor_int8]
def per_tensor_int8(W: Tensor) -> Tensor:
    """W (``O x I``) quantized to int8 with ONE scale for the whole matrix, s = max|W| / 127,
    codes round(W / s) clamped to [-127, 127], and dequantized back: codes * s."""
    s = W.abs().max() / 127
    return torch.round(W / s).clamp(-127, 127) * s
# --8<-- [end:per_tensor_int8]


# --8<-- [start:unpack_int4]
def unpack_int4(data: Tensor, scales: Tensor, zeros: Tensor,
                group_size: int) -> tuple[Tensor, Tensor]:
    """The codes and the weight of a stored int4 matrix: ``data`` (``O x I/2`` uint8) holds
    code 2j in the low nibble and code 2j+1 in the high nibble of byte j; ``scales`` and
    ``zeros`` are ``O x I/g``; the weight is (q - 8) s + z group by group. Returns the codes
    (``O x I`` uint8) and the weight (``O x I`` float32)."""
    rows = data.shape[0]
    codes = torch.stack((data & 15, data >> 4), dim=-1).view(rows, -1)
    groups = codes.view(rows, -1, group_size).float()
    W = (groups - 8) * scales.float()[..., None] + zeros.float()[..., None]
    return codes, W.view(rows, -1)
# --8<-- [end:unpack_int4]


# --8<-- [start:bytes_per_weight]
def bytes_per_weight(kind: str, size: int) -> float:
    """Bytes per weight with 16-bit scales and zero points: ``"int8"`` (one byte per weight
    and one scale per row of ``size`` inputs) or ``"int4"`` (half a byte per weight and a
    scale and a zero point per group of ``size``)."""
    if kind == "int8":
        return 1 + 2 / size
    if kind == "int4":
        return 0.5 + 4 / size
    raise ValueError(f"kind: expected 'int8' or 'int4', got {kind!r}")
# --8<-- [end:bytes_per_weight]


# --8<-- [start:quantize_keeping_head]
def quantize_keeping_head(model: nn.Module, group_size: int) -> nn.Module:
    """A copy of ``model`` with every linear layer and embedding quantized to int4 (groups of
    ``group_size``) except the LM head, which stays in float (and with it the embedding that
    shares its table); ``model`` itself is unchanged."""
    return quantize_model(copy.deepcopy(model), "int4", group_size=group_size,
                          skip=["lm_head"])
# --8<-- [end:quantize_keeping_head]
