"""Transformer == torch.nn.Transformer with the weights copied across (+ the same embeddings,
positional encoding and output projection on both sides)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attnlab.models import Transformer, TransformerConfig
from conftest import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")

V_SRC, V_TGT, E, H, FF = 11, 13, 16, 4, 24


def make_pair(norm_first: bool, final_norm: bool, activation: str = "relu"):
    torch.manual_seed(0)
    config = TransformerConfig(V_SRC, V_TGT, d_model=E, num_heads=H, num_encoder_layers=2,
                               num_decoder_layers=2, d_ff=FF, dropout=0.0, activation=activation,
                               norm_first=norm_first, final_norm=final_norm, max_len=32,
                               pad_id=0, tie_output=False)
    ours = Transformer(config).eval()
    ref = nn.Transformer(E, H, 2, 2, FF, dropout=0.0, activation=activation, batch_first=True,
                         norm_first=norm_first).eval()
    # nn.Transformer always has the final norms; without them our Post-LN stack matches a
    # reference whose final norms are removed.
    if not final_norm:
        ref.encoder.norm = None
        ref.decoder.norm = None
    with torch.no_grad():
        for ours_layer, ref_layer in zip(ours.encoder.layers, ref.encoder.layers, strict=True):
            copy_common(ours_layer, ref_layer)
        for ours_layer, ref_layer in zip(ours.decoder.layers, ref.decoder.layers, strict=True):
            copy_common(ours_layer, ref_layer)
            ours_layer.cross_attn.load_state_dict(ref_layer.multihead_attn.state_dict())
            ours_layer.norm3.load_state_dict(ref_layer.norm3.state_dict())
        if final_norm:
            ours.encoder.norm.load_state_dict(ref.encoder.norm.state_dict())
            ours.decoder.norm.load_state_dict(ref.decoder.norm.state_dict())
    return ours, ref


def copy_common(ours_layer: nn.Module, ref_layer: nn.Module) -> None:
    ours_layer.self_attn.load_state_dict(ref_layer.self_attn.state_dict())
    ours_layer.ffn.linear1.load_state_dict(ref_layer.linear1.state_dict())
    ours_layer.ffn.linear2.load_state_dict(ref_layer.linear2.state_dict())
    ours_layer.norm1.load_state_dict(ref_layer.norm1.state_dict())
    ours_layer.norm2.load_state_dict(ref_layer.norm2.state_dict())


def reference_logits(ours: Transformer, ref: nn.Transformer, src, tgt, src_keep, tgt_keep):
    """Embeddings, PE and projection from our model around torch's encoder-decoder."""
    scale = math.sqrt(E)
    pe_src = ours.encoder.pos.pe[: src.shape[1]]
    pe_tgt = ours.decoder.pos.pe[: tgt.shape[1]]
    x = ours.encoder.embed.weight[src] * scale + pe_src
    y = ours.decoder.embed.weight[tgt] * scale + pe_tgt
    T = tgt.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # torch's bool masks: True = ignore
    h = ref(x, y, tgt_mask=causal, src_key_padding_mask=~src_keep,
            tgt_key_padding_mask=~tgt_keep, memory_key_padding_mask=~src_keep, tgt_is_causal=True)
    return h @ ours.output_proj.weight.T


@pytest.mark.parametrize(("norm_first", "final_norm"), [(False, False), (False, True),
                                                        (True, True)])
def test_parity_with_torch_transformer(norm_first: bool, final_norm: bool) -> None:
    ours, ref = make_pair(norm_first, final_norm)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(1, V_SRC, (3, 7), generator=g)
    tgt = torch.randint(1, V_TGT, (3, 5), generator=g)
    src[0, 5:] = 0  # right padding
    src[1, :2] = 0  # left padding
    tgt[2, 3:] = 0
    with torch.no_grad():
        expected = reference_logits(ours, ref, src, tgt, src != 0, tgt != 0)
        actual = ours(src, tgt)  # masks from pad_id
        explicit = ours(src, tgt, src_mask=src != 0, tgt_mask=tgt != 0)
    assert actual.shape == (3, 5, V_TGT)
    assert_close(actual, expected, rtol=1e-5, atol=1e-5, what="logits vs nn.Transformer")
    assert_close(explicit, actual)


def test_parity_gelu_without_padding() -> None:
    ours, ref = make_pair(True, True, activation="gelu")
    src = torch.randint(1, V_SRC, (2, 6))
    tgt = torch.randint(1, V_TGT, (2, 4))
    with torch.no_grad():
        expected = reference_logits(ours, ref, src, tgt, src != 0, tgt != 0)
        assert_close(ours(src, tgt), expected, rtol=1e-5, atol=1e-5)
