"""Markdown table and PNG of ``python -m devbench variants`` (see ``devbench.variants``)."""

from __future__ import annotations

from pathlib import Path

from attnlab.bench.harness import Measurement, machine_section

__all__ = ["markdown", "plot"]


def markdown(rows: list[dict], cfg: dict, info: dict[str, str], gqa: list[dict]) -> str:
    """Results table (ratios against ``fused`` at the same L, growth per doubling of L), the
    GQA/MQA accounting table and the machine."""
    by_key = {(r["L"], r["variant"]): r for r in rows}
    H, D = cfg["H"], cfg["D"]

    def field(r: dict | None, kind: str, name: str) -> float | None:
        return None if r is None or kind not in r else r[kind][name]

    def ratio(a: float | None, b: float | None) -> str:
        return "—" if a is None or not b else f"{a / b:.2f}x"

    kinds = ["fwd"] + (["fwd_bwd"] if cfg["backward"] else [])
    w = cfg["window"]
    keys = f"causal: {w}" if cfg["causal"] else f"two-sided: {2 * w - 1}"
    head = "| L | variant | fwd ms | vs fused | x per 2x L | fwd peak MiB | peak vs fused |"
    rule = "|---|---|---|---|---|---|---|"
    if cfg["backward"]:
        head += " fwd+bwd ms | vs fused | fwd+bwd peak MiB |"
        rule += "---|---|---|"
    head += " error vs exact |"
    rule += "---|"
    lines = [
        "# Efficient attention variants",
        "",
        f"One attention layer `B x L x E -> B x L x E`, B=1, H={H}, D={D}, E={H * D}, float32, "
        f"{'causal' if cfg['causal'] else 'non-causal'}; every variant with the same weights. "
        f"sliding: window {cfg['window']} ({keys} keys per query); strided: window "
        f"{cfg['window']} + a summary key every "
        f"{cfg['stride']}; Linformer: k = {cfg['proj_len']}; Performer: m = {cfg['features']} "
        "features. Times are medians (ms) of forward passes under `no_grad`; peak is the extra "
        "memory at the peak of one call (MiB); ratios are against `fused` at the same L, measured "
        "in the same run; `x per 2x L` is time(L) / time(L/2). The error is "
        "`|y - y_exact| / |y_exact|` on a random input with random (untrained) weights, where "
        "attention is diffuse: the hardest case for local and low-rank approximations "
        f"(measured up to L = {cfg['error_max_len']}). "
        "Regenerate with `python -m devbench variants`.",
        "",
        head,
        rule,
    ]
    for r in rows:
        fused, half = by_key.get((r["L"], "fused")), by_key.get((r["L"] // 2, r["variant"]))
        f = Measurement(**r["fwd"])
        cells = [
            str(r["L"]), r["variant"], f.time_ms(),
            ratio(f.seconds, field(fused, "fwd", "seconds")),
            ratio(f.seconds, field(half, "fwd", "seconds")),
            f.memory_mib(), ratio(f.peak_bytes, field(fused, "fwd", "peak_bytes")),
        ]
        if "fwd_bwd" in kinds:
            fb = Measurement(**r["fwd_bwd"])
            cells += [fb.time_ms(), ratio(fb.seconds, field(fused, "fwd_bwd", "seconds")),
                      fb.memory_mib()]
        cells.append("—" if r["error"] is None else f"{r['error']:.2e}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Grouped-query and multi-query attention",
        "",
        "One layer of a 7B-class model (E=4096, H=32, D=128, no biases) and the KV cache of 32 "
        "such layers at 4096 tokens, batch 1, float16, for each number of key/value heads G "
        "(`attnlab.attention.accounting`). The cache shrinks by H/G; the weights only by the "
        "K/V projections.",
        "",
        "| G | kind | params / layer | vs MHA | KV cache GiB | vs MHA |",
        "|---|---|---|---|---|---|",
    ]
    H_gqa = gqa[0]["num_kv_heads"]
    for g in gqa:
        kind = "MHA" if g["num_kv_heads"] == H_gqa else "MQA" if g["num_kv_heads"] == 1 else "GQA"
        lines.append(
            f"| {g['num_kv_heads']} | {kind} | {g['params'] / 1e6:.1f} M | "
            f"{g['params_vs_mha']:.3f} | {g['kv_cache_bytes'] / 2**30:.3f} | "
            f"{g['kv_cache_vs_mha']:.4f} |"
        )
    lines += machine_section(info)
    return "\n".join(lines)


def plot(rows: list[dict], cfg: dict, path: Path) -> None:
    """Three panels against L (log-log): forward time, forward peak memory, error vs exact."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = (
        (lambda r: r["fwd"]["seconds"], "forward time (s)"),
        (lambda r: r["fwd"]["peak_bytes"], "forward extra peak memory (bytes)"),
        (lambda r: r["error"] if r["variant"] in ("sliding", "strided", "linformer", "performer")
         else None, "relative error vs exact attention"),
    )
    for ax, (get, title) in zip(axes, panels):
        for variant in variants:
            pts = [(r["L"], get(r)) for r in rows if r["variant"] == variant and get(r)]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
    fig.suptitle(f"attention variants, H={cfg['H']}, D={cfg['D']}, "
                 f"{'causal' if cfg['causal'] else 'non-causal'}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
