"""``attnlab.layers.initialisation``: a model built on the meta device imports no compiler
(the memory of a GGUF or quantized load), and a real one is still initialised as before."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from torch import nn

from attnlab.layers import initialisation
from attnlab.models import DecoderLM, DecoderLMConfig

BUILD_ON_META = textwrap.dedent("""
    import sys
    import torch
    from attnlab.models import DecoderLM, DecoderLMConfig, Transformer, TransformerConfig
    from attnlab.quantization import QuantizedLinear
    with torch.device("meta"):
        DecoderLM(DecoderLMConfig(vocab_size=64, d_model=32, num_heads=4, num_layers=2,
                                  position="learned"))
        Transformer(TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32,
                                      num_heads=4, num_encoder_layers=1, num_decoder_layers=1))
    QuantizedLinear(64, 32, True, bits=4, group_size=32, device="meta")
    print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
""")


def test_building_on_meta_imports_neither_dynamo_nor_sympy():
    run = subprocess.run([sys.executable, "-c", BUILD_ON_META], capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout  # ~70 MiB when imported


def test_normal_leaves_a_meta_tensor_and_fills_a_real_one():
    meta = torch.empty(3, 4, device="meta")
    assert initialisation.normal_(meta, std=0.5) is meta
    real = torch.zeros(200, 300)
    initialisation.normal_(real, std=0.5)
    assert abs(real.std().item() - 0.5) < 0.02 and abs(real.mean().item()) < 0.01


def test_a_real_model_is_still_initialised_with_its_std():
    config = DecoderLMConfig(vocab_size=2000, d_model=64, num_heads=4, num_layers=1,
                             initializer_range=0.05)
    torch.manual_seed(0)
    model = DecoderLM(config)
    table = model.embed_tokens.weight
    assert table.requires_grad
    assert abs(table.std().item() - 0.05) < 0.002 and abs(table.mean().item()) < 0.002


def test_a_real_embedding_draws_as_nn_embedding_so_seeded_models_keep_their_weights():
    torch.manual_seed(3)
    ours = initialisation.embedding(50, 8)
    after_ours = torch.rand(1)
    torch.manual_seed(3)
    theirs = nn.Embedding(50, 8)
    assert torch.equal(ours.weight, theirs.weight) and torch.equal(torch.rand(1), after_ours)
    with torch.device("meta"):
        assert initialisation.embedding(50, 8).weight.is_meta
