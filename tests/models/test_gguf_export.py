"""GGUF out: ``export_gguf`` / ``DecoderLM.save_gguf`` / ``attnlab export-gguf`` write a file
that transformers' GGUF loader (``gguf_file=``) and attnlab's own read back as the model they
came from; the block types are ``gguf.quants.quantize``'s; the tokenizer and chat template
travel in the metadata; an interrupted write leaves no file."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from gguf_writing import SPECIALS, TEMPLATE, Q, bpe_vocabulary, tiny_model
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from attnlab.cli import main
from attnlab.models import export_gguf, from_pretrained
from attnlab.models.gguf import open_gguf
from attnlab.models.gguf_tokenizer import SPLITS, pre_tokenizer_name
from attnlab.tokenizer import Tokenizer
from conftest import assert_close

# Largest |logit difference| against the transformers model the file was made from (f32: the
# tolerance table, and each implementation exactly); f16/bf16/blocks round each weight, so
# only a loose bound applies there (the blocks' exactness is test_block_types_are_gguf_quantize's,
# and attnlab's and transformers' loads of one file agree within the float32 table).
TOLERANCE = {"f32": 1e-4, "f16": 0.05, "bf16": 0.2, "q8_0": 0.2, "q4_0": 2.0, "q4_1": 2.0}
ARCHS = ["llama", "qwen2", "qwen3", "phi3", "gpt2"]


@pytest.fixture(scope="module")
def vocabulary() -> tuple[list[str], list[str]]:
    return bpe_vocabulary()


def folder_of(tmp_path, vocabulary, arch: str, *, tied: bool = True):
    """A transformers model of ``arch`` saved with a byte-level BPE tokenizer (Qwen2's split)
    and a chat template; returns ``(folder, the transformers model)``."""
    tokens, merges = vocabulary
    theirs = tiny_model(arch, len(tokens), tied=tied)
    folder = tmp_path / f"{arch}-hf"
    theirs.save_pretrained(folder)
    backend = Backend(models.BPE({t: i for i, t in enumerate(tokens)},
                                 [tuple(m.split(" ")) for m in merges], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLITS["qwen2"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
         "chat_template": TEMPLATE}))
    return folder, theirs


def logits_error(file, theirs, vocab: int) -> tuple[float, float]:
    """Largest |logit difference| of transformers' and attnlab's loads of ``file`` against
    ``theirs``; the two loads agree within the float32 tolerance table (same weights)."""
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(1))
    back = tf.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                   dtype=torch.float32).eval()
    ours = from_pretrained(file, dtype="float32", kernels=False)  # as transformers reads it
    with torch.no_grad():
        expected, got, read = theirs(input_ids=ids).logits, ours(ids), back(input_ids=ids).logits
    assert_close(got, read, what="attnlab's and transformers' loads of the file")
    return (read - expected).abs().max().item(), (got - expected).abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
def test_an_f32_export_reads_back_as_the_same_model(tmp_path, vocabulary, arch):
    folder, theirs = folder_of(tmp_path, vocabulary, arch, tied=arch != "phi3")
    model = from_pretrained(folder, kernels=False)
    # the tokenizer's pad id: transformers' Phi-3 config defaults to 32000, past this vocabulary
    file = model.save_gguf(tmp_path / "out.gguf", type="f32",
                           tokenizer=Tokenizer.from_pretrained(folder))
    reader = open_gguf(file)
    assert reader.fields["general.architecture"] == arch
    assert all(t.tensor_type == Q.F32 for t in reader.tensors)
    back = from_pretrained(file, kernels=False)
    for name, value in model.state_dict().items():  # float32 weights stored bit for bit
        assert torch.equal(back.state_dict()[name], value), name
    # each implementation reads the file back as exactly the model it was made from
    ids = torch.randint(0, len(vocabulary[0]), (2, 11), generator=torch.Generator().manual_seed(1))
    theirs_back = tf.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name,
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
        assert torch.equal(theirs_back(input_ids=ids).logits, theirs(input_ids=ids).logits)
        # and the two implementations agree within the float32 tolerance table
        assert_close(back(ids), theirs_back(input_ids=ids).logits, what="logits")


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_gemma_reads_back_with_its_norms(tmp_path, vocabulary, kind):
    # transformers reads no Gemma (1) GGUF: attnlab's load against the transformers model
    folder, theirs = folder_of(tmp_path, vocabulary, "gemma")
    file = export_gguf(from_pretrained(folder, kernels=False), tmp_path / "out.gguf", type=kind)
    reader = open_gguf(file)
    norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    stored = torch.tensor(gguf.quants.dequantize(norm.data, norm.tensor_type).reshape(-1))
    assert torch.equal(stored, theirs.model.layers[0].input_layernorm.weight.detach() + 1)
    ids = torch.randint(0, len(vocabulary[0]), (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (from_pretrained(file, kernels=False)(ids) - theirs(input_ids=ids).logits).abs()
    assert err.max().item() <= TOLERANCE[kind], err.max().item()


@pytest.mark.parametrize("kind", ["f16", "bf16", "q8_0", "q4_0", "q4_1"])
def test_each_type_reads_back_in_transformers_and_attnlab(tmp_path, vocabulary, kind):
    folder, theirs = folder_of(tmp_path, vocabulary, "qwen2")
    file = export_gguf(from_pretrained(folder, kernels=False), tmp_path / "out.gguf", type=kind)
    theirs_err, ours_err = logits_error(file, theirs, len(vocabulary[0]))
    assert max(theirs_err, ours_err) <= TOLERANCE[kind], (theirs_err, ours_err)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "bf16", "f16"])
def test_block_types_are_gguf_quantize(tmp_path, vocabulary, kind):
    folder, _ = folder_of(tmp_path, vocabulary, "llama")
    model = from_pretrained(folder, kernels=False)
    file = export_gguf(model, tmp_path / "out.gguf", type=kind)
    qtype = Q[kind.upper()]
    state = model.state_dict()
    # the tensors stored in our row order (Llama's q/k rows are interleaved)
    ours = {"token_embd.weight": "embed_tokens.weight",
            **{f"blk.{i}.{theirs}.weight": f"layers.{i}.{mine}.weight" for i in range(2)
               for theirs, mine in (("attn_v", "self_attn.v_proj"), ("ffn_up", "mlp.up_proj"),
                                    ("ffn_down", "mlp.down_proj"),
                                    ("attn_output", "self_attn.o_proj"))}}
    compared = 0
    for t in open_gguf(file).tensors:
        if len(t.shape) == 1:
            assert t.tensor_type == Q.F32, t.name
            continue
        assert t.tensor_type == qtype, t.name
        if t.name in ours:
            expected = gguf.quants.quantize(state[ours[t.name]].numpy(), qtype)
            assert np.array_equal(t.data.ravel(), expected.view(np.uint8).ravel()), t.name
            compared += 1
    assert compared == len(ours)


def test_the_tokenizer_and_chat_template_travel_in_the_metadata(tmp_path, vocabulary):
    folder, _ = folder_of(tmp_path, vocabulary, "qwen2")
    ours = Tokenizer.from_pretrained(folder)
    file = export_gguf(from_pretrained(folder, kernels=False), tmp_path / "out.gguf",
                       type="q8_0", tokenizer=ours)
    theirs = tf.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    back = Tokenizer.from_pretrained(file)
    for text in ["The quick brown fox", "  spaces\n\nand tabs\t!", "Ünïcödé 日本語",
                 "<|im_start|>user\nhi<|im_end|>", "12345 don't"]:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids, text
        assert back.encode(text) == ids, text
    messages = [{"role": "user", "content": "2+2?"}]
    assert back.apply_chat_template(messages, add_generation_prompt=True) == (
        ours.apply_chat_template(messages, add_generation_prompt=True))
    assert (back.bos_token, back.eos_token) == ("<|endoftext|>", "<|im_end|>")


@pytest.mark.parametrize("positional", [False, True])
def test_the_command_writes_the_file(tmp_path, vocabulary, capsys, positional):
    folder, theirs = folder_of(tmp_path, vocabulary, "llama")
    out = tmp_path / "cli.gguf"
    argv = ([str(folder), str(out)] if positional
            else ["--model", str(folder), "--out", str(out)])
    assert main(["export-gguf", *argv, "--type", "q8_0"]) == 0
    assert str(out) in capsys.readouterr().out
    reader = open_gguf(out)
    assert reader.fields["tokenizer.chat_template"] == TEMPLATE
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {Q.Q8_0}
    assert max(logits_error(out, theirs, len(vocabulary[0]))) <= TOLERANCE["q8_0"]


def test_an_interrupted_write_leaves_no_file(tmp_path, vocabulary, monkeypatch):
    folder, _ = folder_of(tmp_path, vocabulary, "qwen2")
    model = from_pretrained(folder, kernels=False)
    out = tmp_path / "out.gguf"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(model, out, type="q4_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # no file, no temp
    out.write_bytes(b"the old file")
    with pytest.raises(KeyboardInterrupt):
        export_gguf(model, out, type="q4_0")
    assert out.read_bytes() == b"the old file"


def test_what_gguf_cannot_hold_is_refused_naming_it(tmp_path, vocabulary):
    folder, _ = folder_of(tmp_path, vocabulary, "qwen2")
    with pytest.raises(ValueError, match="type: expected one of"):
        export_gguf(from_pretrained(folder, kernels=False), tmp_path / "x.gguf", type="q5_k")
    quantized = from_pretrained(folder, kernels=False, quantize="int8")
    with pytest.raises(ValueError, match="quantized"):
        export_gguf(quantized, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_the_command_refuses_to_overwrite_what_is_not_a_gguf(tmp_path, vocabulary, capsys):
    folder, _ = folder_of(tmp_path, vocabulary, "qwen2")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert main(["export-gguf", str(folder), str(notes)]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err and notes.read_text() == "mine"
    assert main(["export-gguf", str(folder), str(notes), "--model", str(folder)]) == 2
    assert "give the paths once" in capsys.readouterr().err


def test_a_byte_level_pre_tokenizer_is_named_as_llama_cpp_names_it():
    """llama.cpp refuses ``tokenizer.ggml.pre = "gpt2"`` ("unknown pre-tokenizer type"): GPT-2's
    byte-level split is ``gpt-2`` there."""
    assert pre_tokenizer_name({"type": "ByteLevel", "add_prefix_space": False}) == "gpt-2"
