"""Qwen2 through the generic decoder, against transformers' Qwen2ForCausalLM (and a Llama
checkpoint beside it), ported from the old Qwen2ForCausalLM tests: GQA, MQA, MHA, tied and
untied heads, sharded, bfloat16; logits of a left-padded batch, ``logits_to_keep``, greedy
generation token for token, cached == full."""

from __future__ import annotations

import json

import pytest
import torch
from family_parity import (
    V,
    assert_cache_matches_full,
    assert_greedy_match,
    assert_logits_match,
    left_padded_batch,
    load,
    tiny_checkpoint,
)

from attnlab.generation import generate
from attnlab.models import from_pretrained

transformers = pytest.importorskip("transformers")

SIZES = {"vocab_size": V, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
         "num_attention_heads": 4, "initializer_range": 0.1, "max_position_embeddings": 128,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}
# name -> (model type, overrides, dtype, shard size)
CASES = {
    "gqa2-untied-f32": ("qwen2", {"num_key_value_heads": 2}, torch.float32, None),
    "mqa-tied-f32": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True},
                     torch.float32, None),
    "mha-untied-sharded-f32": ("qwen2", {"num_key_value_heads": 4}, torch.float32, "40KB"),
    "gqa2-tied-bf16": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True},
                       torch.bfloat16, None),
    "llama-gqa2-f32": ("llama", {"num_key_value_heads": 2, "head_dim": 12}, torch.float32,
                       "30KB"),
}
CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "llama": ("LlamaConfig", "LlamaForCausalLM")}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    kind, overrides, dtype, shard = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[kind])
    hf = tiny_checkpoint(folder, model_cls, config_cls(**SIZES, **overrides), dtype=dtype,
                         shard=shard)
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
    return hf, load(folder), dtype


def test_config_and_weights_are_raw(pair) -> None:
    hf, ours, dtype = pair
    c = ours.config
    assert c.kv_heads == hf.config.num_key_value_heads
    assert c.family == hf.config.model_type
    assert ours.embed_tokens.weight.dtype == dtype
    assert all(p.requires_grad for p in ours.parameters())
    assert torch.equal(ours.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == c.tie_embeddings
    for p in "qkvo":
        mine = getattr(ours.layers[1].self_attn, f"{p}_proj")
        theirs = getattr(hf.model.layers[1].self_attn, f"{p}_proj")
        assert torch.equal(mine.weight, theirs.weight)
        assert (mine.bias is None) == (theirs.bias is None)
        if mine.bias is not None:
            assert torch.equal(mine.bias, theirs.bias)
    assert (ours.layers[0].self_attn.q_proj.bias is not None) == (c.family == "qwen2")


def test_logits_match_transformers_with_padding(pair) -> None:
    hf, ours, dtype = pair
    # float32: the 1e-4; bfloat16: RMSNorm rounds its weight product once more in
    # transformers (weight * x.to(bf16)) than in ours, a few bf16 ulps of the logits.
    assert_logits_match(hf, ours, atol=1e-4 if dtype == torch.float32 else 0.1)
    ids, mask = left_padded_batch(1)
    with torch.no_grad():
        actual, last = ours(ids, mask), ours(ids, mask, logits_to_keep=1)
    assert actual.shape == (3, 13, V) and last.shape == (3, 1, V)
    torch.testing.assert_close(last[:, 0], actual[:, -1], rtol=1e-5, atol=1e-5)


def test_greedy_generation_matches_transformers(pair) -> None:
    hf, ours, dtype = pair
    if dtype == torch.float32:
        assert_greedy_match(hf, ours, new_tokens=32)
        return
    # bfloat16: one rounding in another order can flip a near-tie and the rows then part
    # ways, so the logits carry the real check there; here 90% of the tokens must agree.
    ids, mask = left_padded_batch(2)
    with torch.no_grad():
        expected = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32,
                               min_new_tokens=32, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
    got = generate(ours, ids, 32, attention_mask=mask, eos_token_id=None)
    new = slice(ids.shape[1], None)
    assert (got[:, new] == expected[:, new]).float().mean() >= 0.9


def test_cached_equals_full_recomputation(pair) -> None:
    _, ours, dtype = pair
    if dtype == torch.float32:
        assert_cache_matches_full(ours)
    ids, mask = left_padded_batch(1)
    assert torch.equal(generate(ours, ids, 6, attention_mask=mask),
                       generate(ours, ids, 6, attention_mask=mask, use_cache=False))


def test_config_reads_both_transformers_formats(tmp_path) -> None:
    """transformers 4 wrote ``rope_theta`` and ``torch_dtype``; 5 ``rope_parameters``, ``dtype``."""
    torch.manual_seed(0)
    old = {"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
           "rope_theta": 50.0,
           "torch_dtype": "bfloat16", "eos_token_id": [3, 4]}
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**old)).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_parameters"]["rope_theta"] == 50.0
    for config in (old, written):
        (tmp_path / "config.json").write_text(json.dumps(config))
        ours = from_pretrained(tmp_path)
        c = ours.config
        assert (c.rope_base, c.kv_heads, c.head_dim, c.eos_token_id) == (50.0, 2, 4, (3, 4))
        assert ours.embed_tokens.weight.dtype == torch.bfloat16
        assert c.resolved_bias("qkv_bias") and not c.resolved_bias("o_bias")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("use_sliding_window", True, "use_sliding_window=true is not supported for qwen2"),
    ("layer_types", ["full_attention", "sliding_attention"],
     r"layer_types\[1\]='sliding_attention' is not supported for qwen2"),
])
def test_sliding_window_is_refused_clearly(tmp_path, key, value, message) -> None:
    config = transformers.Qwen2Config(**SIZES, num_key_value_heads=2)
    tiny_checkpoint(tmp_path, transformers.Qwen2ForCausalLM, config)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, key: value}))
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'config.json'}: {message}"):
        from_pretrained(tmp_path)
