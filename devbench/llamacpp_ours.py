"""The attnlab side of ``python -m devbench llamacpp``: one measure in a fresh process.

``python -m devbench.llamacpp_ours TASK_JSON`` prints one JSON object (the result) as its last
line. The GGUF file is loaded as ``attnlab.models.from_pretrained`` loads it (its blocks kept
quantized, the inference kernels installed); the tasks are ``devbench.llamacpp_theirs``'s, on
the same token ids and with the same formulas:

- ``speed``: decode tokens/s ``(n - 1) / (t(n) - t(1))``, ``t(k)`` the time of ``generate``
  making ``k`` greedy tokens after the prompt (so its prefill cancels out); prefill tokens/s of
  one forward pass over the long prompt with a cache, the last position's logits only (what
  generation needs); each timed once after a warm-up. Resident memory right after ``import
  torch`` (``VmRSS``) and at the end (``VmHWM``, the peak), from ``/proc/self/status``;
- ``logprobs``: ``log_softmax`` (float32) of the logits at every position of each chunk of
  ids, one forward pass per chunk, written to a ``.npy`` file ``T x V``.
"""

import json
import sys
import time

import torch


def _status_kib(field: str) -> int:
    """``field`` of ``/proc/self/status`` in KiB (``devbench.llamacpp_theirs`` has its own: it
    runs where attnlab is not installed)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


AFTER_TORCH_KIB = _status_kib("VmRSS")  # before attnlab's own imports: torch alone

import numpy as np  # noqa: E402

from attnlab.generation import generate  # noqa: E402
from attnlab.models import from_pretrained  # noqa: E402
from attnlab.threads import use_threads  # noqa: E402


def main() -> None:
    task = json.loads(sys.argv[1])
    use_threads(task["threads"])
    with torch.inference_mode():
        model = from_pretrained(task["file"])
        result = {"speed": _speed, "logprobs": _logprobs}[task["task"]](model, task)
    print(json.dumps({**result, "after_import_kib": AFTER_TORCH_KIB}))


def _speed(model: torch.nn.Module, task: dict) -> dict:
    prompt = torch.tensor([task["prompt"]])
    long = torch.tensor([task["prefill"]])
    n = task["new_tokens"]

    def prefill() -> object:
        return model(long, logits_to_keep=1, cache=model.make_cache(1, long.shape[1]))

    generate(model, prompt, 2)  # warm-up
    t1 = _seconds(lambda: generate(model, prompt, 1))
    start = time.perf_counter()
    tokens = generate(model, prompt, n)[0, prompt.shape[1]:].tolist()
    tn = time.perf_counter() - start
    prefill()  # warm-up
    tp = _seconds(prefill)
    return {"decode_tps": (n - 1) / (tn - t1), "prefill_tps": long.shape[1] / tp,
            "tokens": tokens, "peak_kib": _status_kib("VmHWM")}


def _logprobs(model: torch.nn.Module, task: dict) -> dict:
    chunks = task["chunks"]
    rows = sum(len(c) for c in chunks)
    out, row = None, 0
    for chunk in chunks:
        logits = model(torch.tensor([chunk]))[0].float()
        if out is None:
            out = np.lib.format.open_memmap(task["out"], mode="w+", dtype=np.float32,
                                            shape=(rows, logits.shape[-1]))
        out[row:row + len(chunk)] = torch.log_softmax(logits, dim=-1).numpy()
        row += len(chunk)
    out.flush()
    return {"rows": rows, "peak_kib": _status_kib("VmHWM")}


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
