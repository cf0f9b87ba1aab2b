"""Tool calls in a model's text: the formats the families write them in, parsed into OpenAI's
``message.tool_calls``, and the JSON Schema that forces a call.

A chat template renders the request's ``tools`` into the prompt and tells the model how to call
one; each family answers in its own format, and a parser reads that format back:

    ===============  =====================================================  ==================
    parser           the model writes                                       families
    ===============  =====================================================  ==================
    ``hermes``       ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``  Qwen2, Qwen3
                     (one block per call)
    ``llama3_json``  ``{"name": ..., "parameters": {...}}`` as the whole    Llama 3.1
                     answer (several separated by ``;``)
    ``mistral``      ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``  Mistral
                     or (v11) ``[TOOL_CALLS]name[ARGS]{...}`` per call
    ===============  =====================================================  ==================

Real tokenizers make the markers (``[TOOL_CALLS]``, ``[ARGS]``, ``<|python_tag|>``) special
tokens, which decoded text drops; a parser's ``specials`` are the tokens whose text the server
keeps in the answers of a request with tools (and only those).

``parse(text) -> (content, calls)``: the text outside the calls (``None`` when there is none)
and each call's name with its arguments re-serialized as JSON text (``json.dumps`` of the
parsed object, so that what a client reads is JSON whatever spacing the model wrote). Text
that does not parse as the format, in any of its calls, is left whole as content: a call is
never guessed.

``tool_choice: "required"`` or a named function does not wait for the model to choose the
format: ``forced_schema`` is the JSON Schema of the call in the parser's own object
(``{"name": <const>, <arguments key>: <the function's parameters schema>}``; an array of
one or more of them for ``required`` with parallel calls), which the engine enforces while
decoding (``SamplingParams.json_schema``), and ``parse_forced`` reads the JSON it makes.

``ToolStream`` is one streamed choice: text is sent as content while it cannot be the start
of a call, and held from there on; at the end the calls are parsed from the whole text, so
that the streamed deltas assemble to the same message as the answer without streaming.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

__all__ = ["PARSERS", "ToolCall", "ToolParser", "ToolStream", "choose_parser",
           "forced_schema", "parse_answer", "parse_forced"]


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name`` and its ``arguments`` as JSON text (an object)."""

    name: str
    arguments: str

    def openai(self, id: str | None = None) -> dict:
        """OpenAI's ``tool_calls`` item: ``{"id", "type": "function", "function": {...}}``."""
        return {"id": id or new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """A family's tool call format. ``name``: the parser's name; ``arguments_key``: the key of
    the arguments in one call's object; ``marker``: the text that begins the calls (``None``:
    the calls are the whole answer); ``specials``: the tokens whose text it needs, kept in the
    decoded answer when the tokenizer makes them special tokens."""

    name: str = ""
    arguments_key: str = "arguments"
    marker: str | None = None
    specials: tuple[str, ...] = ()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole answer; ``(text, [])`` when it holds no call or a
        malformed one."""
        raise NotImplementedError

    def held(self, text: str) -> int:
        """Where ``text`` (an answer so far) may begin a call: the characters before it are
        content whatever comes next."""
        start = text.find(self.marker)
        if start >= 0:
            return start
        for k in range(min(len(text), len(self.marker) - 1), 0, -1):
            if self.marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def call(self, item: object) -> ToolCall | None:
        """A call from one parsed JSON object ``{"name": str, <arguments_key>: object}``
        (either key of ``arguments``/``parameters`` is taken, as models mix them); ``None``
        for anything else."""
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                or not item["name"]:
            return None
        key = self.arguments_key if self.arguments_key in item else next(
            (k for k in ("arguments", "parameters") if k in item), None)
        extra = set(item) - {"name", key}
        arguments = item.get(key, {}) if key is not None else {}
        if extra or not isinstance(arguments, dict):
            return None
        return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (Hermes' format, Qwen2.5's and Qwen3's
    templates). Content is the text outside the blocks, less the whitespace between them. A
    last block left open (the answer ended inside it) counts when its JSON is whole."""

    name, marker = "hermes", "<tool_call>"
    specials = ("<tool_call>", "</tool_call>")
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        blocks = list(self._block.finditer(text))
        if not blocks:
            return text or None, []
        between = [text[a.end():b.start()] for a, b in pairwise(blocks)]
        calls = [self.call(_json(block.group(1))) for block in blocks]
        if any(c is None for c in calls):
            return text or None, []
        content = (text[:blocks[0].start()] + "".join(g for g in between if g.strip())
                   + text[blocks[-1].end():])
        return content or None, calls


class Llama3JsonParser(ToolParser):
    """Llama 3.1's JSON tool calls: the answer is ``{"name": ..., "parameters": {...}}``
    (after ``<|python_tag|>`` when the tokenizer keeps that token's text), several separated
    by ``;``. There is no content beside the calls: an answer that is not wholly calls is
    content."""

    name, arguments_key = "llama3_json", "parameters"
    _tag = "<|python_tag|>"
    specials = (_tag,)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self._tag).lstrip()
        if not body.startswith("{"):
            return text or None, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                item, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text or None, []
            call = self.call(item)
            if call is None:
                return text or None, []
            calls.append(call)
            rest = body[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return text or None, []
            at = len(body) - len(rest)
        return None, calls

    def held(self, text: str) -> int:
        """An answer that begins (after spaces) with ``{`` or the python tag may be calls:
        all of it is held; any other is content from its first character."""
        body = text.lstrip()
        if not body or body.startswith("{") or self._tag.startswith(body[:len(self._tag)]):
            return 0
        return len(text)


class MistralParser(ToolParser):
    """Mistral's calls after ``[TOOL_CALLS]``, in either of its templates' forms: a JSON array
    of calls (before v11), or, from v11, ``name[ARGS]{arguments}`` for each call, each after
    its own ``[TOOL_CALLS]`` (a ``[CALL_ID]id`` after the name is read past: OpenAI's ids are
    the server's). Content is the text before the first marker."""

    name, marker = "mistral", "[TOOL_CALLS]"
    specials = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    _v11 = re.compile(r"([^\[\]{}\s]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\](.*)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.marker)
        if start < 0:
            return text or None, []
        body = text[start + len(self.marker):]
        if body.lstrip().startswith("["):
            items = _json(body)
            calls = [self.call(item) for item in items] if isinstance(items, list) and items \
                else [None]
        else:
            calls = [self._v11_call(part) for part in body.split(self.marker)]
        if any(c is None for c in calls):
            return text or None, []
        return text[:start] or None, calls

    def _v11_call(self, part: str) -> ToolCall | None:
        """One ``name[ARGS]{...}`` call (``None`` when it is not one)."""
        match = self._v11.fullmatch(part.strip())
        return None if match is None else self.call({"name": match.group(1),
                                                     "arguments": _json(match.group(2))})


PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser(),
                                                      MistralParser())}
# The family's format when its template does not show it (config.json's model_type).
_FAMILY_PARSER = {"qwen2": "hermes", "qwen3": "hermes", "llama": "llama3_json",
                  "mistral": "mistral"}


def choose_parser(family: str | None, template: str) -> ToolParser | None:
    """The parser of a model whose chat template (Jinja source) renders ``tools``: the format
    the template teaches (``<tool_call>``, ``[TOOL_CALLS]``, Llama 3.1's ``"parameters"``
    with its ``ipython`` role), else the ``family``'s; ``None`` when neither is known."""
    if "<tool_call>" in template:
        return PARSERS["hermes"]
    if "[TOOL_CALLS]" in template:
        return PARSERS["mistral"]
    if '"parameters"' in template and ("ipython" in template or "python_tag" in template):
        return PARSERS["llama3_json"]
    name = _FAMILY_PARSER.get(family or "")
    return None if name is None else PARSERS[name]


def forced_schema(parser: ToolParser, tools: Sequence[dict], name: str | None = None, *,
                  parallel: bool = True) -> dict:
    """The JSON Schema of the answer that calls the function ``name`` (one call), or, with
    ``name=None`` (``tool_choice: "required"``), any of ``tools``: an array of one or more
    calls when ``parallel``, else one call. ``tools``: OpenAI's ``[{"type": "function",
    "function": {"name", "parameters"?}}]``; a function without ``parameters`` takes none."""
    def call(function: dict) -> dict:
        parameters = function.get("parameters") or {"type": "object", "properties": {},
                                                    "additionalProperties": False}
        return {"type": "object",
                "properties": {"name": {"const": function["name"]},
                               parser.arguments_key: parameters},
                "required": ["name", parser.arguments_key], "additionalProperties": False}

    functions = [t["function"] for t in tools]
    if name is not None:
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise ValueError(f"name: no function {name!r} in tools; expected one of "
                             f"{[f['name'] for f in functions]}")
        return call(chosen[0])
    one = call(functions[0]) if len(functions) == 1 else {"anyOf": [call(f) for f in functions]}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


def parse_forced(parser: ToolParser, text: str) -> list[ToolCall] | None:
    """The calls in an answer made under ``forced_schema`` (one call's object or an array of
    them); ``None`` when it is not whole (the answer ended by length)."""
    value = _json(text)
    items = value if isinstance(value, list) else [value]
    calls = [parser.call(item) for item in items]
    return calls if calls and all(c is not None for c in calls) else None


def parse_answer(parser: ToolParser, text: str, *, forced: bool = False
                 ) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a whole answer: ``parser.parse``, or when the call was
    ``forced`` (``forced_schema``), ``parse_forced``'s calls and no content (the text as
    content when it is not whole)."""
    if not forced:
        return parser.parse(text)
    calls = parse_forced(parser, text)
    return (None, calls) if calls else (text or None, [])


class ToolStream:
    """One streamed choice of a request with tools. ``push(piece)`` -> the content that can be
    sent now; ``finish()`` -> ``(the rest of the content, the calls)``, equal together to
    ``parse_answer`` of the whole text; ``cut()`` -> the text held back (the answer was cut
    short: it is content). Leading
    whitespace is held until other content follows (an answer that is whitespace before a
    call has no content)."""

    def __init__(self, parser: ToolParser, *, forced: bool = False) -> None:
        self.parser, self.forced = parser, forced
        self.text, self.sent = "", 0

    def push(self, piece: str) -> str:
        self.text += piece
        if self.forced:
            return ""
        safe = self.text[:self.parser.held(self.text)]
        if len(safe) <= self.sent or not safe.strip():
            return ""
        out, self.sent = safe[self.sent:], len(safe)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = parse_answer(self.parser, self.text, forced=self.forced)
        assert (content or "").startswith(self.text[:self.sent]), "content sent was not content"
        return (content or "")[self.sent:], calls

    def cut(self) -> str:
        held, self.sent = self.text[self.sent:], len(self.text)
        return held


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
