"""A tokenizer for Hugging Face-format folders: ``tokenizers`` plus ``tokenizer_config.json``.

``tokenizer.json`` holds the whole pipeline (normaliser, pre-tokeniser, BPE model, BOS/EOS
post-processor, decoder), which the ``tokenizers`` library runs. ``tokenizer_config.json``
adds what that file lacks: the special tokens' roles (``eos_token``, ``pad_token``, ...) and
the chat template, a Jinja program that turns a list of messages into the prompt text the
model was trained on. It may also sit in ``chat_template.jinja`` (transformers 5 writes it
there). The template is rendered as transformers does (``attnlab.chat_render``: a sandboxed
Jinja environment), with the special tokens as variables, but in a worker process with a time
and a memory limit: a template comes with a model folder, and a hostile one must not hang or
flood the program (``Tokenizer.renderer``).

``TextStreamer`` turns generated ids into text as they arrive, holding back a partial
UTF-8 character until it is complete.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import jinja2
import torch
from tokenizers import Tokenizer as _Backend
from tokenizers.decoders import ByteLevel as ByteLevelDecoder
from torch import Tensor

from attnlab._checks import is_int
from attnlab.chat_render import DEFAULT_RENDERER, check_template
from attnlab.models.gguf import gguf_file
from attnlab.models.gguf_reader import GGUFFile
from attnlab.models.gguf_tokenizer import gguf_tokenizer
from attnlab.models.hf_loading import check_folder, read_json

__all__ = ["TextStreamer", "Tokenizer"]

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """``encode``/``decode``/``batch_encode`` and ``apply_chat_template`` over ``tokenizers``.

    ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` are strings or ``None``; the
    ``*_id`` properties give their ids. ``chat_template`` is the Jinja source or ``None``;
    ``template_file`` the file it was read from (named by render errors); ``renderer`` the
    ``chat_render.TemplateRenderer`` that renders it (a shared one with its default limits:
    10 s, 1 GiB; assign another to change them).
    """

    def __init__(self, backend: _Backend, *, special_tokens: dict[str, str | None] | None = None,
                 chat_template: str | None = None, template_file: str | Path | None = None
                 ) -> None:
        if not isinstance(backend, _Backend):
            raise TypeError(f"backend: expected a tokenizers.Tokenizer, got "
                            f"{type(backend).__name__}")
        self.backend = backend
        self._longest: int | None = None  # _longest_token_chars, counted at first need
        self._added: frozenset[int] | None = None  # _added_ids, read at first need
        self._special: frozenset[int] | None = None  # _special_ids, read at first need
        unknown = sorted(set(special_tokens or {}) - set(_SPECIAL), key=str)
        if unknown:
            raise ValueError(f"special_tokens: unknown roles {unknown}; expected some of "
                             f"{_SPECIAL}")
        self.special_tokens = {k: (special_tokens or {}).get(k) for k in _SPECIAL}
        for role, token in self.special_tokens.items():
            if token is not None and not isinstance(token, str):
                raise TypeError(f"special_tokens: {role} should be a string or None, got "
                                f"{token!r}")
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(f"special_tokens: {role} {token!r} is not in the vocabulary")
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template: expected a string or None, got "
                            f"{type(chat_template).__name__}")
        if template_file is not None and not isinstance(template_file, (str, Path)):
            raise TypeError(f"template_file: expected a path or None, got "
                            f"{type(template_file).__name__}")
        self.chat_template, self.template_file = chat_template, template_file
        self.chat_templates = {} if chat_template is None else {"default": chat_template}
        self.renderer = DEFAULT_RENDERER

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Read ``tokenizer.json`` and (when present) ``tokenizer_config.json`` and
        ``chat_template.jinja`` from the local folder ``path`` (a GGUF file, or a folder
        holding one: ``from_gguf``).

        ``chat_template`` in ``tokenizer_config.json`` is a string or, as Hugging Face allows,
        a list of ``{"name": ..., "template": ...}``, of which the one named ``"default"`` is
        used (all of them are in ``chat_templates``). A missing folder, an unreadable file, a
        special token or template of the wrong type, or a template that is not valid Jinja
        raise naming the file (rendering needs messages: its errors come then, naming it too).
        """
        if isinstance(path, (str, Path)) and gguf_file(path) is not None:
            return cls.from_gguf(path)
        folder = check_folder(path, needs="tokenizer.json (and tokenizer_config.json)")
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no such file; expected a Hugging Face "
                                    "tokenizer.json (a 'tokenizers' file) in the folder")
        try:
            backend = _Backend.from_file(str(file))
        except Exception as error:  # tokenizers raises a plain Exception
            raise ValueError(f"{file}: not a readable tokenizers file ({error})") from None
        config_file = folder / "tokenizer_config.json"
        config = read_json(config_file) if config_file.is_file() else {}
        try:
            special = {k: _token_text(k, config.get(k)) for k in _SPECIAL}
            templates = _named_templates(config.get("chat_template"))
        except (TypeError, ValueError) as error:
            raise type(error)(f"{config_file}: {error}") from None
        template, source = templates.get("default"), config_file
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                template, source = jinja_file.read_text(encoding="utf-8"), jinja_file
            except UnicodeDecodeError as error:
                raise ValueError(f"{jinja_file}: not UTF-8 text ({error})") from None
            templates["default"] = template
        for name, text in templates.items():
            try:
                check_template(text)
            except jinja2.TemplateSyntaxError as error:
                raise ValueError(f"{source}: chat_template {name!r} is not a valid Jinja "
                                 f"template ({error.message}, line {error.lineno})") from None
            except RecursionError:
                raise ValueError(f"{source}: chat_template {name!r} is nested too deeply to "
                                 "parse") from None
        try:
            tokenizer = cls(backend, special_tokens=special, chat_template=template,
                            template_file=source)
        except ValueError as error:
            raise ValueError(f"{config_file}: {error}") from None
        tokenizer.chat_templates = templates
        return tokenizer

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer and chat template stored in the GGUF file ``path`` (or the one
        ``*.gguf`` of a folder) as ``tokenizer.ggml.*`` metadata, rebuilt as transformers'
        GGUF loader builds it (``attnlab.models.gguf_tokenizer``: byte-level BPE). Errors name the
        file and the key."""
        file = gguf_file(path)
        if file is None:
            raise ValueError(f"path: {path} is not a GGUF file nor a folder holding one")
        reader = GGUFFile(file)
        try:
            backend, special, template = gguf_tokenizer(reader.fields, file)
        finally:
            reader.close()
        if template is not None:
            try:
                check_template(template)
            except jinja2.TemplateSyntaxError as error:
                raise ValueError(f"{file}: tokenizer.chat_template is not a valid Jinja "
                                 f"template ({error.message}, line {error.lineno})") from None
        return cls(backend, special_tokens=special, chat_template=template, template_file=file)

    # -- ids ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens["eos_token"]

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens["pad_token"]

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens["unk_token"]

    # -- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, *,
               max_tokens: int | None = None) -> list[int]:
        """``text`` -> token ids (BOS/EOS added by the file's post-processor when asked).
        ``max_tokens``: refuse, before tokenizing, a text too long to encode to that many
        tokens (more characters than ``max_tokens`` times the longest token's), which would
        only be refused after seconds of work (a 30 M-character prompt took two minutes)."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        if max_tokens is not None and len(text) > max_tokens * self._longest_token_chars():
            raise ValueError(f"text: {len(text)} characters are more than {max_tokens} tokens "
                             f"can hold (the longest token has {self._longest_token_chars()} "
                             "characters)")
        # encode_batch releases the GIL while it works, encode holds it: a 7 MB text would
        # stop every other thread (a server's event loop) for seconds.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int] | Tensor, skip_special_tokens: bool = False, *,
               keep: Collection[int] = ()) -> str:
        """Token ids (a list or a 1-D integer tensor, each id >= 0) -> text.

        Ids at or above ``vocab_size`` decode to nothing, as in Hugging Face (a model's
        vocabulary is often padded beyond the tokenizer's). ``keep``: special tokens whose
        text stays when ``skip_special_tokens`` drops the others (a tool call's marker).
        """
        if isinstance(ids, Tensor):
            if ids.dim() > 1 or ids.is_floating_point() or ids.dtype == torch.bool:
                raise ValueError(f"ids: expected a 1-D integer tensor, got dtype {ids.dtype} "
                                 f"and shape {tuple(ids.shape)}")
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)):
            raise TypeError(f"ids: expected a sequence of token ids, got {type(ids).__name__}")
        ids = list(ids)
        for i, token in enumerate(ids):
            if not is_int(token) or token < 0:
                raise ValueError(f"ids: expected token ids (ints >= 0), got {token!r} at "
                                 f"position {i}")
        if skip_special_tokens and keep:
            special = self._special_ids()
            ids, skip_special_tokens = [i for i in ids if i in keep or i not in special], False
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text that one token stands for, exact also for a token that holds part
        of a UTF-8 character (which ``decode`` shows as U+FFFD): a byte-level vocabulary's
        entry mapped back through GPT-2's byte-to-character table, a SentencePiece byte
        ``<0xAB>`` as that byte, another entry with its ``▁`` as a space; a special (added)
        token as its text. For token log-probabilities (``attnlab.generation.logprobs``)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token_id: expected an id in [0, {self.vocab_size}), got "
                             f"{token_id!r}")
        if token_id in self._added_ids():
            return piece.encode("utf-8")
        if isinstance(self.backend.decoder, ByteLevelDecoder):
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def batch_encode(self, texts: Sequence[str], add_special_tokens: bool = True
                     ) -> tuple[Tensor, Tensor]:
        """Texts -> ``(input_ids B x P, attention_mask B x P)``, **left**-padded for ``generate``.

        Padding uses ``pad_token`` (else ``eos_token``, else id 0); mask 1 = real token.
        """
        if isinstance(texts, str):
            raise TypeError("texts: expected a list of strings, got one str (wrap it in a list)")
        rows = [self.encode(t, add_special_tokens) for t in texts]
        if not rows or min(map(len, rows)) == 0:
            raise ValueError(f"texts: expected non-empty texts that encode to >= 1 token, got "
                             f"{list(texts)!r}")
        pad = next((i for i in (self.pad_token_id, self.eos_token_id) if i is not None), 0)
        P = max(map(len, rows))
        ids = torch.tensor([[pad] * (P - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows])
        return ids, mask

    # -- chat --------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = False,
                            tokenize: bool = False, max_tokens: int | None = None,
                            **kwargs: object) -> str | list[int]:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the template.

        The template sees ``messages``, ``add_generation_prompt``, ``tools=None``,
        ``documents=None``, the special tokens it has (``bos_token``, ``eos_token``, ...; one
        it lacks is undefined, so ``{{ bos_token }}`` writes nothing) and
        ``kwargs`` (JSON values). ``tokenize=True`` returns ids (encoded without adding special
        tokens, since the template writes them; ``max_tokens`` as ``encode``'s). It renders in
        ``renderer``'s worker process:
        every failure of the template (an exception it raises, its time or memory limit) is a
        ``ValueError`` naming ``template_file``.
        """
        if self.chat_template is None and self.chat_templates:
            raise ValueError(f"chat_template: none is named 'default'; this tokenizer has "
                             f"{sorted(self.chat_templates)}: set tokenizer.chat_template = "
                             f"tokenizer.chat_templates[name]")
        if self.chat_template is None:
            raise ValueError("chat_template: this tokenizer has none (no 'chat_template' in "
                             "tokenizer_config.json and no chat_template.jinja)")
        if isinstance(messages, (str, dict)) or not all(isinstance(m, dict) for m in messages):
            raise TypeError(f"messages: expected a list of dicts, got {messages!r}")
        # A token the tokenizer lacks is undefined, as in transformers (it renders as "", not
        # "None").
        present = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables = {"tools": None, "documents": None, **present, **kwargs,
                     "messages": list(messages), "add_generation_prompt": add_generation_prompt}
        origin = "chat_template" if self.template_file is None else str(self.template_file)
        text = self.renderer.render(self.chat_template, variables, origin=origin)
        if not tokenize:
            return text
        try:
            return self.encode(text, add_special_tokens=False, max_tokens=max_tokens)
        except ValueError as error:
            raise ValueError(f"{origin}: the rendered prompt: {error}") from None

    def _longest_token_chars(self) -> int:
        """The most characters one token stands for: the longest entry of the vocabulary
        (byte-level entries have a character per byte, at least the characters they decode
        to), counted once."""
        if self._longest is None:
            self._longest = max(map(len, self.backend.get_vocab(with_added_tokens=True)),
                                default=1)
        return self._longest

    def _special_ids(self) -> frozenset[int]:
        if self._special is None:
            self._special = frozenset(i for i, token in
                                      self.backend.get_added_tokens_decoder().items()
                                      if token.special)
        return self._special

    def _added_ids(self) -> frozenset[int]:
        if self._added is None:
            self._added = frozenset(self.backend.get_added_tokens_decoder())
        return self._added

    def _id(self, role: str) -> int | None:
        token = self.special_tokens[role]
        return None if token is None else self.backend.token_to_id(token)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos_token={self.eos_token!r}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")


class TextStreamer:
    """A ``Streamer`` for ``generate`` (batch of one) that writes text as tokens arrive.

    Each step decodes only a short window (the last printed tokens and the new ones) and writes
    the text it adds, waiting while the text ends in an incomplete character (U+FFFD).
    ``keep``: ids of special tokens written even when ``skip_special_tokens`` drops the others.
    ``text`` is everything written so far; ``count`` the tokens received.
    """

    def __init__(self, tokenizer: Tokenizer, write: Callable[[str], object] | None = None, *,
                 skip_special_tokens: bool = True, keep: Collection[int] = ()) -> None:
        self.tokenizer, self.skip, self.keep = tokenizer, skip_special_tokens, frozenset(keep)
        self.write = write or _stdout_write
        self.ids: list[int] = []
        self.prefix, self.read = 0, 0  # ids[prefix:read] were printed and give the context
        self.text, self.count = "", 0

    def put(self, token_ids: Tensor) -> None:
        if token_ids.numel() != 1:
            raise ValueError(f"token_ids: TextStreamer takes a batch of one, got shape "
                             f"{tuple(token_ids.shape)}")
        self.ids.append(int(token_ids.reshape(-1)[0]))
        self.count += 1
        self._flush(final=False)

    def end(self) -> None:
        self._flush(final=True)

    def _flush(self, final: bool) -> None:
        decode = functools.partial(self.tokenizer.decode, keep=self.keep)
        before = decode(self.ids[self.prefix:self.read], self.skip)
        after = decode(self.ids[self.prefix:], self.skip)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            new = after[len(before):]
            self.write(new)
            self.text += new
            self.prefix, self.read = self.read, len(self.ids)


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level table, inverted: the printable character that stands for each byte
    in a byte-level BPE vocabulary -> the byte (printable bytes stand for themselves, the
    others for 256 + n in their order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _stdout_write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _token_text(role: str, value: object) -> str | None:
    """A special token as ``tokenizer_config.json`` stores it: a string or ``{"content": ...}``."""
    text = value.get("content") if isinstance(value, dict) else value
    if text is not None and not isinstance(text, str):
        raise TypeError(f"{role}: expected a string, null or {{\"content\": string}}, got "
                        f"{value!r}")
    return text


def _named_templates(value: object) -> dict[str, str]:
    """``chat_template`` as stored (a string, or a list of ``{"name", "template"}``) -> name ->
    Jinja source; a single string is named ``"default"``."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise TypeError(f"chat_template: expected a string or a list of {{\"name\": string, "
                    f"\"template\": string}}, got {shown}")
