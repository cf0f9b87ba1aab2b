"""A ``tokenizers`` pipeline rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata, as
transformers' GGUF loader builds it (so both encode a text to the same ids).

A GGUF has no ``tokenizer.json``: it stores the vocabulary (``tokens``, ids in order), each
token's type (1 normal, 3 control, 4 user-defined), the BPE ``merges`` (``"a b"``), the
pre-tokenizer's name (``pre``) and the special tokens' ids. For ``model = "gpt2"`` (byte-level
BPE: Llama 3, Qwen2, SmolLM, GPT-2) the pipeline is: the text split by the ``pre``
pre-tokenizer's regex (GPT-2's when the name is not one of ``SPLITS``), each piece's bytes
spelled in the byte alphabet, the BPE merges, the byte-level decoder; control tokens are
special added tokens (matched whole, skipped by ``decode(skip_special_tokens=True)``),
user-defined ones plain added tokens. No BOS is added (transformers' GGUF tokenizer adds
none). SentencePiece vocabularies (``model = "llama"``) are not rebuilt yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

__all__ = ["SPLITS", "gguf_tokenizer"]

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex its merges were learned on (transformers' table).
SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"),
                          _LLAMA3),
          **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2)}
_CONTROL, _USER_DEFINED = 3, 4
ROLES = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
         "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def gguf_tokenizer(fields: Mapping[str, Any], file: Path
                   ) -> tuple[Backend, dict[str, str | None], str | None]:
    """``(backend, special tokens by role, chat template or None)`` from a GGUF file's
    metadata ``fields``; a missing or malformed key raises a ``ValueError`` naming ``file``
    and the key."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{file}: tokenizer.ggml.model {kind!r} is not supported; expected "
                         "'gpt2' (byte-level BPE)")
    tokens = _strings(fields, "tokenizer.ggml.tokens", file)
    merges = _strings(fields, "tokenizer.ggml.merges", file)
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{file}: tokenizer.ggml.token_type has {len(types)} entries for "
                         f"{len(tokens)} tokens")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {(t if set(t) <= alphabet else _spelled(t)): i for i, t in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space:
            raise ValueError(f"{file}: tokenizer.ggml.merges: {merge!r} is not two tokens "
                             "joined by a space")
        pairs.append((left, right))
    backend = Backend(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    split = SPLITS.get(fields.get("tokenizer.ggml.pre"))
    backend.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None
                             else pre_tokenizers.Sequence([
                                 pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                          use_regex=False)]))
    backend.decoder = decoders.ByteLevel()
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= alphabet]
    backend.add_special_tokens(control)
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    special = {}
    for role, key in ROLES.items():
        index = fields.get(f"tokenizer.ggml.{key}")
        if index is not None and not (isinstance(index, int) and 0 <= index < len(tokens)):
            raise ValueError(f"{file}: tokenizer.ggml.{key} {index!r} is not a token id "
                             f"(0 to {len(tokens) - 1})")
        special[role] = None if index is None else tokens[index]
    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{file}: tokenizer.chat_template is not a string")
    return backend, special, template


def _strings(fields: Mapping[str, Any], key: str, file: Path) -> list[str]:
    value = fields.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{file}: {key} is missing or not a list of strings")
    return value


def _spelled(token: str) -> str:
    """``token``'s UTF-8 bytes in the byte-level alphabet (a vocabulary written in plain
    text, as some converters do)."""
    table = _byte_alphabet()
    return "".join(table[b] for b in token.encode("utf-8"))


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}
