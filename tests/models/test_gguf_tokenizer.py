"""The tokenizer and chat template of a GGUF file (``Tokenizer.from_gguf``, and
``Tokenizer.from_pretrained`` on a GGUF file) against transformers' GGUF tokenizer on test
texts, for the byte-level BPE pre-tokenizers a file may name."""

from __future__ import annotations

import pytest
import transformers as tf
from gguf_writing import Q, bpe_vocabulary, sentencepiece_vocabulary, tiny_model, write_gguf
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    convert_gguf_tokenizer,
    get_gguf_tokenizer,
)

from attnlab.tokenizer import Tokenizer

TEXTS = ["The quick brown fox", "  leading spaces\n\nand   tabs\t!", "Ünïcödé ≠ 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>", "12345 + 67890", "don't you'LL read it?"]


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "smollm"])
def test_encodings_and_chat_template_match_transformers(tmp_path, pre):
    tokens, merges = bpe_vocabulary()
    file = write_gguf(tmp_path / "tiny.gguf", tiny_model("qwen2", len(tokens)), "qwen2",
                      Q.Q8_0, tokens=tokens, merges=merges, pre=pre)
    theirs = tf.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    ours = Tokenizer.from_pretrained(file)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == (
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert (ours.bos_token, ours.eos_token) == ("<|endoftext|>", "<|im_end|>")


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_a_sentencepiece_vocabulary_matches_transformers(tmp_path, arch):
    tokens, scores, types = sentencepiece_vocabulary()
    file = write_gguf(tmp_path / "sp.gguf", tiny_model(arch, len(tokens), tied=arch != "phi3"),
                      arch, Q.F32, tokens=tokens, merges=None, tokenizer_model="llama",
                      scores=scores, types=types, pre=None)
    theirs = tf.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    ours = Tokenizer.from_pretrained(file)
    for text in [*TEXTS, "<s>hi</s>", "a\nb", " The lazy dog"]:
        ids = theirs.encode(text)  # with BOS: llama.cpp adds it to a SentencePiece text
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip), text
    assert (ours.bos_token, ours.eos_token, ours.unk_token) == ("<s>", "</s>", "<unk>")


def test_a_gemma_sentencepiece_vocabulary_matches_transformers(tmp_path):
    # transformers reads no Gemma (1) GGUF model, so AutoTokenizer refuses the file: its GGUF
    # tokenizer builder is called as AutoTokenizer calls it for Gemma 2 and 3
    tokens, scores, types = sentencepiece_vocabulary()
    tokens[300] = "  "  # a run of spaces, as Gemma's files store one
    file = write_gguf(tmp_path / "sp.gguf", tiny_model("gemma", len(tokens)), "gemma", Q.F32,
                      tokens=tokens, merges=None, tokenizer_model="llama", scores=scores,
                      types=types, pre=None)
    arch, spec, _ = get_gguf_tokenizer(str(file))
    theirs, _ = convert_gguf_tokenizer(arch, spec)
    ours = Tokenizer.from_pretrained(file)
    for text in [*TEXTS, "  two  spaces ", "a\nb"]:
        ids = theirs.encode(text).ids
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.encode(text) == [ours.bos_token_id, *ids], text  # add_bos_token: default
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False), text
