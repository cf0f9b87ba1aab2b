"""capture() and the hook points: exact weights whatever the backend, only what was asked
for is stored, interventions work, and hooks go away even when the forward raises."""

from __future__ import annotations

import pytest
import torch
from attention_reference import reference_pattern

from attnlab.analysis import (
    capture,
    capture_attention,
    hook_names,
    hooks,
    run_with_cache,
    run_with_hooks,
)
from attnlab.analysis.hooks import attention_modules, hook_points
from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.transformer import Transformer, TransformerConfig
from conftest import assert_close


def _transformer(backend: str = "auto") -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(src_vocab_size=20, tgt_vocab_size=18, d_model=32,
                                         num_heads=4, num_encoder_layers=2, num_decoder_layers=3,
                                         d_ff=64, dropout=0.0, backend=backend)).eval()


def _math_weights(model, run):
    """Reference: each module called again with return_weights=True (the math backend)."""
    found = {}

    def hook_for(name):
        def hook(module, args, kwargs, output):
            if kwargs.get("return_weights"):  # our own call below
                return
            backend, module.backend = module.backend, "math"
            try:
                found[name] = module(*args, **{**kwargs, "return_weights": True})[1]
            finally:
                module.backend = backend
        return hook

    handles = [m.register_forward_hook(hook_for(n), with_kwargs=True)
               for n, m in attention_modules(model).items()]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return found


@pytest.mark.parametrize("backend", ["fused", "flash", "math"])
def test_transformer_capture_equals_math_weights(backend):
    model = _transformer(backend)
    src = torch.randint(4, 20, (2, 7))
    src[1, 5:] = 0  # padding
    tgt = torch.randint(4, 18, (2, 5))
    result = capture(model, (src, tgt))
    expected = _math_weights(model, lambda: model(src, tgt))
    assert result.kinds == ["encoder", "decoder", "cross"]
    assert result["encoder"].weights.shape == (2, 2, 4, 7, 7)
    assert result["decoder"].weights.shape == (2, 3, 4, 5, 5)
    assert result["cross"].weights.shape == (2, 3, 4, 5, 7)
    for kind, stack in (("encoder", "encoder.layers.{}.self_attn"),
                        ("decoder", "decoder.layers.{}.self_attn"),
                        ("cross", "decoder.layers.{}.cross_attn")):
        for i, layer in enumerate(result[kind].layers):
            assert_close(result[kind].weights[:, i], expected[stack.format(layer)], what=kind)
    assert result["decoder"].causal and not result["cross"].causal
    # Padding keys get no weight; the logits are the model's.
    assert result["cross"].weights[1, ..., 5:].abs().max() == 0
    assert_close(result.output, model(src, tgt), rtol=1e-4, atol=1e-5)


def test_decoder_lm_gqa_rope_capture_and_tokens():
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama(30, d_model=32, num_layers=2, num_heads=4,
                                            num_kv_heads=2, max_len=32)).eval()
    ids = torch.randint(0, 30, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    inputs = {"input_ids": ids, "attention_mask": mask}
    result = capture(model, inputs, tokens=[list("abcdef"), list("wxyz")])
    _, qk = run_with_cache(model, inputs, "*.[qk]")
    maps = result["self"]
    assert result.kinds == ["self"] and maps.causal
    for i in range(2):  # the formula on the layer's own (rotated) queries and keys
        expected = reference_pattern(qk[f"layers.{i}.self_attn.q"],
                                     qk[f"layers.{i}.self_attn.k"], mask)
        assert_close(maps.weights[:, i], expected)
    w, queries, keys = maps.example(1)
    assert queries == keys == list("wxyz") and w.shape == (2, 4, 4, 4)
    assert maps.query_tokens[1] == ("<pad>", "<pad>", "w", "x", "y", "z")
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 4))
    assert torch.equal(w.triu(1), torch.zeros_like(w))  # causal


def test_only_asked_layers_and_heads_are_hooked_and_stored():
    model = _transformer("fused")
    src, tgt = torch.randint(4, 20, (1, 6)), torch.randint(4, 18, (1, 4))
    hooked = set()
    handles = [m.register_forward_pre_hook(
        lambda mod, args, n=n: hooked.add(n) if mod.pattern.has_hooks else None)
        for n, m in attention_modules(model).items()]
    result = capture(model, (src, tgt), layers=[1], heads=[0, 3], kinds=["cross", "encoder"])
    for h in handles:
        h.remove()
    assert hooked == {"decoder.layers.1.cross_attn", "encoder.layers.1.self_attn"}
    assert result.kinds == ["cross", "encoder"]
    full = capture(model, (src, tgt))
    assert result["cross"].weights.shape == (1, 1, 2, 4, 6)
    assert result["cross"].heads == (0, 3) and result["cross"].layers == (1,)
    # (unhooked layers ran the fused kernel here, the math path there: float tolerance)
    assert_close(result["cross"].weights[:, 0], full["cross"].weights[:, 1][:, [0, 3]])
    # The stored heads are copies, not views of the full pattern.
    assert result["cross"].weights.untyped_storage().nbytes() == 2 * 4 * 6 * 4


def test_capture_errors_name_the_argument():
    model = _transformer()
    src, tgt = torch.randint(4, 20, (1, 6)), torch.randint(4, 18, (1, 4))
    with pytest.raises(ValueError, match=r"layers: .*has layers \[0, 1\], got \[2\]"):
        capture(model, (src, tgt), layers=[2], kinds=["encoder"])
    with pytest.raises(ValueError, match=r"heads: expected indices in 0 \.\. 3"):
        capture(model, (src, tgt), heads=[4])
    with pytest.raises(ValueError, match="kinds: expected some of"):
        capture(model, (src, tgt), kinds=["self"])
    with pytest.raises(ValueError, match="tokens: row 0 has 2 labels, expected 6"):
        capture(model, (src, tgt), tokens={"src": [["a", "b"]]})


def test_run_with_cache_stores_only_the_asked_names():
    model = _transformer()
    src, tgt = torch.randint(4, 20, (2, 6)), torch.randint(4, 18, (2, 4))
    names = hook_names(model)
    assert len(names) == 8 * 6 and names[0] == "encoder.layers.0.self_attn.q"
    out, cache = run_with_cache(model, (src, tgt), ["decoder.layers.0.cross_attn.scores",
                                                    "encoder.*.z"])
    assert sorted(cache) == ["decoder.layers.0.cross_attn.scores",
                             "encoder.layers.0.self_attn.z", "encoder.layers.1.self_attn.z"]
    assert cache["decoder.layers.0.cross_attn.scores"].shape == (2, 4, 4, 6)
    assert cache["encoder.layers.1.self_attn.z"].shape == (2, 4, 6, 8)
    assert out.shape == (2, 4, 18)
    _, qkv = run_with_cache(model, (src, tgt), ["decoder.layers.2.self_attn.[qkv]"])
    assert [t.shape for t in qkv.values()] == [(2, 4, 4, 8)] * 3
    with pytest.raises(ValueError, match=r"names: 'encoder.layers.9.\*' matches no hook point"):
        run_with_cache(model, (src, tgt), ["encoder.layers.9.*"])


def test_hooks_are_removed_even_when_the_forward_raises():
    model = _transformer()
    src, tgt = torch.randint(4, 20, (1, 6)), torch.randint(4, 18, (1, 4))

    def boom(x, name):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_with_cache(model, (src, tgt), "*.pattern", hooks={"decoder.layers.1.*.z": boom})
    assert not any(p.has_hooks for p in hook_points(model).values())
    with pytest.raises(ValueError, match="tgt"):  # the model itself raises (bad ids)
        capture(model, (src, torch.full((1, 4), 99)))
    assert not any(p.has_hooks for p in hook_points(model).values())
    bad = hooks(model, {"*.scores": lambda x, n: x[..., :1]})
    with pytest.raises(ValueError, match=r"hook for .*\.scores: expected None or a tensor"), bad:
        model(src, tgt)
    assert not any(p.has_hooks for p in hook_points(model).values())


def test_interventions_change_the_output():
    model = _transformer()
    src, tgt = torch.randint(4, 20, (1, 6)), torch.randint(4, 18, (1, 4))
    base = model(src, tgt)
    with hooks(model, {"*.pattern": lambda x, n: None}):  # observing changes nothing
        assert_close(model(src, tgt), base, rtol=1e-4, atol=1e-5)
    # Uniform attention over the source in every cross-attention layer, by editing scores.
    with hooks(model, {"*.cross_attn.scores": lambda x, n: torch.zeros_like(x)}):
        _, cache = run_with_cache(model, (src, tgt), "*.cross_attn.pattern")
        changed = model(src, tgt)
    for w in cache.values():
        assert torch.allclose(w, torch.full_like(w, 1 / 6))
    assert (changed - base).abs().max() > 1e-3


def test_legacy_capture_attention_keeps_its_signature():
    model = _transformer("fused")
    src, tgt = torch.randint(4, 20, (1, 6)), torch.randint(4, 18, (1, 4))
    out, weights = capture_attention(model, lambda: model(src, tgt),
                                     ["decoder.layers.2.cross_attn"])
    assert list(weights) == ["decoder.layers.2.cross_attn"] and out.shape == (1, 4, 18)
    assert_close(weights["decoder.layers.2.cross_attn"],
                 capture(model, (src, tgt), layers=[2], kinds=["cross"])["cross"].weights[:, 0])
    with pytest.raises(ValueError, match=r"names: .* are not attention modules"):
        capture_attention(model, lambda: None, ["decoder.nope"])


def test_capture_on_a_flash_decoder_lm_runs_math_for_the_call_only():
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama(30, d_model=32, num_layers=2, num_heads=4,
                                            num_kv_heads=2, max_len=32, backend="flash")).eval()
    ids = torch.randint(0, 30, (1, 5))
    result = capture(model, ids, layers=[1])
    _, qk = run_with_cache(model, ids, "layers.1.self_attn.[qk]")  # on flash
    expected = reference_pattern(qk["layers.1.self_attn.q"], qk["layers.1.self_attn.k"])
    assert_close(result["self"].weights[:, 0], expected)
    assert [m.backend for m in attention_modules(model).values()] == ["flash", "flash"]
    with pytest.raises(ValueError, match="input_ids"):  # the model raises: backends restored
        capture(model, torch.full((1, 5), 99))
    assert [m.backend for m in attention_modules(model).values()] == ["flash", "flash"]
    assert not any(p.has_hooks for p in hook_points(model).values())


def test_hostile_arguments_are_refused_by_name():
    model = _transformer()
    src, tgt = torch.randint(4, 20, (1, 6)), torch.randint(4, 18, (1, 4))
    cases = [
        (lambda: capture(model, (src, tgt), kinds=[]), ValueError, "kinds: expected some of"),
        (lambda: capture(model, (src, tgt), kinds="cross"), TypeError,
         "kinds: expected a list of strs, got str"),
        (lambda: capture(model, (src, tgt), layers=1), TypeError,
         "layers: expected a list of ints, got int"),
        (lambda: capture(model, (src, tgt), heads=[0, True]), TypeError,
         "heads: expected a list of ints, got True"),
        (lambda: capture(model, (src, tgt), heads=iter([7])), ValueError,
         r"heads: expected indices in 0 \.\. 3, got \[7\]"),
        (lambda: run_with_cache(model, (src, tgt), 3), TypeError,
         "names: expected a string or strings, got int"),
        (lambda: run_with_cache(model, (src, tgt), "*.z", hooks={"*.q": "x"}), TypeError,
         r"hooks\['\*\.q'\]: expected a callable"),
        (lambda: hooks(model, [("*.q", print)]).__enter__(), TypeError,
         "fns: expected a mapping"),
        (lambda: hook_names("model"), TypeError, "model: expected a torch.nn.Module, got str"),
        (lambda: run_with_cache(torch.nn.Linear(2, 2), torch.ones(2), "*"), ValueError,
         "model: expected a model with hook points"),
        (lambda: run_with_hooks(model, (src, tgt), {"*.q": lambda x, n: x.double()}), ValueError,
         r"hook for encoder.layers.0.self_attn.q: expected None or a tensor of shape "
         r"\(1, 4, 6, 8\), dtype torch.float32 on cpu, got shape \(1, 4, 6, 8\), dtype "
         r"torch.float64"),
        (lambda: run_with_hooks(model, (src, tgt), {"*.q": lambda x, n: 0}), TypeError,
         "hook for encoder.layers.0.self_attn.q: expected None or a Tensor, got int"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert not any(p.has_hooks for p in hook_points(model).values())


def test_a_fn_under_overlapping_patterns_runs_once_per_point():
    model = _transformer()
    src, tgt = torch.randint(4, 20, (1, 6)), torch.randint(4, 18, (1, 4))
    seen = []

    def count(x, name):
        seen.append(name)

    run_with_hooks(model, (src, tgt), {"*.q": count, "encoder.*": count})
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 8 + 2 * 5  # 8 q + 2 x (k..z)
