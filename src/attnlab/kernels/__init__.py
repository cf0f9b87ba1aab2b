"""Measured fast paths for inference: CPU kernels for ``x W^T + b`` (:mod:`.catalog`; our
own C++ decoding GEMVs among them, :mod:`.native`, compiled on this machine), the
calibration that times them on this machine and caches the winners (:mod:`.calibration`,
:mod:`.cache`), and the module that uses them (:class:`InferenceLinear`, swapped in by
:func:`optimize_for_inference`). The formulas in :mod:`attnlab.functional` never branch on
the CPU; this package is where speed is chosen, by measuring.
"""

from attnlab.kernels.calibration import BUCKETS, bucket_of, choose, measure, measure_rows, plan
from attnlab.kernels.catalog import KERNELS, Kernel
from attnlab.kernels.inference_linear import InferenceLinear, optimize_for_inference

__all__ = [
    "BUCKETS",
    "KERNELS",
    "InferenceLinear",
    "Kernel",
    "bucket_of",
    "choose",
    "measure",
    "measure_rows",
    "optimize_for_inference",
    "plan",
]
