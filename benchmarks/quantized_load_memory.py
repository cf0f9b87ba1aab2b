"""Peak resident memory of quantized loads, each in a fresh process, for one or more sources.

For every float checkpoint FOLDER and method (int8, int4 in groups of 64) it measures VmHWM
(the peak resident set, ``/proc/self/status``; mapped file pages count) of:

- ``baseline``: importing torch and attnlab, loading nothing;
- ``from_pretrained``: ``from_pretrained(FOLDER, quantize=method, kernels=False)``;
- ``attnlab quantize``: ``attnlab quantize FOLDER OUT --bits 8|4``;
- ``load OUT``: ``from_pretrained(OUT, kernels=False)``, OUT written by that source's CLI.

``kernels=False`` and ``ATTNLAB_QUANTIZED_KERNELS=dequantize`` keep kernel calibration (a
separate, timed step) out of the figures. Each ``--src NAME=PATH`` is an attnlab source tree
(its ``src`` folder) put first on ``PYTHONPATH``, so the code before and after a change is
measured in one sitting. Run from anywhere:

    python benchmarks/quantized_load_memory.py --src before=/work/main/src \\
        --src after=src FOLDER [FOLDER ...] --out benchmarks/quantized-load-memory.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, sys
args = json.loads(sys.argv[1])
if args["what"] == "from_pretrained":
    from attnlab.models.io import from_pretrained
    model = from_pretrained(args["folder"], quantize=args["method"], kernels=False)
elif args["what"] == "attnlab quantize":
    from attnlab.cli import main
    bits = "8" if args["method"] == "int8" else "4"
    assert main(["quantize", args["folder"], args["out"], "--bits", bits]) == 0
elif args["what"] == "load OUT":
    from attnlab.models.io import from_pretrained
    model = from_pretrained(args["out"], kernels=False)
else:
    import torch, attnlab.models, attnlab.quantization
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("VMHWM", int(status["VmHWM"].split()[0]) * 1024)
"""
STEPS = ("baseline", "from_pretrained", "attnlab quantize", "load OUT")
METHODS = ("int8", "int4")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="float checkpoint folders")
    parser.add_argument("--src", action="append", required=True, metavar="NAME=PATH",
                        help="an attnlab source tree to measure (repeat: before=..., after=...)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", type=Path, help="markdown file to write the table to")
    args = parser.parse_args(argv)
    sources = dict(item.split("=", 1) for item in args.src)
    rows = []
    with tempfile.TemporaryDirectory(prefix="attnlab-memory-") as scratch:
        for folder in args.folders:
            file_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
            for method in args.methods:
                for name, src in sources.items():
                    out = Path(scratch) / f"{folder.name}-{method}-{name}"
                    peaks = {step: _peak(src, step, folder, method, out) for step in STEPS}
                    written = out / "model.safetensors"
                    quantized = written.stat().st_size if written.is_file() else 0
                    rows.append((folder.name, file_bytes, method, quantized, name, peaks))
                    print(_row(rows[-1]), flush=True)
    table = _table(rows, argv if argv is not None else sys.argv[1:])
    print(table)
    if args.out is not None:
        args.out.write_text(table)
    return 0


def _peak(src: str, step: str, folder: Path, method: str, out: Path) -> int | str:
    """VmHWM in bytes of a fresh process running ``step``, or why it failed (a result too:
    an out-of-memory kill is one)."""
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve()), "OMP_NUM_THREADS": "1",
           "ATTNLAB_QUANTIZED_KERNELS": "dequantize", "ATTNLAB_KERNELS": "formula"}
    payload = json.dumps({"what": step, "folder": str(folder), "method": method,
                          "out": str(out)})
    done = subprocess.run([sys.executable, "-c", _CHILD, payload], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        print(f"{step} failed ({done.returncode}): {done.stderr[-2000:]}", file=sys.stderr)
        return f"failed ({done.returncode}: {last[:60]})"
    return int(done.stdout.split("VMHWM")[-1])


def _mib(n: int | str) -> str:
    return n if isinstance(n, str) else f"{n / 2**20:,.0f}"


def _row(row: tuple) -> str:
    model, file_bytes, method, quantized, name, peaks = row
    return (f"| {model} | {_mib(file_bytes)} | {method} | {_mib(quantized)} | {name} | "
            + " | ".join(_mib(peaks[step]) for step in STEPS) + " |")


def _table(rows: list[tuple], argv: list[str]) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                if line.startswith("Model name")), platform.processor())
    head = ("| model | float file MiB | method | quantized file MiB | code | "
            + " | ".join(f"{step} MiB" for step in STEPS) + " |")
    return "\n".join([
        f"## Quantized loads: peak resident memory (VmHWM), {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"CPU: {cpu}; load average at the end {os.getloadavg()[0]:.1f}; one thread; "
        "each figure a fresh process.",
        f"Command: `python benchmarks/quantized_load_memory.py {' '.join(argv)}`",
        "",
        head,
        "|" + "---|" * (5 + len(STEPS)),
        *(_row(row) for row in rows),
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
