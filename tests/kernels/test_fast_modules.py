"""The code you read is the code that runs: the reference modules are formulas that never
touch attnlab's C++ kernels, and the fast modules that ``optimize_for_inference`` swaps in
(``attnlab.kernels.fast_modules``, ``FusedLayers``) have the reference's signatures and
``state_dict``, show in ``print(model)``, run the kernels for inference only, equal the
reference they replace, and go back with ``restore_reference``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from attnlab.attention.kv_cache import KVCache
from attnlab.attention.sdpa import scaled_dot_product_attention
from attnlab.generation.sampling import greedy_tokens
from attnlab.kernels import (
    FastFeedForward,
    FastGatedMLP,
    FastRMSNorm,
    FastSelfAttention,
    InferenceLinear,
    fused_layers,
    install,
    native,
    optimize_for_inference,
    restore_reference,
)
from attnlab.layers import FeedForward, GatedMLP, RMSNorm
from attnlab.layers.rotary import apply_rotary
from attnlab.layers.self_attention import SelfAttention
from attnlab.models import DecoderLM, DecoderLMConfig

needs_build = pytest.mark.usefixtures("native_kernels")

# Shapes of the families' blocks: RMSNorm + SwiGLU + GQA (Llama), q/k norms (Qwen3), 1 + w
# norms and GeGLU (Gemma), LayerNorm + GELU + learned positions (GPT-2).
CONFIGS = {
    "llama": DecoderLMConfig.llama(97, d_model=32, num_heads=4, num_layers=2, max_len=64),
    "qwen3": DecoderLMConfig.llama(97, d_model=32, num_heads=4, num_layers=2, max_len=64,
                                   qk_norm=True),
    "gemma": DecoderLMConfig.llama(97, d_model=32, num_heads=4, num_layers=2, max_len=64,
                                   norm="rmsnorm_unit_offset", mlp="geglu"),
    "gpt2": DecoderLMConfig.gpt(97, d_model=32, num_heads=4, num_layers=2, max_len=64,
                                mlp="gelu_tanh"),
}


def _pair(name: str, dtype: torch.dtype = torch.float32) -> tuple[DecoderLM, DecoderLM]:
    torch.manual_seed(0)
    reference = DecoderLM(CONFIGS[name]).to(dtype).eval()
    return reference, optimize_for_inference(copy.deepcopy(reference))


def _counting(monkeypatch: pytest.MonkeyPatch, *names: str) -> dict[str, int]:
    """Counts of calls of ``native.<name>`` (the kernels themselves)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(native, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(native, name, counted)
    return calls


def test_reference_modules_never_reach_the_native_kernels(monkeypatch) -> None:
    """Every formula that used to branch into C++ (RMSNorm, RoPE, the gated activation, the
    ``auto`` attention backend for a decoding step, greedy selection, a whole decoder's
    decoding step) runs without asking for the kernels, under ``no_grad`` on the CPU."""
    def refuse(*args, **kwargs):
        raise AssertionError("a reference module asked for the native kernels")

    monkeypatch.setattr(native, "_extension", refuse)
    monkeypatch.setattr(native, "available", refuse)
    torch.manual_seed(0)
    with torch.no_grad():
        RMSNorm(8)(torch.randn(2, 8))
        GatedMLP(8, 16)(torch.randn(2, 3, 8))
        FeedForward(8, 16, activation="gelu_tanh")(torch.randn(2, 8))
        q = torch.randn(1, 1, 2, 8)
        apply_rotary(q, torch.ones(1, 1, 8), torch.zeros(1, 1, 8))
        scaled_dot_product_attention(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8),
                                     torch.randn(1, 2, 5, 8))
        greedy_tokens(torch.randn(2, 50).bfloat16())
        model = DecoderLM(CONFIGS["llama"]).eval()
        model.generate(torch.tensor([[1, 2, 3]]), 3)


@needs_build
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_optimized_model_shows_its_fast_modules_and_keeps_its_state(name) -> None:
    reference, fast = _pair(name)
    text = str(fast)
    assert "FusedDecoderLayers" in text and "FastSelfAttention" in text
    assert ("FastFeedForward" if name == "gpt2" else "FastGatedMLP") in text
    assert ("LayerNorm" if name == "gpt2" else "FastRMSNorm") in text
    assert "FastGreedyTokens" in text
    assert "Fast" not in str(reference)
    ours, theirs = fast.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert isinstance(fast.layers[0].self_attn, SelfAttention)  # a subclass: isinstance holds
    restore_reference(fast)
    assert str(fast) == str(reference)
    assert all(type(a) is type(b) for a, b in zip(fast.modules(), reference.modules()))
    assert all(p.is_contiguous() for p in fast.parameters())
    for call in (optimize_for_inference, restore_reference):
        with pytest.raises(TypeError, match=r"model: expected a torch\.nn\.Module, got dict"):
            call({})


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fast_model_equals_the_reference_and_runs_the_kernels(monkeypatch, name, dtype) -> None:
    """Prefill logits within the dtype's tolerance, greedy generations equal, with the fused
    step, RMSNorm, RoPE, the activation and the decoding attention's kernels all called."""
    reference, fast = _pair(name, dtype)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    kernels = ("decode_layers", "rms_norm", "rotary", "decode_attention", "activation",
               "argmax_rows")
    calls = _counting(monkeypatch, *kernels)
    with torch.no_grad():
        want, got = reference(ids, mask), fast(ids, mask)
        tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        assert torch.equal(fast.generate(ids, 6, attention_mask=mask),
                           reference.generate(ids, 6, attention_mask=mask))
    assert calls["decode_layers"] == 5  # every step after the prompt's
    assert calls["argmax_rows"] == 6  # every greedy choice
    if name != "gpt2":
        assert calls["rms_norm"] > 0 and calls["rotary"] > 0
    if native.activation_available():
        assert calls["activation"] > 0


@needs_build
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_modules_step_equals_the_fused_step_bit_for_bit(monkeypatch, name) -> None:
    """With the one-call step refused, the fast modules decode to the same bits as that step
    (which is built from the same kernels)."""
    _, fast = _pair(name, torch.bfloat16)
    ids, new = torch.tensor([[3, 1, 4, 1, 5]]), torch.tensor([[9]])
    calls = _counting(monkeypatch, "decode_layers")
    with torch.no_grad():
        fused = fast(new, past_key_values=fast(ids, use_cache=True).past_key_values)
        assert calls["decode_layers"] == 1
        monkeypatch.setattr(fused_layers, "fused_layers", lambda *a, **k: None)
        modules = fast(new, past_key_values=fast(ids, use_cache=True).past_key_values)
    assert calls["decode_layers"] == 1
    assert torch.equal(fused.logits, modules.logits)


@needs_build
def test_training_gradients_and_score_hooks_run_the_reference(monkeypatch) -> None:
    reference, fast = _pair("llama")
    calls = _counting(monkeypatch, "decode_layers", "rms_norm", "rotary", "decode_attention",
                      "activation")
    ids = torch.tensor([[5, 6, 7, 8]])
    fast.train()
    loss = fast(ids, labels=ids).loss
    loss.backward()
    reference.train()
    reference(ids, labels=ids).loss.backward()
    assert calls == dict.fromkeys(calls, 0)
    for (n, a), (_, b) in zip(fast.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)
    fast.eval()
    seen = []
    fast.layers[0].self_attn.pattern.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        fast.generate(ids, 2)
    assert calls["decode_layers"] == 0  # a hook inside a block: the blocks run one by one
    assert calls["decode_attention"] == 2  # layer 1's prompt (4 queries) and step
    assert len(seen) == 2  # layer 0's prompt and step: both through the formula


@needs_build
def test_each_fast_module_equals_its_reference_alone() -> None:
    """Each fast class constructed with the reference's arguments, on the same weights."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 16, generator=g)
    pairs = [(RMSNorm(16, eps=1e-5), FastRMSNorm(16, eps=1e-5)),
             (GatedMLP(16, 24, activation="gelu_tanh"), FastGatedMLP(16, 24,
                                                                      activation="gelu_tanh")),
             (FeedForward(16, 24, "gelu_tanh"), FastFeedForward(16, 24, "gelu_tanh"))]
    for reference, fast in pairs:
        fast.load_state_dict(reference.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(fast(x), reference(x), rtol=1e-5, atol=1e-6)
    attention = SelfAttention(16, 4, 2, 4)
    fast = FastSelfAttention(16, 4, 2, 4)
    fast.load_state_dict(attention.state_dict())
    angles = torch.randn(1, 6, 4, generator=g)
    cos, sin = angles.cos(), angles.sin()
    outs = []
    with torch.no_grad():
        for module in (attention, fast):
            cache = KVCache(1, 3, 2, 6, 4)
            module(x, rotary=(cos[:, :5], sin[:, :5]), cache=cache[0])
            outs.append(module(x[:, :1], rotary=(cos[:, 5:], sin[:, 5:]), cache=cache[0]))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)


def test_without_the_kernels_the_reference_runs_and_it_is_said_once(monkeypatch,
                                                                    capsys) -> None:
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "unavailable_reason", lambda: "not built")
    monkeypatch.setattr(install, "_TOLD", [])
    torch.manual_seed(0)
    model = optimize_for_inference(DecoderLM(CONFIGS["llama"]).eval())
    optimize_for_inference(DecoderLM(CONFIGS["gpt2"]).eval())
    err = capsys.readouterr().err
    assert err.count("attnlab:") == 1 and "(not built)" in err
    assert "FastRMSNorm" in err and "FusedDecoderLayers" in err
    assert not any(type(m).__name__.startswith(("Fast", "Fused")) for m in model.modules())
    assert isinstance(model.lm_head, InferenceLinear)  # the Linears' plans need no build


def test_the_import_contracts_keep_the_reference_packages_free_of_the_fast_package() -> None:
    """The contracts themselves (``tests/project/test_layering.py`` runs them): the formulas'
    packages may not import ``attnlab.kernels`` at all, the model classes not directly."""
    text = (Path(__file__).parents[2] / ".importlinter").read_text()
    formulas = text[text.index("[importlinter:contract:formulas]"):]
    for package in ("attnlab.layers", "attnlab.attention", "attnlab.generation",
                    "attnlab.quantization.formats", "attnlab.formulas"):
        assert f"    {package}\n" in formulas.split("forbidden_modules")[0]
    models = text[text.index("[importlinter:contract:formulas-models]"):]
    assert "    attnlab.models.decoder\n" in models


def test_public_names_documented_before_still_work(tmp_path) -> None:
    from attnlab.functional import scaled_dot_product_attention as public
    from attnlab.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

    assert public is scaled_dot_product_attention
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    assert config.family == "qwen2" and config.kv_heads == 2 and config.qkv_bias
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path)
    loaded = Qwen2ForCausalLM.from_pretrained(tmp_path, kernels=False)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(ids), model.eval()(ids))
    assert Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=1, num_attention_heads=4).kv_heads == 4
    with pytest.raises(ValueError, match="intermediate_size"):
        Qwen2Config(vocab_size=64, hidden_size=32)
