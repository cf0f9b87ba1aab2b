"""``attnlab serve``'s HTTP layer: an OpenAI-compatible FastAPI app over an ``Engine``.

    app = create_app("runs/qwen2-folder", max_batch=8)      # or create_app((model, tokenizer))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (the
messages rendered by the tokenizer's chat template), ``POST /tokenize`` and
``POST /detokenize`` (vLLM's), ``GET /health``, ``GET /metrics``, ``GET /openapi.json``. Each
choice of a request (``n`` per prompt) is one engine request; ``stream: true`` answers with
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``. A chat request's
``tools`` are rendered by the chat template, and the answer's calls parsed into
``message.tool_calls`` (``delta.tool_calls`` when streamed) by the parser of the model's family
and template (``attnlab.serving.tool_calls``); ``tool_choice: "required"`` or a named function
makes the engine hold the answer to the call's JSON Schema (``SamplingParams.json_schema``).

Refusals use OpenAI's error JSON (``api.error_body``): 400 for a body that is not JSON, a
field of the wrong type or out of range, a prompt that does not fit the context or the KV
cache, ``n`` or ``max_tokens`` over the operator's limits, more choices (prompts times ``n``)
than the engine's queue holds (naming the field, or why the body
could not be parsed), a chat template that fails or passes its time or memory limit (naming
its file: it renders in a worker process, ``attnlab.chat_render``), ``tools`` for a model
whose chat template does not render them (naming the field); 404 for another model's
name; 408 for a body that stops arriving; 413 for a body over the limit; 429 when the
engine's queue is full; 500 when the engine or a handler failed (the server goes on); 503
once the server is stopping (``attnlab.serving.shutdown``: the running requests finish, or
end with a last chunk). A client that goes away mid-request has its engine requests
aborted, which frees their KV cache pages.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from attnlab._checks import check_positive, is_int, is_number
from attnlab.chat_render import template_variables
from attnlab.generation.config import read_generation_config
from attnlab.generation.grammar import check_schema
from attnlab.generation.inputs import token_id_set
from attnlab.generation.processors import check_logit_bias
from attnlab.models.decoder import DecoderLM
from attnlab.models.io import from_pretrained
from attnlab.serving import Engine, QueueFull, SamplingParams
from attnlab.serving.access import BearerKey, allow_origins, check_key, document
from attnlab.serving.api import (
    MAX_N,
    MAX_SEED,
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    add_error_handlers,
    chat_completion,
    completion,
    error_body,
    new_id,
    now,
    parsed,
    usage,
)
from attnlab.serving.api import chat_chunk as _chat_chunk
from attnlab.serving.api import completion_chunk as _completion_chunk
from attnlab.serving.choice_logprobs import ChoiceLogprobs
from attnlab.serving.choice_text import ChoiceText
from attnlab.serving.engine_thread import EngineError, EngineThread, release_openmp_threads
from attnlab.serving.metrics import CONTENT_TYPE, Metrics
from attnlab.serving.params import Speculation
from attnlab.serving.shutdown import Drain, ShutdownError
from attnlab.serving.speculation import requested, speculation_from, split_draft
from attnlab.serving.tool_calls import (
    PARSERS,
    ToolParser,
    ToolStream,
    choose_parser,
    forced_schema,
    parse_answer,
)
from attnlab.tokenizer import Tokenizer

__all__ = ["ServerState", "create_app"]

# Threads rendering chat templates: chat_render's default renderer has two worker processes.
CHAT_THREADS = 2
# How often a non-streaming request checks that its client is still there.
DISCONNECT_POLL_S = 0.1
SAMPLING_EPS, MIN_TOP_P = 1e-5, 1e-8
ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics",
          "/tokenize", "/detokenize", "/openapi.json")


def create_app(model: str | Path | tuple[DecoderLM, Tokenizer], *,
               served_name: str | None = None, quantize: str | None = None,
               dtype: str | None = None, extra_memory: bool = False, max_batch: int = 8,
               max_tokens_per_step: int = 512, kv_pages: int | None = None, page_size: int = 16,
               max_queue: int = 64, prefix_caching: bool = True,
               max_body_bytes: int = 8 * 2**20, body_timeout_s: float = 60.0,
               max_tokens_limit: int | None = None, max_n: int = MAX_N,
               api_key: str | None = None, allowed_origins: Sequence[str] = (),
               speculative: str | DecoderLM | None = None) -> FastAPI:
    """The FastAPI app serving ``model``: a checkpoint folder (read by ``from_pretrained``,
    weights in ``dtype`` (default the stored one) and quantized when ``quantize`` is
    ``"int8"``/``"int4"``, with oneDNN's packed copies beside them where they win when
    ``extra_memory``, as ``from_pretrained``'s; its tokenizer, and its
    ``generation_config.json`` end ids) or a ``(model, tokenizer)`` pair. ``served_name`` is
    the model id of ``/v1/models`` (default: the folder's name, ``"attnlab"`` for a pair); the
    engine options are ``Engine``'s. The engine thread starts with the app's lifespan (a server
    starting the app) and stops with it; ``app.state.serving`` is the ``ServerState``.
    ``max_body_bytes``: larger request bodies are refused (413); ``body_timeout_s``: a body
    that stops arriving for that long is refused (408). ``max_tokens_limit`` (default: none
    but the context and the KV cache) and ``max_n`` (at most ``MAX_N``): a request asking for
    more new tokens per choice, or more choices, is refused (400 naming the field); a request
    that does not say caps its new tokens at ``max_tokens_limit``. ``api_key``: every route
    but ``/health`` wants ``Authorization: Bearer <api_key>`` (401 without);
    ``allowed_origins``: the browser origins CORS lets in (none: CORS off). Both:
    ``attnlab.serving.access``. ``speculative`` (``ngram``, ``ngram:K``, ``self:N``, or a draft
    model: ``draft:FOLDER``, read as ``model`` is, or a ``DecoderLM``): the speculative
    decoding of requests that do not ask for one and use nothing it cannot serve
    (``attnlab.serving.speculation``). A draft model is loaded once, here; it must share the
    tokenizer (a folder's tokenizer is compared token by token), and requests may then ask
    for ``speculative: "draft"``."""
    check_positive("max_body_bytes", max_body_bytes)
    if not is_number(body_timeout_s, finite=True) or body_timeout_s <= 0:
        raise ValueError(f"body_timeout_s: expected a finite number of seconds > 0, got "
                         f"{body_timeout_s!r}")
    if max_tokens_limit is not None:
        check_positive("max_tokens_limit", max_tokens_limit)
    if api_key is not None:
        check_key(api_key)
    if not is_int(max_n) or not 1 <= max_n <= MAX_N:
        raise ValueError(f"max_n: expected an int in [1, {MAX_N}], got {max_n!r}")
    if served_name is not None and (not isinstance(served_name, str) or not served_name):
        raise TypeError(f"served_name: expected a non-empty str or None, got {served_name!r}")
    state = ServerState.load(model, served_name=served_name, quantize=quantize, dtype=dtype,
                             extra_memory=extra_memory)
    draft = _draft_model(speculative, state.tokenizer, dtype=dtype, quantize=quantize,
                         extra_memory=extra_memory)
    try:
        engine = Engine(state.model, max_batch=max_batch,
                        max_tokens_per_step=max_tokens_per_step, kv_pages=kv_pages,
                        page_size=page_size, max_queue=max_queue, prefix_caching=prefix_caching,
                        tokenizer=state.tokenizer, draft_model=draft)
    except ValueError as error:  # the model's config cannot be served: name the file
        if isinstance(model, tuple) or not str(error).startswith("model: "):
            raise
        raise ValueError(f"{Path(model) / 'config.json'}: "
                         f"{str(error).removeprefix('model: ')}") from None
    state.max_tokens_limit, state.max_n = max_tokens_limit, max_n
    if speculative is not None:
        state.speculation = speculation_from("draft" if draft is not None else speculative)
        engine.speculator.check(state.speculation)
    state.engine = EngineThread(engine)
    # Loading ran OpenMP work on this thread; its idle worker threads would share the cores
    # with the engine thread's (see release_openmp_threads).
    release_openmp_threads()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()
            state.chat_threads.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="attnlab serve", lifespan=lifespan, openapi_url="/openapi.json",
                  docs_url=None, redoc_url=None)
    app.state.serving = state
    add_error_handlers(app)
    _add_routes(app, state)
    document(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
                   "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})
    app.add_middleware(_Gate, metrics=state.metrics, drain=state.drain,
                       max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    if api_key is not None:  # outside the gate: a caller without the key costs no body read
        app.add_middleware(BearerKey, key=api_key)
    allow_origins(app, allowed_origins)  # outermost: it answers the browsers' preflights
    return app


def _draft_model(speculative: object, tokenizer: Tokenizer, **load: object
                 ) -> DecoderLM | None:
    """The draft model that ``create_app``'s ``speculative`` names (None for another
    choice): a ``DecoderLM``, or ``draft:FOLDER`` loaded as the served folder is, whose
    tokenizer (where the folder has one) must be ``tokenizer``, token for token."""
    if isinstance(speculative, DecoderLM):
        return speculative.eval()
    if speculative is None:
        return None
    if not isinstance(speculative, str):
        raise TypeError(f"speculative: expected a str (ngram, ngram:K, self:N, draft:FOLDER), "
                        f"a draft DecoderLM or None, got {type(speculative).__name__}")
    folder = split_draft(speculative)
    if folder is None:
        return None
    try:
        draft = from_pretrained(folder, **load)
    except (ValueError, OSError) as error:
        raise ValueError(f"speculative: draft:{folder}: {error}") from None
    if not isinstance(draft, DecoderLM):
        raise ValueError(f"speculative: draft:{folder} holds a {type(draft).__name__}; "
                         f"expected a decoder-only language model folder")
    try:
        own = Tokenizer.from_pretrained(folder)
    except (ValueError, OSError):  # no tokenizer files: the vocabulary's size is checked
        return draft.eval()
    differs = own.vocab_size != tokenizer.vocab_size or next(
        (i for i in range(tokenizer.vocab_size)
         if own.backend.id_to_token(i) != tokenizer.backend.id_to_token(i)), None) is not None
    if differs:
        raise ValueError(f"speculative: draft:{folder}: its tokenizer differs from the served "
                         f"model's ({own.vocab_size} and {tokenizer.vocab_size} tokens, or a "
                         f"token's text); expected a draft that shares the tokenizer")
    return draft.eval()


@dataclass
class ServerState:
    """What the handlers share: the model, its tokenizer, the end ids, the engine thread, the
    operator's limits on a request's new tokens per choice and on its choices."""

    model: DecoderLM
    tokenizer: Tokenizer
    name: str
    stop_token_ids: tuple[int, ...]
    metrics: Metrics
    engine: EngineThread | None = None
    max_tokens_limit: int | None = None
    max_n: int = MAX_N
    speculation: Speculation | None = None  # the default (create_app's speculative)
    drain: Drain = field(default_factory=Drain)  # stopping: see attnlab.serving.shutdown
    # As many as the chat template renderer's worker processes: more would wait on them.
    chat_threads: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        CHAT_THREADS, thread_name_prefix="attnlab-chat"))

    @classmethod
    def load(cls, model: str | Path | tuple[DecoderLM, Tokenizer], *,
             served_name: str | None, quantize: str | None,
             dtype: str | None = None, extra_memory: bool = False) -> ServerState:
        if isinstance(model, tuple):
            if len(model) != 2 or not isinstance(model[0], DecoderLM) \
                    or not isinstance(model[1], Tokenizer):
                raise TypeError(f"model: expected a folder or a (DecoderLM, Tokenizer) pair, "
                                f"got {tuple(type(m).__name__ for m in model)}")
            if quantize is not None or dtype is not None or extra_memory:
                raise ValueError(f"quantize, dtype, extra_memory: only for a folder (cast, "
                                 f"quantize or load the DecoderLM yourself), got {quantize!r}, "
                                 f"{dtype!r}, {extra_memory!r}")
            net, tokenizer = model
            file_eos, name = None, served_name or "attnlab"
        elif isinstance(model, (str, Path)):
            net = from_pretrained(model, dtype=dtype, quantize=quantize,
                                  extra_memory=extra_memory)
            if not isinstance(net, DecoderLM):
                raise ValueError(f"model: {model} holds a {type(net).__name__}; expected a "
                                 "decoder-only language model folder")
            tokenizer = Tokenizer.from_pretrained(model)
            file = read_generation_config(model)
            file_eos, name = file.eos_token_id, served_name or Path(model).resolve().name
            if file_eos is not None:
                file_eos = token_id_set(f"eos_token_id in {file.path}", file_eos,
                                        net.config.vocab_size)
        else:
            raise TypeError(f"model: expected a folder (str or Path) or a (DecoderLM, "
                            f"Tokenizer) pair, got {type(model).__name__}")
        # As `attnlab generate`: the file's end ids, else the tokenizer's and config.json's.
        fallback = [tokenizer.eos_token_id, *net.config.eos_token_id]
        eos = file_eos or tuple(dict.fromkeys(i for i in fallback if i is not None))
        return cls(net.eval(), tokenizer, name, eos, Metrics())

    @property
    def context(self) -> int:
        return self.model.config.max_len

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "attnlab",
                "max_model_len": self.context}

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise ApiError(404, f"The model {name!r} does not exist; this server serves "
                           f"{self.name!r}", param="model", code="model_not_found")

    async def encode(self, prompt: str | list[int], field: str) -> list[int]:
        """``prompt``'s ids (text tokenized in a thread: a large prompt takes seconds, which
        the event loop spends serving the others), checked against the vocabulary."""
        if isinstance(prompt, str):
            try:
                ids = await asyncio.to_thread(self.tokenizer.encode, prompt,
                                              max_tokens=self.context)
            except ValueError as error:
                raise ApiError(400, f"{field}: {error}: longer than the model's context",
                               param=field) from None
            if not ids:
                raise ApiError(400, f"{field}: encodes to no tokens, got {prompt!r}",
                               param=field)
            return ids
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"{field}: token id {bad} is out of range; expected ids in "
                           f"[0, {vocab})", param=field)
        return list(prompt)

    def tool_parser(self, body: ChatRequest) -> ToolParser | None:
        """The parser of the answer's tool calls (``None``: the request has no tools to call);
        a 400 naming ``tools`` when the chat template does not render tools (the model would
        never learn of them) or when neither it nor the family shows a known format."""
        if body.tool_mode is None:
            return None
        template = self.tokenizer.chat_template
        origin = self.tokenizer.template_file or "its tokenizer_config.json"
        if template is None or "tools" not in _variables(template):
            raise ApiError(400, f"tools: this model's chat template ({origin}) does not render "
                           "tools, so the model cannot be told of them; expected a request "
                           "without tools, or a model whose template renders them (as "
                           "Qwen2.5's and Llama 3.1's do)", param="tools")
        parser = choose_parser(self.model.config.family, template)
        if parser is None:
            raise ApiError(400, f"tools: no tool call format is known for the model family "
                           f"{self.model.config.family!r} or its chat template ({origin}); "
                           f"this server reads {sorted(PARSERS)}", param="tools")
        return parser

    async def chat_ids(self, messages: list[dict], tools: list[dict] | None = None
                       ) -> list[int]:
        """The chat template's prompt ids for ``messages`` (and ``tools``), rendered (in the
        template's worker process, with its time and memory limits) and tokenized in a
        thread, off the event loop; a template that fails or exceeds a limit is a 400 naming
        its file. The renders have threads of their own: a slow template (up to its time
        limit each) queues the chat requests behind it, not the other requests' tokenizing
        and body checks, which share asyncio's default threads."""
        render = partial(self.tokenizer.apply_chat_template, messages, tools=tools,
                         add_generation_prompt=True, tokenize=True, max_tokens=self.context)
        try:
            ids = await asyncio.get_running_loop().run_in_executor(self.chat_threads, render)
        except ValueError as error:
            raise ApiError(400, f"messages: {error}", param="messages") from None
        if not ids:
            raise ApiError(400, "messages: the chat template renders them as no tokens",
                           param="messages")
        return ids

    def check_choices(self, prompts: int, n: int) -> None:
        """Refuse (400) a request of ``prompts`` prompts with ``n`` choices each that the
        engine's queue could never take at once: each choice is an engine request, and they
        are checked (and the prompts tokenized) before any starts, so that a body of a million
        one-character prompts costs one refusal, not a million tokenizations and a 429."""
        most = self.engine.engine.max_queue
        if prompts * n > most:
            param = "n" if prompts == 1 else "prompt"
            raise ApiError(400, f"{param}: {prompts} prompt{'s' * (prompts > 1)} with n={n} "
                           f"choices each make {prompts * n} requests; expected at most "
                           f"{most} in one request (this server's --max-queue)", param=param)

    async def prediction_ids(self, body: CompletionRequest | ChatRequest) -> tuple[int, ...]:
        """The token ids of ``body.prediction`` (none without one), without special tokens:
        the text expected in the output."""
        if body.prediction is None:
            return ()
        try:
            ids = await asyncio.to_thread(self.tokenizer.encode, body.prediction.text, False,
                                          max_tokens=self.context)
        except ValueError as error:
            raise ApiError(400, f"prediction: {error}: longer than the model's context",
                           param="prediction") from None
        return tuple(ids)

    def params(self, body: CompletionRequest | ChatRequest, prompt_length: int,
               asked: int | None, field: str, choice: int,
               group: str | None = None, reference: tuple[int, ...] = (),
               json_schema: dict | None = None) -> SamplingParams:
        """The engine's parameters for one choice of the request ``group``, after checking
        ``n`` and the new tokens ``asked`` in ``field`` against the server's limits, and that
        the choice fits the context and the KV cache. New tokens the client did not ask for
        (``field`` not sent) are as many as fit, within ``max_tokens_limit`` (and the field's
        default, when it has one). Speculative decoding: ``speculation.requested`` (with
        ``reference``, the prediction's ids). ``json_schema``: what the answer must be (a
        forced tool call), else the request's ``response_format``."""
        prompt_field = "messages" if isinstance(body, ChatRequest) else "prompt"
        if body.n > self.max_n:
            raise ApiError(400, f"n: expected at most {self.max_n} (this server's --max-n), "
                           f"got {body.n}", param="n")
        most = self.engine.engine.max_request_tokens
        room = most - prompt_length
        limit = (f"This model's maximum context length is {most} tokens"
                 if most == self.context else f"This server's KV cache holds {most} tokens a "
                 f"request (the model's context is {self.context})")
        if room <= 0:
            raise ApiError(400, f"{prompt_field}: {limit}. However, your {prompt_field} has "
                           f"{prompt_length} tokens, leaving no room for a completion.",
                           param=prompt_field, code="context_length_exceeded")
        if field in body.model_fields_set and asked is not None:
            if self.max_tokens_limit is not None and asked > self.max_tokens_limit:
                raise ApiError(400, f"{field}: expected at most {self.max_tokens_limit} (this "
                               f"server's --max-tokens-limit), got {asked}", param=field)
            if asked > room:
                raise ApiError(400, f"{field}: {limit}. However, you requested "
                               f"{prompt_length + asked} tokens ({prompt_length} in the "
                               f"{prompt_field}, {asked} for the completion). Please reduce "
                               f"the length of the {prompt_field} or {field}.", param=field,
                               code="context_length_exceeded")
        else:  # a default: what fits
            asked = min(room, self.max_tokens_limit or room, asked or room)
        bias = None
        if body.logit_bias:
            try:
                bias = check_logit_bias(body.logit_bias, self.model.config.vocab_size)
            except ValueError as error:
                raise ApiError(400, str(error), param="logit_bias") from None
        # n choices with one seed must differ, as OpenAI's do; each is still reproducible.
        seed = None if body.seed is None else (body.seed + choice) % (MAX_SEED + 1)
        # A temperature this small divides the logits into inf (NaN probabilities): it means
        # greedy, as in vLLM. A top_p under float32's range compares as 0 and would drop every
        # token; any p <= 1/V keeps the most likely token only, which MIN_TOP_P does.
        temperature = 0.0 if body.temperature < SAMPLING_EPS else body.temperature
        k = body.top_k_logprobs
        echo = isinstance(body, CompletionRequest) and bool(body.echo)
        try:
            speculation = requested(body, self.speculation, reference)
            self.engine.engine.speculator.check(speculation)
        except ValueError as error:  # speculation's: the message begins with the field
            name = str(error).partition(":")[0]
            raise ApiError(400, str(error), param=name) from None
        # max_tokens 0 (with echo): one token is made for the prompt's logprobs, not shown
        return SamplingParams(max_tokens=max(asked, 1), temperature=temperature,
                              top_p=max(body.top_p, MIN_TOP_P), top_k=body.top_k, seed=seed,
                              stop_token_ids=self.stop_token_ids, group=group,
                              presence_penalty=body.presence_penalty or 0.0,
                              frequency_penalty=body.frequency_penalty or 0.0,
                              logit_bias=bias, min_p=body.min_p or 0.0,
                              repetition_penalty=body.repetition_penalty or 1.0,
                              logprobs=k, prompt_logprobs=echo and k is not None,
                              json_schema=body.json_schema if json_schema is None else json_schema,
                              speculation=speculation)

    async def check_schema(self, body: CompletionRequest | ChatRequest) -> None:
        """Compile the request's ``response_format`` schema (in a thread: tens of
        milliseconds, once per schema), refusing one the grammar engine cannot enforce with
        a 400 naming it, before anything is queued."""
        if body.json_schema is None:
            return
        try:
            await asyncio.to_thread(self.engine.engine.grammars.get, body.json_schema,
                                    self.stop_token_ids)
        except ValueError as error:
            message = str(error).removeprefix("json_schema: ")
            raise ApiError(400, f"response_format: {message}", param="response_format") \
                from None


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.engine.alive and not state.drain.stopping
        status = "stopping" if state.drain.stopping else "ok" if ok else "engine stopped"
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(state.engine.stats),
                                 media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        state.check_model(name)
        return state.model_card()

    # The bodies are parsed and checked by `parsed`, off the event loop.
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parsed(request, CompletionRequest)
        state.check_model(body.model)
        state.check_choices(len(body.prompt), body.n)
        await state.check_schema(body)
        prompts = [await state.encode(p, "prompt") for p in body.prompt]
        job = _Job(state, body, prompts, body.max_tokens, "max_tokens", chat=False,
                   reference=await state.prediction_ids(body))
        return await job.respond(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parsed(request, ChatRequest)
        state.check_model(body.model)
        state.check_choices(1, body.n)
        await state.check_schema(body)
        parser = state.tool_parser(body)
        tools = None if parser is None else [t.model_dump(exclude_none=True)
                                             for t in body.tools]
        ids = await state.chat_ids([m.for_template() for m in body.messages], tools)
        mode, schema = body.tool_mode, None
        if parser is not None and mode != "auto":  # "required" or a function's name
            if body.json_schema is not None:
                raise ApiError(400, "response_format: a JSON answer and a forced tool call "
                               "(tool_choice) cannot both shape the output; expected one of "
                               "them", param="response_format")
            schema = forced_schema(parser, tools, None if mode == "required" else mode,
                                   parallel=body.parallel_tool_calls is not False)
            try:  # a keyword the grammar engine cannot enforce is refused, never dropped
                check_schema(schema)
            except ValueError as error:
                raise ApiError(400, f"tools: a function's parameters: {error}",
                               param="tools") from None
        asked, field = body.new_tokens
        job = _Job(state, body, [ids], asked, field, chat=True, tools=parser,
                   json_schema=schema, reference=await state.prediction_ids(body))
        return await job.respond(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await parsed(request, TokenizeRequest)
        state.check_model(body.model)
        if body.messages is not None:  # tools rendered as the chat route renders them
            tools = None if not body.tools else [t.model_dump(exclude_none=True)
                                                 for t in body.tools]
            ids = await state.chat_ids([m.for_template() for m in body.messages], tools)
        else:
            try:
                ids = await asyncio.to_thread(state.tokenizer.encode, body.prompt,
                                              body.add_special_tokens, max_tokens=state.context)
            except ValueError as error:
                raise ApiError(400, f"prompt: {error}: longer than the model's context",
                               param="prompt") from None
        return {"count": len(ids), "max_model_len": state.context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await parsed(request, DetokenizeRequest)
        state.check_model(body.model)
        ids = await state.encode(body.tokens, "tokens") if body.tokens else []
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, ids)}


class _Job:
    """One HTTP request: ``n`` engine requests per prompt, whose events share one queue."""

    def __init__(self, state: ServerState, body: CompletionRequest | ChatRequest,
                 prompts: list[list[int]], asked: int | None, field: str, *, chat: bool,
                 reference: tuple[int, ...] = (), tools: ToolParser | None = None,
                 json_schema: dict | None = None) -> None:
        self.state, self.body, self.chat, self.field = state, body, chat, field
        # The parser of a chat answer's tool calls; forced: the answer is the call's JSON.
        self.tools, self.forced = tools, json_schema is not None
        # The special tokens whose text the parser reads (dropped from answers without tools).
        self.keep = frozenset() if tools is None else frozenset(
            i for i in map(state.tokenizer.token_to_id, tools.specials) if i is not None)
        self.prompt_field = "messages" if chat else "prompt"
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options: only with stream: true, got stream: "
                           "false", param="stream_options")
        self.prompt_tokens = sum(map(len, prompts)) * body.n
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now()  # one for the whole completion, every chunk included
        # Every choice is checked before any is started: a refusal leaves nothing running.
        # The choices share one fair share of the engine (its scheduler's groups).
        self.work = [(ids, state.params(body, len(ids), asked, field, j, group=self.id,
                                        reference=reference, json_schema=json_schema))
                     for ids in prompts for j in range(body.n)]
        self.events: asyncio.Queue = asyncio.Queue()
        self.choices: dict[str, tuple[int, ChoiceText]] = {}  # engine id -> (index, text)
        self.logprobs: dict[int, ChoiceLogprobs] = {}  # index -> its logprobs, when asked
        # max_tokens 0 with echo: the one token made for the prompt's logprobs is not shown
        self.hidden_token = asked == 0
        self.echo = not chat and bool(body.echo)
        self.echoed: set[int] = set()  # choices whose prompt text was sent (streaming)
        self.finishes: dict[int, str] = {}
        self.aborted = False

    async def respond(self, request: Request) -> Response:
        # Counted as running from here, so that a stop beginning now waits for (or ends) it.
        self.state.drain.add(self.events)
        try:
            await self._start()
        except BaseException:
            self._end()
            raise
        if self.body.stream:
            return _EventStream(self._stream(), on_close=self._end,
                                media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        try:
            return await self._collect(request)
        finally:
            self._end()

    async def _start(self) -> None:
        for index, (ids, params) in enumerate(self.work):
            try:
                request_id = await self.state.engine.add(ids, params, self.events)
            except QueueFull as error:
                raise ApiError(429, f"The server is busy ({error}); retry later",
                               code="queue_full", type="rate_limit_exceeded") from None
            except ValueError as error:  # the engine's own limit (its KV cache pages)
                param = self.prompt_field if str(error).startswith("prompt_ids") \
                    else self.field
                raise ApiError(400, f"{param}: {error}", param=param,
                               code="context_length_exceeded") from None
            stops = self.body.stop_texts
            self.choices[request_id] = (index, ChoiceText(self.state.tokenizer, stops,
                                                          keep=self.keep))
            if params.logprobs is not None or self.echo:
                self.logprobs[index] = ChoiceLogprobs(self.state.tokenizer, ids, chat=self.chat,
                                                      echo=self.echo)
        self.state.metrics.tokens(self.prompt_tokens, 0)

    def abort(self) -> None:
        """Abort every choice still running (its pages are freed); once only (a stream's
        generator and its response both end the job)."""
        if self.aborted:
            return
        self.aborted = True
        for request_id, (index, _) in self.choices.items():
            if index not in self.finishes:
                self.state.engine.abort(request_id)

    def _end(self) -> None:
        """The answer is over (sent, failed or cut): abort what still runs; no longer
        running for the server's stop."""
        self.abort()
        self.state.drain.remove(self.events)

    async def _updates(self) -> AsyncIterator[tuple[int, str, str | None]]:
        """``(index, new text, finish reason or None)`` as tokens arrive, until every choice
        has finished; an abort of a choice on a stop string is done here."""
        while len(self.finishes) < len(self.choices):
            event = await self.events.get()
            if isinstance(event, (EngineError, ShutdownError)):
                raise event
            index, text = self.choices[event.request_id]
            if index in self.finishes:  # sent before the engine saw our abort (a stop string)
                continue
            finish = event.finish_reason
            if finish == "abort":  # not ours: ours stop the events before the engine reports
                raise EngineError(f"the engine ended the request: "
                                  f"{event.error or 'aborted'}")
            record = self.logprobs.get(index)
            if record is not None and event.prompt_logprobs is not None:
                record.add_prompt(event.prompt_logprobs)
            if event.token_id is not None:
                self.state.metrics.tokens(0, 1)
            if self.hidden_token:
                finish = "length"  # max_tokens 0: no token is shown
            elif event.token_id is not None:
                if record is not None and event.logprobs is not None:
                    record.add(event.token_id, event.logprobs)
                if text.push(event.token_id) and finish is None:
                    self.state.engine.abort(event.request_id)
                    finish = "stop"
            if finish is not None:
                text.finish()
                self.finishes[index] = "stop" if text.stopped else finish
            yield index, text.take(final=finish is not None), self.finishes.get(index)

    def _usage(self) -> dict:
        made = sum(text.tokens for _, text in self.choices.values())
        return usage(self.prompt_tokens, made)

    def _texts(self) -> list[ChoiceText]:
        return [text for _, text in sorted(self.choices.values(), key=lambda c: c[0])]

    async def _collect(self, request: Request) -> JSONResponse:
        """The whole answer; polls the client meanwhile and aborts if it went away."""
        async def drain() -> None:
            async for _ in self._updates():
                pass

        task = asyncio.ensure_future(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    self.abort()
                    # Nobody reads this answer; nginx's code for a client that went away.
                    return JSONResponse(error_body("client disconnected"), status_code=499)
            await task
        except asyncio.CancelledError:  # the server is stopping
            self.abort()
            raise
        except ShutdownError as stop:
            self.abort()
            raise ApiError(503, f"{stop}; the request was not finished", type="server_error",
                           code="server_shutdown") from None
        except EngineError as error:
            self.abort()
            raise ApiError(500, str(error), type="server_error", code="engine_failure") \
                from None
        texts, finishes = [t.text for t in self._texts()], [
            self.finishes[i] for i in range(len(self.work))]
        logprobs = None
        if self.body.top_k_logprobs is not None:
            logprobs = [self.logprobs[i].whole() for i in range(len(self.work))]
        if self.echo:
            texts = [self.logprobs[i].echo_text + t for i, t in enumerate(texts)]
        if self.tools is not None:
            answers = [parse_answer(self.tools, t, forced=self.forced) for t in texts]
            texts = [content for content, _ in answers]
            finishes = ["tool_calls" if calls else f
                        for (_, calls), f in zip(answers, finishes, strict=True)]
            return JSONResponse(chat_completion(
                self.id, self.state.name, texts, finishes, self._usage(), created=self.created,
                logprobs=logprobs,
                tool_calls=[[c.openai() for c in calls] for _, calls in answers]))
        make = chat_completion if self.chat else completion
        return JSONResponse(make(self.id, self.state.name, texts, finishes, self._usage(),
                                 created=self.created, logprobs=logprobs))

    def _chunk_extras(self, index: int, piece: str) -> tuple[str, dict | None]:
        """A stream chunk's text (the prompt's first, with ``echo``) and the logprobs of the
        tokens since the choice's last chunk (``None`` when not asked for)."""
        if self.echo and index not in self.echoed:
            self.echoed.add(index)
            piece = self.logprobs[index].echo_text + piece
        if self.body.top_k_logprobs is None:
            return piece, None
        return piece, self.logprobs[index].take()

    async def _stream(self) -> AsyncIterator[str]:
        """Server-sent events: for chat, a first delta with the role per choice; text
        deltas; each choice's last chunk with its finish reason; the usage chunk when asked;
        ``[DONE]``. With tools, text that may be a call is held back; a choice's calls come
        after its content, one ``delta.tool_calls`` chunk each, then its finish reason
        (``"tool_calls"`` when it made any). Leaving early (client gone) aborts the choices
        still running."""
        name, with_usage = self.state.name, self.body.include_usage
        chat_chunk = partial(_chat_chunk, created=self.created)
        completion_chunk = partial(_completion_chunk, created=self.created)
        calls = {i: ToolStream(self.tools, forced=self.forced) for i in range(len(self.work))
                 } if self.tools is not None else None
        try:
            if self.chat:
                for index in range(len(self.work)):
                    yield _sse(chat_chunk(self.id, name, index,
                                          {"role": "assistant", "content": ""}, None, None,
                                          with_usage=with_usage))
            async for index, piece, finish in self._updates():
                if calls is not None:
                    for chunk in _tool_chunks(calls[index], piece, finish):
                        yield _sse(chat_chunk(self.id, name, index, *chunk, None,
                                              with_usage=with_usage))
                    continue
                if not piece and finish is None:
                    continue
                piece, logprobs = self._chunk_extras(index, piece)
                if self.chat:
                    delta = {"content": piece} if piece else {}
                    yield _sse(chat_chunk(self.id, name, index, delta, finish, None,
                                          with_usage=with_usage, logprobs=logprobs))
                else:
                    yield _sse(completion_chunk(self.id, name, index, piece, finish, None,
                                                with_usage=with_usage, logprobs=logprobs))
            if with_usage:
                make = chat_chunk if self.chat else completion_chunk
                empty = {} if self.chat else ""
                yield _sse(make(self.id, name, None, empty, None, self._usage(),
                                with_usage=True))
        except ShutdownError as stop:
            # Each unfinished choice gets its last chunk, then OpenAI's error object, which
            # the openai client raises: the text so far stays, the cut is not hidden.
            for index in sorted(set(range(len(self.work))) - set(self.finishes)):
                text = self._texts()[index]
                text.finish()
                piece = text.take(final=True)
                if calls is not None:  # what was held back as a possible call is content
                    piece = calls[index].push(piece) + calls[index].cut()
                if self.chat:
                    yield _sse(chat_chunk(self.id, name, index,
                                          {"content": piece} if piece else {}, "abort", None,
                                          with_usage=with_usage))
                else:
                    yield _sse(completion_chunk(self.id, name, index, piece, "abort", None,
                                                with_usage=with_usage))
            yield _sse(error_body(f"{stop}; the stream was cut", type="server_error",
                                  code="server_shutdown"))
        except EngineError as error:
            yield _sse(error_body(str(error), type="server_error", code="engine_failure"))
        finally:
            self._end()
        yield "data: [DONE]\n\n"


def _tool_chunks(stream: ToolStream, piece: str, finish: str | None
                 ) -> list[tuple[dict, str | None]]:
    """A streamed choice's ``(delta, finish_reason)`` chunks for its new text ``piece``: the
    content that cannot be a call; at its ``finish``, the rest of the content, one chunk per
    call (``delta.tool_calls``, its ``index`` the call's place in the message), and the
    finish reason."""
    content = stream.push(piece)
    if finish is None:
        return [({"content": content}, None)] if content else []
    rest, calls = stream.finish()
    content += rest
    return [*([({"content": content}, None)] if content else []),
            *(({"tool_calls": [{"index": k, **call.openai()}]}, None)
              for k, call in enumerate(calls)),
            ({}, "tool_calls" if calls else finish)]


@functools.lru_cache(maxsize=8)
def _variables(template: str) -> frozenset[str]:
    """``template_variables``, parsed once per template (a few ms each time otherwise)."""
    return template_variables(template)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """A ``StreamingResponse`` that closes its generator however the response ends (Starlette
    leaves it open when a send fails), so that the generator's cleanup always runs, and then
    calls ``on_close`` (a generator never started has no cleanup of its own)."""

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], None],
                 **options) -> None:
        super().__init__(content, **options)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_close()


class _Gate:
    """Pure ASGI middleware in front of every route. It counts each answer by route and status
    for ``/metrics``; once the server is stopping it answers 503 (``/health`` and ``/metrics``
    still answer); and it reads each request's body before the app sees it: a body over
    ``max_body_bytes`` is refused (413) by its ``Content-Length`` before it is read, or once
    that many bytes arrived (a chunked body), and a body that stops arriving for
    ``body_timeout_s`` (shorter than its ``Content-Length``) is refused (408), so that no
    connection waits forever on a client."""

    def __init__(self, app, *, metrics: Metrics, drain: Drain, max_body_bytes: int,
                 body_timeout_s: float) -> None:
        self.app, self.metrics, self.drain = app, metrics, drain
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = 500

        async def counted_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.drain.stopping and route not in ("/health", "/metrics"):
                raise ApiError(503, "The server is stopping; retry on another one",
                               type="server_error", code="server_shutdown")
            length = dict(scope["headers"]).get(b"content-length", b"0")
            if not length.isdigit() or int(length) > self.max_body_bytes:
                raise ApiError(413, f"body: expected at most {self.max_body_bytes} bytes, got "
                               f"content-length {length.decode('latin-1')[:40]}",
                               code="body_too_large")
            body = await self._read_body(receive)
            if body is None:  # the client went away; nobody reads an answer
                status = 499
                return
            await self.app(scope, _replay(body, receive), counted_send)
        except ApiError as error:
            status = error.status
            data = json.dumps(error.body()).encode()
            # After a refused body the connection's next bytes are not a request: close it.
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(data)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": data})
        finally:
            self.metrics.request(route, status)

    async def _read_body(self, receive) -> bytes | None:
        """The whole body (None if the client disconnected), within the size and time
        bounds."""
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                raise ApiError(408, f"body: no bytes came for {self.body_timeout_s:g} s after "
                               f"{size} bytes; expected the rest of the body (as many bytes as "
                               "its Content-Length, or a chunked body's last chunk)",
                               code="body_timeout") from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise ApiError(413, f"body: expected at most {self.max_body_bytes} bytes, got "
                               f"more (a chunked body)", code="body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that gives ``body`` as one message, then waits on ``receive`` (for
    the client's disconnect)."""
    given = False

    async def replayed():
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
