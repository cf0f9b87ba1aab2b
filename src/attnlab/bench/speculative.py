"""``attnlab bench generate --speculative ...``: greedy decoding with and without speculative
decoding, on input-grounded prompts (repeat, summarise, edit a given text) and open-ended
ones, in one run.

For each prompt and each proposer: new tokens per second of the whole ``generate`` call
(prefill included; a median of repeats, timed in turns with plain decoding), the speed-up
over plain decoding, the drafts' acceptance rate and the new tokens per forward pass. The
text is checked to be plain decoding's (greedy: token for token). A model folder (``--model``,
with its tokenizer; the chat template applied when it has one) gives real text; without one
a random Llama-style model decodes random prompts (a smoke test: its drafts mean nothing).
Writes ``speculative.md`` and ``speculative.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from attnlab.bench.harness import machine_info, machine_section, time_medians
from attnlab.durable import write_text_atomic
from attnlab.generation import SpeculativeStats, generate
from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.io import from_pretrained
from attnlab.tokenizer import Tokenizer

__all__ = ["PROMPTS", "run"]

TEXT = ("The old lighthouse stood on a rock at the mouth of the bay. Every evening the keeper "
        "climbed its hundred and twelve steps, trimmed the wick, wound the clockwork that "
        "turned the lens, and wrote the weather in a leather book. Ships passed safely for "
        "forty years. When the electric lamp arrived, the keeper stayed on to paint the rails "
        "and to tell visitors how the fog horn once sounded across the water.")

# (name, kind, user message): "grounded" answers copy from the message, "open" ones do not.
PROMPTS = (
    ("repeat", "grounded", f"Repeat the following text exactly, word for word:\n\n{TEXT}"),
    ("summarise", "grounded", f"Summarise the following text in three sentences:\n\n{TEXT}"),
    ("edit", "grounded", "Rewrite the following text with 'keeper' replaced by 'guardian' "
                         f"and nothing else changed:\n\n{TEXT}"),
    ("story", "open", "Write a short story about a fox who learns to sail."),
    ("explain", "open", "Explain why the sky is blue to a ten-year-old."),
)


def run(args: argparse.Namespace) -> Path:
    """Measure every prompt with plain decoding and each ``args.speculative`` proposer
    (``(kind, value)`` pairs of ``parse_speculative``); write and print the table."""
    N, repeats = (8, 1) if args.quick else (args.new_tokens, args.repeats)
    model, prompts, eos, what = _model_and_prompts(args)
    methods = {"plain": {}}
    for kind, value in args.speculative:
        name = f"{kind}:{value}" if kind != "draft" else f"draft:{Path(value).name}"
        methods[name] = _keywords(kind, value, args)
    rows = []
    with torch.inference_mode():
        for name, kind, ids in prompts:
            n = min(N, model.config.max_len - ids.shape[1])
            runs = {m: (lambda kw=kw, ids=ids, n=n: generate(model, ids, n, eos_token_id=eos,
                                                            **kw))
                    for m, kw in methods.items()}
            seconds = time_medians(runs, repeats=repeats)
            plain = runs["plain"]()
            for method, kw in methods.items():
                stats = SpeculativeStats() if kw else None
                out = generate(model, ids, n, eos_token_id=eos,
                               **(dict(kw, speculative_stats=stats) if kw else {}))
                made = out.shape[1] - ids.shape[1]
                rows.append({
                    "prompt": name, "kind": kind, "method": method, "new_tokens": made,
                    "seconds": seconds[method], "tokens_per_s": made / seconds[method],
                    "speedup": seconds["plain"] / seconds[method],
                    "same_tokens": bool(torch.equal(out, plain)),
                    "acceptance_rate": None if stats is None else stats.acceptance_rate,
                    "tokens_per_pass": None if stats is None else stats.tokens_per_pass})
    info = machine_info(torch.device("cpu"))
    results = {"model": what, "new_tokens": N, "rows": rows, "machine": info}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "speculative.json", json.dumps(results, indent=2))
    md = out_dir / "speculative.md"
    write_text_atomic(md, _markdown(results, info))
    print(md.read_text())
    return md


def _model_and_prompts(args: argparse.Namespace):
    """The model, ``(name, kind, ids 1 x P)`` prompts, end ids and a line naming the model."""
    if args.model is None or args.quick:
        config = DecoderLMConfig.llama(256, d_model=64, num_layers=4, num_heads=4, max_len=256)
        torch.manual_seed(0)
        model = DecoderLM(config).eval()
        g = torch.Generator().manual_seed(0)
        prompts = [(f"random {i}", "random", torch.randint(0, 256, (1, 32), generator=g))
                   for i in range(2)]
        return model, prompts, None, "a random Llama-style model (4 layers, d=64)"
    tokenizer = Tokenizer.from_pretrained(args.model)
    model = from_pretrained(args.model)
    prompts = []
    for name, kind, text in PROMPTS:
        ids = (tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=True)
               if tokenizer.chat_template else tokenizer.encode(text))
        prompts.append((name, kind, torch.tensor([ids])))
    ends = [tokenizer.eos_token_id, *model.config.eos_token_id]
    eos = [i for i in dict.fromkeys(ends) if i is not None] or None
    return model, prompts, eos, f"`{Path(args.model).name}` ({model.dtype})"


def _keywords(kind: str, value: int | str, args: argparse.Namespace) -> dict:
    if kind == "ngram":
        return {"prompt_lookup_num_tokens": value}
    if kind == "self":
        return {"assistant_early_exit": value}
    return {"assistant_model": from_pretrained(value)}


def _markdown(r: dict, info: dict[str, str]) -> str:
    def opt(x: float | None, fmt: str) -> str:
        return "—" if x is None else format(x, fmt)

    lines = [
        "# Speculative decoding",
        "",
        f"Greedy decoding of up to {r['new_tokens']} new tokens with {r['model']}, batch 1, "
        "with and without speculative decoding. tokens/s counts the whole call (prefill "
        "included), a median of repeats timed in turns; acceptance: drafts kept over drafts "
        "proposed; tokens/pass: new tokens per forward of the model after the prefill. "
        "Regenerate with `attnlab bench generate --speculative ...`.",
        "",
        "| prompt | kind | method | new tokens | tokens/s | speed-up | acceptance "
        "| tokens/pass | same text |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['prompt']} | {row['kind']} | {row['method']} | {row['new_tokens']} "
            f"| {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x "
            f"| {opt(row['acceptance_rate'], '.0%')} | {opt(row['tokens_per_pass'], '.2f')} "
            f"| {'yes' if row['same_tokens'] else 'NO'} |")
    lines += ["", "Geometric means of the speed-ups:", ""]
    methods = dict.fromkeys(row["method"] for row in r["rows"] if row["method"] != "plain")
    kinds = dict.fromkeys(row["kind"] for row in r["rows"])
    for method in methods:
        means = []
        for kind in kinds:
            ups = [row["speedup"] for row in r["rows"]
                   if row["method"] == method and row["kind"] == kind]
            means.append(f"{kind} {math.prod(ups) ** (1 / len(ups)):.2f}x")
        lines.append(f"- {method}: {', '.join(means)}")
    lines += machine_section(info)
    return "\n".join(lines)
