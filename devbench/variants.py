"""Efficient attention variants: time, peak memory and error vs L, with GQA/MQA accounting.

Every variant is measured as a drop-in layer ``B x L x E -> B x L x E`` (``B=1``, ``E = H*D``,
float32) with the **same weights**: our ``MultiHeadAttention`` with the ``math``, ``flash``
and ``fused`` backends, ``SparseAttention`` (sliding window; local + strided),
``LinformerAttention`` (``E = F`` segment means, the training-free choice: the random
initial projections approximate nothing until trained), ``PerformerAttention`` and
``torch.nn.MultiheadAttention`` as the reference everyone knows. Times are medians of
forward passes under ``no_grad`` (and of forward+backward with ``--backward``); peak is the
extra memory at the peak of one forward.
The error is ``|y - y_exact| / |y_exact|`` against the exact layer on the same random input.
A cell that would not fit is recorded as ``skipped: needs ~X GiB`` before it runs; an
allocation failure as ``OOM``. Writes ``variants.md``, ``variants.json`` and ``variants.png``.
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
from attnlab.attention.accounting import gqa_table
from attnlab.attention.linformer import LinformerAttention, mean_pooling_projection
from attnlab.attention.performer import PerformerAttention
from attnlab.attention.sparse import SparseAttention
from attnlab.bench.harness import (
    Measurement,
    available_memory,
    device_arg,
    is_oom,
    machine_info,
    peak_memory,
    time_median,
)
from attnlab.durable import write_text_atomic
from devbench.variants_report import markdown, plot

__all__ = ["VARIANTS", "add_arguments", "run"]

VARIANTS = ("math", "flash", "fused", "sliding", "strided", "linformer", "performer", "torch")
# The input x, the exact output (None beyond error_max_len) and the exact layer.
_Exact = tuple[tuple[torch.Tensor, "torch.Tensor | None"], nn.Module]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m devbench variants``."""
    parser.add_argument("--max-len", type=positive_int, default=16384,
                        help="longest L (powers of two from --min-len)")
    parser.add_argument("--min-len", type=positive_int, default=512, help="shortest L")
    parser.add_argument("--heads", type=positive_int, default=8, help="attention heads H")
    parser.add_argument("--head-dim", type=positive_int, default=64, help="head dimension D")
    parser.add_argument("--window", type=positive_int, default=256,
                        help="sliding/strided: keys within this distance")
    parser.add_argument("--stride", type=positive_int, default=256,
                        help="strided: a summary key every this many positions")
    parser.add_argument("--proj-len", type=positive_int, default=256,
                        help="Linformer's k (projected length)")
    parser.add_argument("--features", type=positive_int, default=256,
                        help="Performer's m (random features)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of the variants")
    parser.add_argument("--error-max-len", type=positive_int, default=8192,
                        help="measure the error vs exact up to this L (the exact reference is "
                        "O(L^2))")
    parser.add_argument("--causal", action="store_true", help="causal attention (no Linformer)")
    parser.add_argument("--backward", action="store_true", help="also time forward+backward")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed runs per cell (median)")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda")


def run(args: argparse.Namespace) -> Path:
    """Run the benchmark and write its files into ``args.out``; returns the markdown path."""
    cfg = _config(args)
    device = torch.device(args.device)
    rows = []
    cells = [(L, v) for L in cfg["lengths"] for v in cfg["variants"]]
    exact: dict[int, _Exact] = {}
    for L, variant in tqdm(cells, desc="bench variants", unit="cell"):
        if L not in exact:
            exact[L] = _exact_output(L, cfg, device)
            exact.pop(L // 2, None)
        rows.append(_measure(L, variant, cfg, exact[L], device))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(device)
    gqa = gqa_table(4096, 32, head_dim=128, seq_len=4096, num_layers=32, dtype=torch.float16)
    write_text_atomic(out / "variants.json",
        json.dumps({"machine": info, "config": cfg, "rows": rows,
                    "gqa": gqa}, indent=2, default=str)
    )
    md = out / "variants.md"
    write_text_atomic(md, markdown(rows, cfg, info, gqa))
    plot(rows, cfg, out / "variants.png")
    print(md.read_text())
    return md


def _config(args: argparse.Namespace) -> dict:
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if not variants:
        raise ValueError(f"--variants: expected at least one of {VARIANTS}, got {args.variants!r}")
    if unknown:
        raise ValueError(f"--variants: expected names from {VARIANTS}, got {unknown}")
    if args.quick:
        return {"lengths": (64, 128), "H": 2, "D": 16, "window": 16, "stride": 16, "proj_len": 16,
                "features": 32, "variants": variants, "causal": args.causal, "error_max_len": 128,
                "backward": args.backward, "repeats": 3}
    if args.min_len > args.max_len:
        raise ValueError(f"--min-len: expected at most --max-len={args.max_len}, got "
                         f"{args.min_len}")
    lengths, L = [], args.min_len
    while args.max_len >= L:
        lengths.append(L)
        L *= 2
    return {"lengths": tuple(lengths), "H": args.heads, "D": args.head_dim, "window": args.window,
            "stride": args.stride, "proj_len": args.proj_len, "features": args.features,
            "variants": variants, "causal": args.causal, "backward": args.backward,
            "repeats": args.repeats, "error_max_len": args.error_max_len}


def _exact_output(L: int, cfg: dict, device: torch.device) -> _Exact:
    """The input and the exact layer's output at length L (fused backend), and its weights."""
    torch.manual_seed(0)
    E = cfg["H"] * cfg["D"]
    ref = MultiHeadAttention(E, cfg["H"], backend="fused").to(device).eval()
    x = torch.randn(1, L, E, device=device)
    y = None
    if cfg["error_max_len"] >= L:
        with torch.no_grad():
            y = ref(x, is_causal=cfg["causal"])
    return (x, y), ref


def _build(variant: str, L: int, cfg: dict, ref: nn.Module) -> nn.Module:
    E, H = cfg["H"] * cfg["D"], cfg["H"]
    torch.manual_seed(1)
    if variant in ("math", "flash", "fused"):
        layer: nn.Module = MultiHeadAttention(E, H, backend=variant)
    elif variant == "sliding":
        layer = SparseAttention(E, H, cfg["window"])
    elif variant == "strided":
        layer = SparseAttention(E, H, cfg["window"], stride=cfg["stride"])
    elif variant == "linformer":
        P = min(cfg["proj_len"], L)
        layer = LinformerAttention(E, H, max_len=L, proj_len=P, share_kv=True)
        with torch.no_grad():  # training-free E = F: segment means (see the docstring)
            layer.e_proj.copy_(mean_pooling_projection(P, L))
    elif variant == "performer":
        layer = PerformerAttention(E, H, num_features=cfg["features"])
    else:
        layer = nn.MultiheadAttention(E, H, batch_first=True)
    layer.load_state_dict(ref.state_dict(), strict=False)
    return layer.to(next(ref.parameters()).device).eval()


def _call(variant: str, layer: nn.Module, x: torch.Tensor, causal: bool) -> torch.Tensor:
    if variant != "torch":
        return layer(x, is_causal=causal)
    L = x.shape[1]
    # PyTorch's boolean attn_mask means True = ignore: the future, for causal.
    mask = torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1) if causal else None
    return layer(x, x, x, attn_mask=mask, need_weights=False, is_causal=causal)[0]


def _estimate(variant: str, L: int, cfg: dict) -> int:
    """Bytes a forward needs beyond its inputs, a generous estimate (float32)."""
    H, D, w = cfg["H"], cfg["D"], cfg["window"]
    base = 12 * L * H * D * 4
    quadratic = {"math": 4.0, "torch": 1.5 + (0.25 if cfg["causal"] else 0.0)}
    if variant in quadratic:
        return int(base + quadratic[variant] * H * L * L * 4)
    span = (2 if cfg["causal"] else 3) * max(w, 32)
    per_row = {"flash": 3 * 256, "fused": 64, "sliding": 3 * span,
               "strided": 3 * (span + L // cfg["stride"]), "linformer": 4 * cfg["proj_len"],
               "performer": 4 * cfg["features"] + 2 * 128}[variant]
    return base + H * L * per_row * 4


def _measure(L: int, variant: str, cfg: dict, exact: tuple, device: torch.device) -> dict:
    (x, y_exact), ref = exact
    row: dict = {"L": L, "variant": variant, "error": None}
    if variant == "linformer" and cfg["causal"]:
        for kind in ("fwd", "fwd_bwd"):
            row[kind] = {"seconds": None, "peak_bytes": None, "error": "n/a: no causal form"}
        return row
    need = _estimate(variant, L, cfg)
    layer = _build(variant, L, cfg, ref)
    causal = cfg["causal"]
    x_grad = x.detach().clone().requires_grad_()

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return _call(variant, layer, x, causal)

    def forward_backward() -> None:
        _call(variant, layer, x_grad, causal).sum().backward()
        layer.zero_grad(set_to_none=True)
        x_grad.grad = None

    kinds = [("fwd", forward, 1)] + ([("fwd_bwd", forward_backward, 3)] if cfg["backward"] else [])
    for kind, fn, factor in kinds:
        if need * factor > 0.8 * available_memory(device):
            m = Measurement(None, None, f"skipped: needs ~{need * factor / 2**30:.0f} GiB")
        else:
            try:
                peak = peak_memory(fn, device)
                m = Measurement(time_median(fn, repeats=cfg["repeats"], device=device), peak)
                if kind == "fwd" and y_exact is not None:
                    y = forward()
                    row["error"] = float((y - y_exact).norm() / y_exact.norm())
            except (RuntimeError, MemoryError) as error:
                if not is_oom(error):
                    raise
                m = Measurement(None, None, "OOM")
        row[kind] = {"seconds": m.seconds, "peak_bytes": m.peak_bytes, "error": m.error}
    return row
