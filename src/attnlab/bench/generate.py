"""KV-cached generation: prefill time, decode tokens/s with and without the cache.

A Llama-style ``DecoderLM`` (RoPE, RMSNorm, SwiGLU, GQA; 4 layers, d=512, 8 query and 4
key/value heads, vocabulary 8192, float32, batch 1). Measured, each a median of repeats:

- prefill: one forward pass over a ``P``-token prompt, filling the cache;
- decode: ``N`` new tokens one at a time, with the cache (one position per step) and
  without it (the whole prefix recomputed every step);
- per-token decode time at context lengths ``c``: one step after ``c`` cached tokens vs one
  full forward pass over ``c + 1`` tokens; and the cache's memory at each ``c``.

With the cache a step costs ``O(c)`` attention work on top of a fixed ``O(1)`` projection and
MLP cost, so its time stays nearly flat; without it a step redoes ``O(c)`` projections and
MLPs (and ``O(c^2)`` attention), so its time grows at least linearly. Writes
``generate.md``, ``generate.json`` and ``generate.png``.

With ``--speculative ngram|ngram:K|self:N|draft:DIR`` (repeatable; ``--model DIR`` for a real
model) it measures speculative decoding instead (``attnlab.bench.speculative``).
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
from attnlab.bench import speculative
from attnlab.bench.harness import (
    device_arg,
    int_list,
    machine_info,
    machine_section,
    oom_as_error,
    time_median,
)
from attnlab.durable import write_text_atomic
from attnlab.generation.proposers import parse_speculative
from attnlab.models.decoder import DecoderLM, DecoderLMConfig

__all__ = ["add_arguments", "run"]

DEFAULT_CONTEXTS = "128,256,512,1024,2048"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``attnlab bench generate``."""
    parser.add_argument("--contexts", type=int_list, default=DEFAULT_CONTEXTS,
                        help="comma-separated context lengths for the per-token decode time")
    parser.add_argument("--prompt", type=positive_int, default=128, help="prompt length P")
    parser.add_argument("--new-tokens", type=positive_int, default=64,
                        help="tokens decoded for the tokens/s figures")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed runs per cell (median)")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda")
    parser.add_argument("--speculative", type=_speculative, action="append", default=None,
                        metavar="ngram[:K]|self:N|draft:DIR",
                        help="measure speculative decoding with this proposer against plain "
                        "decoding, on input-grounded and open-ended prompts (repeat the flag "
                        "for several; CPU only)")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="with --speculative: a checkpoint folder with its tokenizer "
                        "(default: a random model)")


def run(args: argparse.Namespace) -> Path:
    """Run the benchmark and write its files into ``args.out``; returns the markdown path."""
    if getattr(args, "speculative", None):
        return speculative.run(args)
    device = torch.device(args.device)
    if args.quick:
        config = DecoderLMConfig.llama(256, d_model=64, num_layers=2, num_heads=4, max_len=128)
        contexts, P, N, repeats = (16, 32, 64), 16, 8, 3
    else:
        contexts, P, N, repeats = tuple(args.contexts), args.prompt, args.new_tokens, args.repeats
        config = DecoderLMConfig.llama(8192, d_model=512, num_layers=4, num_heads=8,
                                       max_len=max(max(contexts) + 1, P + N))
    torch.manual_seed(0)
    model = DecoderLM(config).to(device).eval()
    ids = torch.randint(0, config.vocab_size, (1, max(max(contexts) + 1, P + N)), device=device)
    results = {"config": config.to_dict(), "prompt": P, "new_tokens": N, "rows": []}
    with torch.inference_mode():
        results["prefill"] = _cell(lambda: model(ids[:, :P], cache=model.make_cache(1, P)),
                                   repeats, device)
        cache = model.make_cache(1, P + N)
        model(ids[:, :P], cache=cache)

        def decode_cached() -> None:
            cache.truncate(P)
            for i in range(P, P + N):
                model(ids[:, i:i + 1], cache=cache)

        def decode_uncached() -> None:
            for i in range(P, P + N):
                model(ids[:, :i + 1])

        results["decode_cached"] = _cell(decode_cached, repeats, device)
        results["decode_uncached"] = _cell(decode_uncached, repeats, device)
        results["cache_bytes"] = cache.nbytes
        for c in tqdm(contexts, desc="bench generate", unit="context"):
            row, error = oom_as_error(partial(_context_row, model, ids, c, repeats, device))
            cell = {"seconds": None, "error": error}
            results["rows"].append(row or {"context": c, "cache_bytes": None, "cached": cell,
                                           "uncached": cell})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(device)
    results["machine"] = info
    write_text_atomic(out / "generate.json", json.dumps(results, indent=2))
    md = out / "generate.md"
    write_text_atomic(md, _markdown(results, info))
    _plot(results, out / "generate.png")
    print(md.read_text())
    return md


def _speculative(text: str) -> tuple[str, int | str]:
    try:
        return parse_speculative(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _context_row(model: DecoderLM, ids: torch.Tensor, c: int, repeats: int,
                 device: torch.device) -> dict:
    cache = model.make_cache(1, c + 1)
    model(ids[:, :c], cache=cache)

    def step_cached() -> None:
        cache.truncate(c)
        model(ids[:, c:c + 1], cache=cache)

    return {"context": c, "cache_bytes": cache.nbytes,
            "cached": _cell(step_cached, repeats, device),
            "uncached": _cell(lambda: model(ids[:, :c + 1]), repeats, device)}


def _cell(fn: Callable[[], object], repeats: int, device: torch.device) -> dict:
    seconds, error = oom_as_error(partial(time_median, fn, repeats=repeats, device=device))
    return {"seconds": seconds, "error": error}


def _markdown(r: dict, info: dict[str, str]) -> str:
    c, P, N = r["config"], r["prompt"], r["new_tokens"]

    def ms(cell: dict, per: int = 1) -> str:
        return cell["error"] or f"{cell['seconds'] * 1e3 / per:.2f}"

    def rate(cell: dict, n: int) -> str:
        return cell["error"] or f"{n / cell['seconds']:.1f}"

    def mib(n: int | None) -> str:
        return "—" if n is None else f"{n / 2**20:.2f}"

    def ratio(a: dict, b: dict) -> str:
        return "—" if a["error"] or b["error"] else f"{a['seconds'] / b['seconds']:.1f}x"

    cached, uncached = r["decode_cached"], r["decode_uncached"]
    lines = [
        "# KV-cached generation",
        "",
        f"Llama-style `DecoderLM`: {c['num_layers']} layers, d={c['d_model']}, "
        f"{c['num_heads']} query / {c['num_kv_heads']} key-value heads, vocabulary "
        f"{c['vocab_size']}, float32, batch 1. Times are medians (ms). "
        "Regenerate with `attnlab bench generate`.",
        "",
        "| measure | time ms | tokens/s |",
        "|---|---|---|",
        f"| prefill, {P}-token prompt | {ms(r['prefill'])} | {rate(r['prefill'], P)} |",
        f"| decode {N} tokens after it, with cache | {ms(cached)} | {rate(cached, N)} |",
        f"| decode {N} tokens after it, without cache | {ms(uncached)} | {rate(uncached, N)} |",
        "",
        f"Decoding with the cache is {ratio(uncached, cached)} faster; the cache for "
        f"{P + N} positions holds {r['cache_bytes'] / 2**20:.2f} MiB "
        f"(2 x layers x batch x kv_heads x positions x head_dim x 4 bytes).",
        "",
        "## One decode step vs context length",
        "",
        "| context | with cache ms | without cache ms | without / with | cache MiB |",
        "|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(f"| {row['context']} | {ms(row['cached'])} | {ms(row['uncached'])} "
                     f"| {ratio(row['uncached'], row['cached'])} "
                     f"| {mib(row['cache_bytes'])} |")
    first, last = r["rows"][0], r["rows"][-1]
    growth = f"{last['context'] / first['context']:.0f}x"
    lines += [
        "",
        f"From context {first['context']} to {last['context']} ({growth} longer), a cached "
        f"step's time grows {ratio(last['cached'], first['cached'])} and an uncached one's "
        f"{ratio(last['uncached'], first['uncached'])}.",
        *machine_section(info),
    ]
    return "\n".join(lines)


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for key, label in (("cached", "with KV cache"), ("uncached", "without cache (recompute)")):
        pts = [(row["context"], row[key]["seconds"] * 1e3) for row in r["rows"]
               if row[key]["seconds"]]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("context length (tokens already generated or prompted)")
    ax.set_ylabel("time of one decode step (ms)")
    ax.set_title("Per-token decode time vs context")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
