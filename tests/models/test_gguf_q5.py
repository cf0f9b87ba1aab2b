"""GGUF's 5-bit types with a minimum (Q5_1, Q5_K) kept quantized: a grouped int8 with an offset
per group (``attnlab.models.gguf_blocks``), equal to ``gguf``'s own dequantization bit for bit
(even where a folded offset would not be exact in float32), logits and greedy text equal to
transformers' GGUF loading, and no float32 copy of a weight held after the load."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_writing import Q, bpe_vocabulary, make, random_blocks, tiny_model, write_gguf

from attnlab.generation import generate
from attnlab.models import from_pretrained
from attnlab.models.gguf import open_gguf, tensor_weight
from attnlab.models.gguf_reader import GGUFTensor
from attnlab.quantization.kernels import QUANTIZED_KERNELS
from attnlab.quantization.modules import QuantizedEmbedding, QuantizedLinear


@pytest.fixture(scope="module")
def vocabulary() -> tuple[list[str], list[str]]:
    return bpe_vocabulary()


# Q5_1 blocks are 32 inputs, Q5_K's 256: a model 256 wide; tied and untied tables.
CASES = [("llama", Q.Q5_1, True, 64), ("qwen2", Q.Q5_1, False, 64),
         ("llama", Q.Q5_K, True, 256), ("qwen2", Q.Q5_K, False, 256)]


@pytest.mark.parametrize(("arch", "qtype", "tied", "width"), CASES,
                         ids=[f"{a}-{q.name}" for a, q, _, _ in CASES])
def test_q5_1_and_q5_k_stay_quantized_and_match_transformers(tmp_path, vocabulary, arch, qtype,
                                                             tied, width, capsys):
    file, theirs = make(tmp_path, vocabulary, arch, qtype, tied=tied, width=width)
    ours = from_pretrained(file)
    assert "dequantized" not in capsys.readouterr().err
    for module in (ours.layers[0].mlp.up_proj, ours.layers[1].self_attn.k_proj, ours.lm_head):
        assert isinstance(module, QuantizedLinear)
        assert (module.bits, module.group_size) == (8, 32)
        assert module.qweight.dtype == torch.int8 and module.zeros is not None
        assert "int8, group_size=32, offsets" in repr(module)  # print(model) shows the format
    assert isinstance(ours.embed_tokens, QuantizedEmbedding)
    assert (ours.embed_tokens.source is ours.lm_head) == tied
    for t in open_gguf(file).tensors:
        if len(t.shape) == 2:
            expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
            assert torch.equal(tensor_weight(t).dequantize(), expected), t.name  # bitwise
    ids = torch.randint(0, len(vocabulary[0]), (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (theirs(input_ids=ids).logits - ours(ids)).abs().max().item()
        want = theirs.generate(input_ids=ids, max_new_tokens=12, min_new_tokens=12,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
    assert err <= 1e-4, f"max |logit difference| {err:.3g}"
    assert torch.equal(generate(ours, ids, 12, eos_token_id=None), want)


@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.Q5_1], ids=lambda q: q.name)
def test_no_float32_copy_of_a_weight_is_held(tmp_path, vocabulary, qtype):
    # 1 byte a code and a float32 scale and offset per 32 inputs: 1.25 bytes a weight, not 4;
    # also after a forward pass (the formula dequantizes a layer's weight for its call only)
    tokens, merges = vocabulary
    file = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama", len(tokens), width=256),
                      "llama", qtype, tokens=tokens, merges=merges)
    weights = [t for t in open_gguf(file).tensors if len(t.shape) == 2]
    smallest = min(int(np.prod(t.shape)) for t in weights)
    ours = from_pretrained(file)
    with torch.no_grad():
        generate(ours, torch.tensor([[1, 2, 3]]), 2, eos_token_id=None)
    held = {id(x): x for x in (*ours.parameters(), *ours.buffers())}
    for module in ours.modules():
        if isinstance(module, QuantizedLinear):  # what its kernels prepared
            held.update({id(x): x for state in module._states.values() for x in _tensors(state)})
    floats = [x for x in held.values() if x.is_floating_point()]
    assert max(x.numel() for x in floats) < smallest / 8, sorted(x.shape for x in floats)[-3:]
    values = sum(int(np.prod(t.shape)) for t in weights)
    kept = sum(x.numel() * x.element_size() for x in held.values())
    assert kept <= 1.3 * values, (kept, values)


def _tensors(state) -> list[torch.Tensor]:
    """The tensors in a kernel's prepared state (tuples of tensors, weights and numbers)."""
    found = []
    for item in state if isinstance(state, tuple) else (state,):
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif hasattr(item, "data") and isinstance(item.data, torch.Tensor):  # QuantizedWeight
            found += [x for x in (item.data, item.scales, item.zeros) if x is not None]
    return found


def test_q5_k_is_bit_for_bit_where_a_folded_offset_would_not_be():
    # d and dmin of full half-precision mantissas, 2^-12 apart: Q4_K's 8 d sc - dmin m is
    # not exact in float32 in most groups; Q5_K keeps -dmin m itself, so every group is exact
    data = random_blocks((64, 512), Q.Q5_K, seed=7).reshape(64, 2, 176)
    data[..., 0:2] = np.full((64, 2, 1), 1.9990234375, np.float16).view(np.uint8)
    data[..., 2:4] = np.full((64, 2, 1), 1.9990234375 * 2**-12, np.float16).view(np.uint8)
    data = data.reshape(64, -1)
    weight = tensor_weight(GGUFTensor("w", Q.Q5_K, (512, 64), data.size, 0, data))
    folded = 16 * weight.scales.double() + weight.zeros.double()  # the centred codes' offset
    assert bool((folded.float().double() != folded).any())  # not exact in float32
    assert torch.equal(weight.dequantize(), torch.from_numpy(gguf.quants.dequantize(data,
                                                                                    Q.Q5_K)))


def test_q5_1_is_bit_for_bit_whatever_its_minimum():
    # a minimum about 2^22 times the step: m + 16 d has no float32 form; m itself is kept
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32) * 2**-8 + 4096
    data = gguf.quants.quantize(w, Q.Q5_1)
    weight = tensor_weight(GGUFTensor("w", Q.Q5_1, (256, 64), data.size, 0, data))
    folded = 16 * weight.scales.double() + weight.zeros.double()
    assert bool((folded.float().double() != folded).any())
    assert torch.equal(weight.dequantize(), torch.from_numpy(gguf.quants.dequantize(data,
                                                                                    Q.Q5_1)))


@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.Q5_1], ids=lambda q: q.name)
def test_grouped_int8_with_offsets_runs_the_grouped_kernel_with_its_offsets(
        tmp_path, vocabulary, qtype, native_kernels, monkeypatch):
    # no per-row int8 kernel reads offsets: the rule's plan must fall to the grouped kernel
    # (which adds them) for decoding rows and to the formula above, never to a kernel that
    # would drop them
    tokens, merges = vocabulary
    file = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama", len(tokens), width=256),
                      "llama", qtype, tokens=tokens, merges=merges)
    formula = from_pretrained(file, kernels=False)
    monkeypatch.delenv("ATTNLAB_KERNELS")
    fast = from_pretrained(file)
    down = fast.layers[0].mlp.down_proj
    for dtype in (torch.float32, torch.bfloat16):
        takers = [n for n, k in QUANTIZED_KERNELS.items() if k.takes(down.weight_format, dtype)]
        assert takers == ["dequantize", "int8_grouped"], takers
        assert [k.name for k in down.plan(dtype).values()] == [
            "int8_grouped", "int8_grouped", "int8_grouped", "dequantize"]
    ids = torch.randint(0, len(tokens), (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # the other layers' fast modules round differently: a tolerance
        expected, step = formula(ids), formula(ids[:1, :1])  # step: a decoding row
        err = (fast(ids) - expected).abs().max().item() / expected.abs().max().item()
        err_step = (fast(ids[:1, :1]) - step).abs().max().item() / step.abs().max().item()
    assert max(err, err_step) <= 1e-5, (err, err_step)


def test_a_bfloat16_load_keeps_q5_k_with_scales_and_offsets_in_bfloat16(tmp_path, vocabulary):
    file, theirs = make(tmp_path, vocabulary, "llama", Q.Q5_K, tied=True, width=256)
    ours = from_pretrained(file, dtype="bfloat16")
    up = ours.layers[0].mlp.up_proj
    assert up.qweight.dtype == torch.int8
    assert up.scales.dtype == up.zeros.dtype == torch.bfloat16
    ids = torch.randint(0, len(vocabulary[0]), (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, expected = ours(ids), theirs(input_ids=ids).logits
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected).abs().max().item() <= 0.1 * expected.abs().max().item()
