"""MultiHeadAttention against torch.nn.MultiheadAttention(need_weights=False), same weights.

Self-attention, E=512, 8 heads, at (B=8, L=128) and (B=1, L=2048), in training mode
(forward+backward) and in eval mode under ``torch.inference_mode`` (where PyTorch takes its
fused fast path). Medians of repeats; the ratio is ours / PyTorch's from the same run.
A shape that runs out of memory is recorded as ``OOM``.
Writes ``mha.md``, ``mha.json`` and ``mha.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from attnlab.arg_types import positive_int
from attnlab.attention import MultiHeadAttention
from attnlab.bench.harness import (
    device_arg,
    machine_info,
    machine_section,
    oom_as_error,
    time_medians,
)
from attnlab.durable import write_text_atomic

__all__ = ["add_arguments", "run"]

SHAPES = ((8, 128), (1, 2048))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m devbench mha``."""
    parser.add_argument("--embed-dim", type=positive_int, default=512,
                        help="model dimension E (a multiple of --heads)")
    parser.add_argument("--heads", type=positive_int, default=8, help="attention heads")
    parser.add_argument("--repeats", type=positive_int, default=31,
                        help="timed runs per cell (median)")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda")


def run(args: argparse.Namespace) -> Path:
    """Run the benchmark and write its files into ``args.out``; returns the markdown path."""
    device = torch.device(args.device)
    E, H = (64, 4) if args.quick else (args.embed_dim, args.heads)
    if E % H:
        raise ValueError(f"--embed-dim: expected a multiple of --heads={H}, got {E}")
    shapes = ((2, 16), (1, 64)) if args.quick else SHAPES
    repeats = 3 if args.quick else args.repeats
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True, device=device)
    ours = MultiHeadAttention.from_torch(ref)
    rows = []
    for (B, L), mode in tqdm([(s, m) for s in shapes for m in ("train", "eval")], desc="bench mha"):
        rows.append(_measure(ref, ours, B, L, mode, repeats, device))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(device)
    write_text_atomic(out / "mha.json", json.dumps({"machine": info, "rows": rows}, indent=2))
    md = out / "mha.md"
    write_text_atomic(md, _markdown(rows, info, E, H))
    _plot(rows, out / "mha.png")
    print(md.read_text())
    return md


def _measure(ref: nn.Module, ours: nn.Module, B: int, L: int, mode: str, repeats: int,
             device: torch.device) -> dict:
    """One table row: both modules timed in turns, or ``error: "OOM"`` when one ran out."""
    row: dict = {"B": B, "L": L, "mode": mode, "torch_s": None, "attnlab_s": None,
                 "ratio": None, "error": None}

    def measure() -> dict[str, float]:
        x = torch.randn(B, L, ref.embed_dim, device=device)
        steps = {name: _step(name, m, x, mode) for name, m in (("torch", ref), ("attnlab", ours))}
        return time_medians(steps, repeats=repeats, warmup=2, device=device)

    times, row["error"] = oom_as_error(measure)
    if times is None:
        return row
    row.update(torch_s=times["torch"], attnlab_s=times["attnlab"],
               ratio=times["attnlab"] / times["torch"])
    return row


def _step(name: str, module: nn.Module, x: torch.Tensor, mode: str):
    def call() -> torch.Tensor:
        if name == "torch":
            return module(x, x, x, need_weights=False)[0]
        return module(x)

    if mode == "eval":

        def infer() -> None:
            module.eval()
            with torch.inference_mode():
                call()

        return infer

    def train() -> None:
        module.train()
        call().sum().backward()
        module.zero_grad(set_to_none=True)

    return train


def _markdown(rows: list[dict], info: dict[str, str], E: int, H: int) -> str:
    lines = [
        "# MultiHeadAttention vs torch.nn.MultiheadAttention",
        "",
        f"Self-attention, E={E}, {H} heads, float32, same weights",
        "(`MultiHeadAttention.from_torch`).",
        "train = forward+backward in training mode; eval = forward in eval mode under",
        "`torch.inference_mode` (PyTorch's fast path). Medians in ms, the two timed in turns;",
        "ratio = attnlab / torch (<= 1.0 means ours is no slower). Regenerate with",
        "`python -m devbench mha`.",
        "",
        "| B | L | mode | torch ms | attnlab ms | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['B']} | {r['L']} | {r['mode']} | {r['error']} | {r['error']} | — |")
            continue
        lines.append(
            f"| {r['B']} | {r['L']} | {r['mode']} | {r['torch_s'] * 1e3:.2f} "
            f"| {r['attnlab_s'] * 1e3:.2f} | {r['ratio']:.2f} |"
        )
    lines += machine_section(info)
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("error")]
    labels = [f"B={r['B']} L={r['L']}\n{r['mode']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(
        [x - 0.2 for x in xs],
        [r["torch_s"] * 1e3 for r in rows],
        0.4,
        label="torch.nn.MultiheadAttention",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [r["attnlab_s"] * 1e3 for r in rows],
        0.4,
        label="attnlab MultiHeadAttention",
    )
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("median time (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
