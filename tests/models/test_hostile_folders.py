"""Model folders that must not fool or exhaust the loader (issue 40): a NaN or an infinity in
a weight is refused at load naming the tensor and the file (a NaN row of ``q_proj`` once
generated text); a config size far beyond the weights is refused naming ``config.json`` and
the key before anything proportional to it is allocated; special ids outside the vocabulary
load (transformers reads them) and are refused only where they would be used."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab.generation import generate
from attnlab.models import DecoderLM, DecoderLMConfig, from_pretrained, save_pretrained
from attnlab.models.families import family_for

HF_CONFIG = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 64}
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def folder(tmp_path):
    torch.manual_seed(0)
    config = family_for("qwen2").config_from_hf(HF_CONFIG)
    return save_pretrained(DecoderLM(config).eval(), tmp_path / "ckpt")


def edit_weights(folder, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


def edit_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize(("name", "bad"), [(Q_PROJ, float("nan")),
                                           ("model.norm.weight", float("inf")),
                                           ("model.embed_tokens.weight", float("-inf"))])
def test_a_non_finite_weight_is_refused_naming_the_tensor_and_file(folder, quantize, name,
                                                                    bad) -> None:
    def poison(tensors):
        tensors[name][3] = bad  # a whole row of q_proj: one query row of one head

    edit_weights(folder, poison)
    with pytest.raises(ValueError, match=rf"{folder / 'model.safetensors'}: tensor "
                       rf"'{name}' holds NaN or infinite values"):
        from_pretrained(folder, quantize=quantize, kernels=False)


def test_a_non_finite_weight_in_our_own_format_is_refused(tmp_path) -> None:
    torch.manual_seed(0)
    folder = DecoderLM(DecoderLMConfig.llama(vocab_size=32, d_model=32, num_layers=1,
                                             num_heads=2, max_len=16)).save_pretrained(
        tmp_path / "own")
    edit_weights(folder, lambda t: t["layers.0.self_attn.q_proj.weight"][0].fill_(torch.nan))
    with pytest.raises(ValueError, match=r"tensor 'layers\.0\.self_attn\.q_proj\.weight' holds "
                       "NaN or infinite values"):
        from_pretrained(folder)


def test_a_huge_head_dim_is_refused_by_key_before_it_allocates(folder) -> None:
    """``head_dim: 2**28`` took 1.8 GB (the rotary frequencies, made on the CPU while the model
    was built on meta) before the shape check refused it; peak memory is measured in a fresh
    process (torch's allocations are invisible to tracemalloc)."""
    edit_config(folder, head_dim=2 ** 28)
    script = textwrap.dedent(f"""
        import resource
        from attnlab.models import from_pretrained
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            from_pretrained({str(folder)!r})
        except ValueError as error:
            print(error)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
        print("grown KiB", grown)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    message, grown = run.stdout.strip().splitlines()
    assert message.startswith(f"{folder / 'config.json'}: head_dim 268435456 is more than")
    assert int(grown.split()[-1]) < 300 * 1024, run.stdout  # KiB: 1.8 GB before


@pytest.mark.parametrize("scaling", [{"rope_type": "dynamic", "factor": 1e30},
                                     {"rope_type": "linear", "factor": 1e-45}])
def test_rope_scaling_that_overflows_is_refused_at_load_naming_the_file(folder, scaling):
    """Each value in range, together past float32: dynamic's ``factor s/M - (factor - 1)`` is
    0 (1e30 - 1e30) raised to a power, linear's frequencies divided by ~0. These loaded and
    gave NaN logits at the first token."""
    edit_config(folder, rope_parameters={"rope_theta": 10000.0, **scaling})
    with pytest.raises(ValueError) as error:
        from_pretrained(folder)
    message = str(error.value)
    assert message.startswith(f"{folder / 'config.json'}: rope_scaling: "
                              f"{scaling['rope_type']} scaling with")
    assert "gives non-finite rotary frequencies" in message


@pytest.mark.parametrize("key", ["bos_token_id", "eos_token_id"])
def test_special_ids_outside_the_vocabulary_load_and_are_refused_where_used(folder,
                                                                             key) -> None:
    edit_config(folder, **{key: 50256})  # as tiny test checkpoints keep GPT-2's end id
    model = from_pretrained(folder, kernels=False)
    assert getattr(model.config, key) in (50256, (50256,))
    prompt = torch.tensor([[1, 2, 3]])
    assert generate(model, prompt, 2).shape == (1, 5)  # unused: no harm
    message = r"expected a token id in \[0, 64\) \(the model's vocabulary\), got 50256"
    with pytest.raises(ValueError, match=rf"eos_token_id: {message}"):
        generate(model, prompt, 2, eos_token_id=50256)
    with pytest.raises(ValueError, match=rf"pad_token_id: {message}"):
        generate(model, prompt, 2, pad_token_id=50256)


def test_a_nan_row_of_q_proj_in_memory_reaches_the_nan_logits_check() -> None:
    """What the load check guards against: the fused attention kernel once returned zeros for
    the NaN query row and the model generated text; NaN now flows to the logits' check."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama(vocab_size=64, d_model=32, num_layers=2,
                                            num_heads=4, max_len=32)).eval()
    with torch.no_grad():
        model.layers[1].self_attn.q_proj.weight[3] = float("nan")
    with pytest.raises(ValueError, match=r"logits .*: row 0 \(of 1\) holds NaN"):
        generate(model, torch.tensor([[1, 2, 3]]), 4)
