"""Where speed lives: fast inference modules with the signatures of the reference modules they
stand in for, swapped in by :func:`optimize_for_inference` (``from_pretrained`` calls it
unless ``kernels=False``) and out by :func:`restore_reference`: :class:`InferenceLinear`
(``x W^T + b`` on a planned kernel per shape and row count, :mod:`.catalog`,
:mod:`.calibration`), the modules of :mod:`.fast_modules` (RMSNorm, the MLPs' activation,
RoPE, a decoding step's attention and the greedy argmax), and :mod:`.fused_layers` (a
decoding step through every block in one call). They run attnlab's C++ kernels
(:mod:`.native`, built by ``attnlab build``). A Linear's kernel is chosen by a fixed rule
you can read, from the dtype, the rows bucket and the CPU's features (:mod:`.rule`), or by a
plan that ``attnlab calibrate`` measured on this machine (:mod:`.calibration`,
:mod:`.cache`): loads never time anything. Nothing in the reference packages (formulas,
functional, attention, layers, generation, the model classes) imports this package.
"""

from attnlab.kernels.calibration import BUCKETS, bucket_of, choose, measure, measure_rows, plan
from attnlab.kernels.catalog import KERNELS, Kernel
from attnlab.kernels.fast_modules import (
    FastFeedForward,
    FastGatedMLP,
    FastGreedyTokens,
    FastRMSNorm,
    FastSelfAttention,
)
from attnlab.kernels.fused_layers import FusedLayers
from attnlab.kernels.inference_linear import InferenceLinear
from attnlab.kernels.install import optimize_for_inference, restore_reference
from attnlab.kernels.rule import Features, features, rule

__all__ = [
    "BUCKETS",
    "KERNELS",
    "FastFeedForward",
    "FastGatedMLP",
    "FastGreedyTokens",
    "FastRMSNorm",
    "FastSelfAttention",
    "Features",
    "FusedLayers",
    "InferenceLinear",
    "Kernel",
    "bucket_of",
    "choose",
    "features",
    "measure",
    "measure_rows",
    "optimize_for_inference",
    "plan",
    "restore_reference",
    "rule",
]
