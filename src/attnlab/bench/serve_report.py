"""The targets, table and plot of ``attnlab bench serve`` (``bench.serve``).

A run's result ``r`` holds ``runs`` (one summary per number of clients: ``tokens_per_s``,
``ttft_p50_ms`` ... ``itl_p95_ms``) and ``prefix`` (the summaries with prefix caching on
and off). The targets are issue 16's, each ``PASS``, ``FAIL`` or ``not measured``.
"""

from __future__ import annotations

from pathlib import Path

from attnlab.bench.harness import machine_section

__all__ = ["ITL_RATIO", "PREFIX_SPEEDUP", "SPEEDUP", "markdown", "plot", "targets"]

# The requests' lengths by default (attnlab bench serve --prompt-tokens, --output-tokens).
PROMPT_TOKENS, OUTPUT_TOKENS = (32, 512), (16, 96)

SPEEDUP, ITL_RATIO, PREFIX_SPEEDUP = 5.0, 3.0, 3.0
LATENCIES = ("ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms")


def targets(r: dict) -> list[dict]:
    """The three targets against the figures of ``r``: the most clients' tokens/s >= 5x one
    client's; their p95 ITL <= 3x one client's; TTFT p50 without prefix caching >= 3x with
    it. Each ``{"target", "measured", "ratio", "result"}``."""
    by_clients = {run["clients"]: run for run in r["runs"]}
    one, most = by_clients.get(1), by_clients.get(max(by_clients, default=1))
    many = None if most is None or most["clients"] == 1 else most
    n = many["clients"] if many else "N"
    prefix = {run["prefix_caching"]: run for run in r["prefix"]}
    return [
        _target(f"{n} clients >= {SPEEDUP:g}x the tokens/s of one at a time",
                _ratio(many, one, "tokens_per_s"), lambda x: x >= SPEEDUP, "tokens/s"),
        _target(f"p95 inter-token latency at {n} clients <= {ITL_RATIO:g}x one client's",
                _ratio(many, one, "itl_p95_ms"), lambda x: x <= ITL_RATIO, "p95 ITL"),
        _target(f"prefix caching cuts the time to first token >= {PREFIX_SPEEDUP:g}x "
                f"({r['workload']['system']}-token shared system prompt)",
                _ratio(prefix.get(False), prefix.get(True), "ttft_p50_ms"),
                lambda x: x >= PREFIX_SPEEDUP, "TTFT p50"),
    ]


def markdown(r: dict, info: dict[str, str]) -> str:
    """The run as markdown: what was measured and how, the tables, the targets, the machine."""
    s, w, e = r["sizes"], r["workload"], r["engine"]
    lines = [
        "# attnlab serve under load",
        "",
        f"Measured on {info['cpu']} ({info['cores']} cores, {info['torch threads']} torch "
        f"threads), server and clients in one process. Random Qwen2 checkpoint "
        f"({r['checkpoint']}, served in {e.get('dtype', 'float32')}): "
        f"{s['num_hidden_layers']} layers, hidden "
        f"{s['hidden_size']}, {s['num_attention_heads']} query / {s['num_key_value_heads']} "
        f"key-value heads, intermediate {s['intermediate_size']}, vocabulary "
        f"{s['vocab_size']}; a word-level tokenizer covering the vocabulary. `attnlab serve` "
        f"(`create_app`, uvicorn on 127.0.0.1) with --max-batch {e['max_batch']} "
        f"--max-tokens-per-step {e['max_tokens_per_step']} --page-size {e['page_size']}"
        f"{' --extra-memory' if e.get('extra_memory') else ''}, a fresh server per row, "
        f"warmed up by one request. {w['requests']} streamed greedy "
        f"completion requests (token-id prompts of {w['prompt'][0]}-{w['prompt'][1]} tokens, "
        f"{w['output'][0]}-{w['output'][1]} new tokens, seed {r['seed']}), the same ones in "
        f"every row, sent by C client threads (`http.client`), each sending the next request "
        f"when its last one ends; at most {r['time_limit_s']:g} s per row. Tokens/s: output "
        f"tokens / wall time. TTFT: from sending a request to its first token; ITL: the gaps "
        f"between a request's successive tokens; percentiles over all requests / gaps. "
        f"Regenerate with `{_command(r)}`.",
        "",
        "| clients | requests done | cut | failed | output tokens | wall s | tokens/s "
        "| x one at a time | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    one = next((run for run in r["runs"] if run["clients"] == 1), None)
    for run in r["runs"]:
        speedup = _ratio(run, one, "tokens_per_s")
        lines.append(f"| {run['clients']} | {run['done']} | {run['cut']} | {run['failed']} "
                     f"| {run['tokens']} | {run['wall_s']:.1f} | {_num(run['tokens_per_s'])} "
                     f"| {'—' if speedup is None else f'{speedup:.2f}x'} | "
                     + " | ".join(_num(run[k]) for k in LATENCIES) + " |")
    lines += [
        "",
        "## Prefix caching",
        "",
        f"{w['prefix_requests']} requests one at a time, each a shared {w['system']}-token "
        f"system prompt + its own user part of {w['user'][0]}-{w['user'][1]} tokens, "
        f"{w['prefix_output']} new tokens; after a warm-up request with the same system "
        f"prompt (which fills the cache when it is on). Pages reused: the engine's "
        f"`prefix_hits`, warm-up included.",
        "",
        "| prefix caching | requests done | TTFT p50 ms | TTFT p95 ms | pages reused |",
        "|---|---|---|---|---|",
    ]
    for run in r["prefix"]:
        lines.append(f"| {'on' if run['prefix_caching'] else 'off'} | {run['done']} "
                     f"| {_num(run['ttft_p50_ms'])} | {_num(run['ttft_p95_ms'])} "
                     f"| {run['engine_stats'].get('prefix_hits', '—')} |")
    lines += ["", "## Targets (issue 16)", "", "| target | measured | result |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {t['result']} |" for t in r["targets"]]
    errors = sorted({e for run in r["runs"] + r["prefix"] for e in run["errors"]})
    if errors:
        lines += ["", "Failed requests: " + "; ".join(f"`{e}`" for e in errors)]
    lines += machine_section(info)
    return "\n".join(lines)


def plot(path: Path, r: dict, title: str) -> None:
    """Two panels against the number of clients: output tokens/s, and the latencies (TTFT
    and ITL, p50 and p95, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = [run["clients"] for run in r["runs"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(clients, [run["tokens_per_s"] or 0 for run in r["runs"]], "o-",
              label="measured")
    one = next((run["tokens_per_s"] for run in r["runs"] if run["clients"] == 1), None)
    if one:
        left.plot(clients, [SPEEDUP * one] * len(clients), "--", color="gray",
                  label=f"target at the most clients: {SPEEDUP:g}x one client")
    left.set_xlabel("concurrent clients")
    left.set_ylabel("output tokens/s")
    left.set_title("throughput")
    left.legend(fontsize=8)
    for key in LATENCIES:
        points = [(run["clients"], run[key]) for run in r["runs"] if run[key] is not None]
        if points:
            right.plot(*zip(*points), "o-", label=key.removesuffix("_ms").replace("_", " "))
    right.set_yscale("log")
    right.set_xlabel("concurrent clients")
    right.set_ylabel("milliseconds")
    right.set_title("latency")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _target(name: str, ratio: float | None, passes, what: str) -> dict:
    if ratio is None:
        return {"target": name, "measured": "—", "ratio": None, "result": "not measured"}
    return {"target": name, "measured": f"{ratio:.2f}x ({what})", "ratio": ratio,
            "result": "PASS" if passes(ratio) else "FAIL"}


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    """``a[key] / b[key]``, or None when either is missing or ``b[key]`` is 0."""
    if a is None or b is None or a.get(key) is None or not b.get(key):
        return None
    return a[key] / b[key]


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _command(r: dict) -> str:
    if r["quick"]:
        return "attnlab bench serve --quick"
    return (f"attnlab bench serve --clients {','.join(str(x['clients']) for x in r['runs'])} "
            f"--requests {r['workload']['requests']} --max-batch {r['engine']['max_batch']} "
            f"--max-tokens-per-step {r['engine']['max_tokens_per_step']} --page-size "
            f"{r['engine']['page_size']} --layers {r['sizes']['num_hidden_layers']} "
            f"--system-tokens {r['workload']['system']} --time-limit {r['time_limit_s']:g} "
            f"--seed {r['seed']} --dtype {r['engine'].get('dtype', 'float32')}"
            f"{_lengths(r['workload'])}"
            f"{' --extra-memory' if r['engine'].get('extra_memory') else ''}")


def _lengths(work: dict) -> str:
    """The request length options, where they are not the defaults."""
    prompt, output = tuple(work["prompt"]), tuple(work["output"])
    return ((f" --prompt-tokens {prompt[0]},{prompt[1]}" if prompt != PROMPT_TOKENS else "")
            + (f" --output-tokens {output[0]},{output[1]}" if output != OUTPUT_TOKENS else ""))
