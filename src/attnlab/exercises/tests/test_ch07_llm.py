"""Checks of tutorial 7's exercises (``attnlab exercises check 7``)."""

import tempfile

import torch

from attnlab.exercises.checks import assert_close, assert_equal, learner
from attnlab.generation import top_p_filter
from attnlab.layers import RMSNorm
from attnlab.layers.rotary import RotaryEmbedding, apply_rotary
from attnlab.models import DecoderLM, DecoderLMConfig, from_pretrained


def chapter():
    return learner(__file__)


def qwen2_like(**changes) -> DecoderLM:
    """A tiny random model of the Qwen2 layout: RMSNorm, RoPE, GQA (H=4, G=2), SwiGLU,
    q/k/v biases."""
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                   d_ff=48, max_len=64, qkv_bias=True, rope_base=1000.0,
                                   **changes)
    model = DecoderLM(config).eval()
    with torch.no_grad():  # weights large enough that a forgotten RoPE or norm shows
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
    return model


def test_7_1_precision_gap():
    model = qwen2_like()
    ids = torch.tensor([[3, 9, 4, 17, 25, 8]])
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        gap, same = chapter().precision_gap(folder, ids)
        m32, m16 = from_pretrained(folder, dtype="float32"), from_pretrained(folder,
                                                                             dtype="bfloat16")
    with torch.no_grad():
        z32, z16 = m32(ids), m16(ids).float()
    assert_close(torch.tensor(float(gap)), (z32 - z16).abs().max(), rtol=1e-4,
                 name="precision_gap(...)[0], the largest |float32 - bfloat16| logit")
    assert_equal(bool(same), torch.equal(z32.argmax(-1), z16.argmax(-1)),
                 name="precision_gap(...)[1], the same greedy token everywhere")


def test_7_2_kv_cache_bytes():
    model = qwen2_like()
    c = model.config
    for tokens in (1, 1000):
        assert_equal(chapter().kv_cache_bytes(tokens, c.num_layers, c.kv_heads, c.head_dim, 4),
                     model.make_cache(1, tokens).nbytes,
                     name=f"kv_cache_bytes({tokens}, ...) against make_cache(1, {tokens}).nbytes")
    assert_equal(chapter().kv_cache_bytes(1000, 24, 2, 64, 2), 12_288_000,
                 name="kv_cache_bytes of Qwen2.5-0.5B's shape, 1000 tokens, bfloat16")


def test_7_3_my_top_p():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 2
    for p in (0.01, 0.3, 0.5, 0.9, 0.99):
        mine = chapter().my_top_p(logits, p)
        assert_equal(mine.isfinite(), top_p_filter(logits, p).isfinite(),
                     name=f"the tokens my_top_p(logits, p={p}) keeps")
        assert_close(mine[mine.isfinite()], logits[mine.isfinite()],
                     name="the kept logits (unchanged)")


def test_7_4_shift_difference():
    ids = torch.tensor([[3, 9, 4, 17, 25]])
    rope_model = qwen2_like()
    gap = chapter().shift_difference(rope_model, ids, 7)
    assert gap < 1e-4, f"shift_difference of a RoPE model = {gap:.3g}, expected ~0"
    torch.manual_seed(0)
    learned = DecoderLM(DecoderLMConfig.gpt(64, d_model=32, num_layers=2, num_heads=4,
                                            max_len=64)).eval()
    with torch.no_grad():
        expected = (learned(ids) - learned(ids, position_ids=torch.arange(7, 12)[None])).abs()
    assert_close(torch.tensor(float(chapter().shift_difference(learned, ids, 7))),
                 expected.max(), rtol=1e-4,
                 name="shift_difference of a model with learned positions (GPT-2 style)")


def test_7_5_rms_norm():
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 32), torch.randn(32)
    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(w)
        assert_close(chapter().rms_norm(x, w, 1e-6), norm(x), name="rms_norm(x, w, 1e-6)")


def test_7_5_rope():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 16)  # B x H x L x D
    cos, sin = RotaryEmbedding(16, base=1000.0, max_len=64)(torch.arange(6))
    expected = apply_rotary(x.transpose(1, 2), cos, sin).transpose(1, 2)
    assert_close(chapter().rope(x, 1000.0), expected, atol=1e-5,
                 name="rope(x, base=1000) on B x H x L x D, positions 0..L-1")


def test_7_5_swiglu():
    mlp = qwen2_like().layers[0].mlp
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert_close(chapter().swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight,
                                      mlp.down_proj.weight), mlp(x), atol=1e-6,
                     name="swiglu(x, W_gate, W_up, W_down)")


def test_7_5_decoder_block_equals_the_models_block():
    model = qwen2_like()
    c = model.config
    block = model.layers[0]
    torch.manual_seed(1)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        expected = block(x, rotary=model.rotary(torch.arange(7)))
        mine = chapter().decoder_block(x, block.state_dict(), num_heads=c.num_heads,
                                       num_kv_heads=c.kv_heads, rope_base=c.rope_base,
                                       eps=c.norm_eps)
    assert_close(mine, expected, atol=1e-5,
                 name="decoder_block(x, block.state_dict(), ...) against the model's block 0")


def test_7_6_decoder_only_example():
    src, tgt = torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11])
    input_ids, labels = chapter().decoder_only_example(src, tgt, 3)
    assert_equal(input_ids, torch.tensor([5, 6, 7, 8, 3, 9, 10, 11]),
                 name="input_ids: the source, the separator, the target")
    assert_equal(labels, torch.tensor([-100, -100, -100, -100, -100, 9, 10, 11]),
                 name="labels: -100 on the source and the separator, the target's ids after")
    model = qwen2_like()
    loss = model(input_ids[None], labels=labels[None]).loss
    with torch.no_grad():
        logits = model(input_ids[None])[0]
    expected = torch.nn.functional.cross_entropy(logits[4:-1], tgt)
    assert_close(loss.detach(), expected, atol=1e-5,
                 name="the loss of these labels (the target's tokens, each from the ones before)")
