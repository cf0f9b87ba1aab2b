"""Structured output: a JSON Schema enforced while decoding, by llguidance.

``JsonSchemaGrammar(schema, tokenizer)`` compiles the schema once for a vocabulary; each row
of a generation gets its own ``GrammarState`` (``grammar.start()``), which at every step gives
the tokens allowed next (``allowed() -> bool V``) and takes the chosen one (``advance(id)``).
``generate`` sets the logits of the other tokens to ``-inf`` before sampling (after the
penalties and the bias, so that no processor can let a forbidden token back in), and a row
ends with its end token, the only one allowed once the JSON value is complete.

llguidance refuses a schema keyword that it cannot enforce (``uniqueItems``, ``not``,
``if``/``then``, ``dependentRequired``, ...) instead of dropping it; the refusal is a
``ValueError`` naming the keyword, never a silently weaker constraint. ``schema=None`` asks
for any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
Why llguidance rather than xgrammar: ``benchmarks/grammar_engines.md``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence

import llguidance
import llguidance.numpy
import numpy as np
import torch
from tokenizers import Tokenizer as TokenizersBackend
from torch import Tensor

__all__ = ["GrammarState", "JsonSchemaGrammar", "check_schema"]

# OpenAI's json_object mode: any JSON object.
ANY_OBJECT: dict = {"type": "object"}
# llguidance writes its mask as 32-bit words in the machine's order; the unpacking above reads
# their bytes as little-endian, as every CPU that torch builds for is.
assert sys.byteorder == "little", "the token mask's unpacking assumes little-endian words"


class JsonSchemaGrammar:
    """A JSON Schema compiled for one vocabulary.

    schema: a JSON Schema (a mapping or its JSON text; ``None``: any object). tokenizer:
    ``attnlab.tokenizer.Tokenizer`` or a ``tokenizers.Tokenizer``. vocab_size: the model's
    ``V`` (may exceed the tokenizer's: the extra ids are never allowed). eos_token_id: the end
    id(s) that close a finished value. ``whitespace_flexible=False`` (the default) allows no
    whitespace between tokens of the JSON, so that a random model cannot pad forever.
    """

    def __init__(self, schema: Mapping | str | None, tokenizer: object, *, vocab_size: int,
                 eos_token_id: int | Sequence[int], whitespace_flexible: bool = False) -> None:
        backend = getattr(tokenizer, "backend", tokenizer)
        if not isinstance(backend, TokenizersBackend):
            raise TypeError(f"tokenizer: expected an attnlab Tokenizer or a tokenizers."
                            f"Tokenizer, got {type(tokenizer).__name__}")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"schema: expected a JSON Schema, got invalid JSON "
                                 f"({error})") from None
        if schema is None:
            schema = ANY_OBJECT
        if not isinstance(schema, Mapping):
            raise ValueError(f"schema: expected a JSON Schema object, got "
                             f"{type(schema).__name__}")
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if not eos:
            raise ValueError("eos_token_id: a grammar needs an end id to close a value, got "
                             "none")
        self.schema = dict(schema)
        self.eos_token_id = tuple(eos)
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                                eos_token=eos)
        options = {"whitespace_flexible": whitespace_flexible}
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(self.schema,
                                                                     overrides=options)
        # Compiled once here; each row's state starts from a copy (microseconds, where
        # compiling takes tens of milliseconds).
        self.matcher = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"schema: {_why(self.matcher.get_error())}")

    def start(self) -> GrammarState:
        """A fresh state, at the start of the value."""
        return GrammarState(self)


class GrammarState:
    """One row's place in the grammar: ``allowed()`` the tokens allowed next (bool ``V``),
    ``advance(token)`` takes one, ``done`` once the value is complete (then ``allowed`` holds
    the end ids only)."""

    def __init__(self, grammar: JsonSchemaGrammar) -> None:
        self.matcher = grammar.matcher.deep_copy()
        # llguidance.numpy, not .torch: importing that one compiles a kernel with
        # torch.compile (seconds at `import attnlab`).
        self._bits = llguidance.numpy.allocate_token_bitmask(1, grammar.vocab_size)
        self.vocab_size = grammar.vocab_size

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    def allowed(self) -> Tensor:
        """bool ``V``: True for each token that keeps the text a prefix of a valid value."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bits)
        # Token t is bit t % 32 of word t // 32, so, in little-endian memory, bit t % 8 of
        # byte t // 8: numpy unpacks that in one pass (a quarter of the time of 32 shifts
        # per word in torch, ~0.1 ms at V = 49k).
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[:self.vocab_size].view(np.bool_))

    def advance(self, token: int) -> None:
        """Take ``token`` (one that ``allowed`` gave)."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"token: {token} is not allowed by the grammar here "
                             f"({self.matcher.get_error()})")


def check_schema(schema: Mapping) -> None:
    """Raise ``ValueError`` (``"schema: ..."``, naming the keywords) when the grammar engine
    cannot enforce ``schema``, without a vocabulary: a server checks a request's schema so
    before anything is queued (``JsonSchemaGrammar`` compiles it for the tokens later)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            dict(schema), overrides={"whitespace_flexible": False})
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError) as failure:
        error = str(failure) or type(failure).__name__
    if error:
        raise ValueError(f"schema: {_why(error)}")


def _why(error: str) -> str:
    """llguidance's message, worded for a user: an unimplemented keyword is named as such."""
    if "Unimplemented keys" in error:
        keys = error[error.index("Unimplemented keys"):].split("\n")[0]
        return (f"the grammar engine cannot enforce the JSON Schema keywords "
                f"{keys.removeprefix('Unimplemented keys: ')} (refused rather than enforced "
                f"loosely)")
    return f"not a schema the grammar engine can enforce ({error.strip()})"
