"""``python -m attnlab.kernels.calibrate``: time every available linear kernel on this machine
for given shapes and row counts, and print the table (median microseconds per call, the
winner named). It measures afresh and does not touch the kernel cache (``attnlab calibrate
FOLDER`` is what writes a plan there, for a model's shapes). A kernel whose first timed call
is more than 10 ms and 10x the fastest is timed only that once.

Example: ``python -m attnlab.kernels.calibrate --dtype float32 bfloat16 --shape 896x896
4864x896 --rows 1 8 512``
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

import torch

from attnlab.arg_types import positive_int
from attnlab.kernels.cache import cpu_model
from attnlab.kernels.calibration import measure_rows
from attnlab.kernels.catalog import KERNELS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the options, measure each (dtype, shape, rows), print one table."""
    parser = argparse.ArgumentParser(
        prog="python -m attnlab.kernels.calibrate",
        description="Time the linear kernels (y = x W^T + b, W of shape OUTxIN) on this "
                    "machine and print the median microseconds per call of each.")
    parser.add_argument("--dtype", nargs="+", choices=tuple(_DTYPES), default=["float32"])
    parser.add_argument("--shape", nargs="+", type=_shape, required=True,
                        help="weight shapes OUTxIN, e.g. 4864x896")
    parser.add_argument("--rows", nargs="+", type=positive_int, default=[1, 8, 512],
                        help="rows of x per call (default 1 8 512)")
    parser.add_argument("--kernels", nargs="+", choices=tuple(KERNELS), default=None,
                        help="the kernels to time (default all that can run)")
    parser.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True,
                        help="time y = x W^T + b (default) or, with --no-bias, y = x W^T")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch threads (default torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = args.kernels or list(KERNELS)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| dtype | O x I | rows | " + " | ".join(names) + " | winner |")
    print("|---|---|---|" + "---:|" * len(names) + "---|")
    for dtype in args.dtype:
        for out_features, in_features in args.shape:
            for rows in args.rows:
                try:
                    us = measure_rows(_DTYPES[dtype], out_features, in_features, rows, names,
                                      bias=args.bias)
                except (RuntimeError, MemoryError) as error:  # e.g. a weight too large
                    parser.error(f"--shape {out_features}x{in_features} --rows {rows}: "
                                 f"not measured ({error})")
                cells = [f"{us[n]:.1f}" if n in us else "-" for n in names]
                winner = min(us, key=us.__getitem__)
                print(f"| {dtype} | {out_features}x{in_features} | {rows} | "
                      + " | ".join(cells) + f" | {winner} |", flush=True)


def _shape(text: str) -> tuple[int, int]:
    """``OUTxIN`` -> ``(OUT, IN)``, both positive."""
    match = re.fullmatch(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*", text)
    if match is None or 0 in (int(match[1]), int(match[2])):
        raise argparse.ArgumentTypeError(
            f"expected OUTxIN with two positive ints, e.g. 4864x896, got {text!r}")
    return int(match[1]), int(match[2])


if __name__ == "__main__":
    main()
