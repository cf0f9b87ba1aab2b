"""The OpenAI API's request bodies, response objects and error JSON, as the server speaks them.

Requests are pydantic models in strict mode: a string where a number is expected, or a float
where an integer is, is refused rather than converted, and each range is checked, so that a
bad request gets a 400 naming its field instead of a surprise. Every field of OpenAI's chat and
completions request schemas is implemented (sampling, ``logprobs`` in each endpoint's form,
``echo``, penalties, ``logit_bias``, ``response_format``), refused when given a value that
would change the output (``best_of``, ``suffix``, ... : ``_UNSUPPORTED``), or accepted and
ignored because it does not change the output (``user``, ``store``, ``metadata``, ...:
``_Sampling``'s last fields). Chat takes ``tools`` and ``tool_choice`` (the calls are parsed by
``attnlab.serving.tool_calls``), and messages that carry them back (an assistant's
``tool_calls``, a ``tool`` message's ``tool_call_id``); attnlab's extensions (vLLM's ``top_k``,
``min_p``, ``repetition_penalty``) are fields too. Any other field is a 400 "Unrecognized
request argument supplied: X", as OpenAI answers.

Responses are plain dicts built by the functions below (``completion``, ``chat_completion``,
``chunk``, ...), each in the shape of the OpenAI reference: ``choices`` with ``index`` and
``finish_reason`` (``"stop"``, ``"length"`` or ``"tool_calls"``), ``usage`` with ``prompt_tokens``,
``completion_tokens`` and ``total_tokens``. ``add_error_handlers`` makes every refusal an
OpenAI error JSON (``{"error": {"message", "type", "param", "code"}}``), FastAPI's 422 a 400.
"""

from __future__ import annotations

import asyncio
import email.message
import json
import math
import sys
import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from starlette.exceptions import HTTPException

__all__ = [
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "StreamOptions",
    "TokenizeRequest",
    "add_error_handlers",
    "chat_chunk",
    "chat_completion",
    "completion",
    "completion_chunk",
    "error_body",
    "new_id",
    "now",
    "parsed",
    "usage",
]

# torch.Generator seeds are unsigned 64-bit integers.
MAX_SEED = 2**64 - 1
MAX_N = 16
MAX_STOP = 4  # OpenAI's limit on stop sequences


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)

    def body(self) -> dict:
        return error_body(self.message, param=self.param, code=self.code, type=self.type)


def error_body(message: str, *, param: str | None = None, code: str | None = None,
               type: str = "invalid_request_error") -> dict:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


# OpenAI fields this server does not implement -> the values that change nothing.
_UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""),
                "functions": (None, []), "function_call": (None, "none", "auto"),
                "modalities": (None, ["text"]), "audio": (None,),
                "web_search_options": (None,)}
# OpenAI's limits on the alternatives per token: completions' logprobs, chat's top_logprobs.
MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
StopText = Annotated[str, Field(min_length=1)]


class _Sampling(BaseModel):
    """The fields that completions and chat share. An unknown field is refused
    (``extra="forbid"``; the error handler words it as OpenAI does)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    # Not in OpenAI's API (vLLM's extension; the openai client sends it via extra_body).
    top_k: Annotated[int, Field(ge=0)] = 0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Checked per endpoint (completions: an int k; chat: a bool with top_logprobs).
    logprobs: bool | int | None = None
    echo: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # token id (its decimal string, as JSON writes keys) -> bias
    logit_bias: dict[str, Bias] | None = None
    response_format: dict | None = None
    # Refused when they would change the output (see _UNSUPPORTED).
    best_of: int | None = None
    suffix: str | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    modalities: list | None = None
    audio: dict | None = None
    web_search_options: dict | None = None
    # attnlab's (and vLLM's) extensions.
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    # attnlab's: speculative decoding (ngram, ngram:K, self:N, draft; attnlab.serving.speculation),
    # checked by the server; `prediction` (OpenAI's Predicted Outputs) asks for it too.
    speculative: str | None = None
    num_speculative_tokens: Annotated[int, Field(ge=1)] | None = None
    prediction: Prediction | None = None
    # OpenAI's, accepted and ignored: none changes the text of this server's answers
    # (storage, billing, routing and caching hints; parallel_tool_calls is read by chat).
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_is_a_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator(*_UNSUPPORTED, mode="after")
    @classmethod
    def _refuse_unsupported(cls, value: object, info: ValidationInfo) -> object:
        harmless = _UNSUPPORTED[info.field_name]
        if value not in harmless:
            raise ValueError(f"not supported by this server; expected it left out (or "
                             f"{harmless[1]!r})")
        return value

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _token_keys(cls, value: dict | None) -> dict | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"expected token ids (decimal strings) as keys, got {key!r}")
        return value

    @field_validator("response_format", mode="after")
    @classmethod
    def _response_format(cls, value: dict | None) -> dict | None:
        """OpenAI's three forms: ``{"type": "text"}``, ``{"type": "json_object"}``,
        ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``."""
        if value is None:
            return value
        kind = value.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"expected type 'text', 'json_object' or 'json_schema', got "
                             f"{kind!r}")
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
                    or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("expected json_schema: {name: a str, schema: a JSON Schema "
                                 f"object, strict: a bool}}, got {spec!r}")
        return value

    @property
    def json_schema(self) -> dict | None:
        """The JSON Schema that ``response_format`` asks the output to follow (``None``: free
        text; ``{"type": "object"}`` for ``json_object``)."""
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            return self.response_format["json_schema"].get("schema", {})
        return None

    @property
    def stop_texts(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a text, a list of token ids, or a list of
    either (several prompts, each giving ``n`` choices)."""

    prompt: list[str | list[int]]
    # 0 with echo: the prompt's logprobs only (what evaluation harnesses ask for)
    max_tokens: Annotated[int, Field(ge=0)] | None = 16

    @model_validator(mode="after")
    def _logprobs_form(self) -> CompletionRequest:
        """OpenAI's legacy form: ``logprobs: k`` in ``[0, 5]``; ``max_tokens: 0`` only with
        ``echo``; no ``top_logprobs`` (chat's)."""
        k = self.logprobs
        if k is not None and (type(k) is not int or not 0 <= k <= MAX_COMPLETION_LOGPROBS):
            raise _field_error("logprobs", f"expected an int in [0, {MAX_COMPLETION_LOGPROBS}] "
                               f"(the alternatives per token), got {k!r}")
        if self.top_logprobs is not None:
            raise _field_error("top_logprobs", "chat's field; completions take logprobs: k, "
                               f"got {self.top_logprobs!r}")
        if self.max_tokens == 0 and not self.echo:
            raise _field_error("max_tokens", "expected >= 1 (0 only with echo: true, the "
                               "prompt's logprobs alone), got 0")
        return self

    @property
    def top_k_logprobs(self) -> int | None:
        """The alternatives per token asked for (``None``: no logprobs)."""
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: object) -> list[str | list[int]]:
        """One message for every wrong shape (a union's errors name its members instead)."""
        one = isinstance(value, str) or (isinstance(value, list) and value != []
                                         and all(_is_id(v) for v in value))
        prompts = [value] if one else value
        if not isinstance(prompts, list) or not prompts or not all(
                (isinstance(p, str) and p and _is_unicode(p))
                or (isinstance(p, list) and p and all(_is_id(v) for v in p))
                for p in prompts):
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise ValueError(f"expected a non-empty text (valid Unicode), a non-empty list of "
                             f"token ids "
                             f"(ints >= 0), or a non-empty list of either, got {shown}")
        return prompts


def _field_error(field: str, message: str) -> RequestValidationError:
    """A refusal of ``field`` found by a model validator, worded as pydantic's own errors."""
    return RequestValidationError([{"type": "value_error", "loc": ("body", field),
                                    "msg": message}])


def _is_id(value: object) -> bool:
    return type(value) is int and value >= 0


def _is_unicode(text: str) -> bool:
    """False for a text with a lone surrogate (JSON's "\\ud800"), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _unicode(text: str) -> str:
    if not _is_unicode(text):
        shown = repr(text) if len(repr(text)) <= 80 else repr(text)[:77] + "..."
        raise ValueError(f"expected valid Unicode text, got {shown} (a lone surrogate)")
    return text


UnicodeText = Annotated[str, AfterValidator(_unicode)]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: UnicodeText


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": text or text parts}``,
    the output expected (mostly); the server looks its n-grams up to propose drafts."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["content"]
    content: UnicodeText | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


# OpenAI's rule for a function's name.
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: FunctionName
    arguments: str  # JSON text, as OpenAI's clients send it back


class ToolCallItem(BaseModel):
    """An assistant message's call, sent back: ``{"id", "type": "function", "function"}``."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    """One message. Its ``content`` is required, as OpenAI requires it, but for an assistant
    message with ``tool_calls``; a ``tool`` message names the call it answers
    (``tool_call_id``)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Before content, whose check reads it (pydantic checks the fields in this order). An
    # empty list, which some clients send, is no calls.
    tool_calls: list[ToolCallItem] | None = None
    content: UnicodeText | list[TextPart] | None = Field(default=None, validate_default=True)
    tool_call_id: str | None = Field(default=None, validate_default=True)
    name: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls_by_assistant(cls, value: object, info: ValidationInfo) -> object:
        role = info.data.get("role")
        if value and role not in (None, "assistant"):
            raise ValueError(f"only in an assistant message, got one in a {role} message")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _id_in_tool_message(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if role == "tool" and value is None:
            raise ValueError("expected in a tool message (the id of the call it answers), got "
                             "none")
        if role not in (None, "tool") and value is not None:
            raise ValueError(f"only in a tool message, got one in a {role} message")
        return value

    @field_validator("content")
    @classmethod
    def _content_given(cls, value: object, info: ValidationInfo) -> object:
        if value is None and not (info.data.get("role") == "assistant"
                                  and info.data.get("tool_calls")):
            raise ValueError("expected a text or a list of text parts, got none (only an "
                             "assistant message with tool_calls may leave it out)")
        return value

    @property
    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content

    def for_template(self) -> dict:
        """The message as chat templates read it (transformers' form): ``role`` and
        ``content``, and ``tool_calls`` with each call's ``arguments`` parsed from its JSON
        text (Qwen2.5's and Llama 3.1's templates write them with ``tojson``; text that is not
        a JSON object stays text), ``tool_call_id``, ``name`` when given."""
        message: dict = {"role": self.role, "content": self.text}
        if self.tool_calls:  # a template may test for the key (Llama 3.1's does)
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": _object_or_text(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _object_or_text(arguments: str) -> object:
    try:
        value = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        return arguments
    return value if isinstance(value, dict) else arguments


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema of the arguments (none: no arguments)
    strict: bool | None = None


class ToolDef(BaseModel):
    """One of ``tools``: ``{"type": "function", "function": {"name", "description",
    "parameters", "strict"}}``."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: FunctionName


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the function to call: ``{"type": "function", "function":
    {"name"}}``."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: ChosenFunction


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered by the folder's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[ToolDef] | None = None
    # None: "auto" with tools, "none" without (OpenAI's defaults).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @field_validator("tools")
    @classmethod
    def _names_differ(cls, tools: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [tool.function.name for tool in tools or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"each function needs its own name, got {twice} more than once")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, choice: object, info: ValidationInfo) -> object:
        names = [tool.function.name for tool in info.data.get("tools") or ()]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"names the function {choice.function.name!r}; expected one of "
                             f"tools ({names or 'none given'})")
        if choice == "required" and not names:
            raise ValueError("'required' needs tools; none were given")
        return choice

    @property
    def tool_mode(self) -> str | None:
        """How the answer may call ``tools``: ``"auto"`` (the model chooses), ``"required"``,
        a function's name (it must call that one), or ``None`` (no tools, or
        ``tool_choice: "none"``)."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    @model_validator(mode="after")
    def _logprobs_form(self) -> ChatRequest:
        """OpenAI's chat form: ``logprobs: true`` with ``top_logprobs`` in ``[0, 20]``; no
        ``echo`` (completions')."""
        if self.logprobs is not None and type(self.logprobs) is not bool:
            raise _field_error("logprobs", f"expected a bool (the alternatives are "
                               f"top_logprobs), got {self.logprobs!r}")
        k = self.top_logprobs
        if k is not None and (type(k) is not int or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise _field_error("top_logprobs", f"expected an int in [0, {MAX_TOP_LOGPROBS}], "
                               f"got {k!r}")
        if k is not None and not self.logprobs:
            raise _field_error("top_logprobs", "expected logprobs: true with it, got "
                               f"logprobs: {json.dumps(self.logprobs)}")
        if self.echo:
            raise _field_error("echo", "completions' field; not supported by chat, expected "
                               "it left out (or false)")
        return self

    @property
    def top_k_logprobs(self) -> int | None:
        """The alternatives per token asked for (``None``: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def new_tokens(self) -> tuple[int | None, str]:
        """The asked limit on new tokens (``None``: as many as fit) and the field that set it
        (``max_completion_tokens`` replaces the deprecated ``max_tokens``)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (as vLLM's): ``prompt`` tokenized (with the tokenizer's special
    tokens unless ``add_special_tokens`` is false), or ``messages`` (and ``tools``) rendered
    by the chat template with the assistant's turn begun: the ids the chat route gives the
    model for them."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str
    prompt: UnicodeText | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[ToolDef] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("expected one of prompt (a text) or messages (a chat), got "
                             f"{'both' if self.prompt is not None else 'neither'}")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools: only with messages (the chat template renders them), "
                             "got a prompt")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (as vLLM's): ``tokens`` -> their text."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str
    tokens: list[Annotated[int, Field(ge=0)]]


RequestBody = TypeVar("RequestBody", bound=BaseModel)


async def parsed(request: Request, model: type[RequestBody]) -> RequestBody:
    """The request's body parsed and checked as ``model``, in a thread: 8 MiB of small items
    (four million token ids, a quarter of a million messages) take seconds to parse and
    check, which the event loop spends serving the others. As FastAPI reads a body: JSON
    when the Content-Type is ``application/json`` (or ``+json``), else the bytes as they
    came (refused: not an object). A refusal is FastAPI's (``RequestValidationError``, or a
    400 ``HTTPException`` caused by what ``json.loads`` raised), answered as every other."""
    data = await request.body()
    return await asyncio.to_thread(_parse, model, data, request.headers.get("content-type"))


def _parse(model: type[RequestBody], data: bytes, content_type: str | None) -> RequestBody:
    if not data:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    body: object = data
    kind = email.message.Message()
    kind["content-type"] = content_type or ""
    subtype = kind.get_content_subtype()
    if content_type and kind.get_content_maintype() == "application" and (
            subtype == "json" or subtype.endswith("+json")):
        try:
            body = json.loads(data)
        except json.JSONDecodeError as error:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", error.pos),
                                           "msg": "JSON decode error", "input": {},
                                           "ctx": {"error": error.msg}}]) from None
        except (ValueError, RecursionError) as error:  # bad UTF-8, json's own limits
            raise HTTPException(400, "There was an error parsing the body") from error
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)]
        ) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """A response's ``created``: the Unix time in whole seconds."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(id: str, model: str, texts: list[str], finishes: list[str], use: dict, *,
               created: int, logprobs: list[dict] | None = None) -> dict:
    """A ``text_completion`` object, one choice per text; ``created``: the completion's Unix
    time (``now()``, read once per completion); ``logprobs``: each choice's (the legacy form
    of ``attnlab.generation.logprobs.completions_logprobs``), ``None`` when not asked."""
    lps = logprobs or [None] * len(texts)
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                        for i, (t, f, lp) in enumerate(zip(texts, finishes, lps,
                                                           strict=True))],
            "usage": use}


def chat_completion(id: str, model: str, texts: list[str | None], finishes: list[str],
                    use: dict, *, created: int, logprobs: list[dict] | None = None,
                    tool_calls: list[list[dict]] | None = None) -> dict:
    """A ``chat.completion`` object, one assistant message per text (``None``: a message of
    tool calls only); ``logprobs``: each choice's (``{"content": [...]}``), ``None`` when not
    asked; ``tool_calls``: each message's calls (``ToolCall.openai()`` items), given only to
    a request with tools."""
    lps = logprobs or [None] * len(texts)

    def message(i: int, text: str | None) -> dict:
        if tool_calls is None:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": text, "tool_calls": tool_calls[i] or None}

    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": message(i, t), "logprobs": lp,
                         "finish_reason": f}
                        for i, (t, f, lp) in enumerate(zip(texts, finishes, lps,
                                                           strict=True))],
            "usage": use}


def completion_chunk(id: str, model: str, index: int | None, text: str,
                     finish: str | None, use: dict | None, *, with_usage: bool,
                     created: int, logprobs: dict | None = None) -> dict:
    """One streamed ``text_completion`` chunk; ``index=None`` makes the usage-only chunk.
    Every chunk of a completion carries its one ``id`` and ``created``, as OpenAI's do;
    ``logprobs``: the chunk's tokens'."""
    choices = [] if index is None else [{"index": index, "text": text, "logprobs": logprobs,
                                         "finish_reason": finish}]
    return _chunk(id, "text_completion", model, choices, use, with_usage, created)


def chat_chunk(id: str, model: str, index: int | None, delta: dict, finish: str | None,
               use: dict | None, *, with_usage: bool, created: int,
               logprobs: dict | None = None) -> dict:
    """One ``chat.completion.chunk``; ``index=None`` makes the usage-only chunk."""
    choices = [] if index is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}]
    return _chunk(id, "chat.completion.chunk", model, choices, use, with_usage, created)


def _chunk(id: str, object: str, model: str, choices: list, use: dict | None,
           with_usage: bool, created: int) -> dict:
    body = {"id": id, "object": object, "created": created, "model": model,
            "choices": choices}
    if with_usage:  # OpenAI: null on every chunk but the last one when usage is asked for
        body["usage"] = use
    return body


def add_error_handlers(app: FastAPI) -> None:
    """Answer every refusal and failure of ``app`` with OpenAI's error JSON: ``ApiError`` with
    its status; FastAPI's validation errors (422) as 400 naming the field; Starlette's HTTP
    errors (404, 405, a body that is not JSON) with their status; anything else as 500."""
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 with its own JSON; OpenAI's clients expect 400 and this shape.
        # Of a union's errors (one per member), the deepest is the member that was meant.
        first = max(error.errors(), key=lambda e: len(e.get("loc", ())))
        where = [str(p) for p in first.get("loc", ())
                 if p != "body" and (isinstance(p, int) or str(p).isidentifier())]
        param = ".".join(where) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":  # OpenAI's words for an unknown field
            name = str(first["loc"][-1])
            message = f"Unrecognized request argument supplied: {name}"
            return JSONResponse(error_body(message, param=name), status_code=400)
        if first.get("type") == "json_invalid":
            message, param = f"The body is not valid JSON: {message}", None
        elif first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
            message = "expected a JSON object, got an empty body"
        elif "input" in first and first.get("type") not in ("missing", "value_error"):
            message += f", got {_shown(first['input'])}"
        return JSONResponse(error_body(f"{param or 'body'}: {message}", param=param),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        unparsed = _unparsed(error.__cause__)  # FastAPI's 400 for a body json.loads refused
        if error.status_code == 400 and unparsed is not None:
            return JSONResponse(error_body(unparsed), status_code=400)
        return JSONResponse(error_body(str(error.detail), code=str(error.status_code)),
                            status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(error).__name__}",
                                       type="server_error"), status_code=500)


def _unparsed(cause: BaseException | None) -> str | None:
    """What is wrong with a body that ``json.loads`` raised ``cause`` on (FastAPI says only
    "There was an error parsing the body"); None for another cause."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"body: not valid {cause.encoding.upper()}: byte "
                f"0x{cause.object[cause.start]:02x} at offset {cause.start} ({cause.reason}); "
                "expected JSON text in UTF-8")
    if isinstance(cause, RecursionError):
        return (f"body: JSON nested too deeply to parse (over about {sys.getrecursionlimit()} "
                "levels of arrays or objects); expected a request body")
    if isinstance(cause, ValueError):  # json's own limits: an integer of over 4300 digits
        return f"body: not valid JSON here: {str(cause).split(';')[0]}"
    return None


def _shown(value: object) -> str:
    text = json.dumps(value, default=repr) if not isinstance(value, float) or math.isfinite(
        value) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
