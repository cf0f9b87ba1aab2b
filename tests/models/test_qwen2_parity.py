"""Qwen2ForCausalLM against transformers' Qwen2/Llama on tiny random checkpoints.

Each checkpoint is made here with transformers and ``save_pretrained`` and loaded by us from
the folder. Checked: logits for a left-padded batch (float32 within 1e-4), greedy generation
of 32 tokens token for token, and our KV-cached path against full recomputation.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnlab.generation import generate  # noqa: E402
from attnlab.models.qwen2 import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

V = 96
# name -> (transformers config class name, overrides, dtype, shard size)
CASES = {
    "gqa2-untied-f32": ("Qwen2Config", {"num_key_value_heads": 2}, torch.float32, None),
    "mqa-tied-f32": ("Qwen2Config", {"num_key_value_heads": 1, "tie_word_embeddings": True},
                     torch.float32, None),
    "mha-untied-sharded-f32": ("Qwen2Config", {"num_key_value_heads": 4}, torch.float32,
                               "40KB"),
    "gqa2-tied-bf16": ("Qwen2Config", {"num_key_value_heads": 2, "tie_word_embeddings": True},
                       torch.bfloat16, None),
    "llama-gqa2-f32": ("LlamaConfig", {"num_key_value_heads": 2, "head_dim": 12},
                       torch.float32, "30KB"),
}


def make_checkpoint(folder, kind: str, overrides: dict, dtype: torch.dtype,
                    shard: str | None) -> torch.nn.Module:
    """A random transformers model saved to ``folder`` (biases made non-zero); returned."""
    torch.manual_seed(0)
    sizes = {"vocab_size": V, "hidden_size": 48, "intermediate_size": 80,
             "num_hidden_layers": 2, "num_attention_heads": 4, "initializer_range": 0.1,
             "max_position_embeddings": 128, "rope_theta": 1000.0}
    config = getattr(transformers, kind)(**{**sizes, **overrides})
    model_cls = (transformers.Qwen2ForCausalLM if kind == "Qwen2Config"
                 else transformers.LlamaForCausalLM)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model = model.to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    kind, overrides, dtype, shard = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(folder, kind, overrides, dtype, shard)
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
    return hf, Qwen2ForCausalLM.from_pretrained(folder), dtype


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :9] = 0
    return ids, mask


def test_config_and_weights_are_raw(pair) -> None:
    hf, ours, dtype = pair
    c = ours.config
    assert c.num_key_value_heads == hf.config.num_key_value_heads
    assert ours.embed_tokens.weight.dtype == dtype
    assert torch.equal(ours.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == c.tie_word_embeddings
    q = hf.model.layers[1].self_attn.q_proj.weight
    assert torch.equal(ours.layers[1].self_attn.in_proj_weight[: q.shape[0]], q)


def test_logits_match_transformers_with_padding(pair) -> None:
    hf, ours, dtype = pair
    ids, mask = batch()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what transformers' generate passes
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, position_ids=positions).logits
        actual = ours(ids, attention_mask=mask)
        last = ours(ids, attention_mask=mask, logits_to_keep=1)
    real = mask.bool()
    error = (actual[real].float() - expected[real].float()).abs().max().item()
    # float32: the 1e-4; bfloat16: RMSNorm rounds its weight product once more in
    # transformers (weight * x.to(bf16)) than in ours, a few bf16 ulps of the logits.
    assert error < (1e-4 if dtype == torch.float32 else 0.1), error
    assert actual.shape == (3, 12, V) and last.shape == (3, 1, V)
    torch.testing.assert_close(last[:, 0], actual[:, -1], rtol=1e-5, atol=1e-5)


def test_greedy_generation_matches_transformers(pair) -> None:
    hf, ours, dtype = pair
    ids, mask = batch()
    if dtype != torch.float32:
        ids, mask = ids[:1], mask[:1]
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
    actual = generate(ours, ids, 32, attention_mask=mask)
    agree = (actual[:, 12:] == expected[:, 12:]).float().mean().item()
    if dtype == torch.float32:
        assert torch.equal(actual, expected)
    else:  # bfloat16 rounding could flip a near-tie; on this checkpoint it does not
        assert agree >= 0.9, agree


def test_cached_equals_full_recomputation(pair) -> None:
    _, ours, dtype = pair
    ids, mask = batch()
    with torch.no_grad():
        full = ours(ids, attention_mask=mask)
        cache = ours.make_cache(3, 12)
        parts = [ours(ids[:, :7], attention_mask=mask[:, :7], cache=cache)]
        for t in range(7, 12):
            parts.append(ours(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache))
    stepped = torch.cat(parts, dim=1)
    real = mask.bool()
    tol = 1e-5 if dtype == torch.float32 else 0.1
    assert (stepped[real].float() - full[real].float()).abs().max().item() < tol
    assert cache.length == 12
    assert torch.equal(generate(ours, ids, 6, attention_mask=mask),
                       generate(ours, ids, 6, attention_mask=mask, use_cache=False))


def test_config_reads_both_transformers_formats(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,'
        ' "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 50.0,'
        ' "torch_dtype": "bfloat16", "eos_token_id": [3, 4]}')
    c = Qwen2Config.from_hf(tmp_path)
    assert (c.rope_theta, c.torch_dtype, c.num_key_value_heads, c.head_dim) == (
        50.0, "bfloat16", 2, 4)
    assert c.eos_token_id == (3, 4) and c.attention_bias and not c.o_proj_bias
