"""Attention backends: time and peak memory of math, flash, fused and auto, forward and backward.

For each length ``L`` (``B=1, H=8, D=64``, float32, causal and not) every backend is timed
(median of repeats; flash, fused and auto take their runs in turns) forward under
``no_grad`` and forward+backward, with its extra peak memory; ratios are against ``fused``
measured in the same run. Writes ``attention.md``, ``attention.json`` and ``attention.png``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from attnlab.arg_types import positive_int
from attnlab.attention import scaled_dot_product_attention
from attnlab.bench.harness import (
    Measurement,
    available_memory,
    device_arg,
    int_list,
    is_oom,
    machine_info,
    machine_section,
    oom_as_error,
    peak_memory,
    time_median,
    time_medians,
)
from attnlab.durable import write_text_atomic

__all__ = ["add_arguments", "run"]

BACKENDS = ("math", "flash", "fused", "auto")
DEFAULT_LENGTHS = "256,1024,4096,8192"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m devbench attention``."""
    parser.add_argument("--lengths", type=int_list, default=DEFAULT_LENGTHS,
                        help="comma-separated sequence lengths L")
    parser.add_argument("--heads", type=positive_int, default=8, help="attention heads H")
    parser.add_argument("--head-dim", type=positive_int, default=64, help="head dimension D")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed runs per cell (median)")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda")


def run(args: argparse.Namespace) -> Path:
    """Run the benchmark and write its files into ``args.out``; returns the markdown path."""
    device = torch.device(args.device)
    lengths = (64, 128) if args.quick else tuple(args.lengths)
    H, D = (2, 16) if args.quick else (args.heads, args.head_dim)
    repeats = 3 if args.quick else args.repeats
    # A warm-up before the first cell, discarded: the first peak measured in a process also
    # holds one-off allocations (the allocator's arenas, each backend's first call), which made
    # the first cell's peak several times the next ones' and the memory fall as L grew.
    oom_as_error(partial(_measure, lengths[0], False, H, D, 1, device))
    rows = []
    groups = [(L, c) for L in lengths for c in (False, True)]
    for L, causal in tqdm(groups, desc="bench attention", unit="group"):
        # Out of memory outside a timed call (the inputs of a huge L) is a result too.
        found, error = oom_as_error(partial(_measure, L, causal, H, D, repeats, device))
        cell = {"seconds": None, "peak_bytes": None, "error": error}
        rows += found or [{"L": L, "causal": causal, "backend": b, "fwd": cell, "fwd_bwd": cell}
                          for b in BACKENDS]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(device)
    write_text_atomic(out / "attention.json", json.dumps({"machine": info, "rows": rows}, indent=2))
    md = out / "attention.md"
    write_text_atomic(md, _markdown(rows, info, H, D, quick=args.quick))
    _plot(rows, out / "attention.png")
    print(md.read_text())
    return md


def _measure(
    L: int, causal: bool, H: int, D: int, repeats: int, device: torch.device
) -> list[dict]:
    """One row per backend; the backends' timed runs alternate (``time_medians``)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=g).to(device).requires_grad_() for _ in range(3))

    def forward(backend: str) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad():
                scaled_dot_product_attention(q, k, v, is_causal=causal, backend=backend)

        return call

    def forward_backward(backend: str) -> Callable[[], None]:
        def call() -> None:
            out = scaled_dot_product_attention(q, k, v, is_causal=causal, backend=backend)
            out.backward(torch.ones_like(out))
            q.grad = k.grad = v.grad = None

        return call

    rows = [{"L": L, "causal": causal, "backend": b} for b in BACKENDS]
    for name, make, factor in (("fwd", forward, 1), ("fwd_bwd", forward_backward, 2)):
        peaks, errors = {}, {}
        for backend in BACKENDS:
            # The math backend holds several L x L score matrices; skip what cannot fit
            # rather than let the system kill the process.
            need = (3 * H * L * L * 4 if backend == "math" else 0) * factor
            if need > 0.8 * available_memory(device):
                errors[backend] = f"skipped: needs ~{need / 2**30:.0f} GiB"
                continue
            try:
                peaks[backend] = peak_memory(make(backend), device)
            except (RuntimeError, MemoryError) as error:
                if not is_oom(error):
                    raise
                errors[backend] = "OOM"
        # math is timed on its own: freeing its L x L matrices slows whichever call follows it
        # in the turns, so it would skew the others' ratios (timing flash after math and
        # without it in this benchmark shows the difference).
        fast = {b: make(b) for b in peaks if b != "math"}
        seconds, error = oom_as_error(partial(time_medians, fast, repeats=repeats, device=device))
        seconds = seconds or {}
        errors.update(dict.fromkeys(fast, error) if error else {})
        if "math" in peaks:
            seconds["math"], errors["math"] = oom_as_error(
                partial(time_median, make("math"), repeats=repeats, device=device))
        for row in rows:
            b = row["backend"]
            row[name] = {"seconds": seconds.get(b), "peak_bytes": peaks.get(b),
                         "error": errors.get(b)}
    return rows


def _markdown(rows: list[dict], info: dict[str, str], H: int, D: int, *,
              quick: bool = False) -> str:
    by_key = {(r["L"], r["causal"], r["backend"]): r for r in rows}

    def ratio(r: dict, kind: str, ref: str, field: str) -> str:
        base = by_key[(r["L"], r["causal"], ref)][kind][field]
        val = r[kind][field]
        return "—" if not base or val is None else f"{val / base:.2f}x"

    lines = [
        "# Attention backends",
        "",
        f"B=1, H={H}, D={D}, float32. Times are medians (ms); flash, fused and auto take their",
        "runs in turns. Peak is the extra memory at the peak of the call (MiB). Time ratios are",
        "against `fused`, memory ratios against `math`, all measured in the same run.",
        "Regenerate with `python -m devbench attention`.",
        *(["", "**A `--quick` run** (tiny sizes: L = 64 and 128, H = 2, D = 16), not the full "
            "one: the full sizes take too long on a busy machine. Run `python -m devbench "
            "attention` for them."] if quick else []),
        "",
        "| L | causal | backend | fwd ms | fwd vs fused | fwd+bwd ms | fwd+bwd vs fused "
        "| fwd peak MiB | fwd+bwd peak MiB | fwd peak vs math |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f, fb = (Measurement(**r[k]) for k in ("fwd", "fwd_bwd"))
        lines.append(
            f"| {r['L']} | {'yes' if r['causal'] else 'no'} | {r['backend']} | {f.time_ms()} "
            f"| {ratio(r, 'fwd', 'fused', 'seconds')} | {fb.time_ms()} "
            f"| {ratio(r, 'fwd_bwd', 'fused', 'seconds')} | {f.memory_mib()} | {fb.memory_mib()} "
            f"| {ratio(r, 'fwd', 'math', 'peak_bytes')} |"
        )
    lines += machine_section(info)
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("fwd", "seconds", "forward time (s)"),
        ("fwd_bwd", "seconds", "forward+backward time (s)"),
        ("fwd", "peak_bytes", "forward extra peak memory (bytes)"),
    )
    for ax, (kind, field, title) in zip(axes, panels):
        for backend in BACKENDS:
            for causal, style in ((False, "-"), (True, "--")):
                pts = [
                    (r["L"], r[kind][field])
                    for r in rows
                    if r["backend"] == backend and r["causal"] == causal and r[kind][field]
                ]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(
                        xs, ys, style, marker="o", label=f"{backend}{' causal' if causal else ''}"
                    )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
