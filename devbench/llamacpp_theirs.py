"""The llama.cpp side of ``python -m devbench llamacpp``: one measure in a fresh process.

Run by the Python of the environment where ``llama-cpp-python`` is installed (``--llama-python``),
so it imports nothing but the standard library, ``numpy`` and ``llama_cpp``; it takes one JSON
object (the task) as its argument and prints one JSON object (the result) as its last line:

- ``speed``: batch-1 greedy decode and prefill, as ``devbench.llamacpp_ours`` measures them
  (the same token ids, the same formulas): decode tokens/s ``(n - 1) / (t(n) - t(1))``, ``t(k)``
  the time of ``k`` new tokens after the prompt (the prompt's evaluation cancels out); prefill
  tokens/s of one ``llama_decode`` of the whole prompt; each timed once after a warm-up. The
  resident memory after importing ``llama_cpp`` (``VmRSS``) and at the end (``VmHWM``, the peak)
  come from ``/proc/self/status``;
- ``logprobs``: ``log_softmax`` of the logits at every position of each chunk of ids (a fresh
  context per chunk, ``logits_all=True``), written to a float32 ``.npy`` file ``T x V``;
- ``quantize``: ``llama_model_quantize`` (llama.cpp's own quantizer) of one GGUF file into
  another of the given ``ftype`` (``Q4_K_M`` is 15).
"""

import ctypes
import json
import sys
import time

import llama_cpp
import numpy as np


def main() -> None:
    after_import_kib = _status_kib("VmRSS")
    task = json.loads(sys.argv[1])
    result = {"speed": _speed, "logprobs": _logprobs, "quantize": _quantize}[task["task"]](task)
    print(json.dumps({**result, "after_import_kib": after_import_kib}))


def _speed(task: dict) -> dict:
    prompt, long, n = task["prompt"], task["prefill"], task["new_tokens"]
    llm = _load(task, n_ctx=max(len(prompt) + n, len(long)) + 8, logits_all=False)

    vocab = llm.n_vocab()

    def greedy() -> int:
        # Without logits_all, Llama.eval keeps no logits: the last position's, from llama.cpp.
        last = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(last, shape=(vocab,))))

    def decode(count: int) -> list[int]:
        llm.reset()
        llm.eval(prompt)
        out = [greedy()]
        while len(out) < count:
            llm.eval(out[-1:])
            out.append(greedy())
        return out

    def prefill() -> None:
        llm.reset()
        llm.eval(long)

    decode(2)  # warm-up
    t1 = _seconds(lambda: decode(1))
    start = time.perf_counter()
    tokens = decode(n)
    tn = time.perf_counter() - start
    prefill()  # warm-up
    tp = _seconds(prefill)
    return {"decode_tps": (n - 1) / (tn - t1), "prefill_tps": len(long) / tp,
            "tokens": tokens, "peak_kib": _status_kib("VmHWM")}


def _logprobs(task: dict) -> dict:
    chunks = task["chunks"]
    context = max(len(c) for c in chunks)
    llm = _load(task, n_ctx=context, logits_all=True)
    rows = sum(len(c) for c in chunks)
    out = np.lib.format.open_memmap(task["out"], mode="w+", dtype=np.float32,
                                    shape=(rows, llm.n_vocab()))
    row = 0
    for chunk in chunks:
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[:len(chunk)], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logits -= np.log(np.exp(logits).sum(axis=1, keepdims=True))
        out[row:row + len(chunk)] = logits
        row += len(chunk)
    out.flush()
    return {"rows": rows, "peak_kib": _status_kib("VmHWM")}


def _quantize(task: dict) -> dict:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = task["ftype"]
    params.nthread = task["threads"]
    code = llama_cpp.llama_model_quantize(task["source"].encode(), task["out"].encode(),
                                          ctypes.byref(params))
    return {"returned": int(code)}


def _load(task: dict, *, n_ctx: int, logits_all: bool) -> "llama_cpp.Llama":
    # n_batch = n_ubatch = the context: a prompt is one llama_decode, as attnlab's prefill is
    # one forward pass.
    return llama_cpp.Llama(model_path=task["file"], n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                           n_threads=task["threads"], n_threads_batch=task["threads"],
                           logits_all=logits_all, verbose=False)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


if __name__ == "__main__":
    main()
