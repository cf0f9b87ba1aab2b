"""A ``tokenizers`` pipeline rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata, as
transformers' GGUF loader builds it (so both encode a text to the same ids).

A GGUF has no ``tokenizer.json``: it stores the vocabulary (``tokens``, ids in order), each
token's type (1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte), the BPE ``merges``
(``"a b"``) or the SentencePiece ``scores``, the pre-tokenizer's name (``pre``) and the special
tokens' ids.

- ``model = "gpt2"`` (byte-level BPE: Llama 3, Qwen2, SmolLM, GPT-2): the text split by the
  ``pre`` pre-tokenizer's regex (GPT-2's when the name is not one of ``SPLITS``), each
  piece's bytes spelled in the byte alphabet, the BPE merges, the byte-level decoder. No BOS
  is added (transformers' GGUF tokenizer adds none).
- ``model = "llama"`` (SentencePiece BPE: Llama 2, Mistral, Phi-3): spaces as ``▁`` (a
  ``Metaspace`` that prepends one to the text; Phi-3: a normalizer that does the same), the
  merges rebuilt from the scores (every split of a token into two tokens, the best-scored
  merged token first: transformers' ``generate_merges``), unknown bytes as ``<0xNN>``
  tokens, the decoder undoing all that; BOS added unless ``add_bos_token`` is false, EOS when
  ``add_eos_token``. Gemma's variant: merges in the file's order, runs of spaces respelled
  as ``▁``, no prefix space (transformers' ``gemma_tokenizer``).

Control tokens and the special tokens' own (BOS, EOS, unknown, padding) are special added
tokens (matched whole, skipped by ``decode(skip_special_tokens=True)``), user-defined ones
plain added tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

__all__ = ["SPLITS", "gguf_tokenizer", "pre_tokenizer_name", "tokenizer_fields"]

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex its merges were learned on (transformers' table).
SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"),
                          _LLAMA3),
          **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2)}
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5
ROLES = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
         "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def gguf_tokenizer(fields: Mapping[str, Any], file: Path
                   ) -> tuple[Backend, dict[str, str | None], str | None]:
    """``(backend, special tokens by role, chat template or None)`` from a GGUF file's
    metadata ``fields``; a missing or malformed key raises a ``ValueError`` naming ``file``
    and the key."""
    kind = fields.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{file}: tokenizer.ggml.model {kind!r} is not supported; expected "
                         "'gpt2' (byte-level BPE) or 'llama' (SentencePiece)")
    tokens = _strings(fields, "tokenizer.ggml.tokens", file)
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{file}: tokenizer.ggml.token_type has {len(types)} entries for "
                         f"{len(tokens)} tokens")
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
    if kind == "llama":
        return _sentencepiece(fields, tokens, types, special, file), special, template
    merges = _strings(fields, "tokenizer.ggml.merges", file)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {(t if set(t) <= alphabet else _spelled(t)): i for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab, _pairs(merges, file), fuse_unk=False,
                                 byte_fallback=False))
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
    return backend, special, template


def _sentencepiece(fields: Mapping[str, Any], tokens: list[str], types: list[int],
                   special: dict[str, str | None], file: Path) -> Backend:
    """The SentencePiece BPE pipeline of a ``model = "llama"`` vocabulary (module
    docstring)."""
    arch = fields.get("general.architecture")
    scores = fields.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise ValueError(f"{file}: tokenizer.ggml.scores is missing or not one number per "
                         "token")
    space = "\u2581"
    gemma = arch in ("gemma", "gemma2", "gemma3")
    if gemma:  # runs of spaces stored as spaces; merges in the file's order, not by score
        tokens = [space * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = (_pairs(_strings(fields, "tokenizer.ggml.merges", file), file)
              if "tokenizer.ggml.merges" in fields else merges_from_scores(vocab, scores))
    backend = Backend(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True,
                                 unk_token="<unk>" if gemma else None))
    steps = [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:  # transformers' GemmaTokenizer: spaces marked, no prefix space
        backend.normalizer = normalizers.Replace(" ", space)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":  # the prefix space from a normalizer (transformers' phi3_tokenizer)
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(space),
                                                   normalizers.Replace(" ", space)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=space,
                                                         prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(steps if gemma else [*steps, decoders.Strip(" ", 1, 0)])
    named = [t for t in special.values() if t is not None]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in
                                dict.fromkeys([*named, *(t for t, kind in zip(tokens, types)
                                                         if kind == _CONTROL)])])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    ends = [(role, special[f"{role}_token"]) for role in ("bos", "eos")
            if fields.get(f"tokenizer.ggml.add_{role}_token", role == "bos")
            and special[f"{role}_token"] is not None]
    if ends:
        bos = [t for role, t in ends if role == "bos"]
        eos = [t for role, t in ends if role == "eos"]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([*bos, "$A", *eos]),
            pair=" ".join([*bos, "$A", *eos, *(f"{t}:1" for t in bos), "$B:1",
                           *(f"{t}:1" for t in eos)]),
            special_tokens=[(t, vocab[t]) for t in dict.fromkeys([*bos, *eos])])
    return backend


def merges_from_scores(vocab: Mapping[str, int], scores: list[float]
                       ) -> list[tuple[str, str]]:
    """SentencePiece merges from its scores, as transformers' ``generate_merges`` makes them:
    every split of a token into two tokens of the vocabulary, ordered by the merged token's
    score (best first), then the left and right parts' lengths (longest first), ties in the
    order of the parts' ids."""
    merges = []
    for token, score in zip(vocab, scores):
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _pairs(merges: list[str], file: Path) -> list[tuple[str, str]]:
    """``"a b"`` merges as pairs; a merge without a space raises naming ``file``."""
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space:
            raise ValueError(f"{file}: tokenizer.ggml.merges: {merge!r} is not two tokens "
                             "joined by a space")
        pairs.append((left, right))
    return pairs


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


def tokenizer_fields(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of ``tokenizer`` (an ``attnlab.tokenizer.Tokenizer``: its
    ``backend``, ``special_tokens`` and ``chat_template``) for a model of ``vocab_size`` rows,
    the inverse of ``gguf_tokenizer``: a byte-level BPE's tokens in id order (rows past the
    vocabulary padded with ``[PAD<id>]`` tokens of type 5, unused, as llama.cpp's converter
    pads), their types (special added tokens control, other added tokens user-defined),
    merges, the pre-tokenizer's name (``pre_tokenizer_name``), the special tokens' ids and
    the chat template. Another kind of tokenizer raises a ``ValueError`` naming it."""
    backend = getattr(tokenizer, "backend", None)
    if not isinstance(backend, Backend):
        raise TypeError(f"tokenizer: expected an attnlab.tokenizer.Tokenizer, got "
                        f"{tokenizer.__class__.__name__}")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer: a {model.get('type')} model; GGUF export writes "
                         "byte-level BPE vocabularies (tokenizer.ggml.model 'gpt2') only")
    pre = pre_tokenizer_name(spec.get("pre_tokenizer"))
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [_UNUSED] * size
    for token, index in vocab.items():
        tokens[index], types[index] = token, _NORMAL
    for added in spec.get("added_tokens") or []:
        types[added["id"]] = _CONTROL if added.get("special") else _USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    fields: dict[str, Any] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                              "tokenizer.ggml.tokens": tokens,
                              "tokenizer.ggml.token_type": types,
                              "tokenizer.ggml.merges": merges}
    for role, key in ROLES.items():
        token = (getattr(tokenizer, "special_tokens", None) or {}).get(role)
        if token is not None:
            fields[f"tokenizer.ggml.{key}"] = vocab[token]
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        fields["tokenizer.chat_template"] = template
    return fields


def pre_tokenizer_name(spec: Mapping[str, Any] | None) -> str:
    """The ``tokenizer.ggml.pre`` name of a ``tokenizer.json`` pre-tokenizer ``spec``: the
    ``SPLITS`` entry whose regex its ``Split`` uses (``llama-bpe``, ``qwen2``), or ``gpt-2``
    for a plain byte-level one (llama.cpp's name: it refuses a file that says ``gpt2``); any
    other raises a ``ValueError`` naming it."""
    kind = (spec or {}).get("type")
    if kind == "ByteLevel" and spec.get("use_regex", True):
        return "gpt-2"
    steps = spec.get("pretokenizers", []) if kind == "Sequence" else []
    for step in steps:
        pattern = (step.get("pattern") or {}).get("Regex") if step.get("type") == "Split" else None
        for name in ("llama-bpe", "qwen2"):
            if pattern == SPLITS[name]:
                return name
    raise ValueError(f"tokenizer: its pre-tokenizer ({kind}) is not one GGUF names; expected "
                     "GPT-2's byte-level split or Llama 3's or Qwen2's regex")
