"""The one-call decoding step (``attnlab.kernels.fused_layers``): bit-equal to the modules'
forward on every family, dtype and weight kind it takes, and not taken where the modules
must run (hooks, gradients, another backend, a cache it does not know)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import grouped_int8

from attnlab.attention.kv_cache import KVCache
from attnlab.kernels import fused_layers as fused_module
from attnlab.kernels import native, optimize_for_inference
from attnlab.models.decoder import DecoderLM
from attnlab.models.families import family_for
from attnlab.quantization import QuantizedLinear
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
    # every product on the kernel under test (int4's default keeps some layers in int8)
    model = model.quantize(bits, group, kernel=kernel, int8_layers=())
    if kernel == "int8_grouped":  # GGUF's Q5_1 kind: a scale and an offset per 32 inputs
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                module.set_weight(grouped_int8(module.dequantize(torch.float32), 32,
                                               offsets=True, scale_dtype=module.scales.dtype))
    return optimize_for_inference(model)


def count_calls(monkeypatch, owner: object, name: str) -> list[int]:
    """A one-item list counting the calls of ``owner.name`` from now on (patched through)."""
    calls = [0]
    real = getattr(owner, name)

    def counting(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(owner, name, counting)
    return calls


def counted(monkeypatch) -> list[int]:
    """How many times the native one-call step runs."""
    return count_calls(monkeypatch, native, "decode_layers")


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


# The kernels that a step plan runs (a StepKind each; "columns" is the formula on the
# column-major weight), and some that it does not: then no plan, the modules run.
WEIGHTS = ["native_gemv", "native_pairs", "native_tiles", "formula", "columns",
           "int8:int8_native", "int8:int8_tiles", "int8:int8_integers", "int8:int8_mm",
           "int4:int4_native", "int4:int4_native_pairs", "int4:int4_integers", "int4:int4_mm",
           "int8:int8_grouped", "rows_gemv", "onednn", "int8:dequantize", "int4:native_dequantize"]
NOT_IN_THE_STEP = {"rows_gemv", "onednn", "int8:dequantize", "int4:native_dequantize"}


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
    steps = 0 if weights in NOT_IN_THE_STEP else 6  # every one-token step, not the prompt
    assert calls[0] == steps
    monkeypatch.setattr(fused_module, "fused_layers", lambda *args: None)
    plain, plain_cache = decode(model)
    assert calls[0] == steps
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    for a, b in zip(fused_cache.layers, plain_cache.layers):
        assert a.length == b.length == 15
        assert torch.equal(a.k[:, :, :15], b.k[:, :, :15])
        assert torch.equal(a.v[:, :, :15], b.v[:, :, :15])


# mistral: a window of 6 < 13 positions.
@pytest.mark.parametrize(("model_type", "dtype", "weights", "rows"), [
    ("qwen2", torch.bfloat16, "native_gemv", 2), ("mistral", torch.bfloat16, "native_gemv", 2),
    ("llama", torch.float32, "formula", 1)])
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



def counted_builds(monkeypatch) -> list[int]:
    """How many times a layer list's step plan is built (or refused) from its modules."""
    return count_calls(monkeypatch, fused_module, "_build")


def modules_decode(monkeypatch, model: DecoderLM, steps: int) -> list[torch.Tensor]:
    """``decode`` through the blocks' modules (the one-call step refused)."""
    with monkeypatch.context() as patch:
        patch.setattr(fused_module, "fused_layers", lambda *args: None)
        return decode(model, steps)[0]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_plan_is_built_once_and_kept_across_steps_and_generations(monkeypatch) -> None:
    model = model_of("qwen2", torch.bfloat16, "native_gemv")
    builds, calls = counted_builds(monkeypatch), counted(monkeypatch)
    decode(model, steps=6)
    decode(model, steps=6)  # a new cache, the same rows and dtype
    assert calls[0] == 12 and builds[0] == 1
    ids = torch.randint(3, 96, (2, 4), generator=torch.Generator().manual_seed(3))
    model.generate(ids, 4)  # 2 rows: 3's rows bucket (2-8)
    assert builds[0] == 1 and calls[0] == 15
    model.generate(ids[:1], 4)  # 1 row: another bucket, whose kernels may differ
    model.generate(ids[1:], 4)
    assert builds[0] == 2 and calls[0] == 21


def test_a_hook_registered_or_removed_rebuilds_the_plan(monkeypatch) -> None:
    model = model_of("llama", torch.float32, "native_gemv")
    builds, calls = counted_builds(monkeypatch), counted(monkeypatch)
    want = modules_decode(monkeypatch, model, 3)
    assert same(decode(model, 3)[0], want) and builds[0] == 1 and calls[0] == 3
    seen = []
    handle = model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(1))
    assert same(decode(model, 3)[0], want)
    assert calls[0] == 3 and len(seen) == 4  # the prompt and every step through the modules
    assert builds[0] == 4  # a plan refused for a hook is not kept: each step looks again
    handle.remove()
    assert same(decode(model, 3)[0], want)
    assert calls[0] == 6 and builds[0] == 5 and len(seen) == 4


def test_a_replaced_module_or_parameter_rebuilds_the_plan(monkeypatch) -> None:
    model = model_of("qwen2", torch.float32, "native_gemv")
    torch.manual_seed(5)
    down = optimize_for_inference(torch.nn.Linear(128, 64), kernel="native_gemv")
    builds, calls = counted_builds(monkeypatch), counted(monkeypatch)
    decode(model, 2)
    assert builds[0] == 1
    model.layers[1].mlp.down_proj = down
    assert same(decode(model, 2)[0], modules_decode(monkeypatch, model, 2))
    assert builds[0] == 2 and calls[0] == 4
    norm = model.layers[0].post_attention_layernorm
    norm.weight = torch.nn.Parameter(torch.rand(64) + 0.5)
    got = decode(model, 2)[0]
    assert builds[0] == 3 and calls[0] == 6
    assert same(got, modules_decode(monkeypatch, model, 2))
    with torch.no_grad():
        norm.weight.mul_(2)  # in place: the plan holds this tensor, no rebuild
    assert same(decode(model, 2)[0], modules_decode(monkeypatch, model, 2))
    assert builds[0] == 3 and calls[0] == 8


def test_train_then_eval_runs_the_modules_then_the_plan_with_the_new_weights(monkeypatch) -> None:
    model = model_of("llama", torch.float32, "native_gemv")
    builds, calls = counted_builds(monkeypatch), counted(monkeypatch)
    decode(model, 2)
    model.train()
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(ids, labels=ids).loss.backward()
    optimizer.step()  # the weights change in place
    with torch.no_grad():
        cache = model.make_cache(2, 8)
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
    assert calls[0] == 2  # training mode: the modules
    model.eval()
    model.layers[1].self_attn.train()  # one part in training mode is enough
    decode(model, 2)
    assert calls[0] == 2
    model.layers[1].self_attn.eval()
    assert same(decode(model, 2)[0], modules_decode(monkeypatch, model, 2))
    assert calls[0] == 4 and builds[0] == 1  # the plan holds the Parameters themselves


def test_a_converted_model_rebuilds_its_stale_plan(monkeypatch) -> None:
    model = model_of("qwen2", torch.float32, "native_gemv")
    builds, calls = counted_builds(monkeypatch), counted(monkeypatch)
    decode(model, 2)
    model.to(torch.bfloat16)  # the same Parameters, new storage: the float32 plan is stale
    assert same(decode(model, 2)[0], modules_decode(monkeypatch, model, 2))
    assert builds[0] == 2 and calls[0] == 4  # a bfloat16 plan
    model.to(torch.float32)
    got = decode(model, 3)[0]
    # The stale float32 plan refuses its first step (the modules run it), the next rebuilds.
    assert builds[0] == 3 and calls[0] == 7
    assert same(got, modules_decode(monkeypatch, model, 3))


def test_restore_and_reinstall_rebuild_and_a_copy_keeps_no_plan(monkeypatch) -> None:
    import copy

    from attnlab.kernels import restore_reference

    model = model_of("qwen2", torch.float32, "native_gemv")
    builds = counted_builds(monkeypatch)
    decode(model, 2)
    clone = copy.deepcopy(model)  # the plan (C++ objects, this model's tensors) stays behind
    assert "_step_plans" in model.layers.__dict__
    assert "_step_plans" not in clone.layers.__dict__
    assert same(decode(clone, 2)[0], decode(model, 2)[0])
    assert builds[0] == 2
    restore_reference(model)
    assert "_step_plans" not in model.layers.__dict__
    optimize_for_inference(model, kernel="formula")
    assert same(decode(model, 2)[0], modules_decode(monkeypatch, model, 2))
    assert builds[0] == 3


def test_the_step_codes_come_from_the_extension() -> None:
    built = native._require()
    assert native.step_enum("StepKind") is built.StepKind
    assert native.step_kind("native_gemv") == built.StepKind.native_gemv
    assert native.step_kind("onednn") is None and native.step_kind("columns") is None
    assert set(built.NormKind.__members__) == {"rms", "rms_unit_offset", "layer_norm"}
    # The step's activations are attnlab.layers' names; the one-pass kernel's codes are theirs.
    from attnlab.layers import ACTIVATIONS

    assert set(built.Activation.__members__) <= set(ACTIVATIONS)
    assert set(native.ACTIVATIONS) <= set(built.Activation.__members__)
    for name in ("STEP_KINDS", "STEP_CALL"):
        assert not hasattr(native, name)
    assert not hasattr(fused_module, "_ACTIVATIONS")
    with pytest.raises(ValueError, match="name: expected one of"):
        native.step_enum("Kind")
    with pytest.raises(RuntimeError, match="s: expected the scales"):
        native.step_linear(built.StepKind.int8_native, torch.zeros(2, 2, dtype=torch.int8),
                           None, None, 0, None)


def test_quantizing_an_optimized_model_rebuilds_its_plan(monkeypatch) -> None:
    model = model_of("qwen2", torch.float32, "native_gemv")
    builds, calls = counted_builds(monkeypatch), counted(monkeypatch)
    decode(model, 2)
    model.quantize("int8", None, kernel="int8_native")  # new modules: their buffers registered
    got = decode(model, 2)[0]
    assert builds[0] == 2 and calls[0] == 4
    assert same(got, modules_decode(monkeypatch, model, 2))
