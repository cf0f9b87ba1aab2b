"""``attnlab viz``: look inside a checkpoint on one input text.

``attnlab viz --model DIR --text "..." [--html out.html] [--png out/]`` captures every
attention layer and head on the text, prints the head metric table, and writes the
interactive HTML viewer and/or PNG pictures (a head grid per kind and layer, a layer x head
entropy map per kind, a head similarity per kind and layer). ``DIR`` is an attnlab
checkpoint (a seq2seq model: the text is the source and the model's greedy translation the
target; a character LM: the text is the input) or a Hugging Face checkpoint folder of any
family that ``attnlab.models.io.from_pretrained`` reads (``attnlab.models.families.FAMILIES``:
Llama, Qwen2, ...), with its ``tokenizer.json``.
``--alignment`` adds, for a date checkpoint, the year-alignment report and its pictures;
it refuses any other checkpoint before doing any work.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab._checks import check_positive
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
from attnlab.analysis.dates import check_date_checkpoint, date_alignment_report
from attnlab.cli import add_command
from attnlab.cli.options import add_model_option
from attnlab.models.decoder import DecoderLM
from attnlab.models.families import FAMILIES
from attnlab.models.gguf import gguf_file
from attnlab.models.hf_loading import read_json
from attnlab.models.io import from_pretrained
from attnlab.threads import add_threads_option
from attnlab.tokenizer import Tokenizer
from attnlab.training.checkpoint import FORMAT, load_model
from attnlab.training.tasks.seq2seq import SEQ2SEQ_TASKS, make_seq2seq_task
from attnlab.training.tasks.vocab import BOS, CharVocab

__all__ = ["add_commands", "load_for_viz"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``viz`` on the top-level sub-parsers."""
    viz = add_command(sub, "viz", "Capture every attention layer and head of a checkpoint on "
                      "a text, print the head metric table, and write the interactive HTML "
                      "viewer and/or PNG pictures.")
    add_model_option(viz, alias="--checkpoint",
                     help="an attnlab checkpoint folder (seq2seq or character LM) or a Hugging "
                          "Face checkpoint folder with tokenizer.json, of a supported family "
                          f"({', '.join(sorted(FAMILIES))}), or a GGUF file")
    viz.add_argument("--text", required=True,
                     help="the input text: the source of a seq2seq model, else the prompt")
    viz.add_argument("--html", metavar="FILE",
                     help="write the interactive viewer to FILE; when neither --html nor "
                          "--png is given it goes to attention.html")
    viz.add_argument("--png", metavar="DIR",
                     help="write PNG pictures into DIR: a head grid per kind and layer, the "
                          "layer x head entropy map of each kind, and the head similarity "
                          "of each kind and layer")
    viz.add_argument("--layers", type=int, nargs="+", metavar="I",
                     help="capture only these layer indices (all when not given)")
    viz.add_argument("--heads", type=int, nargs="+", metavar="H",
                     help="capture only these head indices (all when not given)")
    viz.add_argument("--max-tokens", type=int, default=256, metavar="N",
                     help="positions kept per axis in the HTML viewer (longer inputs are cut "
                          "there, and the page says so)")
    viz.add_argument("--max-lines", type=int, default=40, metavar="N",
                     help="attention lines drawn at most per token in the HTML viewer")
    viz.add_argument("--alignment", action="store_true",
                     help="date-task checkpoints only (attnlab demo writes runs/demo/best): "
                          "also the year-alignment report and its pictures, under "
                          "the --png folder (or .) in alignment/")
    add_threads_option(viz)
    viz.set_defaults(handler=_viz)


def load_for_viz(checkpoint: str | Path, text: str) -> tuple[nn.Module, Any, dict, str]:
    """``(model, inputs, tokens, description)`` ready for ``capture`` on ``text``."""
    folder = Path(checkpoint)
    if not text:
        raise ValueError("text: expected a non-empty string, got ''")
    if gguf_file(folder) is not None:  # its tokenizer in its metadata
        return _load_lm(folder, text)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"checkpoint: no config.json in {str(folder)!r}")
    raw = read_json(config_path)
    if raw.get("format") != FORMAT:
        return _load_hf(folder, text, raw)
    model, config = load_model(folder)
    extra = config.get("extra", {})
    chars = extra["src_chars"] if config["model_type"] == "transformer" else extra["chars"]
    _check_text(text, chars, model.config.max_len)
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
    # Every check that needs no model comes first: a wrong option fails in a moment.
    check_positive("--max-tokens", args.max_tokens)
    check_positive("--max-lines", args.max_lines)
    if not args.text:
        raise ValueError("--text: expected a non-empty string, got ''")
    html = args.html or (None if args.png else "attention.html")
    if html:
        _check_output("--html", Path(html), folder=False)
    if args.png:
        _check_output("--png", Path(args.png), folder=True)
    if args.alignment:
        try:
            check_date_checkpoint(args.model)
        except (ValueError, FileNotFoundError) as error:
            raise ValueError(f"--alignment: needs a date-task checkpoint (attnlab demo writes "
                             f"runs/demo/best); {error}") from None
    model, inputs, tokens, description = load_for_viz(args.model, args.text)
    result = capture(model, inputs, args.layers, args.heads, tokens=tokens)
    report = head_report(result)
    print(f"{args.model}: {description}\n")
    print(report.to_markdown())
    written: list[Path] = []
    if html:
        written.append(save_html(result, html, report=report, max_tokens=args.max_tokens,
                                 max_lines=args.max_lines,
                                 title=f"{Path(args.model).name}: {description}"))
    if args.png:
        written += _pictures(result, report, Path(args.png))
    if args.alignment:
        folder = Path(args.png or ".") / "alignment"
        report_ = date_alignment_report(args.model, out_dir=folder)
        print("\n" + report_.summary())
        written += report_.pictures
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def _check_output(flag: str, path: Path, *, folder: bool) -> None:
    """Refuse, before any work, an output that cannot be written: a folder where a file is
    to go, or a file where a folder is (or must be created)."""
    if not folder and path.is_dir():
        raise ValueError(f"{flag}: {str(path)!r} is a folder, expected a file name")
    where = path if folder else path.parent
    existing = next((p for p in [where, *where.parents] if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"{flag}: {str(existing)!r} is a file, expected a folder there")


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
            col_labels=[f"h{h}" for h in maps.heads], title=f"{kind_label(kind)}: entropy",
            label="mean entropy of a query's weights (nats)"))
        for i, layer in enumerate(maps.layers):
            paths.append(plot_head_similarity(
                head_similarity(w[i].float()), out / f"{kind}_similarity_layer{layer}.png",
                labels=[f"h{h}" for h in maps.heads],
                title=f"{kind_label(kind)}, layer {layer}: head similarity"))
    return paths


def _check_text(text: str, chars: str, max_len: int) -> None:
    """A character model sees an unknown character as ``<unk>``: refuse rather than draw
    attention on tokens that are not what they say."""
    unknown = sorted(set(text) - set(chars))
    if unknown:
        raise ValueError(f"text: characters {''.join(unknown)!r} are not in the checkpoint's "
                         f"vocabulary {chars!r}")
    if len(text) > max_len:
        raise ValueError(f"text: expected at most {max_len} characters (the model's max_len), "
                         f"got {len(text)}")


def _seq2seq_task(extra: dict) -> Any:
    if extra.get("task") not in SEQ2SEQ_TASKS:
        return None
    return make_seq2seq_task(extra["task"], seed=extra.get("seed", 0),
                             max_len=extra.get("max_len", 12), n_test=1, n_valid=1)


def _load_hf(folder: Path, text: str, raw: dict) -> tuple[nn.Module, Any, dict, str]:
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in {*FAMILIES, DecoderLM.MODEL_TYPE}:
        raise ValueError(f"checkpoint: {str(folder)!r} is neither an attnlab checkpoint nor a "
                         f"folder of a supported family (model_type {model_type!r}; expected "
                         f"one of {sorted(FAMILIES)}, or {DecoderLM.MODEL_TYPE!r} as "
                         "save_pretrained and attnlab quantize write it)")
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"checkpoint: {str(folder)!r} has no tokenizer.json")
    return _load_lm(folder, text)


def _load_lm(folder: Path, text: str) -> tuple[nn.Module, Any, dict, str]:
    """A decoder-only model and its tokenizer (a checkpoint folder or a GGUF file)."""
    tokenizer = Tokenizer.from_pretrained(folder)
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError(f"text: {text!r} encodes to no tokens")
    model = from_pretrained(folder, dtype=torch.float32)
    if len(ids) > model.config.max_len:
        raise ValueError(f"text: expected at most {model.config.max_len} tokens (the model's "
                         f"max_len), got {len(ids)}")
    unknown = sorted({i for i in ids if i >= model.config.vocab_size})
    if unknown:
        raise ValueError(f"checkpoint: tokenizer.json gives ids {unknown} for the text, outside "
                         f"the model's vocabulary of {model.config.vocab_size}")
    tokens = [tokenizer.decode([i]) or tokenizer.backend.id_to_token(i) for i in ids]
    return model, torch.tensor([ids]), {"input": [tokens]}, repr(text)
