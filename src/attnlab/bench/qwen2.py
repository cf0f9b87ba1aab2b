"""Qwen2 speed: prefill and decode tokens/s, ours vs transformers, against the bandwidth bound.

A random checkpoint shaped like Qwen2-0.5B with 4 layers (hidden 896, 14 query and 2
key/value heads, intermediate 4864, vocabulary 151936, tied; 196 M parameters) is written
with ``Qwen2ForCausalLM.save_pretrained`` into a temporary folder and loaded by us and, when
``transformers`` is installed, by ``transformers`` (eager and sdpa attention) in the same run.

- prefill: one forward pass over a 512-token prompt with a cache, logits for the last
  position only (what generation needs);
- decode: greedy ``generate`` of 128 new tokens after a 32-token prompt; tokens/s is
  ``127 / (t(128 tokens) - t(1 token))``, so the prefill cancels out;
- batched decode: 8 left-padded prompts of different lengths, tokens/s over all rows;
- bandwidth bound: decoding one token reads every weight once, so tokens/s <= read bandwidth
  / weight bytes; the read bandwidth is measured here (``sum`` over a 1 GiB buffer);
- ours also with the weights in their stored (row-major, memory-mapped) layout;
- with ``--dtype bfloat16``: our bfloat16 model too, and its next-token agreement with our
  float32 model on the same 128 tokens.

A measurement that runs out of memory is recorded as ``OOM``. Writes ``qwen2.md``,
``qwen2.json`` and ``qwen2.png``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from attnlab.arg_types import positive_int
from attnlab.bench.harness import (
    machine_info,
    machine_section,
    oom_as_error,
    time_median,
)
from attnlab.generation import generate
from attnlab.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

__all__ = ["add_arguments", "read_bandwidth", "run"]

FULL = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                   num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2,
                   tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=4096)
QUICK = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                    max_position_embeddings=512)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``attnlab bench qwen2``."""
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16 adds our bfloat16 model and its next-token agreement")
    parser.add_argument("--prefill", type=positive_int, default=512,
                        help="prefill prompt length")
    parser.add_argument("--prompt", type=positive_int, default=32, help="decode prompt length")
    parser.add_argument("--new-tokens", type=positive_int, default=128,
                        help="tokens decoded (at least 2: the rate is a difference)")
    parser.add_argument("--batch", type=positive_int, default=8,
                        help="prompts in the batched decode")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed runs per cell (median)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip transformers even when it is installed")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch threads for every model (None: torch's default)")


def run(args: argparse.Namespace) -> Path:
    """Run the benchmark and write its files into ``args.out``; returns the markdown path."""
    config = QUICK if args.quick else FULL
    P0, P, N, B = ((32, 8, 16, 4) if args.quick
                   else (args.prefill, args.prompt, args.new_tokens, args.batch))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if N < 2:
        raise ValueError(f"--new-tokens: expected >= 2 (the rate is a difference), got {N}")
    g = torch.Generator().manual_seed(0)
    long_ids = torch.randint(0, config.vocab_size, (1, P0), generator=g)
    ids = torch.randint(0, config.vocab_size, (B, P), generator=g)
    lengths = [max(1, P - i * max(1, P // (2 * B))) for i in range(B)]
    mask = torch.tensor([[0] * (P - n) + [1] * n for n in lengths])
    r = {"config": config.to_dict(), "prefill_len": P0, "prompt": P, "new_tokens": N,
         "batch": B, "lengths": lengths, "rows": [], "threads": torch.get_num_threads()}
    r["bandwidth_gbs"] = read_bandwidth(2**20 if args.quick else 2**28) / 1e9
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(tmp)
        models: dict[str, tuple[torch.nn.Module, str]] = {
            "ours": (Qwen2ForCausalLM.from_pretrained(tmp), "ours"),
            "ours, stored layout": (Qwen2ForCausalLM.from_pretrained(tmp, layout="stored"),
                                    "ours")}
        if args.dtype == "bfloat16":
            models["ours bfloat16"] = (Qwen2ForCausalLM.from_pretrained(tmp, "bfloat16"), "ours")
        r["reference"] = _add_transformers(models, tmp, args.no_reference)
        for name, (model, kind) in models.items():
            print(f"bench qwen2: {name}", flush=True)
            r["rows"].append(_measure(name, model, kind, long_ids, ids[:1], N, args.repeats))
        ours = models["ours"][0]
        rate, error = oom_as_error(lambda: _decode_rate(
            lambda n: generate(ours, ids, n, attention_mask=mask), N, args.repeats))
        r["batched"] = {"name": "ours", "tokens_per_s": rate and B * rate, "error": error}
        if "ours bfloat16" in models:
            half = models["ours bfloat16"][0]
            rate, error = oom_as_error(lambda: _decode_rate(
                lambda n: generate(half, ids, n, attention_mask=mask), N, args.repeats))
            r["batched_bf16"] = {"name": "ours bfloat16", "tokens_per_s": rate and B * rate,
                                 "error": error}
            seq = torch.randint(0, config.vocab_size, (1, 128), generator=g)
            same = ours(seq).argmax(-1) == half(seq).argmax(-1)
            r["agreement"] = same.float().mean().item()
    for row in r["rows"]:
        row["bound_tokens_per_s"] = r["bandwidth_gbs"] * 1e9 / row["weight_bytes"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    r["machine"] = info
    (out / "qwen2.json").write_text(json.dumps(r, indent=2))
    md = out / "qwen2.md"
    md.write_text(_markdown(r, info))
    _plot(r, out / "qwen2.png")
    print(md.read_text())
    return md


def read_bandwidth(numel: int = 2**28, repeats: int = 5) -> float:
    """Memory read bandwidth in bytes/s: a float32 buffer of ``numel`` elements summed."""
    buf = torch.ones(numel)
    seconds = time_median(lambda: buf.sum(), repeats=repeats, warmup=1)
    return numel * 4 / seconds


def _add_transformers(models: dict, folder: str, skip: bool) -> str:
    if skip:
        return "skipped (--no-reference)"
    try:
        import transformers  # the reference only; the library does not depend on it
    except ImportError:
        print("bench qwen2: transformers is not installed; measuring ours only")
        return "transformers is not installed: no reference measured"
    for impl in ("eager", "sdpa"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation=impl).eval()
        models[f"transformers {impl}"] = (hf, "hf")
    return f"transformers {transformers.__version__}, float32"


def _measure(name: str, model: torch.nn.Module, kind: str, long_ids: torch.Tensor,
             ids: torch.Tensor, N: int, repeats: int) -> dict:
    if kind == "ours":
        def prefill() -> object:
            return model(long_ids, cache=model.make_cache(1, long_ids.shape[1]),
                         logits_to_keep=1)

        def gen(n: int) -> object:
            return generate(model, ids, n)
    else:
        def prefill() -> object:
            return model(long_ids, use_cache=True, logits_to_keep=1)

        def gen(n: int) -> object:
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=0)
    params = {p.data_ptr(): p for p in model.parameters()}.values()  # tied counted once
    dtype = next(iter(params)).dtype
    prefill_s, error = oom_as_error(lambda: time_median(prefill, repeats=repeats, warmup=1))
    rate, decode_error = oom_as_error(lambda: _decode_rate(gen, N, repeats))
    return {"name": name, "dtype": str(dtype).removeprefix("torch."),
            "weight_bytes": sum(p.numel() * p.element_size() for p in params),
            "prefill_s": prefill_s, "decode_tokens_per_s": rate,
            "error": error or decode_error}


def _decode_rate(gen: Callable[[int], object], N: int, repeats: int) -> float:
    """Tokens/s per row of the decode steps alone: ``(N - 1) / (t(N) - t(1))``."""
    full = time_median(lambda: gen(N), repeats=repeats, warmup=1)
    one = time_median(lambda: gen(1), repeats=repeats, warmup=1)
    return (N - 1) / max(full - one, 1e-9)


def _markdown(r: dict, info: dict[str, str]) -> str:
    c = r["config"]
    rows = {row["name"]: row for row in r["rows"]}
    refs = [rows[k] for k in ("transformers eager", "transformers sdpa") if k in rows]

    def ratio(row: dict, key: str, better: str) -> str:
        if not refs or row["name"].startswith("transformers") or row[key] is None:
            return "—"
        pairs = [(ref[key], row[key]) if better == "low" else (row[key], ref[key])
                 for ref in refs]
        return " / ".join("—" if a is None else f"{a / b:.2f}x" for a, b in pairs)

    def value(x: float | None, scale: float = 1.0, error: str | None = None) -> str:
        return (error or "—") if x is None else f"{x * scale:.1f}"

    def share(row: dict) -> str:
        rate = row["decode_tokens_per_s"]
        return "—" if rate is None else f"{100 * rate / row['bound_tokens_per_s']:.0f}%"

    lines = [
        "# Qwen2 prefill and decode",
        "",
        f"Random Qwen2 checkpoint: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"{c['num_attention_heads']} query / {c['num_key_value_heads']} key-value heads, "
        f"intermediate {c['intermediate_size']}, vocabulary {c['vocab_size']}, tied. Reference: "
        f"{r['reference']}. Prefill: {r['prefill_len']}-token prompt, last-position logits. "
        f"Decode: greedy, {r['new_tokens']} new tokens after a {r['prompt']}-token prompt, "
        f"batch 1. Medians of repeats; {r['threads']} torch threads. Measured read bandwidth "
        f"{r['bandwidth_gbs']:.1f} GB/s. Regenerate with `attnlab bench qwen2"
        f"{' --dtype bfloat16' if 'agreement' in r else ''}`.",
        "",
        "| model | dtype | weight MiB | prefill ms | prefill speed-up vs eager / sdpa "
        "| decode tokens/s | decode speed-up vs eager / sdpa | bound tokens/s | % of bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['name']} | {row['dtype']} | {row['weight_bytes'] / 2**20:.0f} "
            f"| {value(row['prefill_s'], 1e3, row['error'])} | {ratio(row, 'prefill_s', 'low')} "
            f"| {value(row['decode_tokens_per_s'], 1.0, row['error'])} "
            f"| {ratio(row, 'decode_tokens_per_s', 'high')} "
            f"| {row['bound_tokens_per_s']:.1f} "
            f"| {share(row)} |")
    lines.append("")
    for key in ("batched", "batched_bf16"):
        if key in r:
            batched, single = r[key]["tokens_per_s"], rows[r[key]["name"]]["decode_tokens_per_s"]
            rate = value(batched, 1.0, r[key]["error"])
            times = "—" if batched is None or single is None else f"{batched / single:.1f}x"
            lines.append(f"Batched decode ({r[key]['name']}, {r['batch']} prompts of lengths "
                         f"{r['lengths']}, left-padded): {rate} tokens/s, "
                         f"{times} the single-prompt rate.")
    if "agreement" in r:
        lines.append(f"Next-token agreement of our bfloat16 and float32 models on the same "
                     f"128 tokens: {100 * r['agreement']:.1f}%.")
    lines += ["", "\"ours\" stores the weight matrices column-major (`layout=\"auto\"`: same "
              "values), so a one-token product runs as an embedding_bag near memory bandwidth; "
              "\"stored layout\" uses the memory-mapped row-major tensors as saved.",
              *machine_section(info)]
    return "\n".join(lines)


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [row for row in r["rows"] if row["error"] is None]
    names = [row["name"] for row in measured]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.barh(names, [row["prefill_s"] * 1e3 for row in measured], color="tab:blue")
    ax1.set_xlabel(f"prefill ms ({r['prefill_len']} tokens, lower is better)")
    ax2.barh(names, [row["decode_tokens_per_s"] for row in measured], color="tab:green")
    for i, row in enumerate(measured):
        ax2.plot([row["bound_tokens_per_s"]] * 2, [i - 0.4, i + 0.4], color="black")
    ax2.set_xlabel("decode tokens/s (higher is better; bars: bandwidth bound)")
    ax2.set_yticks([])
    fig.suptitle("Qwen2 (4 layers of Qwen2-0.5B's shape): ours vs transformers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
