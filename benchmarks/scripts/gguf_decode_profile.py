"""Where one batch-1 decode step of a GGUF file goes in attnlab: the layers' native step, the
Python around it, the LM head, and ``generate``'s own loop. For issue 42, point 5: what bounds
attnlab's decode where ``python -m devbench llamacpp`` finds it slower than llama.cpp.

    python benchmarks/scripts/gguf_decode_profile.py FILE.gguf [--threads 1] [--steps 64]

The file is loaded as ``attnlab.models.from_pretrained`` loads it. After a 16-token prompt,
``--steps`` one-token steps (``model(token, cache=...)`` and the argmax), the cache rewound
each round, ``--rounds`` rounds after one warm-up; the medians of the rounds, in microseconds
a step:

- ``native``: ``native.decode_layers`` (every block's kernels in one C++ call);
- ``python around``: ``fused_layers`` minus ``native`` (the step plan's Python);
- ``lm head``: the output projection (``V x E``, the largest single weight of a small model);
- ``rest of forward``: the step minus the three (embedding, final norm, RoPE tables, the
  model's Python);
- ``generate loop``: ``generate``'s time per token minus the bare step (its processors,
  bookkeeping and stopping checks).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from step_overhead import timed  # this folder's scripts: run as python benchmarks/scripts/...

from attnlab.generation import generate
from attnlab.kernels import fused_layers as fused_module
from attnlab.kernels import native
from attnlab.models import from_pretrained
from attnlab.threads import use_threads

PROMPT = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    use_threads(args.threads)
    model = from_pretrained(args.file)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT),
                        generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        per_token = _generate_us(model, ids, args.steps, args.rounds)
        inside = timed(native, "decode_layers")
        outside = timed(fused_module, "fused_layers")
        head = timed(model.lm_head, "forward")
        cache = model.make_cache(1, PROMPT + args.steps + 1)
        model(ids, cache=cache, logits_to_keep=1)
        parts: dict[str, list[float]] = {k: [] for k in ("step", "native", "python around",
                                                         "lm head")}
        for round_ in range(args.rounds + 1):  # the first round warms up
            cache.truncate(PROMPT)
            token = ids[:, -1:]
            inside[0] = outside[0] = head[0] = 0.0
            start = time.perf_counter()
            for _ in range(args.steps):
                token = model(token, cache=cache, logits_to_keep=1)[:, -1].argmax(-1, True)
            elapsed = time.perf_counter() - start
            if round_:
                for key, seconds in (("step", elapsed), ("native", inside[0]),
                                     ("python around", outside[0] - inside[0]),
                                     ("lm head", head[0])):
                    parts[key].append(1e6 * seconds / args.steps)
    us = {k: statistics.median(v) for k, v in parts.items()}
    us["rest of forward"] = us["step"] - us["native"] - us["python around"] - us["lm head"]
    us["generate loop"] = per_token - us["step"]
    print(f"{args.file.name}: {args.threads} thread(s), generate {1e6 / per_token:.1f} tok/s "
          f"({per_token:.0f} us a token), bare step {us['step']:.0f} us")
    for key in ("native", "python around", "lm head", "rest of forward", "generate loop"):
        print(f"  {key:16s} {us[key]:8.0f} us  {us[key] / per_token:6.1%}")


def _generate_us(model: torch.nn.Module, ids: torch.Tensor, steps: int, rounds: int) -> float:
    """Median microseconds a token of ``generate``, ``(t(n) - t(1)) / (n - 1)``."""
    generate(model, ids, 2)  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        generate(model, ids, 1)
        one = time.perf_counter() - start
        start = time.perf_counter()
        generate(model, ids, steps + 1)
        times.append(1e6 * (time.perf_counter() - start - one) / steps)
    return statistics.median(times)


if __name__ == "__main__":
    main()
