"""Decoding's matrix-vector products: bound by memory or by the kernels' arithmetic, here?

One decoding step multiplies ``x`` (one row per sequence decoded at once, ``--rows``) by
every weight once, so its speed is weight bytes / read bandwidth, whatever the rows, only
while a kernel turns bytes into sums faster than memory brings them: each row more is more
arithmetic on the same bytes. For each count of rows, each weight scheme (float32, bfloat16,
int8, int4 in groups of ``--group-size``) and each kernel that can run it on this CPU
(``attnlab.kernels.KERNELS``, and ``attnlab.quantization.kernels.QUANTIZED_KERNELS`` with
bfloat16 activations), two measures, against the read bandwidth measured in the same rounds
(``sum`` over a float32 buffer of 1 GiB, timed in turns with the streamed passes):

- resident: one ``--resident`` matrix called over and over (it stays in the caches): the
  rate the kernel's instructions sustain, as GB/s of its own bytes and as GFLOP/s
  (``2 rows O K`` a call), to hold against the CPU's multiply-add peak;
- streamed: the ``--shapes`` of a decoder block, copied until the copies exceed
  ``--stream-mib`` (several times the caches), each read once per pass as a decoding step
  reads them: GB/s from memory, and the speed-up of one set of the shapes over the fastest
  bfloat16 kernel's at the same rows (what fewer bytes per weight buy: ~2x for int8, ~3.5x
  for int4 with its scales, were both bound by memory alone).

A kernel whose resident rate is not well above the bandwidth cannot stream at it. Kernels are
timed in turns (``harness.time_medians``); medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from attnlab.arg_types import positive_int
from attnlab.bench.harness import (
    BandwidthProbe,
    int_list,
    machine_info,
    machine_section,
    time_medians,
)
from attnlab.durable import write_text_atomic
from attnlab.kernels import KERNELS, Kernel
from attnlab.quantization import quantize
from attnlab.quantization.formats import GROUP_SIZES, QuantizedWeight
from attnlab.quantization.kernels import QUANTIZED_KERNELS

__all__ = ["add_arguments", "run"]

# One Qwen2-0.5B block: q, k, v, o, gate, up, down (O x K).
DEFAULT_SHAPES = "896x896,128x896,128x896,896x896,4864x896,4864x896,896x4864"
SCHEMES = ("float32", "bfloat16", "int8", "int4")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m devbench gemv``."""
    parser.add_argument("--shapes", type=_shape_list, default=DEFAULT_SHAPES,
                        help="comma-separated OxK weight shapes read by one streamed pass")
    parser.add_argument("--rows", type=int_list, default="1",
                        help="comma-separated rows of x (sequences decoded at once), each a "
                        "full set of measures")
    parser.add_argument("--resident", type=_shape, default="4096x1024",
                        help="OxK of the matrix timed while it stays in the caches")
    parser.add_argument("--stream-mib", type=positive_int, default=128,
                        help="the streamed copies' bytes per kernel, at least (MiB): every "
                        "kernel's copies are held at once, timed in turns")
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=64,
                        help="int4 group size")
    parser.add_argument("--repeats", type=positive_int, default=7,
                        help="timed rounds (median)")


def run(args: argparse.Namespace) -> Path:
    """Run the benchmark and write ``gemv.md`` and ``gemv.json`` into ``args.out``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = ((64, 128), (32, 128)) if args.quick else args.shapes
    resident = (64, 128) if args.quick else args.resident
    stream_bytes = 2**20 if args.quick else args.stream_mib * 2**20
    repeats = 2 if args.quick else args.repeats
    probe = BandwidthProbe(2**18 if args.quick else 2**28)
    skipped: list[dict] = []
    x_rows = tuple(dict.fromkeys(args.rows))
    with torch.inference_mode():
        runs = {(m, scheme, name): run
                for scheme in tqdm(SCHEMES, desc="bench gemv", unit="scheme")
                for (m, name), run in _prepared(scheme, x_rows, shapes, resident, stream_bytes,
                                                args.group_size, skipped).items()}
        # Every kernel of every scheme in turns: the ratios across schemes see one machine.
        hot = time_medians({key: run["hot"] for key, run in runs.items()}, repeats=repeats)
        streamed = time_medians({**{key: run["streamed"] for key, run in runs.items()},
                                 "probe": probe}, repeats=repeats)
    bandwidth_gbs = probe.gbs(streamed.pop("probe"))
    rows = [{"x_rows": m, "scheme": scheme, "kernel": name,
             "bytes_resident": run["bytes_resident"], "resident_s": hot[m, scheme, name],
             "bytes_layer": run["bytes_layer"],
             "layer_s": streamed[m, scheme, name] / run["layers"]}
            for (m, scheme, name), run in runs.items()]
    best = {m: min((row["layer_s"] for row in rows
                    if row["scheme"] == "bfloat16" and row["x_rows"] == m), default=None)
            for m in x_rows}
    for row in rows:
        fastest = best[row["x_rows"]]
        row["resident_gbs"] = row["bytes_resident"] / row["resident_s"] / 1e9
        row["resident_gflops"] = (_CALLS * 2 * row["x_rows"] * resident[0] * resident[1]
                                  / row["resident_s"] / 1e9)
        row["streamed_gbs"] = row["bytes_layer"] / row["layer_s"] / 1e9
        row["speedup_vs_bfloat16"] = None if fastest is None else fastest / row["layer_s"]
    r = {"x_rows": list(x_rows), "shapes": [list(s) for s in shapes], "resident": list(resident),
         "group_size": args.group_size, "threads": torch.get_num_threads(),
         "bandwidth_gbs": bandwidth_gbs, "rows": rows, "skipped": skipped,
         "machine": machine_info()}
    write_text_atomic(out / "gemv.json", json.dumps(r, indent=2))
    text = _markdown(r)
    md = out / "gemv.md"
    write_text_atomic(md, text)
    print(text)
    return md


def _prepared(scheme: str, x_rows: tuple[int, ...], shapes: tuple[tuple[int, int], ...],
              resident: tuple[int, int], stream_bytes: int, group_size: int,
              skipped: list[dict]) -> dict[tuple[int, str], dict]:
    """``{(rows, kernel): {"hot", "streamed": timed functions, "bytes_resident",
    "bytes_layer", "layers"}}`` for each kernel that runs ``scheme`` with that many rows of x
    here (checked by one call per shape); the others are added to ``skipped`` with the
    reason. A kernel's copies of the weights serve all its row counts."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, k, generator=g) / k**0.5 for o, k in (*shapes, resident)]
    xs = {(m, k): torch.randn(m, k, generator=g).to(_DTYPES.get(scheme, torch.bfloat16))
          for m in x_rows for _, k in (*shapes, resident)}
    ks = [k for _, k in shapes]
    runs = {}
    for name, (prepare, call, takes) in _runners(scheme, group_size).items():
        counts = [m for m in x_rows if takes(m, 64)]
        if not counts:
            continue
        try:
            stored = [prepare(w) for w in weights]
            layer_bytes = sum(_bytes(s) for s in stored[:-1])
            copies = [stored[:-1]] + [_copy(stored[:-1], weights[:-1], prepare)
                                      for _ in range(-(-stream_bytes // layer_bytes) - 1)]
        except (RuntimeError, ValueError) as error:  # a kernel this CPU or shape cannot run
            skipped += [{"x_rows": m, "scheme": scheme, "kernel": name,
                         "reason": _reason(error)} for m in counts]
            continue
        for m in counts:
            try:
                for (o, k), s in zip((*shapes, resident), stored, strict=True):
                    if not takes(m, o):
                        raise ValueError(f"{name} does not run {m} rows of x with a {o} x {k} "
                                         "weight")
                    call(xs[m, k], s)
            except (RuntimeError, ValueError) as error:
                skipped.append({"x_rows": m, "scheme": scheme, "kernel": name,
                                "reason": _reason(error)})
                continue

            def streamed(m: int = m, copies: list = copies, call: Callable = call) -> None:
                for layer in copies:
                    for k, s in zip(ks, layer, strict=True):
                        call(xs[m, k], s)

            def hot(m: int = m, last: object = stored[-1], call: Callable = call) -> None:
                for _ in range(_CALLS):
                    call(xs[m, resident[1]], last)

            runs[m, name] = {"hot": hot, "streamed": streamed, "layers": len(copies),
                             "bytes_resident": _CALLS * _bytes(stored[-1]),
                             "bytes_layer": layer_bytes}
    return runs


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CALLS = 20  # resident calls per timed run


_Runner = tuple[Callable[[Tensor], object], Callable[[Tensor, object], Tensor],
                Callable[[int, int], bool]]


def _runners(scheme: str, group_size: int) -> dict[str, _Runner]:
    """``{kernel: (prepare(float weight) -> stored, call(x, stored) -> y, takes(rows,
    out_features) -> bool)}`` for the kernels that run ``scheme`` on this CPU (asked on a
    64 x 128 weight; ``prepare`` refuses a shape that a kernel does not run)."""
    if scheme in _DTYPES:
        dtype = _DTYPES[scheme]
        return {name: (lambda w, k=k: k.prepare(w.to(dtype), dtype),
                       lambda x, s, k=k: k.run(x, s, None),
                       lambda m, o, k=k: k.available(torch.empty(o, 1, dtype=dtype,
                                                                 device="meta"), dtype, m))
                for name, k in KERNELS.items()}
    bits = 8 if scheme == "int8" else 4
    g = group_size if bits == 4 else None

    def prepare(w: Tensor, k: Kernel) -> tuple:
        q = quantize(w, bits, g, torch.bfloat16)
        if not k.takes(q, torch.bfloat16):
            raise ValueError(f"{k.name} does not run {scheme} {tuple(w.shape)}")
        return k.prepare(q.with_layout(k.layout or q.layout), torch.bfloat16)

    like = quantize(torch.ones(64, 128), bits, g, torch.bfloat16)
    return {name: (lambda w, k=k: prepare(w, k), lambda x, s, k=k: k.run(x, s, None),
                   lambda m, o, k=k: k.max_rows is None or m <= k.max_rows)
            for name, k in QUANTIZED_KERNELS.items() if k.takes(like, torch.bfloat16)}


def _reason(error: Exception) -> str:
    """The first line of an error's message (``"failed"`` when it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else "failed"


def _copy(stored: list, weights: list[Tensor], prepare: Callable[[Tensor], object]) -> list:
    """Another copy of ``stored`` in memory of its own: copied, or prepared again from the
    weights where it cannot be copied (oneDNN's packed, opaque tensors)."""
    try:
        return copy.deepcopy(stored)
    except RuntimeError:
        return [prepare(w) for w in weights]


def _bytes(stored: object) -> int:
    """Bytes of the tensors a kernel reads (a state tuple's, a QuantizedWeight's)."""
    if isinstance(stored, Tensor):
        return stored.numel() * stored.element_size()
    if isinstance(stored, QuantizedWeight):
        return sum(_bytes(t) for t in (stored.data, stored.scales, stored.zeros)
                   if t is not None)
    if isinstance(stored, (tuple, list)):
        return sum(_bytes(item) for item in stored)
    return 0  # a dtype, a group size


def _markdown(r: dict) -> str:
    shapes = ", ".join(f"{o}x{k}" for o, k in r["shapes"])
    x_rows = ", ".join(str(m) for m in r["x_rows"])
    rows_option = "" if r["x_rows"] == [1] else " --rows " + ",".join(map(str, r["x_rows"]))
    o, k = r["resident"]
    lines = [
        "# Decoding's matrix-vector products: memory or arithmetic",
        "",
        f"Measured on {r['machine']['cpu']} ({r['threads']} torch threads); read bandwidth "
        f"{r['bandwidth_gbs']:.1f} GB/s (`sum` over 1 GiB of float32, timed in turns with the "
        f"streamed passes). Rows of x: {x_rows} (sequences decoded at once: a step reads each "
        "weight once whatever the rows, so the bandwidth bounds every row count alike, while "
        f"the arithmetic grows with the rows). Resident: a {o}x{k} weight called {_CALLS} "
        "times in a row (it stays in the caches): the rate of the kernel's instructions, as "
        "GB/s of its own bytes and as GFLOP/s (2 rows O K a call). Streamed: the shapes "
        f"{shapes} copied until the copies exceed the caches several times, each read once per "
        "pass: GB/s from memory, and the speed-up of one set of the shapes over the fastest "
        "bfloat16 kernel at the same rows (bound by memory alone: ~2x int8, ~3.5x int4 with "
        "its scales). int8/int4 take bfloat16 activations, int4 in groups of "
        f"{r['group_size']}. A kernel whose resident rate is not well above the bandwidth "
        "cannot stream at it: its decoding is bound by arithmetic. Regenerate with "
        f"`python -m devbench gemv{rows_option}`.",
        "",
        "| rows | scheme | kernel | resident GB/s | resident GFLOP/s | resident / bandwidth "
        "| streamed GB/s | streamed / bandwidth | speed-up vs bfloat16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    bw = r["bandwidth_gbs"]
    for row in r["rows"]:
        vs = ("—" if row["speedup_vs_bfloat16"] is None
              else f"{row['speedup_vs_bfloat16']:.2f}x")
        lines.append(f"| {row['x_rows']} | {row['scheme']} | {row['kernel']} "
                     f"| {row['resident_gbs']:.1f} | {row['resident_gflops']:.1f} "
                     f"| {row['resident_gbs'] / bw:.2f} | {row['streamed_gbs']:.1f} "
                     f"| {row['streamed_gbs'] / bw:.0%} | {vs} |")
    if r["skipped"]:
        lines += ["", "Not run here: " + "; ".join(
            f"{s['scheme']} {s['kernel']} (rows {s['x_rows']}: {s['reason']})"
            for s in r["skipped"]) + "."]
    lines += machine_section(r["machine"])
    return "\n".join(lines)


def _shape(text: str) -> tuple[int, int]:
    """``argparse`` type for ``OxK``: two positive ints."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected OxK with two positive ints, got {text!r}")
    return int(parts[0]), int(parts[1])


def _shape_list(text: str) -> tuple[tuple[int, int], ...]:
    """``argparse`` type for comma-separated ``OxK`` shapes."""
    return tuple(_shape(p) for p in text.split(","))
