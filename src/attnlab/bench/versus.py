"""Ours vs transformers on one checkpoint folder: prefill and decode tokens/s, one prompt and a
left-padded batch, each figure a median of repeats with both models timed in turns.

Shared by ``python -m devbench qwen2`` and ``attnlab bench families``. Both models are loaded from
the same folder: ours with ``attnlab.models.io.from_pretrained``, the reference with
``transformers.AutoModelForCausalLM.from_pretrained(attn_implementation="sdpa")``.

- prefill: one forward pass with a cache, logits for the last position only (what generation
  needs); tokens/s counts the real (unpadded) prompt tokens;
- decode: greedy generation of ``N`` new tokens; tokens/s is
  ``rows x (N - 1) / (t(N tokens) - t(1 token))``, so the prefill cancels out;
- bandwidth bound of a decode step: it reads every weight once for all rows, so
  ``tokens/s <= rows x read bandwidth / weight bytes`` (the token embedding table is not
  read in full, unless it is also the output head); the bandwidth is measured in turns with
  each decode measure's runs (``harness.BandwidthProbe``), so that a machine whose speed
  swings gives both the same moments.

Out-of-memory is a result (``"OOM"``), not a crash.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.arg_types import positive_int
from attnlab.bench.harness import (
    BandwidthProbe,
    device_arg,
    is_oom,
    oom_as_error,
    time_median,
    time_medians,
)
from attnlab.generation import generate
from attnlab.models.decoder import DecoderLM
from attnlab.models.families import family_for
from attnlab.models.io import from_pretrained, save_pretrained
from attnlab.quantization import weight_bytes as held_bytes

__all__ = [
    "DTYPES",
    "MEASURES",
    "QWEN2_FULL",
    "QWEN2_QUICK",
    "Workload",
    "bandwidth_range",
    "compare",
    "dtype_list",
    "load_reference",
    "measure_folder",
    "measure_quantized",
    "median_bandwidth",
    "ours_label",
    "random_checkpoint",
    "weight_bytes",
]

# The random Qwen2 checkpoint of the qwen2 and serve benchmarks: Qwen2-0.5B's shape with 4
# layers (196 M parameters), and a tiny one for --quick.
QWEN2_FULL = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 4, "num_attention_heads": 14, "num_key_value_heads": 2,
              "tie_word_embeddings": True, "rope_theta": 1e6, "max_position_embeddings": 4096}
QWEN2_QUICK = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "tie_word_embeddings": True, "max_position_embeddings": 512}
DTYPES = ("float32", "bfloat16")


def dtype_list(text: str) -> tuple[str, ...]:
    """``argparse`` type for comma-separated dtypes among ``DTYPES``, each once."""
    names = tuple(x.strip() for x in text.split(","))
    wrong = [x for x in names if x not in DTYPES]
    if wrong or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated dtypes among {DTYPES}, "
                                         f"each once, got {text!r}")
    return names


# measure -> (what it runs, batched)
MEASURES = {"prefill": ("prefill", False), "prefill batched": ("prefill", True),
            "decode": ("decode", False), "decode batched": ("decode", True)}


@dataclass(frozen=True)
class Workload:
    """What is timed: a ``prefill``-token prompt for the one-prompt prefill, a
    ``prompt``-token one for decoding ``new_tokens`` tokens, and ``batch`` left-padded
    prompts of ``prompt`` tokens at most (lengths going down) for the batched measures."""

    prefill: int
    prompt: int
    new_tokens: int
    batch: int
    repeats: int

    def __post_init__(self) -> None:
        if self.new_tokens < 2:
            raise ValueError(f"--new-tokens: expected >= 2 (the rate is a difference), got "
                             f"{self.new_tokens}")

    def lengths(self) -> list[int]:
        """The batched prompts' real lengths: ``prompt`` down by equal steps."""
        step = max(1, self.prompt // (2 * self.batch))
        return [max(1, self.prompt - i * step) for i in range(self.batch)]


def add_workload_arguments(parser: argparse.ArgumentParser, *, prefill: int,
                           new_tokens: int, batch: int) -> None:
    """The options every ours-vs-transformers benchmark takes (its defaults as given)."""
    parser.add_argument("--prefill", type=positive_int, default=prefill,
                        help="prefill prompt length")
    parser.add_argument("--prompt", type=positive_int, default=32,
                        help="decode prompt length (the longest of the batch)")
    parser.add_argument("--new-tokens", type=positive_int, default=new_tokens,
                        help="tokens decoded (at least 2: the rate is a difference)")
    parser.add_argument("--batch", type=positive_int, default=batch,
                        help="left-padded prompts in the batched prefill and decode")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed runs per cell (median)")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda")
    parser.add_argument("--extra-memory", action="store_true",
                        help="load ours with extra_memory=True: oneDNN's packed copies beside "
                        "the weights where they win (up to twice the weights' memory)")


def ours_label(extra_memory: bool) -> str:
    """How ours was loaded, for a table's text."""
    return ("Ours: from_pretrained(..., extra_memory=True), oneDNN's packed copies beside the "
            "weights where the kernel choice takes them" if extra_memory else
            "Ours: from_pretrained defaults (the rule's kernels, one copy of the weights)")


def start_run(args: argparse.Namespace, quick: Workload
              ) -> tuple[torch.device, Workload, Path, BandwidthProbe]:
    """``(device, workload, output folder, bandwidth probe)`` for a run: ``quick`` or the
    options' workload, the folder made first (a bad ``--out`` fails before the
    measurement). ``attnlab`` has set the threads (``--threads``) before the run."""
    device = torch.device(args.device)
    work = quick if args.quick else Workload(
        prefill=args.prefill, prompt=args.prompt, new_tokens=args.new_tokens,
        batch=args.batch, repeats=args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return device, work, out, BandwidthProbe(2**20 if args.quick else 2**28, device=device)


def random_checkpoint(folder: str | Path, model_type: str, sizes: Mapping[str, Any], *,
                      seed: int = 0) -> tuple[Path, str]:
    """Write a random float32 checkpoint of ``model_type`` into ``folder``; returns
    ``(folder, who wrote it)``.

    ``sizes`` are ``config.json`` keys in Llama's spelling (``hidden_size``,
    ``num_hidden_layers``, ...). With ``transformers`` installed, its model class writes the
    folder (keys a family spells otherwise, such as GPT-2's ``n_embd``, are found through the
    config's ``attribute_map``; keys it has no place for are left out), so the folder is what
    a user has on disk. Without it, our ``save_pretrained`` writes the family's format.
    """
    family = family_for(model_type)
    folder = Path(folder)
    torch.manual_seed(seed)
    transformers = _transformers()
    if transformers is None:
        model = DecoderLM(family.config_from_hf({"model_type": model_type, **sizes}))
        save_pretrained(model, folder)
        return folder, "attnlab.models.io.save_pretrained"
    default = transformers.AutoConfig.for_model(model_type)
    known = {k: v for k, v in sizes.items()
             if hasattr(default, k) or k in getattr(default, "attribute_map", {})}
    # Special ids inside the small vocabulary (the defaults are those of the full model's).
    ids = {k: i for i, k in enumerate(("pad_token_id", "bos_token_id", "eos_token_id"))
           if hasattr(default, k)}
    config = transformers.AutoConfig.for_model(model_type, **{**known, **ids})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder, f"transformers {transformers.__version__} save_pretrained"


def load_reference(folder: str | Path, dtype: torch.dtype,
                   device: torch.device) -> tuple[nn.Module | None, str]:
    """``(transformers model, note)`` from ``folder`` with sdpa attention, or ``(None, why
    not)`` when transformers is missing or cannot run it here (the bench then measures ours
    only)."""
    transformers = _transformers()
    if transformers is None:
        return None, "transformers is not installed: no reference measured"
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    except Exception as error:
        if is_oom(error):
            return None, "transformers: OOM while loading"
        return None, f"transformers could not load it on {device}: {error}"
    return model, f"transformers {transformers.__version__} (sdpa)"


def measure_folder(folder: str | Path, dtype: str, device: torch.device, work: Workload, *,
                   reference: bool = True, probe: Tensor | None = None,
                   bandwidth: BandwidthProbe, extra_memory: bool = False) -> dict[str, Any]:
    """Load ours (and, if ``reference``, transformers) from ``folder`` in ``dtype`` on
    ``device`` and ``compare`` them; each decode cell gets its ``bound`` tokens/s
    (``rows x bandwidth / weight bytes``, the bandwidth timed in turns with the cell's
    runs). ``probe`` (``1 x L`` ids): our greedy next tokens on it are returned too
    (``"next_tokens"``), to compare dtypes. ``extra_memory`` goes to our
    ``from_pretrained``. The models are released before it returns."""
    ours, error = oom_as_error(lambda: from_pretrained(folder, dtype=dtype, device=device,
                                                       extra_memory=extra_memory))
    if ours is None:
        return {"dtype": dtype, "error": f"ours: {error} while loading", "cells": {}}
    hf, note = (load_reference(folder, getattr(torch, dtype), device) if reference
                else (None, "skipped (--no-reference)"))
    cells = compare(ours, hf, work, device, bandwidth=bandwidth)
    nbytes = weight_bytes(ours)
    _bound(cells, nbytes)
    result = {"dtype": dtype, "reference": note, "weight_bytes": nbytes, "cells": cells}
    if probe is not None:
        with torch.inference_mode():
            result["next_tokens"] = ours(probe.to(device)).argmax(-1)[0].tolist()
    return result


def measure_quantized(folder: str | Path, method: str, group_size: int | None,
                      device: torch.device, work: Workload, *, bandwidth: BandwidthProbe
                      ) -> dict[str, Any]:
    """Our model from ``folder`` quantized (``method``, ``group_size``; activations, norms and
    scales in bfloat16) against our bfloat16 model from the same folder, with ``compare``
    (its ``"transformers"`` slot holds the bfloat16 model here). Each decode cell gets the
    ``bound`` of the quantized model's own bytes. Also returned: the bytes each model holds
    (``held``, ``held_bfloat16``) and reads per decode step (``weight_bytes``)."""
    ours, error = oom_as_error(lambda: from_pretrained(folder, dtype="bfloat16", device=device,
                                                       quantize=method, group_size=group_size))
    if ours is None:
        return {"dtype": method, "error": f"ours: {error} while loading", "cells": {}}
    plain = from_pretrained(folder, dtype="bfloat16", device=device)
    cells = compare(ours, plain, work, device, reference_is_ours=True, bandwidth=bandwidth)
    nbytes = weight_bytes(ours)
    _bound(cells, nbytes)
    return {"dtype": method, "group_size": group_size, "reference": "our bfloat16 model",
            "weight_bytes": nbytes, "held": held_bytes(ours), "held_bfloat16": held_bytes(plain),
            "cells": cells}


def compare(ours: nn.Module, reference: nn.Module | None, work: Workload,
            device: torch.device, *, seed: int = 0, reference_is_ours: bool = False,
            bandwidth: BandwidthProbe | None = None) -> dict[str, dict[str, Any]]:
    """Time each of ``MEASURES`` on both models: ``{measure: {"ours": tokens/s or None,
    "transformers": ..., "ours_error": "OOM" or None, "transformers_error": ..., "rows": B,
    "prompt_tokens": real prompt tokens}}``, and for a decode measure with ``bandwidth``
    its ``"bandwidth_gbs"``, the probe timed in turns with the models. Both models get the
    same ids (``1 x prefill``, ``1 x prompt``, ``batch x prompt`` left-padded).
    ``reference_is_ours``: the reference is one of our models too (driven as ours are)."""
    V = ours.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    long_ids = torch.randint(0, V, (1, work.prefill), generator=g).to(device)
    ids = torch.randint(0, V, (work.batch, work.prompt), generator=g).to(device)
    lengths = work.lengths()
    mask = torch.tensor([[0] * (work.prompt - n) + [1] * n for n in lengths], device=device)
    inputs = {False: (long_ids, torch.ones_like(long_ids)), True: (ids, mask)}
    decode_inputs = {False: (ids[:1], torch.ones_like(ids[:1])), True: (ids, mask)}
    models = {"ours": (ours, _ours_runner),
              "transformers": (reference, _ours_runner if reference_is_ours
                               else _reference_runner)}
    results: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        for measure, (kind, batched) in MEASURES.items():
            x, m = (inputs if kind == "prefill" else decode_inputs)[batched]
            rows, prompt_tokens = x.shape[0], int(m.sum())
            fns: dict[str, Callable[[], object]] = {}
            for name, (model, runner) in models.items():
                if model is None:
                    continue
                prefill, gen = runner(model, x, m)
                if kind == "prefill":
                    fns[name] = prefill
                else:
                    fns[f"{name} N"] = lambda gen=gen: gen(work.new_tokens)
                    fns[f"{name} 1"] = lambda gen=gen: gen(1)
            if kind == "decode" and bandwidth is not None:
                fns["bandwidth"] = bandwidth
            seconds = _timed(fns, work.repeats, device)
            cell: dict[str, Any] = {"rows": rows, "prompt_tokens": prompt_tokens}
            probe_s = seconds.get("bandwidth", (None, None))[0]
            if probe_s is not None:
                cell["bandwidth_gbs"] = bandwidth.gbs(probe_s)
            for name in models:
                if kind == "prefill":
                    s, error = seconds.get(name, (None, None))
                    rate = None if s is None else prompt_tokens / s
                else:
                    (full, e1), (one, e2) = (seconds.get(f"{name} {n}", (None, None))
                                             for n in ("N", "1"))
                    error = e1 or e2
                    rate = (None if full is None or one is None
                            else rows * (work.new_tokens - 1) / max(full - one, 1e-9))
                cell[name], cell[f"{name}_error"] = rate, error
            results[measure] = cell
    return results


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter and stored buffer once (a tied
    head counted once; a quantized layer's codes and scales), except embedding tables, of
    which a step reads one row (the output head reads a tied table in full, and counts it)."""
    read: dict[int, int] = {}
    tables = [name for name, m in model.named_modules()
              if isinstance(m, nn.Embedding) or type(m).__name__.endswith("Embedding")]
    for name, module in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in tables):
            continue
        stored = module.state_dict(keep_vars=True)
        tensors = [*module.parameters(recurse=False),
                   *(b for n, b in module.named_buffers(recurse=False) if n in stored)]
        for t in tensors:
            read[t.data_ptr()] = t.numel() * t.element_size()
    return sum(read.values())


def bandwidth_range(cells: list[dict[str, Any]]) -> str:
    """``"lo-hi GB/s"`` over the bandwidths measured beside ``cells`` ("—" without any)."""
    found = _bandwidths(cells)
    return f"{min(found):.1f}-{max(found):.1f} GB/s" if found else "—"


def median_bandwidth(cells: list[dict[str, Any]]) -> float | None:
    """The median of the bandwidths (GB/s) measured beside ``cells``, None without any."""
    found = _bandwidths(cells)
    return statistics.median(found) if found else None


def _bandwidths(cells: list[dict[str, Any]]) -> list[float]:
    return [c["bandwidth_gbs"] for c in cells if c.get("bandwidth_gbs")]


def _bound(cells: dict[str, dict[str, Any]], nbytes: int) -> None:
    """Each decode cell's ``bound`` tokens/s: rows x its bandwidth / weight bytes."""
    for measure, cell in cells.items():
        if MEASURES[measure][0] == "decode" and cell.get("bandwidth_gbs"):
            cell["bound"] = cell["rows"] * cell["bandwidth_gbs"] * 1e9 / nbytes


def _transformers() -> Any:
    """The ``transformers`` module, quiet (no progress bars or warnings in the bench output),
    or None when it is not installed: it is the reference only, not a dependency."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def _ours_runner(model: nn.Module, ids: Tensor, mask: Tensor
                 ) -> tuple[Callable[[], object], Callable[[int], object]]:
    def prefill() -> object:
        return model(ids, attention_mask=mask, logits_to_keep=1,
                     cache=model.make_cache(ids.shape[0], ids.shape[1]))

    def gen(n: int) -> object:
        return generate(model, ids, n, attention_mask=mask)

    return prefill, gen


def _reference_runner(model: nn.Module, ids: Tensor, mask: Tensor
                      ) -> tuple[Callable[[], object], Callable[[int], object]]:
    def prefill() -> object:
        return model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)

    def gen(n: int) -> object:  # min_new_tokens: no end token cuts a run short
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, eos_token_id=None)

    return prefill, gen


def _timed(fns: dict[str, Callable[[], object]], repeats: int,
           device: torch.device) -> dict[str, tuple[float | None, str | None]]:
    """Medians timed in turns; when that runs out of memory, each function alone, so one
    model's OOM leaves the other's figure."""
    try:
        return {k: (s, None) for k, s in
                time_medians(fns, repeats=repeats, warmup=1, device=device).items()}
    except (RuntimeError, MemoryError) as error:
        if not is_oom(error):
            raise
    return {k: oom_as_error(lambda fn=fn: time_median(fn, repeats=repeats, device=device))
            for k, fn in fns.items()}
