"""The one-call decoding step (``attnlab.kernels.fused_layers``): bit-equal to the modules'
forward on every family, dtype and weight kind it takes, and not taken where the modules
must run (hooks, gradients, another backend, a cache it does not know)."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention.kv_cache import KVCache
from attnlab.kernels import fused_layers as fused_module
from attnlab.kernels import native, optimize_for_inference
from attnlab.models.decoder import DecoderLM
from attnlab.models.families import family_for
from conftest import native_lacks

# Built by `attnlab build` before the session (conftest), else these tests skip saying so.
pytestmark = pytest.mark.usefixtures("native_kernels")

SIZES = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 64}
# Each family's own parts: biases (qwen2, gpt2), q/k norms (qwen3), 1 + w norms and GeGLU
# (gemma), LayerNorm, learned positions and a plain GELU MLP (gpt2), partial RoPE and a
# sliding window shorter than the sequence (phi3, mistral), llama3 RoPE scaling (llama).
FAMILIES = {
    "llama": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16}},
    "mistral": {"sliding_window": 6},
    "qwen2": {},
    "qwen3": {},
    "gemma": {},
    "gpt2": {},
    "phi3": {"partial_rotary_factor": 0.5, "sliding_window": 7},
}


def model_of(model_type: str, dtype: torch.dtype, weights: str) -> DecoderLM:
    torch.manual_seed(0)
    # PyTorch's int4 op takes weights of whole 64-row blocks: 4 key/value heads of 16.
    heads = {"num_key_value_heads": 4} if weights == "int4:int4_mm" else {}
    config = family_for(model_type).config_from_hf(
        {"model_type": model_type, **SIZES, **heads, **FAMILIES[model_type]})
    model = DecoderLM(config).to(dtype).eval()
    if ":" not in weights:
        return optimize_for_inference(model, kernel=weights)
    bits, kernel = weights.split(":")
    # int4 in groups of 32 (the smallest), of 64 for the integer products (the smallest they take)
    group = (64 if kernel == "int4_integers" else 32) if bits == "int4" else None
    return optimize_for_inference(model.quantize(bits, group, kernel=kernel))


def counted(monkeypatch) -> list[int]:
    calls = [0]
    real = native.decode_layers

    def counting(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(native, "decode_layers", counting)
    return calls


def decode(model: DecoderLM, steps: int = 6) -> tuple[list[torch.Tensor], KVCache]:
    """A left-padded batch of 3 prompts, then ``steps`` greedy steps one token at a time;
    the logits of every step and the cache."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (3, 9), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :4] = False
    mask[2, :2] = False
    cache = model.make_cache(3, 9 + steps)
    out = []
    with torch.inference_mode():
        logits = model(ids, mask, cache=cache)[:, -1]
        out.append(logits)
        for _ in range(steps):
            ids = logits.argmax(-1, keepdim=True)
            mask = torch.cat((mask, torch.ones_like(ids, dtype=torch.bool)), 1)
            logits = model(ids, mask, cache=cache)[:, -1]
            out.append(logits)
    return out, cache


# The kernels that decode_layers runs itself, and some that it calls back in Python.
WEIGHTS = ["native_gemv", "native_pairs", "native_tiles", "formula", "int8:int8_native",
           "int8:int8_tiles", "int8:int8_integers", "int8:int8_mm", "int4:int4_native",
           "int4:int4_native_pairs", "int4:int4_integers", "int4:int4_mm",
           "rows_gemv", "onednn", "int8:dequantize", "int4:native_dequantize"]


# The kernels that take bfloat16 activations only (a float32 model runs others: the catalogs'
# own tests check that they refuse float32), by the native loop that they need.
BFLOAT16_ONLY = {"native_pairs": "pairs", "int4:int4_native_pairs": "pairs",
                 "native_tiles": "tiles", "int8:int8_tiles": "tiles",
                 "int8:int8_integers": "integers", "int4:int4_integers": "integers"}


def _cases() -> list:
    """(model_type, dtype, weights) for every family, dtype and weight kind that runs here:
    a bfloat16-only kernel in bfloat16 alone; one whose loop this machine lacks as one case,
    skipped saying what it lacks."""
    cases = []
    for weights in WEIGHTS:
        loop = BFLOAT16_ONLY.get(weights)
        missing = native_lacks(loop) if loop else None
        if missing is not None:
            cases.append(pytest.param("llama", torch.bfloat16, weights,
                                      marks=pytest.mark.skip(reason=missing)))
            continue
        dtypes = [torch.bfloat16] if loop else [torch.float32, torch.bfloat16]
        cases += [(m, d, weights) for d in dtypes for m in FAMILIES]
    return cases


@pytest.mark.parametrize(("model_type", "dtype", "weights"), _cases(), ids=str)
def test_fused_step_equals_the_modules_bit_for_bit(monkeypatch, model_type, dtype,
                                                   weights) -> None:
    model = model_of(model_type, dtype, weights)
    calls = counted(monkeypatch)
    fused, fused_cache = decode(model)
    assert calls[0] == 6  # every one-token step, not the prompt
    monkeypatch.setattr(fused_module, "fused_layers", lambda *args: None)
    plain, plain_cache = decode(model)
    assert calls[0] == 6
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    for a, b in zip(fused_cache.layers, plain_cache.layers):
        assert a.length == b.length == 15
        assert torch.equal(a.k[:, :, :15], b.k[:, :, :15])
        assert torch.equal(a.v[:, :, :15], b.v[:, :, :15])


# mistral: a window of 6 < 13 positions; blocks_gemv: one row over the threads, called back.
@pytest.mark.parametrize(("model_type", "dtype", "weights", "rows"), [
    ("qwen2", torch.bfloat16, "native_gemv", 2), ("mistral", torch.bfloat16, "native_gemv", 2),
    ("llama", torch.float32, "blocks_gemv", 1)])
def test_generate_takes_the_fused_step_and_gives_the_same_tokens(monkeypatch, model_type, dtype,
                                                                  weights, rows) -> None:
    model = model_of(model_type, dtype, weights)
    ids = torch.randint(3, 96, (rows, 5), generator=torch.Generator().manual_seed(2))
    calls = counted(monkeypatch)
    fused = model.generate(ids, 8)
    assert calls[0] == 7
    monkeypatch.setattr(fused_module, "fused_layers", lambda *args: None)
    assert torch.equal(fused, model.generate(ids, 8))


def test_a_hook_sees_its_call_instead(monkeypatch) -> None:
    model = model_of("llama", torch.float32, "native_gemv")
    calls = counted(monkeypatch)
    seen = []
    handle = model.layers[1].mlp_out.register_forward_hook(lambda m, i, o: seen.append(o))
    hooked, _ = decode(model, steps=3)
    assert calls[0] == 0 and len(seen) == 4
    handle.remove()
    plain, _ = decode(model, steps=3)
    assert calls[0] == 3
    assert all(torch.equal(a, b) for a, b in zip(hooked, plain))
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        decode(model, steps=2)
    finally:
        handle.remove()
    assert calls[0] == 3


def test_not_taken_with_gradients_another_backend_or_kernel(monkeypatch) -> None:
    model = model_of("qwen2", torch.float32, "native_gemv")
    calls = counted(monkeypatch)
    ids = torch.randint(3, 96, (1, 4))
    cache = model.make_cache(1, 8)
    model(ids, cache=cache)  # gradients on: the modules (and autograd) run
    logits = model(ids[:, :1], cache=cache)
    assert calls[0] == 0 and logits.requires_grad
    model.layers[0].self_attn.backend = "math"
    decode(model, steps=2)
    assert calls[0] == 0
    model.layers[0].self_attn.backend = "auto"
    model.layers[1].self_attn.train()  # its dropout (p = 0 here) would be the modules' to run
    decode(model, steps=2)
    assert calls[0] == 0
    model.layers[1].self_attn.eval()
    model.layers[1].mlp.down_proj = torch.nn.Linear(128, 64).eval()  # the formula's module
    decode(model, steps=2)
    assert calls[0] == 0


def test_a_full_cache_is_refused_as_the_modules_refuse_it() -> None:
    model = model_of("qwen2", torch.float32, "native_gemv")
    cache = model.make_cache(1, 3)
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7]]), cache=cache)
        with pytest.raises(ValueError, match="cannot take 1 more"):
            model(torch.tensor([[8]]), cache=cache)
    assert cache.length == 3


def test_a_growing_cache_grows() -> None:
    model = model_of("qwen2", torch.float32, "native_gemv")
    cache = model.make_cache(1, 3, grow=True)
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7]]), cache=cache)
        model(torch.tensor([[8]]), cache=cache)
    assert cache.length == 4 and cache.max_len == 6


def test_a_cache_of_another_shape_gets_the_modules_error(monkeypatch) -> None:
    model = model_of("qwen2", torch.float32, "native_gemv")
    calls = counted(monkeypatch)
    cache = KVCache(2, 1, 1, 8, 16)  # 1 key/value head where the model has 2
    with torch.inference_mode(), pytest.raises(ValueError, match="expected shape B x G x L"):
        model(torch.tensor([[5]]), cache=cache)
    assert calls[0] == 0 and cache.length == 0

