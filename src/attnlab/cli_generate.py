"""``attnlab generate``: stream text from a Hugging Face-format Qwen2/Llama checkpoint folder.

    attnlab generate --model DIR --prompt "Once upon a time" [--chat] [--max-new-tokens 64]
                     [--do-sample --temperature 0.7 --top-k 50 --top-p 0.9 --seed 0]

The text goes to stdout token by token; a summary (prompt tokens, prefill time, new tokens
and decode tokens/s) goes to stderr at the end.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from attnlab.generation import generate
from attnlab.models.hf_loading import SUPPORTED_DTYPES
from attnlab.models.qwen2 import Qwen2ForCausalLM
from attnlab.tokenizer import TextStreamer, Tokenizer

__all__ = ["add_commands", "run_generate"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``generate`` on the top-level sub-parsers."""
    p = sub.add_parser("generate", help="stream text from a Qwen2/Llama checkpoint folder")
    p.add_argument("--model", required=True, help="folder with config.json, model.safetensors "
                   "(or a sharded index), tokenizer.json and tokenizer_config.json")
    p.add_argument("--prompt", required=True, help="the prompt (the user message with --chat)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--system", default=None, help="a system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(SUPPORTED_DTYPES), default=None,
                   help="weights dtype (default: the checkpoint's)")
    p.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Load, render the prompt, generate with a ``TextStreamer`` and print the summary."""
    tokenizer = Tokenizer.from_pretrained(args.model)
    model = Qwen2ForCausalLM.from_pretrained(args.model, dtype=args.dtype)
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system is not None:
            messages.insert(0, {"role": "system", "content": args.system})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    else:
        ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ValueError(f"--prompt: expected text that encodes to >= 1 token, got "
                         f"{args.prompt!r}")
    eos = tokenizer.eos_token_id
    if eos is None and model.config.eos_token_id:
        eos = model.config.eos_token_id[0]
    streamer = _TimedStreamer(tokenizer)
    start = time.perf_counter()
    generate(model, torch.tensor([ids]), args.max_new_tokens, do_sample=args.do_sample,
             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
             repetition_penalty=args.repetition_penalty, eos_token_id=eos, seed=args.seed,
             streamer=streamer)
    end = time.perf_counter()
    first = streamer.first_time or end
    n = streamer.count
    decode_rate = (n - 1) / (end - first) if n > 1 and end > first else float("nan")
    print(file=sys.stdout, flush=True)
    print(f"[{len(ids)} prompt tokens, prefill {1e3 * (first - start):.0f} ms; {n} new tokens "
          f"in {end - start:.2f} s, decode {decode_rate:.1f} tokens/s; "
          f"{str(model.embed_tokens.weight.dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads]", file=sys.stderr)
    return 0


class _TimedStreamer(TextStreamer):
    """A ``TextStreamer`` that also records when the first token arrived (end of prefill)."""

    first_time: float | None = None

    def put(self, token_ids: torch.Tensor) -> None:
        if self.first_time is None:
            self.first_time = time.perf_counter()
        super().put(token_ids)
