"""The one-call decoding step's cost outside C++: decode tokens per second of a Qwen2-shaped
model through ``FusedDecoderLayers``, and the time per step spent in Python around the native
call (``fused_layers`` minus ``native.decode_layers``). For issue 38, point 4 (the typed step
plan); run it on two checkouts in turns to compare them.

    python benchmarks/scripts/step_overhead.py [--layers 4] [--dtype bfloat16] [--steps 48]

Random weights in the shape of Qwen2.5-0.5B with ``--layers`` blocks, batch 1, a prompt of 16
tokens, then ``--steps`` one-token steps (the cache rewound to the prompt each round), timed
``--rounds`` times. Prints one line: tokens per second (the median round), the per-step
Python overhead in microseconds (the median round) and the spread of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnlab.kernels import fused_layers as fused_module
from attnlab.kernels import native, optimize_for_inference
from attnlab.models import DecoderLM, preset

PROMPT = 16


def timed(owner: object, name: str) -> list[float]:
    """Replace ``owner.name`` by a wrapper adding its seconds into the returned one-item list."""
    total, real = [0.0], getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start

    setattr(owner, name, wrapper)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DecoderLM(preset("qwen2.5-0.5b", num_hidden_layers=args.layers))
    model = optimize_for_inference(model.to(getattr(torch, args.dtype)).eval())
    inside = timed(native, "decode_layers")
    outside = timed(fused_module, "fused_layers")
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT),
                        generator=torch.Generator().manual_seed(1))
    cache = model.make_cache(1, PROMPT + args.steps + 1)
    rates, overheads = [], []
    with torch.inference_mode():
        model(ids, cache=cache, logits_to_keep=1)
        for round_ in range(args.rounds + 1):  # the first round warms up
            cache.truncate(PROMPT)
            token = ids[:, -1:]
            inside[0] = outside[0] = 0.0
            start = time.perf_counter()
            for _ in range(args.steps):
                token = model(token, cache=cache, logits_to_keep=1)[:, -1].argmax(-1, True)
            elapsed = time.perf_counter() - start
            if round_:
                rates.append(args.steps / elapsed)
                overheads.append(1e6 * (outside[0] - inside[0]) / args.steps)
    rate, overhead = statistics.median(rates), statistics.median(overheads)
    print(f"layers={args.layers} dtype={args.dtype} tok/s={rate:.2f} "
          f"(spread {(max(rates) - min(rates)) / rate:.0%}) python_us_per_step={overhead:.1f} "
          f"(spread {(max(overheads) - min(overheads)) / overhead:.0%})")


if __name__ == "__main__":
    main()
