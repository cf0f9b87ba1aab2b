"""Benchmark programs behind ``attnlab bench ...``: medians of repeats, the reference measured
in the same run, ratios printed, results saved as markdown and PNG under ``benchmarks/``."""

from attnlab.bench.harness import Measurement, machine_info, peak_memory, time_median

__all__ = ["Measurement", "machine_info", "peak_memory", "time_median"]
