"""One row of x through every 2-D float32 weight of a safetensors checkpoint with the native
GEMV (``attnlab.kernels.native.gemv``), the weights as ``from_pretrained`` keeps them (mapped
from the file, on large pages where the kernel's page cache has them) and as copies in
anonymous memory (4 KiB pages unless transparent huge pages are always on). For issue 38's
float32 decode regression: run it on two checkouts in turns to compare their one-row loops.

    python benchmarks/scripts/gemv_one_row.py FOLDER [--passes 25] [--threads 1]

Prints, for each placement, the median and the range over the passes of the process's CPU
time for one pass over the weights (CPU time, not wall time: other programs on a busy machine
then cost less of the spread; their memory traffic still counts).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from safetensors import safe_open

from attnlab.kernels import native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--passes", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with safe_open(str(args.folder / "model.safetensors"), framework="pt") as f:
        mapped = [t for t in (f.get_tensor(n) for n in f.keys())  # noqa: SIM118 (a handle)
                  if t.dim() == 2 and t.dtype == torch.float32]
    placements = {"mapped": mapped, "anonymous": [w.clone() for w in mapped]}
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in mapped}
    times: dict[str, list[float]] = {name: [] for name in placements}
    for p in range(args.passes + 1):
        for name, weights in placements.items():  # in turns: both see the same moments
            start = time.process_time()
            for w in weights:
                native.gemv(xs[w.shape[1]], w)
            if p:  # the first pass warms up
                times[name].append((time.process_time() - start) * 1e3)
    total = sum(w.numel() * 4 for w in mapped) / 1e6
    print(f"{len(mapped)} weights, {total:.0f} MB, {args.threads} thread(s)")
    for name, values in times.items():
        print(f"{name}: {statistics.median(values):.2f} ms a pass "
              f"({min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
