"""``attnlab viz``: look inside a checkpoint on one input text.

``attnlab viz --checkpoint DIR --text "..." [--html out.html] [--png out/]`` captures every
attention layer and head on the text, prints the head metric table, and writes the
interactive HTML viewer and/or PNG pictures (a head grid per kind and layer, a layer x head
entropy map and head similarity per kind). ``DIR`` is an attnlab checkpoint (a seq2seq
model: the text is the source and the model's greedy translation the target; a character
LM: the text is the input) or a Hugging Face Qwen2/Llama folder with ``tokenizer.json``.
``--alignment`` adds, for a date checkpoint, the year-alignment report and its pictures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab.analysis import (
    capture,
    head_report,
    head_similarity,
    plot_attention_heads,
    plot_head_similarity,
    plot_metric_map,
    save_html,
)
from attnlab.analysis.capture import AttentionCapture, kind_label

__all__ = ["add_commands", "load_for_viz"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``viz`` on the top-level sub-parsers."""
    viz = sub.add_parser("viz", help="capture and draw a checkpoint's attention on a text")
    viz.add_argument("--checkpoint", required=True,
                     help="attnlab checkpoint folder or Hugging Face Qwen2 folder")
    viz.add_argument("--text", required=True, help="the input text")
    viz.add_argument("--html", help="write the interactive viewer here (default: "
                                    "attention.html when --png is not given)")
    viz.add_argument("--png", help="folder for PNG pictures")
    viz.add_argument("--layers", type=int, nargs="+", help="layer indices (default: all)")
    viz.add_argument("--heads", type=int, nargs="+", help="head indices (default: all)")
    viz.add_argument("--max-tokens", type=int, default=256,
                     help="positions kept per axis in the HTML viewer (default 256)")
    viz.add_argument("--alignment", action="store_true",
                     help="date checkpoints: year-alignment report and head similarity")
    viz.set_defaults(handler=_viz)


def load_for_viz(checkpoint: str | Path, text: str) -> tuple[nn.Module, Any, dict, str]:
    """``(model, inputs, tokens, description)`` ready for ``capture`` on ``text``."""
    from attnlab.training.checkpoint import FORMAT, load_model
    from attnlab.training.tasks.vocab import BOS, CharVocab

    folder = Path(checkpoint)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"checkpoint: no config.json in {str(folder)!r}")
    if not text:
        raise ValueError("text: expected a non-empty string, got ''")
    raw = json.loads(config_path.read_text())
    if raw.get("format") != FORMAT:
        return _load_hf(folder, text, raw)
    model, config = load_model(folder)
    extra = config.get("extra", {})
    if config["model_type"] == "transformer":
        src_vocab, tgt_vocab = CharVocab(extra["src_chars"]), CharVocab(extra["tgt_chars"])
        src = src_vocab.batch([text])
        task = _seq2seq_task(extra)
        out = task.translate(model, [text])[0] if task is not None else ""
        tgt = torch.tensor([[BOS, *tgt_vocab.encode(out)]])
        tokens = {"src": [list(text)], "tgt": [["<bos>", *out]]}
        return model, (src, tgt), tokens, f"{text!r} -> {out!r}"
    vocab = CharVocab(extra["chars"])
    ids = torch.tensor([vocab.encode(text)])
    return model, ids, {"input": [list(text)]}, repr(text)


def _viz(args: argparse.Namespace) -> int:
    model, inputs, tokens, description = load_for_viz(args.checkpoint, args.text)
    result = capture(model, inputs, args.layers, args.heads, tokens=tokens)
    report = head_report(result)
    print(f"{args.checkpoint}: {description}\n")
    print(report.to_markdown())
    written: list[Path] = []
    html = args.html or (None if args.png else "attention.html")
    if html:
        written.append(save_html(result, html, report=report, max_tokens=args.max_tokens,
                                 title=f"{Path(args.checkpoint).name}: {description}"))
    if args.png:
        written += _pictures(result, report, Path(args.png))
    if args.alignment:
        from attnlab.analysis.dates import date_alignment_report

        folder = Path(args.png or ".") / "alignment"
        report_ = date_alignment_report(args.checkpoint, out_dir=folder)
        print("\n" + report_.summary())
        written += report_.pictures
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def _pictures(result: AttentionCapture, report: Any, out: Path) -> list[Path]:
    paths = []
    rows = report.to_dicts()
    for kind, maps in result.maps.items():
        w, queries, keys = maps.example(0)
        for i, layer in enumerate(maps.layers):
            paths.append(plot_attention_heads(
                w[i], queries, keys, out / f"{kind}_layer{layer}.png",
                title=f"{kind_label(kind)}, layer {layer}"))
        entropy = torch.tensor([[r["entropy"] for r in rows if r["kind"] == kind
                                 and r["layer"] == layer] for layer in maps.layers])
        paths.append(plot_metric_map(
            entropy, out / f"{kind}_entropy.png", row_labels=[f"layer {x}" for x in maps.layers],
            col_labels=[f"h{h}" for h in maps.heads], title=f"{kind_label(kind)}: entropy"))
        paths.append(plot_head_similarity(
            head_similarity(w[-1].float()), out / f"{kind}_similarity.png",
            labels=[f"h{h}" for h in maps.heads],
            title=f"{kind_label(kind)}, layer {maps.layers[-1]}: head similarity"))
    return paths


def _seq2seq_task(extra: dict) -> Any:
    from attnlab.training.tasks.seq2seq import SEQ2SEQ_TASKS, make_seq2seq_task

    if extra.get("task") not in SEQ2SEQ_TASKS:
        return None
    return make_seq2seq_task(extra["task"], seed=extra.get("seed", 0),
                             max_len=extra.get("max_len", 12), n_test=1, n_valid=1)


def _load_hf(folder: Path, text: str, raw: dict) -> tuple[nn.Module, Any, dict, str]:
    if raw.get("model_type") not in ("qwen2", "llama"):
        raise ValueError(f"checkpoint: {str(folder)!r} is neither an attnlab checkpoint nor a "
                         f"Qwen2/Llama folder (model_type {raw.get('model_type')!r})")
    try:
        from attnlab.models.qwen2 import Qwen2ForCausalLM
    except ImportError:  # pragma: no cover - the module ships with attnlab
        raise ValueError("checkpoint: Qwen2 folders need attnlab.models.qwen2") from None
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise ValueError(f"checkpoint: {str(folder)!r} has no tokenizer.json")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok_path))
    ids = tokenizer.encode(text).ids
    if not ids:
        raise ValueError(f"text: {text!r} encodes to no tokens")
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens = [tokenizer.decode([i]) or tokenizer.id_to_token(i) for i in ids]
    return model, torch.tensor([ids]), {"input": [tokens]}, repr(text)
