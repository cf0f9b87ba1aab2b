"""int8 and int4 weights: the formats as formulas (:mod:`.formats`), the kernels that read
them and the measuring that picks one (:mod:`.kernels`), the modules swapped in for
``nn.Linear``/``nn.Embedding`` (:mod:`.modules`) and the model-level conversion
(:mod:`.convert`). Decoding reads every weight once per token, so fewer bytes per weight is
the only way past the bandwidth bound of bfloat16.
"""

from attnlab.quantization.convert import (
    METHODS,
    QuantizationConfig,
    quantize_model,
    quantized_skeleton,
    weight_bytes,
)
from attnlab.quantization.formats import QuantizedWeight, quantize
from attnlab.quantization.kernels import QUANTIZED_KERNELS
from attnlab.quantization.modules import QuantizedEmbedding, QuantizedLinear

__all__ = [
    "METHODS",
    "QUANTIZED_KERNELS",
    "QuantizationConfig",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedWeight",
    "quantize",
    "quantize_model",
    "quantized_skeleton",
    "weight_bytes",
]
