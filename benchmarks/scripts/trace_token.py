"""The attnlab files that one served token and one ``generate()`` step cross, in order (issue
39: "about half of today's", in one direction).

    python benchmarks/scripts/trace_token.py [--model FOLDER] [--family qwen2] [--dtype float32]

Loads ``--model`` (or a tiny random Llama/Qwen2 folder written to a temporary folder) with
``DecoderLM.from_pretrained``, which installs the fast modules, warms up, then traces with
``sys.setprofile`` exactly one decode step of ``serving.Engine`` (one request, decoding) and one
KV-cached decode step of ``generation.generate`` (from the entry of its first decode forward to
the entry of its second: the model's step, then the loop's sampling and bookkeeping). Prints,
for each, the attnlab source files entered (first-entry order, paths below ``src/attnlab``),
their count, the files re-entered and the native (C++) entry points called.

One direction: no file is entered again (called from another file) while it is still running
higher up the stack, i.e. the path never goes down from a file and comes back up into it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import torch

import attnlab
from attnlab.generation import generate
from attnlab.kernels import native
from attnlab.models import DecoderLM, save_pretrained
from attnlab.models.families import FAMILIES
from attnlab.serving import Engine, SamplingParams

PACKAGE = Path(attnlab.__file__).resolve().parent
PROMPT, WARM = 12, 3


@dataclass
class Trace:
    """One traced step: the ``files`` entered, in first-entry order; the ``reentered``
    crossings (caller, callee: a file entered again from below while it is still running
    higher up the stack); every distinct crossing (``caller file:function -> callee
    file:function``, first-call order); the ``native`` entry points called (first-call
    order)."""

    files: list[str] = field(default_factory=list)
    reentered: list[tuple[str, str]] = field(default_factory=list)
    crossings: list[str] = field(default_factory=list)
    native: list[str] = field(default_factory=list)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint folder (default: a tiny "
                        "random one of --family)")
    parser.add_argument("--family", choices=("qwen2", "llama"), default="qwen2")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--crossings", action="store_true",
                        help="also print every distinct call from one file into another")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.model or tiny_folder(Path(scratch), args.family)
        model = DecoderLM.from_pretrained(folder, dtype=args.dtype)
    for name, trace in (("served token (Engine.step, one request decoding)",
                         trace_engine(model)),
                        ("generate() step (KV-cached)", trace_generate(model))):
        print(f"{name}: {len(trace.files)} files")
        print("  " + " -> ".join(trace.files))
        print(f"  re-entered: {sorted(set(trace.reentered)) or 'none'}")
        print(f"  native entry points: {', '.join(trace.native) or 'none'}")
        if args.crossings:
            print("\n".join(f"    {crossing}" for crossing in trace.crossings))


def tiny_folder(folder: Path, family: str) -> Path:
    """A tiny random ``family`` model (2 layers, GQA 4/2 heads) saved in ``folder``."""
    config = FAMILIES[family].config_from_hf(
        {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "initializer_range": 0.2})
    torch.manual_seed(0)
    save_pretrained(DecoderLM(config), folder)
    return folder


def trace_engine(model: DecoderLM) -> Trace:
    """One ``Engine.step`` with one request decoding (its prefill and ``WARM`` tokens done)."""
    engine = Engine(model, max_batch=2, page_size=8)
    engine.add_request(_prompt(model), SamplingParams(max_tokens=WARM + 4, temperature=0.0))
    while engine.stats()["tokens_generated"] < WARM:
        engine.step()
    return traced(engine.step)


def trace_generate(model: DecoderLM) -> Trace:
    """One decode step of ``generate`` (greedy, KV-cached): from its first decode forward's
    entry to its second's, after a whole warm-up call."""
    ids = torch.tensor([_prompt(model)])
    generate(model, ids, WARM)
    forward = type(model).forward.__code__
    calls = [0]

    def window(frame: FrameType) -> bool | None:
        # True from the second forward (the first decode) to the third; None: stop tracing
        if frame.f_code is forward:
            calls[0] += 1
        return None if calls[0] > 2 else calls[0] == 2

    return traced(lambda: generate(model, ids, WARM), window)


def traced(step, window=None) -> Trace:
    """Run ``step()`` under ``sys.setprofile``; record the attnlab files it enters (within
    ``window(frame)``'s True span, checked at each call; all of it without one)."""
    trace, extension = Trace(), native._extension()
    extension = None if extension is None else extension.__name__
    on = [window is None]

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            if window is not None:
                state = window(frame)
                if state is None:
                    sys.setprofile(None)
                    return
                if state and not on[0]:  # the driver: the file the window opens from
                    on[0] = True
                    caller = _caller(frame.f_back)
                    if caller is not None:
                        trace.files.append(_name(caller))
            if not on[0]:
                return
            name = _file(frame)
            if name is None:
                return
            if name not in trace.files:
                trace.files.append(name)
            caller = _caller(frame.f_back)
            if caller is None or _name(caller) == name:
                return
            crossing = (f"{_name(caller)}:{caller.f_code.co_name} -> "
                        f"{name}:{frame.f_code.co_name}")
            if crossing not in trace.crossings:
                trace.crossings.append(crossing)
            if _active(name, caller.f_back):
                trace.reentered.append((_name(caller), name))
        elif (event == "c_call" and on[0] and _native(arg, extension)
              and arg.__name__ not in trace.native):
            trace.native.append(arg.__name__)

    sys.setprofile(profile)
    try:
        with torch.inference_mode():
            step()
    finally:
        sys.setprofile(None)
    return trace


def _prompt(model: DecoderLM) -> list[int]:
    return [(7 * i + 3) % model.config.vocab_size for i in range(PROMPT)]


def _file(frame: FrameType) -> str | None:
    """``frame``'s file below the attnlab package (``serving/engine``), or None outside it."""
    path = Path(frame.f_code.co_filename)
    if path.suffix != ".py" or PACKAGE not in path.parents:
        return None
    return path.relative_to(PACKAGE).with_suffix("").as_posix()


def _active(name: str, frame: FrameType | None) -> bool:
    """Whether a frame from ``frame`` outwards runs the attnlab file ``name``."""
    while frame is not None:
        if _file(frame) == name:
            return True
        frame = frame.f_back
    return False


def _native(function: object, extension: str | None) -> bool:
    """Whether ``function`` (a builtin) belongs to the native extension named ``extension``:
    one of its functions, or a method of one of its classes."""
    owner = getattr(function, "__self__", None)
    return extension is not None and extension in (getattr(function, "__module__", None),
                                                   type(owner).__module__)


def _caller(frame: FrameType | None) -> FrameType | None:
    """The nearest frame from ``frame`` outwards that runs attnlab code."""
    while frame is not None and _file(frame) is None:
        frame = frame.f_back
    return frame


def _name(frame: FrameType) -> str:
    name = _file(frame)
    assert name is not None
    return name


if __name__ == "__main__":
    main()
