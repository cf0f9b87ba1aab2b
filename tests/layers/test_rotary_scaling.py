"""Rotary embeddings with scaling against transformers 5 (ROPE_INIT_FUNCTIONS, the Llama and
Phi-3 rotary modules, apply_rotary_pos_emb), our old RoPE, and the rotation as complex numbers."""

from __future__ import annotations

import json

import pytest
import torch

from attnlab.layers import RoPE
from attnlab.layers.rope_scaling import ROPE_TYPES, RopeScaling, rope_inverse_frequencies
from attnlab.layers.rotary import RotaryEmbedding, apply_rotary
from conftest import assert_close

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, Phi3Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding  # noqa: E402
from transformers.models.phi3.modeling_phi3 import (  # noqa: E402
    apply_rotary_pos_emb as phi3_apply_rotary_pos_emb,
)

HEAD_DIM, THETA, MAX_POS = 16, 500.0, 32

# rope_type -> the rope_parameters (beside rope_theta) of a config.json; several per type.
CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "yarn-betas-untruncated": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0,
                               "beta_slow": 2.0, "truncate": False,
                               "original_max_position_embeddings": 8},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4},
    "yarn-attention-factor": {"type": "yarn", "factor": 2.0, "attention_factor": 0.8,
                              "original_max_position_embeddings": 16},
    "yarn-implicit-factor": {"rope_type": "yarn", "original_max_position_embeddings": 8,
                             "factor": None},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "llama3-default-original": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 2.0,
                                "high_freq_factor": 3.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 8,
                 "short_factor": [1.0, 1.5, 2.0, 3.0, 1.1, 1.2, 1.3, 1.4],
                 "long_factor": [2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]},
}


def hf_config(params: dict, *, head_dim: int = HEAD_DIM, partial: float | None = None,
              cls: type = LlamaConfig) -> transformers.PretrainedConfig:
    rope = {**params, "rope_theta": THETA}
    if partial is not None:
        rope["partial_rotary_factor"] = partial
    extra = {}
    if cls is Phi3Config:  # Phi-3 keeps the pretraining length outside rope_parameters
        extra["original_max_position_embeddings"] = params.get(
            "original_max_position_embeddings", MAX_POS)
    return cls(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
               num_key_value_heads=4, max_position_embeddings=MAX_POS,
               rope_parameters=rope, **extra)


def hf_init(params: dict, config: transformers.PretrainedConfig, **kwargs):
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, **kwargs)


@pytest.mark.parametrize("case", CASES)
def test_inverse_frequencies_equal_transformers(case: str) -> None:
    params = CASES[case]
    expected, expected_factor = hf_init(params, hf_config(params))
    scaling = RopeScaling.from_hf(params)
    inv_freq, factor = rope_inverse_frequencies(HEAD_DIM, THETA, scaling, MAX_POS)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (HEAD_DIM // 2,)
    torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)
    # The scaling changes something, so the comparison can fail (dynamic only scales once
    # the sequence grows: test_dynamic_and_longrope_frequencies_for_a_length...).
    if case not in ("default", "dynamic"):
        assert not torch.equal(inv_freq, hf_init({"rope_type": "default"}, hf_config({}))[0]) \
            or factor != 1.0


@pytest.mark.parametrize("seq_len", [33, 50, 97])
def test_dynamic_and_longrope_frequencies_for_a_length_equal_transformers(seq_len: int) -> None:
    for case in ("dynamic", "longrope"):
        params = CASES[case]
        # transformers passes the length as a tensor, max(position_ids) + 1, when it grows.
        expected, _ = hf_init(params, hf_config(params), seq_len=torch.tensor(seq_len))
        inv_freq, _ = rope_inverse_frequencies(HEAD_DIM, THETA, RopeScaling.from_hf(params),
                                               MAX_POS, seq_len=seq_len)
        torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["default", "linear", "yarn", "llama3", "longrope"])
def test_partial_rotary_frequencies_equal_transformers(case: str) -> None:
    params = CASES[case]
    if case == "longrope":  # its factor lists have one number per rotated pair
        params = {**params, "short_factor": params["short_factor"][:4],
                  "long_factor": params["long_factor"][:4]}
    config = hf_config(params, partial=0.5, cls=Phi3Config if case == "default" else LlamaConfig)
    expected, expected_factor = (
        Phi3RotaryEmbedding.compute_default_rope_parameters(config) if case == "default"
        else ROPE_INIT_FUNCTIONS[case](config))
    inv_freq, factor = rope_inverse_frequencies(HEAD_DIM // 2, THETA,
                                                RopeScaling.from_hf(params), MAX_POS)
    torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


def test_llama31_checkpoint_numbers_equal_transformers() -> None:
    """The rope_scaling of Llama 3.1/3.2 (head_dim 128, theta 500000, 8192 -> 131072)."""
    params = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128,
                         max_position_embeddings=131072,
                         rope_parameters={**params, "rope_theta": 500000.0})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    inv_freq, _ = rope_inverse_frequencies(128, 500000.0, RopeScaling.from_hf(params), 131072)
    torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)


def rotary_pair(params: dict, max_len: int = 128):
    """Ours and transformers' rotary modules for one config (Phi-3's for longrope)."""
    if params.get("rope_type") == "longrope":
        theirs = Phi3RotaryEmbedding(hf_config(params, cls=Phi3Config))
    else:
        theirs = LlamaRotaryEmbedding(hf_config(params))
    ours = RotaryEmbedding(HEAD_DIM, base=THETA, max_len=max_len,
                           scaling=RopeScaling.from_hf(params), max_position_embeddings=MAX_POS)
    return ours, theirs


def assert_same_cos_sin(ours: RotaryEmbedding, theirs, positions: torch.Tensor) -> None:
    cos, sin = ours(positions)
    hf_positions = positions if positions.dim() == 2 else positions[None]
    hf_cos, hf_sin = theirs(torch.zeros(1, dtype=torch.float32), hf_positions)
    assert cos.dtype == sin.dtype == torch.float32
    assert cos.shape == (hf_positions.shape[0], hf_positions.shape[1], HEAD_DIM)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_cos_sin_equal_transformers_rotary_module(case: str) -> None:
    ours, theirs = rotary_pair(CASES[case])
    assert_same_cos_sin(ours, theirs, torch.arange(5))
    assert_same_cos_sin(ours, theirs, torch.tensor([[0, 1, 2, 3], [3, 9, 10, 11]]))  # B x L
    assert_same_cos_sin(ours, theirs, torch.tensor([[20, 21], [30, 31]]))


@pytest.mark.parametrize("case", ["dynamic", "longrope"])
def test_stateful_scaling_follows_transformers_through_a_kv_cache(case: str) -> None:
    """Prefill, decode steps past the trained length, a new short prompt, a middle one."""
    ours, theirs = rotary_pair(CASES[case])
    calls = [torch.arange(6),                            # prefill within MAX_POS
             torch.arange(6, 40),                        # grows past MAX_POS: scaled for 40
             torch.tensor([40]), torch.tensor([41]),     # each decode step rescales
             torch.tensor([[42], [12]]),                 # batch: the longest row decides
             torch.arange(20),                           # shorter than seen, >= MAX_POS: kept
             torch.arange(10),                           # dynamic: back to unscaled
             torch.arange(3, 36), torch.tensor([36]),
             # the boundaries: longrope's original length (8), dynamic's MAX_POS (32)
             torch.arange(8), torch.tensor([[8]]), torch.arange(32), torch.tensor([32])]
    for positions in calls:
        assert_same_cos_sin(ours, theirs, positions)
    # The state matters: the same positions after a long call differ from a fresh module.
    fresh, _ = rotary_pair(CASES[case])
    if case == "dynamic":
        ours(torch.arange(60))
        assert not torch.equal(ours(torch.arange(40))[0], fresh(torch.arange(40))[0])


def complex_rotation(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                     rotary_dim: int, interleaved: bool, factor: float = 1.0) -> torch.Tensor:
    """Reference (float64): pairs of the first rotary_dim features as complex numbers,
    z * factor * exp(i p inv_freq_j); the other features unchanged."""
    x = x.double()
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
    else:
        a, b = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
    angle = positions.double()[..., None] * inv_freq.double()  # (B x) L x R/2
    turn = torch.polar(torch.full_like(angle, factor), angle).unsqueeze(-2)
    z = torch.complex(a, b) * turn
    if interleaved:
        out = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        out = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((out, rest), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 8, 6])
def test_apply_rotary_equals_the_rotation_formula(interleaved: bool, rotary_dim: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, HEAD_DIM)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    scaling = RopeScaling.from_hf(CASES["yarn"])  # an attention factor != 1 too
    rotary = RotaryEmbedding(rotary_dim, base=THETA, max_len=64, scaling=scaling,
                             interleaved=interleaved, max_position_embeddings=MAX_POS)
    out = apply_rotary(x, *rotary(positions), interleaved=interleaved)
    inv_freq, factor = rope_inverse_frequencies(rotary_dim, THETA, scaling, MAX_POS)
    assert factor != 1.0
    expected = complex_rotation(x, positions, inv_freq, rotary_dim, interleaved, factor)
    assert_close(out, expected.float(), atol=1e-5)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_equals_transformers_apply_rotary_pos_emb(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    ours, theirs = rotary_pair(CASES["llama3"])
    positions = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    q, k = torch.randn(2, 4, 3, HEAD_DIM, dtype=dtype), torch.randn(2, 4, 2, HEAD_DIM, dtype=dtype)
    cos, sin = ours(positions)
    hf_cos, hf_sin = theirs(q, positions)  # cast to q's dtype, as transformers does
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin, unsqueeze_dim=2)  # B x L x H x D
    assert apply_rotary(q, cos, sin).dtype == dtype
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q, rtol=0, atol=0)
    torch.testing.assert_close(apply_rotary(k, cos, sin), hf_k, rtol=0, atol=0)


def test_partial_apply_rotary_equals_transformers_phi3() -> None:
    torch.manual_seed(2)
    config = hf_config({"rope_type": "default"}, partial=0.5, cls=Phi3Config)
    theirs = Phi3RotaryEmbedding(config)
    ours = RotaryEmbedding(HEAD_DIM // 2, base=THETA, max_len=MAX_POS)
    positions = torch.tensor([[0, 1, 2], [4, 5, 6]])
    q, k = torch.randn(2, 3, 4, HEAD_DIM), torch.randn(2, 3, 2, HEAD_DIM)
    hf_q, hf_k = phi3_apply_rotary_pos_emb(q, k, *theirs(q, positions), unsqueeze_dim=2)
    cos, sin = ours(positions)
    assert cos.shape == (2, 3, HEAD_DIM // 2)
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q, rtol=0, atol=0)
    torch.testing.assert_close(apply_rotary(k, cos, sin), hf_k, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_equals_old_rope(interleaved: bool) -> None:
    """Same layout as RoPE(traditional=interleaved): with RoPE's own float32 tables, the same
    bits; with ours (float32 angles, RoPE's are float64) within float32 rounding."""
    torch.manual_seed(3)
    old = RoPE(HEAD_DIM, max_len=64, base=THETA, traditional=interleaved)
    x = torch.randn(2, 4, 3, HEAD_DIM)
    positions = torch.tensor([[0, 1, 2, 3], [9, 10, 11, 12]])
    expected = old(x, offset=positions)
    tables = []
    for half in (old.cos[positions], old.sin[positions]):
        tables.append(half.repeat_interleave(2, -1) if interleaved else torch.cat((half, half), -1))
    torch.testing.assert_close(apply_rotary(x, *tables, interleaved=interleaved), expected,
                               rtol=0, atol=0)
    rotary = RotaryEmbedding(HEAD_DIM, base=THETA, max_len=64, interleaved=interleaved)
    assert_close(apply_rotary(x, *rotary(positions), interleaved=interleaved), expected,
                 atol=1e-5)


def test_one_dimensional_positions_broadcast_over_the_batch() -> None:
    torch.manual_seed(4)
    rotary = RotaryEmbedding(HEAD_DIM, base=THETA, max_len=16)
    cos, sin = rotary(torch.arange(3, 7))
    assert cos.shape == (1, 4, HEAD_DIM)
    x = torch.randn(3, 4, 2, HEAD_DIM)
    per_row = apply_rotary(x, *rotary(torch.arange(3, 7).expand(3, 4)))
    torch.testing.assert_close(apply_rotary(x, cos, sin), per_row, rtol=0, atol=0)
    empty = rotary(torch.zeros(2, 0, dtype=torch.long))[0]
    assert empty.shape == (2, 0, HEAD_DIM)
    # Meta tensors have no values: a shape-only run skips the bounds check (and leaves the
    # module as it was).
    assert rotary(torch.zeros(2, 5, dtype=torch.long, device="meta"))[1].shape == (2, 5, HEAD_DIM)
    torch.testing.assert_close(rotary(torch.arange(3, 7)), (cos, sin), rtol=0, atol=0)


def test_no_table_of_max_len_rows_and_robust_to_meta_and_dtype_casts() -> None:
    with torch.device("meta"):  # how the loader builds a model before assigning weights
        rotary = RotaryEmbedding(128, base=500000.0, max_len=1 << 30,
                                 scaling=RopeScaling.from_hf(CASES["llama3"]))
    held = [t for t in vars(rotary).values() if isinstance(t, torch.Tensor)]
    assert sum(t.numel() for t in held) <= 128  # inv_freq (and its unscaled copy) only
    rotary.to(torch.bfloat16)
    cos, _ = rotary(torch.tensor([(1 << 30) - 1]))
    assert cos.dtype == torch.float32 and cos.device.type == "cpu"
    fresh = RotaryEmbedding(128, base=500000.0, max_len=1 << 30,
                            scaling=RopeScaling.from_hf(CASES["llama3"]))
    torch.testing.assert_close(cos, fresh(torch.tensor([(1 << 30) - 1]))[0], rtol=0, atol=0)


def test_scaling_round_trips_through_json() -> None:
    for params in CASES.values():
        scaling = RopeScaling.from_hf(params)
        text = json.dumps(scaling.to_dict())
        assert RopeScaling.from_dict(json.loads(text)) == scaling
    assert RopeScaling.from_hf(None) == RopeScaling.from_hf({}) == RopeScaling()
    eight = RopeScaling.from_hf({"rope_type": "linear", "factor": 8})  # JSON ints: floats
    assert type(eight.factor) is float and eight.to_dict()["factor"] == 8.0
    # The old key "type" and JSON nulls read as transformers reads them.
    assert RopeScaling.from_hf({"type": "yarn", "factor": 2.0, "beta_fast": None}) == \
        RopeScaling(rope_type="yarn", factor=2.0)


@pytest.mark.parametrize("params, error, words", [
    ({"rope_type": "ntk-by-parts"}, ValueError, ["rope_type", "'ntk-by-parts'", "llama3",
                                                 "yarn", "dynamic"]),
    ({"type": 3}, ValueError, ["rope_type", "3", "default"]),
    ({"rope_type": "linear", "factor": -2.0}, ValueError, ["factor", "-2.0", "> 0"]),
    ({"rope_type": "linear", "factor": "2"}, TypeError, ["factor", "'2'", "number"]),
    ({"rope_type": "linear", "factor": True}, TypeError, ["factor", "True"]),
    ({"rope_type": "linear", "factor": float("nan")}, ValueError, ["factor", "nan", "finite"]),
    ({"rope_type": "linear", "factor": 10**400}, ValueError, ["factor", "finite"]),
    # transformers requires these keys: no silent default.
    ({"rope_type": "linear"}, ValueError, ["'linear'", "missing ['factor']"]),
    ({"rope_type": "llama3", "factor": 8.0}, ValueError,
     ["missing ['low_freq_factor', 'high_freq_factor']"]),
    ({"rope_type": "dynamic", "factor": None}, TypeError, ["factor", "None"]),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0},
     ValueError, ["high_freq_factor", "4.0", "low_freq_factor"]),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}, ValueError,
     ["original_max_position_embeddings", "0"]),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8.5}, ValueError,
     ["original_max_position_embeddings", "8.5"]),
    ({"rope_type": "yarn", "factor": 2.0, "truncate": "no"}, TypeError, ["truncate", "'no'"]),
    ({"rope_type": "longrope", "short_factor": [1.0]}, ValueError, ["missing ['long_factor']"]),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": None}, ValueError,
     ["long_factor", "None"]),
    ({"rope_type": "yarn", "factor": 2.0, "truncate": None}, TypeError, ["truncate", "None"]),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": "2"}, TypeError,
     ["long_factor", "'2'"]),
    ({"rope_type": "default", "mrope_section": [2, 2]}, ValueError, ["mrope_section"]),
    ([("rope_type", "linear")], TypeError, ["list"]),
])
def test_bad_rope_scaling_is_refused_naming_the_key(params, error, words) -> None:
    with pytest.raises(error) as caught:
        RopeScaling.from_hf(params, source="cfg/config.json: rope_scaling")
    message = str(caught.value)
    assert message.startswith("cfg/config.json: rope_scaling")
    for word in words:
        assert word in message, (word, message)


def test_bad_arguments_are_refused_naming_them() -> None:
    rotary = RotaryEmbedding(8, max_len=10)
    dynamic = RotaryEmbedding(8, max_len=10, scaling=RopeScaling("dynamic", 2.0),
                              max_position_embeddings=5)
    cases = [
        (lambda: RotaryEmbedding(7, max_len=10), ValueError, ["rotary_dim", "7", "even"]),
        (lambda: RotaryEmbedding(0, max_len=10), ValueError, ["rotary_dim", "0"]),
        (lambda: RotaryEmbedding(8, max_len=0), ValueError, ["max_len", "0"]),
        (lambda: RotaryEmbedding(8, max_len=10, base=-1.0), ValueError, ["base", "-1.0"]),
        (lambda: RotaryEmbedding(8, max_len=10, base=1), ValueError, ["base", "> 1", "1"]),
        (lambda: RotaryEmbedding(8, max_len=10, base=10**400), ValueError, ["base", "finite"]),
        (lambda: RotaryEmbedding(8, max_len=10, base="1e4"), TypeError, ["base", "'1e4'"]),
        (lambda: RotaryEmbedding(8, max_len=10, scaling={"rope_type": "linear"}), TypeError,
         ["scaling", "dict"]),
        (lambda: RotaryEmbedding(2, max_len=10, scaling=RopeScaling("dynamic", 2.0)),
         ValueError, ["rotary_dim", "2"]),
        (lambda: RotaryEmbedding(8, max_len=10, scaling=RopeScaling.from_hf(CASES["longrope"])),
         ValueError, ["short_factor", "4", "8"]),
        (lambda: RopeScaling("rope"), ValueError, ["rope_type", "'rope'", "longrope"]),
        (lambda: RopeScaling.from_dict({"kind": "yarn"}), ValueError, ["kind", "rope_type"]),
        (lambda: rotary(torch.arange(4.0)), TypeError, ["positions", "float32"]),
        (lambda: rotary(torch.ones(4, dtype=torch.bool)), TypeError, ["positions", "bool"]),
        (lambda: rotary([0, 1]), TypeError, ["positions", "list"]),
        (lambda: rotary(torch.zeros(1, 2, 3, dtype=torch.long)), ValueError,
         ["positions", "(1, 2, 3)"]),
        (lambda: dynamic(torch.tensor([8, 9, 10])), ValueError, ["positions", "max_len=10",
                                                                 "10"]),
        (lambda: dynamic(torch.tensor([-1, 0])), ValueError, ["positions", "-1"]),
        (lambda: apply_rotary(torch.zeros(2, 3, 8), *rotary(torch.arange(3))), ValueError,
         ["x", "(2, 3, 8)"]),
        (lambda: apply_rotary(torch.zeros(2, 4, 1, 8), *rotary(torch.arange(3))), ValueError,
         ["cos", "(1, 3, 8)", "4"]),
        (lambda: apply_rotary(torch.zeros(2, 3, 1, 4), *rotary(torch.arange(3))), ValueError,
         ["cos", "<= 4"]),
        (lambda: apply_rotary(torch.zeros(2, 3, 1, 8), torch.zeros(3, 3, 8),
                              torch.zeros(3, 3, 8)), ValueError, ["cos", "(3, 3, 8)"]),
        (lambda: apply_rotary(torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 8),
                              torch.zeros(1, 3, 6)), ValueError, ["sin", "(1, 3, 6)"]),
        (lambda: apply_rotary(torch.zeros(1, 3, 1, 8, dtype=torch.long), *rotary(torch.arange(3))),
         TypeError, ["x", "int64", "floating"]),
        (lambda: apply_rotary(torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 8, device="meta"),
                              torch.zeros(1, 3, 8, device="meta")),
         ValueError, ["cos, sin", "cpu", "meta"]),
        (lambda: apply_rotary(torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 5),
                              torch.zeros(1, 3, 5)), ValueError, ["cos", "even"]),
    ]
    for call, error, words in cases:
        with pytest.raises(error) as caught:
            call()
        for word in words:
            assert word in str(caught.value), (word, str(caught.value))


def test_every_supported_type_is_tested() -> None:
    assert {p.get("rope_type", p.get("type")) for p in CASES.values()} == set(ROPE_TYPES)


# Every way a tensor's value reaches the host (each waits for the device).
_READ_BACKS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@pytest.mark.parametrize("case", list(CASES))
def test_only_length_chosen_scalings_read_the_positions_back(monkeypatch, case) -> None:
    rotary = rotary_pair(CASES[case], max_len=64)[0]
    positions = torch.arange(20).expand(2, 20)
    expected = rotary(positions)
    reads: list[str] = []
    for name in _READ_BACKS:
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _n=name, _m=method, **k: (
            reads.append(_n), _m(t, *a, **k))[1])
    got = rotary(positions)
    monkeypatch.undo()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    by_length = rotary.scaling.rope_type in ("dynamic", "longrope")
    assert reads == (["tolist"] if by_length else []), reads


@pytest.mark.parametrize("case", list(CASES))
def test_a_rotary_built_on_meta_holds_real_frequencies(case) -> None:
    # A model is built on "meta" and then loaded (families.loading): the rotary module, which
    # nothing loads, must come out of that block ready to run.
    with torch.device("meta"):
        built = rotary_pair(CASES[case], max_len=64)[0]
    expected = rotary_pair(CASES[case], max_len=64)[0]
    assert not list(built.buffers())
    positions = torch.tensor([[0, 5, 40, 63]])
    for got, want in zip(built(positions), expected(positions)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
