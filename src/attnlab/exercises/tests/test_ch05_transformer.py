"""Checks of tutorial 5's exercises (``attnlab exercises check 5``)."""

import torch

from attnlab.exercises.checks import assert_close, assert_equal, learner
from attnlab.masks import key_mask_to_attention_mask, padding_mask
from attnlab.models import (
    DecoderLayer,
    EncoderLayer,
    Transformer,
    TransformerConfig,
    count_parameters,
)


def chapter():
    return learner(__file__)


def small_model(**changes) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(src_vocab_size=20, tgt_vocab_size=24, d_model=32, num_heads=4,
                               num_encoder_layers=2, num_decoder_layers=3, d_ff=64,
                               dropout=0.0, max_len=32, **changes)
    return Transformer(config).eval()


def test_5_1_parameter_counts():
    for E, F, layers in [(32, 64, (2, 3)), (48, 100, (1, 4))]:
        model = small_model() if E == 32 else Transformer(TransformerConfig(
            src_vocab_size=20, tgt_vocab_size=24, d_model=E, num_heads=4, d_ff=F,
            num_encoder_layers=layers[0], num_decoder_layers=layers[1]))
        counts = chapter().parameter_counts(E, F, 20, 24, *layers)
        for key, module in [("attention", model.encoder.layers[0].self_attn),
                            ("ffn", model.encoder.layers[0].ffn),
                            ("encoder_layer", model.encoder.layers[0]),
                            ("decoder_layer", model.decoder.layers[0]),
                            ("total", model)]:
            assert_equal(counts.get(key), count_parameters(module),
                         name=f"parameter_counts(E={E}, F={F}, ...)[{key!r}]")


def test_5_2_positions_changed():
    model = small_model()
    src = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 0, 0]])
    tgt = torch.tensor([[1, 4, 5, 6, 7, 8], [1, 8, 9, 10, 11, 12]])
    for position in [0, 2, 5]:
        assert_equal(chapter().positions_changed(model, src, tgt, position),
                     torch.arange(6) >= position,
                     name=f"positions_changed(..., position={position}) (the causal mask: "
                     f"exactly the positions from {position} on)")


def test_5_3_encoder_stream_rms():
    src = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    post, pre = small_model(), small_model(norm_first=True)
    expected = []
    for model in (post, pre):
        rms = []
        hooks = [layer.register_forward_hook(
                     lambda mod, args, out, rms=rms: rms.append(out.pow(2).mean().sqrt()))
                 for layer in model.encoder.layers]
        with torch.no_grad():
            model.encode(src)
        for h in hooks:
            h.remove()
        expected.append(torch.stack(rms))
    for model, want, name in [(post, expected[0], "Post-LN"), (pre, expected[1], "Pre-LN")]:
        got = chapter().encoder_stream_rms(model, src)
        assert_close(torch.tensor(list(got), dtype=torch.float32), want, atol=1e-5,
                     name=f"encoder_stream_rms of the {name} model (one value per layer)")
    assert not any(layer._forward_hooks for layer in post.encoder.layers), (
        "encoder_stream_rms left its hooks on the model: remove them")


def test_5_4_head_dim():
    assert_equal(chapter().head_dim(512, 8), 64, name="head_dim(512, 8)")
    try:
        chapter().head_dim(30, 4)
    except ValueError as error:
        assert "d_model" in str(error) and "num_heads" in str(error), (
            f"head_dim(30, 4): the message should name d_model and num_heads, got {error!r}")
    else:
        raise AssertionError("head_dim(30, 4) should raise ValueError: 30 is not a multiple of 4")


def test_5_5_encoder_layer_equals_the_library():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32)
    mask = key_mask_to_attention_mask(padding_mask(torch.tensor([7, 5])))
    for norm_first in (False, True):
        reference = EncoderLayer(32, 4, 64, dropout=0.0, norm_first=norm_first).eval()
        mine = chapter().MyEncoderLayer(32, 4, 64, norm_first=norm_first).eval()
        mine.load_state_dict(reference.state_dict())
        with torch.no_grad():
            assert_close(mine(x, mask), reference(x, mask), atol=1e-5,
                         name=f"MyEncoderLayer(norm_first={norm_first}) with a padding mask")


def test_5_6_decoder_layer_equals_the_library():
    torch.manual_seed(0)
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    memory_mask = key_mask_to_attention_mask(padding_mask(torch.tensor([7, 5])))
    for norm_first in (False, True):
        reference = DecoderLayer(32, 4, 64, dropout=0.0, norm_first=norm_first).eval()
        mine = chapter().MyDecoderLayer(32, 4, 64, norm_first=norm_first).eval()
        mine.load_state_dict(reference.state_dict())
        with torch.no_grad():
            assert_close(mine(x, memory, memory_mask),
                         reference(x, memory, memory_mask=memory_mask), atol=1e-5,
                         name=f"MyDecoderLayer(norm_first={norm_first})")
            # The causal self-attention: position 0 must not see the later positions.
            later = x.clone()
            later[:, 1:] = torch.randn(2, 4, 32)
            assert_close(mine(later, memory, memory_mask)[:, 0],
                         mine(x, memory, memory_mask)[:, 0], atol=1e-5,
                         name="MyDecoderLayer's output at position 0 after changing positions "
                         "1.. (the self-attention must be causal)")


def test_5_7_attention_with_dropout():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 8), torch.randn(2, 9, 8), torch.randn(2, 9, 3)
    reference = torch.softmax(q @ k.transpose(-2, -1) / 8**0.5, dim=-1)
    out, weights = chapter().attention_with_dropout(q, k, v, 0.0)
    assert_close(weights, reference, name="the weights with p=0 (plain softmax)")
    p = 0.25
    out, weights = chapter().attention_with_dropout(
        q, k, v, p, generator=torch.Generator().manual_seed(1))
    kept = weights != 0
    assert_close(weights[kept], reference[kept] / (1 - p), atol=1e-6,
                 name="a kept weight (divided by 1 - p)")
    assert_close(out, weights @ v, atol=1e-6, name="the output (the dropped weights times v)")
    share = 1 - kept.float().mean().item()
    assert 0.1 < share < 0.4, f"{share:.2f} of the weights dropped with p={p}"
    again = chapter().attention_with_dropout(q, k, v, p, generator=torch.Generator().manual_seed(1))
    assert_close(again[1], weights, name="the same generator seed, the same weights dropped")
