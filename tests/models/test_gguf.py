"""GGUF in: tiny GGUF files written by the ``gguf`` package's writer, loaded by
``attnlab.models.from_pretrained`` and by transformers' GGUF loader (``gguf_file=``), compared
logit for logit and token for token; the kept blocks equal to ``gguf``'s own dequantization
bit for bit; hostile files refused naming the file."""

from __future__ import annotations

import math
import shutil
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf_writing import Q, bpe_vocabulary, make, random_blocks, tiny_model, write_gguf

from attnlab.generation import generate
from attnlab.kernels import native
from attnlab.models import from_pretrained
from attnlab.models.gguf import open_gguf, tensor_weight
from attnlab.models.gguf_reader import GGUFTensor
from attnlab.quantization.kernels import QUANTIZED_KERNELS
from attnlab.quantization.modules import QuantizedEmbedding, QuantizedLinear
from attnlab.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def vocabulary() -> tuple[list[str], list[str]]:
    return bpe_vocabulary()


CASES = [("llama", Q.Q4_1), ("llama", Q.Q4_0), ("llama", Q.Q8_0), ("llama", Q.F16),
         ("llama", Q.Q5_0), ("qwen2", Q.Q4_0), ("qwen2", Q.Q8_0), ("qwen2", Q.F32),
         ("qwen3", Q.Q4_1), ("qwen3", Q.BF16), ("phi3", Q.Q4_0), ("phi3", Q.F16),
         ("gpt2", Q.Q8_0), ("gpt2", Q.F32)]


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=[f"{a}-{q.name}" for a, q in CASES])
def test_logits_and_greedy_text_match_transformers(tmp_path, vocabulary, arch, qtype):
    file, theirs = make(tmp_path, vocabulary, arch, qtype, tied=arch == "llama")
    ours = from_pretrained(file, dtype="float32")  # transformers reads a GGUF in float32
    ids = torch.randint(0, len(vocabulary[0]), (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = theirs(input_ids=ids).logits, ours(ids)
    err = (expected - got).abs().max().item()
    assert err <= 1e-4, f"max |logit difference| {err:.3g}"
    with torch.no_grad():
        want = theirs.generate(input_ids=ids, max_new_tokens=12, min_new_tokens=12,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(generate(ours, ids, 12, eos_token_id=None), want)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_kept_blocks_stay_quantized_and_dequantize_as_gguf_does(tmp_path, vocabulary, qtype):
    tokens, merges = vocabulary
    file = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama", len(tokens)), "llama", qtype,
                      tokens=tokens, merges=merges)
    for t in open_gguf(file).tensors:
        if len(t.shape) == 2:
            expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
            got = tensor_weight(t).dequantize(torch.float32)
            assert torch.equal(got, expected), t.name  # bit for bit
    ours = from_pretrained(file, kernels=False)
    bits = 8 if qtype == Q.Q8_0 else 4
    head, q_proj = ours.lm_head, ours.layers[0].self_attn.q_proj
    assert isinstance(head, QuantizedLinear) and isinstance(q_proj, QuantizedLinear)
    assert (head.bits, head.group_size, q_proj.bits, q_proj.group_size) == (bits, 32, bits, 32)
    assert isinstance(ours.embed_tokens, QuantizedEmbedding)  # tied: reads the head's table
    assert ours.embed_tokens.source is head


def test_a_folder_and_an_ollama_blob_load(tmp_path, vocabulary):
    file, _ = make(tmp_path, vocabulary, "qwen2", Q.Q8_0)
    blob = tmp_path / "blobs" / "sha256-0123abcd"
    blob.parent.mkdir()
    shutil.copy(file, blob)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = from_pretrained(file)(ids)
        assert torch.equal(from_pretrained(blob)(ids), expected)
        assert torch.equal(from_pretrained(tmp_path)(ids), expected)


def _header(file, tensors: int, kvs: int) -> None:
    data = bytearray(file.read_bytes())
    data[8:24] = struct.pack("<QQ", tensors, kvs)
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["tensor count", "kv count", "truncated", "not gguf",
                                    "block count", "width"])
def test_a_hostile_file_is_refused_naming_it(tmp_path, vocabulary, damage):
    tokens, merges = vocabulary
    file = write_gguf(tmp_path / "bad.gguf", tiny_model("llama", len(tokens)), "llama", Q.Q4_0,
                      tokens=tokens, merges=merges)
    if damage == "tensor count":
        _header(file, 2**60, 0)
    elif damage == "kv count":
        _header(file, 1, 2**62)
    elif damage in ("block count", "width"):  # a metadata value past what the tensors hold
        data = bytearray(file.read_bytes())
        key = b"llama.block_count" if damage == "block count" else b"llama.embedding_length"
        at = data.index(key) + len(key) + 4  # after the key, its u32 type: the u32 value
        data[at:at + 4] = struct.pack("<I", 2**31 - 1)
        file.write_bytes(bytes(data))
    elif damage == "truncated":  # the last tensor reaches past the end
        file.write_bytes(file.read_bytes()[:-100])
    else:
        file.write_bytes(b"GGUX" + file.read_bytes()[4:])
    # without its magic the file is no GGUF to from_pretrained (it then wants a folder)
    load = open_gguf if damage == "not gguf" else from_pretrained
    with pytest.raises(ValueError, match=r"bad\.gguf"):
        load(file)


def test_quantize_is_refused_for_a_gguf(tmp_path, vocabulary):
    file, _ = make(tmp_path, vocabulary, "llama", Q.Q8_0)
    with pytest.raises(ValueError, match="quantize"):
        from_pretrained(file, quantize="int8")


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_the_kernels_chosen_by_the_rule_agree_with_the_formula(tmp_path, vocabulary, qtype,
                                                               native_kernels, monkeypatch):
    tokens, merges = vocabulary
    file = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama", len(tokens)), "llama", qtype,
                      tokens=tokens, merges=merges)
    formula = from_pretrained(file, kernels=False)
    monkeypatch.delenv("ATTNLAB_KERNELS")
    fast = from_pretrained(file)
    ids = torch.randint(0, len(tokens), (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        err = (fast(ids) - formula(ids)).abs().max().item()
        step = (fast(ids[:1, :1]) - formula(ids[:1, :1])).abs().max().item()  # decoding rows
    assert max(err, step) <= 1e-4, (err, step)


def test_grouped_int8_runs_its_own_kernel_and_looks_up_rows(tmp_path, vocabulary):
    tokens, merges = vocabulary
    file = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama", len(tokens), tied=False),
                      "llama", Q.Q8_0, tokens=tokens, merges=merges)
    ours = from_pretrained(file, kernels=False)
    weight = ours.embed_tokens.source.weight_format
    assert weight.bits == 8 and weight.group_size == 32 and not weight.per_row
    for dtype in (torch.float32, torch.bfloat16):
        takers = [n for n, k in QUANTIZED_KERNELS.items() if k.takes(weight, dtype)]
        # No per-row int8 kernel reads grouped scales: the formula, and the grouped GEMV
        # where the native kernels are built.
        assert takers == ["dequantize", *(["int8_grouped"] if native.available() else [])]
    ids = torch.tensor([[5, 0, 17], [3, 3, 1]])
    assert torch.equal(ours.embed_tokens(ids), weight.dequantize()[ids])


def test_a_q8_0_file_decodes_on_the_grouped_kernel_with_transformers_greedy_text(
        tmp_path, vocabulary, native_kernels, monkeypatch):
    """The rule plans ``int8_grouped`` for every Q8_0 product (the tied embedding/output
    table too) and ``print(model)`` names it once planned; the one-call decoding step takes
    the model; the greedy text equals transformers' (which dequantizes the file to
    float32)."""
    file, theirs = make(tmp_path, vocabulary, "llama", Q.Q8_0)
    monkeypatch.delenv("ATTNLAB_KERNELS")
    ours = from_pretrained(file)
    steps = [0]
    real = native.decode_layers

    def counting(*args):
        steps[0] += 1
        return real(*args)

    monkeypatch.setattr(native, "decode_layers", counting)
    ids = torch.randint(0, len(vocabulary[0]), (2, 11),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs.generate(input_ids=ids, max_new_tokens=12, min_new_tokens=12,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(generate(ours, ids, 12, eos_token_id=None), want)
    assert steps[0] == 11  # every one-token step after the prompt
    linears = [m for m in ours.modules() if isinstance(m, QuantizedLinear)]
    assert linears and all("1=int8_grouped 2-8=int8_grouped 9-32=int8_grouped" in repr(m)
                           for m in linears)  # planned on their first call


@pytest.mark.parametrize("qtype", [Q.Q3_K, Q.Q2_K], ids=lambda q: q.name)
def test_types_without_a_format_are_dequantized_with_a_notice(tmp_path, vocabulary, qtype,
                                                              capsys):
    file, theirs = make(tmp_path, vocabulary, "llama", qtype, width=256)
    ours = from_pretrained(file, kernels=False)
    assert f"{qtype.name} tensors dequantized to float32" in capsys.readouterr().err
    tensor = next(t for t in open_gguf(file).tensors if t.name == "blk.0.ffn_up.weight")
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    assert torch.equal(ours.layers[0].mlp.up_proj.weight, expected)
    ids = torch.randint(0, len(vocabulary[0]), (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        err = (theirs(input_ids=ids).logits - ours(ids)).abs().max().item()
    assert err <= 1e-4, f"max |logit difference| {err:.3g}"


def test_saving_a_model_with_gguf_blocks_is_refused(tmp_path, vocabulary):
    tokens, merges = vocabulary
    file = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama", len(tokens)), "llama", Q.Q4_0,
                      tokens=tokens, merges=merges)
    with pytest.raises(ValueError, match="GGUF"):
        from_pretrained(file).save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


@pytest.mark.parametrize(("qtype", "dtype"), [(Q.BF16, torch.bfloat16), (Q.F16, torch.float32),
                                               (Q.F32, torch.float32), (Q.Q8_0, torch.float32)],
                         ids=lambda v: str(v))
def test_a_file_of_bfloat16_matrices_loads_in_bfloat16_by_default(tmp_path, vocabulary, qtype,
                                                                  dtype):
    file, theirs = make(tmp_path, vocabulary, "llama", qtype)
    ours = from_pretrained(file)
    assert ours.dtype == dtype
    if qtype == Q.Q8_0:  # its kernels chosen at load, shown before the first call
        assert f"kernels=({str(dtype).removeprefix('torch.')}: " in repr(ours.layers[0].mlp)
    if qtype == Q.BF16:  # the file's numbers as they are, not widened
        weight = ours.layers[0].self_attn.o_proj.weight
        assert weight.dtype == torch.bfloat16
        assert torch.equal(weight.float(), theirs.model.layers[0].self_attn.o_proj.weight)
    ids = torch.randint(0, len(vocabulary[0]), (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, expected = ours(ids).float(), theirs(input_ids=ids).logits
    assert (got - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


def test_a_bfloat16_load_keeps_the_blocks_with_scales_in_bfloat16(tmp_path, vocabulary):
    file, theirs = make(tmp_path, vocabulary, "llama", Q.Q4_1)
    ours = from_pretrained(file, dtype="bfloat16")
    q_proj = ours.layers[0].self_attn.q_proj
    # the module's activations' dtype is the load's: its formula's W' is made in it
    assert q_proj.scales.dtype == q_proj.dtype == q_proj.dequantize().dtype == torch.bfloat16
    ids = torch.randint(0, len(vocabulary[0]), (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, expected = ours(ids), theirs(input_ids=ids).logits
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected).abs().max().item() <= 0.1 * expected.abs().max().item()


@pytest.mark.parametrize(("qtype", "bits", "group"), [(Q.Q5_0, 8, 32), (Q.Q6_K, 8, 16),
                                                      (Q.Q4_K, 4, 32)], ids=lambda v: str(v))
def test_q5_0_q6_k_and_q4_k_stay_quantized(tmp_path, vocabulary, qtype, bits, group, capsys):
    file, theirs = make(tmp_path, vocabulary, "llama", qtype, width=256)
    ours = from_pretrained(file, kernels=False)
    assert "dequantized" not in capsys.readouterr().err
    up = ours.layers[0].mlp.up_proj
    assert isinstance(up, QuantizedLinear) and (up.bits, up.group_size) == (bits, group)
    for t in open_gguf(file).tensors:
        if len(t.shape) == 2:
            expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
            if qtype == Q.Q4_K:
                check_q4_k(t, expected)
            else:
                assert torch.equal(tensor_weight(t).dequantize(), expected), t.name  # bitwise
    ids = torch.randint(0, len(vocabulary[0]), (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        err = (theirs(input_ids=ids).logits - ours(ids)).abs().max().item()
    assert err <= 1e-4, f"max |logit difference| {err:.3g}"


def test_q4_k_zeros_not_exact_in_float32_stay_within_the_bound():
    # d and dmin of full half-precision mantissas, 2^-12 apart: 8 d sc - dmin m needs more
    # than float32's 24 bits in most groups
    data = random_blocks((64, 512), Q.Q4_K, seed=7).reshape(64, 2, 144)
    data[..., 0:2] = np.full((64, 2, 1), 1.9990234375, np.float16).view(np.uint8)
    data[..., 2:4] = np.full((64, 2, 1), 1.9990234375 * 2**-12, np.float16).view(np.uint8)
    data = data.reshape(64, -1)
    t = GGUFTensor("w", Q.Q4_K, (512, 64), data.size, 0, data)
    assert check_q4_k(t, torch.from_numpy(gguf.quants.dequantize(data, Q.Q4_K))) > 0


def check_q4_k(t, expected) -> int:
    """Q4_K kept as int4: bit for bit in the groups whose zero 8 d sc - dmin m is exact in
    float32, else within one rounding of the zero and of the weight (gguf_blocks'
    docstring); returns the number of inexact groups."""
    weight = tensor_weight(t)
    got = weight.dequantize(torch.float32)
    z = weight.zeros.repeat_interleave(32, dim=1)
    bound = 2.0**-24 * (z.abs() + 2 * expected.abs()) * (1 + 2.0**-20)
    assert bool(((got - expected).abs() <= bound).all()), t.name
    blocks = t.data.reshape(-1, 144)  # d, dmin, 12 bytes of 6-bit sc/m, the codes
    dmin = torch.from_numpy(blocks[:, 2:4].copy().view(np.float16)).double()
    m = torch.from_numpy(gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])[1].astype(float))
    true_z = 8 * weight.scales.double() - (dmin * m).view(weight.scales.shape)
    exact = (true_z == weight.zeros.double()).repeat_interleave(32, dim=1)
    assert torch.equal(got[exact], expected[exact]), t.name
    return int((~exact).sum()) // 32


def test_a_model_split_into_shards_loads_as_one(tmp_path, vocabulary):
    tokens, merges = vocabulary
    hf_model = tiny_model("qwen2", len(tokens))
    whole = write_gguf(tmp_path / "whole.gguf", hf_model, "qwen2", Q.Q8_0, tokens=tokens,
                       merges=merges)
    (tmp_path / "split").mkdir()
    first = write_gguf(tmp_path / "split" / "tiny.gguf", hf_model, "qwen2", Q.Q8_0,
                       tokens=tokens, merges=merges, split_max_tensors=8)
    shards = sorted((tmp_path / "split").iterdir())
    assert first.name == "tiny-00001-of-00004.gguf" and len(shards) == 4
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected = from_pretrained(whole)(ids)
        for path in (first, shards[2], tmp_path / "split"):  # any shard, or their folder
            assert torch.equal(from_pretrained(path)(ids), expected), path
    assert Tokenizer.from_pretrained(shards[1]).encode("The quick") == (
        Tokenizer.from_pretrained(whole).encode("The quick"))
    shards[3].unlink()
    with pytest.raises(ValueError, match=r"tiny-00004-of-00004\.gguf: shard 4 of 4 is missing"):
        from_pretrained(first)


def test_rope_freqs_scale_the_rotary_frequencies_as_llama_cpp_does(tmp_path, vocabulary):
    # A Llama 3-scaled model as llama.cpp's converter writes it: the scaling as rope_freqs,
    # one divisor per frequency (its formula below), read by attnlab as the scaled model.
    tokens, merges = vocabulary
    theirs = tiny_model("llama", len(tokens))
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    theirs.config.rope_parameters = {**theirs.config.rope_parameters, **scaling}
    theirs = type(theirs)(theirs.config).eval()  # rebuilt: its rotary embedding scaled
    theirs.load_state_dict(tiny_model("llama", len(tokens)).state_dict())
    file = write_gguf(tmp_path / "tiny.gguf", theirs, "llama", Q.F32, tokens=tokens,
                      merges=merges, extra={"rope_freqs.weight": _llama3_factors(16, scaling)})
    ours = from_pretrained(file, kernels=False)
    ids = torch.randint(0, len(tokens), (1, 200), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        err = (ours(ids) - expected).abs().max().item()
        unscaled = (tiny_model("llama", len(tokens))(input_ids=ids).logits - expected).abs()
    assert err <= 1e-4, f"max |logit difference| {err:.3g}"
    assert unscaled.max().item() > 100 * max(err, 1e-6)  # the scaling changes the logits


def _llama3_factors(head_dim: int, s: dict) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old = s["original_max_position_embeddings"]
    low, high = old / s["low_freq_factor"], old / s["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"]
                                                               - s["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)
