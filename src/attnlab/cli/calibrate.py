"""``attnlab calibrate FOLDER``: measure the kernels for a model's weight shapes on this
machine and write the plan into the kernel cache, which ``from_pretrained`` then uses.

A load never times kernels: it runs the fixed rule (``attnlab.kernels.rule``) unless the cache
(``$ATTNLAB_CACHE_DIR/kernels.json``) holds a measured plan for the exact key (CPU, torch,
threads, native build, dtype, shape, rows bucket, bias; the scheme for int8/int4). This
command is how a plan gets there: for each weight shape of FOLDER's model (loaded with
``--dtype`` and ``--quantize`` as ``from_pretrained`` will load it), every candidate kernel
is timed at each bucket's representative row count, on copies of a random weight that exceed
the caches. A measured plan picks the fastest kernel per bucket, which may differ from one
bucket to the next (the rule keeps one batch-invariant kernel for 1-32 rows where it can).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from attnlab.arg_types import positive_int
from attnlab.cli import add_command
from attnlab.cli.options import add_dtype_option, add_model_option, model_and_out
from attnlab.kernels import calibration
from attnlab.kernels.cache import cache_file
from attnlab.models.io import from_pretrained
from attnlab.quantization import QuantizedLinear
from attnlab.quantization import kernels as quantized_kernels
from attnlab.quantization.convert import DEFAULT_GROUP_SIZE

__all__ = ["add_commands", "calibrate"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``calibrate`` on the top-level sub-parsers."""
    p = add_command(sub, "calibrate", __doc__)
    add_model_option(p, "checkpoint folder (any that `attnlab generate` reads)", required=False)
    p.add_argument("paths", nargs="*", metavar="FOLDER", help="the older spelling of --model")
    add_dtype_option(p, "the dtype the model will be loaded in (default: the stored one)")
    p.add_argument("--quantize", choices=("int8", "int4"), default=None,
                   help="measure for from_pretrained(..., quantize=...) with this scheme")
    p.add_argument("--group-size", type=int, default=None,
                   help=f"int4 group size (default {DEFAULT_GROUP_SIZE})")
    p.add_argument("--extra-memory", action="store_true",
                   help="also time oneDNN's packed copies (for loads with extra_memory=True)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads to measure with; a plan is kept per thread count "
                   "(default torch's)")
    p.set_defaults(handler=_calibrate)


def calibrate(model: nn.Module, *, extra_memory: bool = False) -> int:
    """Measure the kernels of every ``nn.Linear`` (or its ``InferenceLinear``) and
    ``QuantizedLinear`` of ``model`` on the CPU for the dtype it holds, writing the timings
    into the kernel cache; the shapes already measured are read back, not timed again.
    -> the number of distinct weights (dtype, shape, bias, scheme) measured."""
    seen = set()
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.is_cpu:
            w = module.weight
            key = (w.dtype, *w.shape, module.bias is not None)
            if key not in seen:
                seen.add(key)
                calibration.plan(w.dtype, module.out_features, module.in_features,
                                 extra_memory=extra_memory, bias=module.bias is not None,
                                 measure_now=True)
        elif isinstance(module, QuantizedLinear) and module.qweight.is_cpu:
            weight = module.weight_format
            # the activations' dtype (float16 scales serve float32 ones)
            dtype = torch.float32 if module.dtype == torch.float16 else module.dtype
            key = (weight.bits, weight.group_size, weight.coded, dtype, *weight.shape,
                   module.bias is not None)
            if key not in seen:
                seen.add(key)
                quantized_kernels.plan(weight, dtype, bias=module.bias is not None,
                                       measure_now=True)
    return len(seen)


def _calibrate(args: argparse.Namespace) -> int:
    model_and_out(args, with_out=False)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = from_pretrained(args.model, dtype=args.dtype, kernels=False,
                            quantize=args.quantize, group_size=args.group_size)
    print(f"attnlab calibrate: timing every kernel for each weight shape of {args.model} on "
          f"{torch.get_num_threads()} threads (seconds to minutes a shape) ...",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    count = calibrate(model, extra_memory=args.extra_memory)
    print(f"attnlab calibrate: {count} weight shapes measured in "
          f"{time.perf_counter() - start:.0f} s; the plan is in {cache_file()}")
    return 0
