"""Fast paths for inference: CPU kernels for ``x W^T + b`` (:mod:`.catalog`; our own C++
decoding GEMVs among them, :mod:`.native`), the fixed rule that names one per dtype, rows
bucket and CPU feature (:mod:`.rule`), the chooser that applies it or a plan that ``attnlab
calibrate`` measured on this machine (:mod:`.calibration`, :mod:`.cache`), and the module
that runs them (:class:`InferenceLinear`, swapped in by :func:`optimize_for_inference`). The
formulas in :mod:`attnlab.functional` never branch on the CPU; this package is where speed is
chosen, by a rule you can read, and measured only when asked.
"""

from attnlab.kernels.calibration import BUCKETS, bucket_of, choose, measure, measure_rows, plan
from attnlab.kernels.catalog import KERNELS, Kernel
from attnlab.kernels.inference_linear import InferenceLinear, optimize_for_inference
from attnlab.kernels.rule import Features, features, rule

__all__ = [
    "BUCKETS",
    "KERNELS",
    "Features",
    "InferenceLinear",
    "Kernel",
    "bucket_of",
    "choose",
    "features",
    "measure",
    "measure_rows",
    "optimize_for_inference",
    "plan",
    "rule",
]
