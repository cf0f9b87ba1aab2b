"""One decoding step three ways: the reference modules, the fast modules with attnlab's C++
step (``FusedDecoderLayers``), and ``torch.compile`` (inductor on the CPU) of the reference
modules' step. For the question of issue 38, point 4: keep a C++ step only where it wins.

    python benchmarks/scripts/step_compile.py [--threads N] [--repeats R] [--out FILE]

Random weights in the shapes of Qwen2.5-0.5B (24 layers) and SmolLM2-135M (30 layers), float32
and bfloat16; the step is one token at position 64 of a cache of 128, batch 1; each figure is
the median of ``--repeats`` timed steps (after warm-up), the three ways measured in turns.
Prints a markdown table with the machine, the load average and the spread of the repeats.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

import torch

from attnlab.kernels import optimize_for_inference
from attnlab.models import DecoderLM, preset

SHAPES = {
    "qwen2.5-0.5b (24 layers)": ("qwen2.5-0.5b", {}),
    "smollm2-135m (30 layers)": ("llama-3.2-1b", {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "tie_word_embeddings": True, "rope_scaling": None,
        "max_position_embeddings": 2048}),
}
PROMPT, ROOM = 64, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    rows = []
    for label, (name, keys) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            rows.append((label, dtype, *measure(name, keys, dtype, args.repeats)))
            print(rows[-1], file=sys.stderr, flush=True)
    cpu = _cpu()
    lines = [f"CPU: {cpu}; torch {torch.__version__}; {args.threads} threads; load average "
             f"{load:.2f} at start, {os.getloadavg()[0]:.2f} at end (usable CPUs "
             f"{len(os.sched_getaffinity(0))}); median of {args.repeats} steps (spread = "
             "(max - min) / median)", "",
             "| model | dtype | reference ms | C++ step ms | compiled ms | compile s "
             "| C++ / compiled |", "|---|---|---|---|---|---|---|"]
    for label, dtype, ref, fused, compiled, compile_s in rows:
        lines.append(f"| {label} | {str(dtype).removeprefix('torch.')} | {_fmt(ref)} | "
                     f"{_fmt(fused)} | {_fmt(compiled)} | {compile_s:.0f} | "
                     f"{statistics.median(compiled) / statistics.median(fused):.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


def measure(name: str, keys: dict, dtype: torch.dtype,
            repeats: int) -> tuple[list[float], list[float], list[float], float]:
    torch.manual_seed(0)
    reference = DecoderLM(preset(name, **keys)).to(dtype).eval()
    fast = optimize_for_inference(copy.deepcopy(reference))
    compiled = torch.compile(reference, dynamic=True)
    ids = torch.randint(0, reference.config.vocab_size, (1, PROMPT))
    token = torch.tensor([[7]])
    models = {"reference": reference, "fused": fast, "compiled": compiled}
    caches = {}
    with torch.inference_mode():
        for key, model in models.items():
            caches[key] = reference.make_cache(1, ROOM)
            model(ids, cache=caches[key], logits_to_keep=1)
        start = time.perf_counter()
        _step(compiled, token, caches["compiled"])
        _step(compiled, token, caches["compiled"])
        compile_s = time.perf_counter() - start
        times = {key: [] for key in models}
        for _ in range(3):  # warm-up
            for key, model in models.items():
                _step(model, token, caches[key])
        for _ in range(repeats):
            for key, model in models.items():
                start = time.perf_counter()
                _step(model, token, caches[key])
                times[key].append(1e3 * (time.perf_counter() - start))
    return times["reference"], times["fused"], times["compiled"], compile_s


def _step(model, token: torch.Tensor, cache) -> None:
    if cache.length >= ROOM - 1:  # keep the position in range: rewind to the prompt
        cache.truncate(PROMPT)
    model(token, cache=cache, logits_to_keep=1)


def _fmt(values: list[float]) -> str:
    median = statistics.median(values)
    return f"{median:.2f} (±{(max(values) - min(values)) / median:.0%})"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
