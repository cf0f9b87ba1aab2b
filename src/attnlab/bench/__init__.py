"""The benchmarks a user runs on their own model, behind ``attnlab bench generate|serve|families|
quantization``: medians of repeats, the reference measured in the same run, ratios printed,
results saved as markdown and PNG (``runs/bench``). The repository's developer benchmarks
(``devbench/``) use the same harness."""

from attnlab.bench.harness import Measurement, machine_info, peak_memory, time_median

__all__ = ["Measurement", "machine_info", "peak_memory", "time_median"]
