"""``attnlab quantize --model FOLDER --out OUT``: a checkpoint folder's weights as int8 or int4
(``attnlab quantize FOLDER OUT``, the older spelling, works too); and ``attnlab export-gguf
--model FOLDER --out OUT.gguf --type TYPE``: the folder's model as a GGUF file
(``attnlab.models.export_gguf``, the folder's tokenizer and chat template in its metadata).

int4 keeps the token tables (the embedding, and the LM head tied to it) in int8 unless
``--table-bits 4``, and the layers of ``--int8-layers`` (default every ``v_proj`` and the last
layer's ``down_proj``) and ``--int8-outliers`` more ``down_proj`` (by default, with the
default layers, one for every 15: those whose weights hold the largest outliers) in int8;
it stores each group's scale and
zero as 8-bit codes (4.5 bits a weight at the default groups of 32; float16 with gptq) and
chooses them by ``--method``: ``search`` (the default: least squared error,
``attnlab.quantization.search``), ``nearest`` (round-to-nearest), or ``gptq`` with
``--calibration FILE`` (``attnlab.quantization.gptq``: the model runs on the file's text,
and layer by layer, each layer's rounding errors are compensated for the inputs that the
layers quantized before it give it; the float model is then held in memory).

Reads any folder that ``attnlab.models.from_pretrained`` reads, quantizing each weight as it
is read (``attnlab.quantization``: the float model is never held), and writes OUT in
attnlab's own format: ``config.json`` with a ``"quantization"`` record (``method``,
``group_size``, ``skip``) and ``model.safetensors`` holding each quantized layer's
``qweight``/``scales``/``zeros``. The tokenizer and generation files are copied beside them,
so ``attnlab generate --model OUT`` works as on FOLDER, and ``quantized_from.json`` records
the command's output: ``{"format": "attnlab-quantize", "source": FOLDER's absolute path}``.

OUT is never overwritten by surprise: a missing or empty OUT is written, an OUT that this
command wrote from the same FOLDER is replaced, and anything else (another model's weights,
the user's files) is refused unless ``--force``. OUT is written in a hidden folder beside it
and swapped in at the end (``attnlab.durable``), so an interrupted run leaves no half-written
model: OUT is absent or holds what it held before.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors import SafetensorError

from attnlab.arg_types import non_negative_int
from attnlab.cli import add_command
from attnlab.cli.options import add_dtype_option, add_model_option, model_and_out
from attnlab.durable import new_folder, swap_in
from attnlab.models.gguf import gguf_file
from attnlab.models.gguf_export import TYPES, export_gguf
from attnlab.models.hf_loading import CONFIG_NAME, WEIGHTS_NAME, check_folder, weight_files
from attnlab.models.io import from_pretrained
from attnlab.quantization.convert import (
    DEFAULT_GROUP_SIZE,
    FITS,
    QuantizationConfig,
    outliers_asked,
)
from attnlab.quantization.gptq import gptq_quantize
from attnlab.tokenizer import Tokenizer

__all__ = ["add_commands"]

# Copied from FOLDER: what a generate or chat call reads besides the weights.
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt")
# Written into OUT: what marks it as this command's output, and from which FOLDER.
MARKER, MARKER_FORMAT = "quantized_from.json", "attnlab-quantize"
CALIBRATION_CONTEXT = 512  # tokens a calibration chunk (fewer when the model's context is)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``quantize`` and ``export-gguf`` on the top-level sub-parsers."""
    p = add_command(sub, "quantize", __doc__)
    add_model_option(p, "checkpoint folder (any that `attnlab generate` reads)", required=False)
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder to write (made if missing; must not be the model's); an "
                   "existing one must be empty or an earlier output of this command for it")
    p.add_argument("paths", nargs="*", metavar="FOLDER OUT",
                   help="the older spelling of --model FOLDER --out OUT")
    p.add_argument("--bits", type=int, choices=(8, 4), default=8,
                   help="8: int8 per output row; 4: int4 in groups of --group-size")
    p.add_argument("--group-size", type=int, default=None,
                   help=f"inputs per int4 scale and zero point: 32, 64, 128 or 256 (default "
                   f"{DEFAULT_GROUP_SIZE}; int4 only)")
    p.add_argument("--method", choices=FITS, default=None,
                   help="how int4 chooses its codes (default search; int4 only): search, "
                   "nearest (round-to-nearest) or gptq (needs --calibration)")
    p.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                   help="a UTF-8 text file that --method gptq runs the model on (English prose "
                   "of a few thousand tokens)")
    p.add_argument("--table-bits", type=int, choices=(8, 4), default=None,
                   help="bits of the token tables, the embedding and a tied LM head (default 8)")
    p.add_argument("--int8-layers", nargs="*", default=None, metavar="PATTERN",
                   help="int4 only: linear layers kept in int8 (fnmatch patterns, {last} "
                   "for the last layer's number; default every v_proj and the last layer's "
                   "down_proj; none given: every layer int4)")
    p.add_argument("--int8-outliers", type=non_negative_int, default=None, metavar="N",
                   help="int4 only: N more down_proj kept in int8, those of the largest "
                   "max|W|/std(W) (default: one for every 15 with the default --int8-layers, "
                   "else 0)")
    p.add_argument("--skip", nargs="*", default=[], metavar="PATTERN",
                   help="module names kept in float (fnmatch patterns, e.g. lm_head '*.mlp.*')")
    add_dtype_option(p, "dtype of what stays float and of the scales (default: the stored one)")
    p.add_argument("--force", action="store_true",
                   help="replace OUT whatever it holds (all of it: OUT becomes the new model)")
    p.set_defaults(handler=_quantize)
    e = add_command(sub, "export-gguf", "Write a checkpoint folder's model as a GGUF file "
                    "(llama.cpp, Ollama, transformers' gguf_file=), the folder's tokenizer and "
                    "chat template in its metadata.")
    add_model_option(e, "checkpoint folder (any that `attnlab generate` reads)", required=False)
    e.add_argument("--out", default=None, metavar="FILE", help="GGUF file to write; an "
                   "existing file is replaced only when it is a GGUF")
    e.add_argument("paths", nargs="*", metavar="FOLDER OUT",
                   help="the positional spelling of --model FOLDER --out OUT")
    e.add_argument("--type", choices=sorted(TYPES), default="f16",
                   help="type of the 2-d weights (norms and biases stay f32)")
    e.set_defaults(handler=_export_gguf)


def _quantize(args: argparse.Namespace) -> int:
    model_and_out(args, with_out=True)
    source = check_folder(args.model)
    # A link is written through, at its target: swapping the new folder in beside the link
    # would replace the link itself (the model on the link's disk, the target untouched).
    out = Path(args.out).resolve() if Path(args.out).is_symlink() else Path(args.out)
    if out.exists() and out.resolve() == source.resolve():
        raise ValueError(f"out: {out} is FOLDER itself; write the quantized copy elsewhere")
    if args.bits == 8:
        for flag, value in (("--group-size", args.group_size), ("--method", args.method),
                            ("--table-bits", args.table_bits),
                            ("--int8-layers", args.int8_layers),
                            ("--int8-outliers", args.int8_outliers)):
            if value is not None and not (flag == "--table-bits" and value == 8):
                raise ValueError(f"{flag}: int8 scales whole rows by their maximum; it "
                                 "applies to --bits 4 only")
    if args.method == "gptq" and args.calibration is None:
        raise ValueError("--calibration: --method gptq needs a text file to calibrate on "
                         "(--calibration FILE)")
    if args.calibration is not None and args.method != "gptq":
        raise ValueError(f"--calibration: only --method gptq reads calibration text, got "
                         f"--method {args.method or 'search (the default)'}")
    calibration = _calibration_ids(source, args.calibration) if args.calibration else None
    _check_out(out, source, args.force)
    start = time.perf_counter()
    # Writing the codes needs no kernel: the formula forced here, so no kernel is chosen
    # (timing every kernel took ~45 s for a tiny checkpoint); the folder's loader measures.
    if calibration is not None:
        model = from_pretrained(source, dtype=args.dtype, kernels=False)
        gptq_quantize(model, calibration, group_size=args.group_size, skip=args.skip,
                      table_bits=args.table_bits, int8_layers=args.int8_layers,
                      int8_outliers=args.int8_outliers,
                      kernel="dequantize", progress=True,
                      context=min(CALIBRATION_CONTEXT, model.config.max_len))
    else:
        group_size = (args.group_size or DEFAULT_GROUP_SIZE) if args.bits == 4 else None
        scheme = QuantizationConfig(f"int{args.bits}", group_size, args.skip, args.table_bits,
                                    args.method, int8_layers=args.int8_layers,
                                    int8_outliers=outliers_asked(args.int8_layers,
                                                                 args.int8_outliers))
        model = from_pretrained(source, dtype=args.dtype, kernels=False, quantize=scheme,
                                quantized_kernel="dequantize")
    tmp = new_folder(out)
    try:
        model.save_pretrained(tmp)
        for name in _SIDE_FILES:
            if (source / name).is_file() and name != CONFIG_NAME:
                shutil.copyfile(source / name, tmp / name)
        marker = {"format": MARKER_FORMAT, "source": str(source.resolve())}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        swap_in(tmp, out)
    except (OSError, SafetensorError) as error:  # a full disk (safetensors has its own type)
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(f"out: cannot write {out} ({error}); it is as it was before") from error
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    before = sum(path.stat().st_size for path in set(weight_files(source).values()))
    after = (out / WEIGHTS_NAME).stat().st_size
    print(f"quantized {source} as {model.quantization.scheme}: weights {before / 2**20:.1f} "
          f"MiB -> {after / 2**20:.1f} MiB ({after / before:.2f}x) in "
          f"{time.perf_counter() - start:.1f} s")
    print(f"wrote {out}")
    return 0


def _export_gguf(args: argparse.Namespace) -> int:
    model_and_out(args, with_out=True)
    folder, out = args.model, args.out
    out = Path(out)
    if out.exists() and (out.is_dir() or gguf_file(out) is None):
        raise ValueError(f"out: {out} exists and is not a GGUF file; choose another path")
    source = check_folder(folder)
    model = from_pretrained(source, kernels=False)
    tokenizer = (Tokenizer.from_pretrained(source)
                 if (source / "tokenizer.json").is_file() else None)
    if tokenizer is None:
        print(f"attnlab: {source} has no tokenizer.json: the GGUF holds no vocabulary "
              "(llama.cpp needs one to run it)", file=sys.stderr)
    export_gguf(model, out, type=args.type, tokenizer=tokenizer)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {args.type})")
    return 0


def _calibration_ids(source: Path, path: Path) -> torch.Tensor:
    """The token ids of the calibration file (FOLDER's tokenizer, no special tokens)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--calibration: {path} is not UTF-8 text ({error})") from None
    ids = Tokenizer.from_pretrained(source).encode(text, add_special_tokens=False)
    if len(ids) < 2:
        raise ValueError(f"--calibration: {path} holds {len(ids)} tokens; expected text of "
                         "a few thousand")
    return torch.tensor(ids)


def _check_out(out: Path, source: Path, force: bool) -> None:
    """Refuse an ``out`` that holds something other than this command's output for
    ``source`` (module docstring), unless ``force``."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"out: {out} is a file; expected a folder to write the quantized "
                         "model in")
    if source.resolve().is_relative_to(out.resolve()):  # replacing OUT would delete FOLDER
        raise ValueError(f"out: {out} holds FOLDER {source}; write the quantized copy "
                         "elsewhere")
    held = sorted(path.name for path in out.iterdir())
    if not held or force:
        return
    recorded = _recorded_source(out / MARKER)
    if recorded == str(source.resolve()):
        return
    if recorded is not None:
        what = f"the quantized weights of another folder, {recorded}"
    else:
        names = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        what = f"files that attnlab quantize did not write ({names})"
    raise ValueError(f"out: {out} already holds {what}; choose another folder, or pass "
                     "--force to replace all of it")


def _recorded_source(path: Path) -> str | None:
    """The FOLDER recorded in an earlier output's marker; None when there is none."""
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
        return None
    source = marker.get("source")
    return source if isinstance(source, str) else None
