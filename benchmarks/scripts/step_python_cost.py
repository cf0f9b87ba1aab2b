"""The Python cost of one call of ``attnlab.kernels.fused_layers.fused_layers`` alone: the
native step replaced by a stub that returns a ready tensor, on a model 64 wide with
``--layers`` Qwen2 blocks (so that only the per-block work in Python counts). For issue 38,
point 4 (the typed step plan); run it on two checkouts in turns to compare them.

    python benchmarks/scripts/step_python_cost.py [--layers 24]

Prints the minimum and the median over 30 repeats of 200 calls, in microseconds a call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnlab.kernels import fused_layers as fused_module
from attnlab.kernels import native, optimize_for_inference
from attnlab.models import DecoderLM
from attnlab.models.families import family_for

PROMPT = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = family_for("qwen2").config_from_hf({
        "model_type": "qwen2", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": args.layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 4096})
    model = optimize_for_inference(DecoderLM(config).eval(), kernel="native_gemv")
    cache = model.make_cache(1, PROMPT + 201)
    out = torch.zeros(1, 64)
    native.decode_layers = lambda *args: out  # the stub: no C++ step
    x, rotary = torch.randn(1, 1, 64), (torch.randn(1, 1, 16), torch.randn(1, 1, 16))
    times = []
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        for _ in range(30):
            cache.truncate(PROMPT)
            start = time.perf_counter()
            for _ in range(200):
                fused_module.fused_layers(model.layers, model.layers.block_type, x, rotary, None,
                                          cache)
            times.append(1e6 * (time.perf_counter() - start) / 200)
    print(f"layers={args.layers} python us a step: min {min(times):.1f} "
          f"median {statistics.median(times):.1f}")


if __name__ == "__main__":
    main()
