"""Hook points on every family: each point fires with its documented shape, identity hooks
change nothing (bit for bit), the stored pattern is the formula's, an intervention propagates
exactly as recomputed by hand, the residual stream chains from block to block, hooks leave the
backend alone (except scores/pattern, which need math), and hooks go away after an error.

Each family style is built from ``DecoderLMConfig`` fields directly; every family registered
in ``attnlab.models.families.FAMILIES`` is also built from a tiny transformers config of its
``model_type`` through its own ``config_from_hf``, so a new family is covered when it lands.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_reference import reference_pattern
from tiny_families import tiny_hf_config

from attnlab.analysis import hook_names, hooks, run_with_cache, run_with_hooks
from attnlab.analysis.hooks import RESIDUAL_POINTS, attention_modules, hook_points
from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.families import FAMILIES
from conftest import assert_close

V = 64
SIZES = {"d_model": 32, "num_layers": 2, "num_heads": 4, "max_len": 64}

# The style of each family, as DecoderLMConfig fields (sizes from SIZES).
STYLES = {
    "llama": lambda: DecoderLMConfig.llama(V, **SIZES, num_kv_heads=2),
    "mistral": lambda: DecoderLMConfig.llama(V, **SIZES, num_kv_heads=2, sliding_window=3),
    "qwen2": lambda: DecoderLMConfig.llama(V, **SIZES, num_kv_heads=2, qkv_bias=True),
    "qwen3": lambda: DecoderLMConfig.llama(V, **SIZES, num_kv_heads=2, qk_norm=True,
                                           head_dim=12),
    "gemma": lambda: DecoderLMConfig.llama(V, **SIZES, num_kv_heads=1,
                                           norm="rmsnorm_unit_offset", mlp="geglu",
                                           embedding_scale=math.sqrt(32)),
    "gpt2": lambda: DecoderLMConfig.gpt(V, **SIZES, mlp="gelu_tanh"),
    "phi3": lambda: DecoderLMConfig.llama(V, **SIZES, rotary_dim=4),
}

def _from_family(model_type: str) -> DecoderLMConfig:
    return FAMILIES[model_type].config_from_hf(tiny_hf_config(model_type, V).to_dict())


BUILDS = {**{f"style-{n}": f for n, f in STYLES.items()},
          **{f"family-{t}": (lambda t=t: _from_family(t)) for t in sorted(FAMILIES)}}


def _model(build: str, **overrides: object) -> DecoderLM:
    config = BUILDS[build]()
    fields = {**config.to_dict(), **overrides} if overrides else None
    config = config if fields is None else type(config).from_dict(fields)
    torch.manual_seed(0)
    model = DecoderLM(config).eval()
    with torch.no_grad():  # norms and biases off their initial values, so a missed one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _inputs() -> dict[str, torch.Tensor]:
    """Two rows, the second left-padded: ``B x L = 2 x 9``."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


builds = pytest.mark.parametrize("build", list(BUILDS))


@builds
def test_every_point_fires_with_its_documented_shape(build):
    model = _model(build)
    c, inputs = model.config, _inputs()
    B, L = inputs["input_ids"].shape
    H, G, D, E = c.num_heads, c.kv_heads, c.head_dim, c.d_model
    expected = {}
    for i in range(c.num_layers):
        expected.update({f"layers.{i}.{p}": (B, L, E) for p in RESIDUAL_POINTS})
        a = f"layers.{i}.self_attn"
        expected.update({f"{a}.q": (B, H, L, D), f"{a}.k": (B, G, L, D), f"{a}.v": (B, G, L, D),
                         f"{a}.scores": (B, H, L, L), f"{a}.pattern": (B, H, L, L),
                         f"{a}.z": (B, H, L, D)})
    assert sorted(hook_names(model)) == sorted(expected)
    assert list(attention_modules(model)) == [f"layers.{i}.self_attn"
                                              for i in range(c.num_layers)]
    fired = []
    run_with_hooks(model, inputs, {"*": lambda x, name: fired.append((name, tuple(x.shape)))})
    assert sorted(fired) == sorted(expected.items())  # each point once, with its shape


@builds
def test_identity_hooks_leave_the_logits_bit_identical(build):
    model = _model(build)
    inputs = _inputs()
    with torch.no_grad():
        base = model(**inputs)
        not_scores = [n for n in hook_names(model) if not n.endswith((".scores", ".pattern"))]
        out = run_with_hooks(model, inputs, dict.fromkeys(not_scores, lambda x, n: x.clone()))
        assert torch.equal(out, base)
        # scores/pattern exist on the math backend only: the same model on math, unhooked
        for m in attention_modules(model).values():
            m.backend = "math"
        math_base = model(**inputs)
        out = run_with_hooks(model, inputs, {"*": lambda x, n: x.clone()})
        assert torch.equal(out, math_base)
    assert_close(math_base, base, rtol=1e-4, atol=1e-5)


@builds
def test_pattern_is_softmax_of_scores_and_the_formula(build):
    model = _model(build)
    c, inputs = model.config, _inputs()
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        _, cache = run_with_cache(model, inputs, ["*.q", "*.k", "*.scores", "*.pattern"])
    for i in range(c.num_layers):
        a = f"layers.{i}.self_attn"
        scores, pattern = cache[f"{a}.scores"], cache[f"{a}.pattern"]
        assert_close(pattern, torch.softmax(scores, -1).nan_to_num(0.0))
        expected = reference_pattern(cache[f"{a}.q"], cache[f"{a}.k"], real,
                                     window=c.sliding_window, scale=c.attention_scale)
        assert_close(pattern, expected)
        rows = pattern.sum(-1).transpose(1, 2)[real]  # the rows of real queries
        assert_close(rows, torch.ones_like(rows))
        assert pattern[~real[:, None, None, :].expand_as(pattern)].abs().max() == 0


@builds
def test_zeroing_a_heads_z_changes_the_output_as_recomputed_by_hand(build):
    model = _model(build)
    c, inputs = model.config, _inputs()
    B, L = inputs["input_ids"].shape
    attn = model.layers[0].self_attn

    def zero_head_1(z, name):
        z = z.clone()
        z[:, 1] = 0
        return z

    with torch.no_grad():
        base, before = run_with_cache(model, inputs, "layers.0.self_attn.z")
        ablated, cache = run_with_cache(
            model, inputs, ["layers.0.self_attn.z", "layers.0.attn_out", "layers.0.resid_*"],
            hooks={"layers.0.self_attn.z": zero_head_1})
        z = cache["layers.0.self_attn.z"]
        assert z[:, 1].abs().max() == 0
        assert torch.equal(z[:, 0], before["layers.0.self_attn.z"][:, 0])
        by_hand = attn.o_proj(z.transpose(1, 2).reshape(B, L, c.num_heads * c.head_dim))
        assert_close(cache["layers.0.attn_out"], by_hand)
        assert torch.equal(cache["layers.0.resid_mid"],
                           cache["layers.0.resid_pre"] + cache["layers.0.attn_out"])
        patched = run_with_hooks(model, inputs, {"layers.0.attn_out": lambda x, n: by_hand})
    assert_close(ablated, patched)
    real = inputs["attention_mask"].bool()
    assert (ablated - base)[real].abs().max() > 1e-4


@builds
def test_the_residual_stream_chains_from_block_to_block(build):
    model = _model(build)
    with torch.no_grad():
        _, cache = run_with_cache(model, _inputs(), "layers.*.resid_*")
        _, parts = run_with_cache(model, _inputs(), ["*.attn_out", "*.mlp_out"])
    n = model.config.num_layers
    for i in range(n):
        r = f"layers.{i}"
        pre, mid, post = (cache[f"{r}.resid_{p}"] for p in ("pre", "mid", "post"))
        assert torch.equal(mid, pre + parts[f"{r}.attn_out"])
        assert torch.equal(post, mid + parts[f"{r}.mlp_out"])
        if i + 1 < n:
            assert torch.equal(cache[f"{r}.resid_post"], cache[f"layers.{i + 1}.resid_pre"])


@builds
def test_hooks_other_than_scores_and_pattern_keep_the_backend(build, backend_calls):
    model = _model(build)
    n, inputs = model.config.num_layers, _inputs()
    calls = backend_calls
    with torch.no_grad():
        run_with_cache(model, inputs, ["*.q", "*.k", "*.v", "*.z", "*.resid_*", "*_out"])
    assert calls == {"math": 0, "fused": n, "flash": 0, "native": 0}  # 9 queries: fused
    calls.update(math=0, fused=0)
    with torch.no_grad():
        run_with_cache(model, inputs, "layers.0.self_attn.pattern")
    assert calls == {"math": 1, "fused": n - 1, "flash": 0, "native": 0}  # the hooked layer


@builds
def test_scores_and_pattern_hooks_on_flash_raise_clearly(build, backend_calls):
    model = _model(build, backend="flash")
    inputs = _inputs()
    with pytest.raises(ValueError, match=r"hook point 'layers.1.self_attn.pattern': expected a "
                                         r"layer with backend 'auto' or 'math'.*got backend "
                                         r"'flash'"):
        run_with_cache(model, inputs, "layers.1.self_attn.pattern")
    assert not any(p.has_hooks for p in hook_points(model).values())
    # PyTorch's own hook API reaches the same refusal from the backend itself
    handle = model.layers[0].self_attn.scores.register_forward_hook(lambda m, a, x: None)
    try:
        with pytest.raises(ValueError, match="backend 'flash'"), torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    calls = backend_calls
    with torch.no_grad():  # the other points run on flash
        _, cache = run_with_cache(model, inputs, ["*.z", "*.q"])
    assert calls["flash"] == model.config.num_layers and calls["math"] == 0
    assert len(cache) == 2 * model.config.num_layers


@builds
def test_hooks_are_removed_after_an_exception(build):
    model = _model(build)
    inputs = _inputs()

    def boom(x, name):
        raise RuntimeError(f"boom at {name}")

    with torch.no_grad():
        base = model(**inputs)
        with hooks(model, {"*.q": lambda x, n: None}):
            with pytest.raises(RuntimeError, match=r"boom at layers\.1\.resid_mid"):
                run_with_cache(model, inputs, "*.pattern", hooks={"layers.1.resid_mid": boom})
            # the enclosing block's hooks stay; the inner ones are gone
            assert {n for n, p in hook_points(model).items() if p.has_hooks} == {
                f"layers.{i}.self_attn.q" for i in range(model.config.num_layers)}
            with pytest.raises(ValueError, match=r"hook for layers.0.resid_pre: expected None "
                                                 r"or a tensor of shape \(2, 9, 32\)"):
                run_with_hooks(model, inputs, {"layers.0.resid_pre": lambda x, n: x[:, :1]})
        assert not any(p.has_hooks for p in hook_points(model).values())
        assert torch.equal(model(**inputs), base)
