"""``attnlab serve``'s small things, driven by the official ``openai`` client and plain HTTP:
one id and one created per completion across its chunks; unknown fields refused as OpenAI
refuses them, OpenAI's other fields accepted or refused by name; /tokenize, /detokenize;
/openapi.json with the request models; --api-key (401 but on /health) and CORS only for
--allowed-origin."""

from __future__ import annotations

import itertools
import json

import openai
import pytest
from server_live import client, live, raw

from attnlab.cli import build_parser
from attnlab.serving import api as api_module
from attnlab.serving.server import create_app
from attnlab.tokenizer import Tokenizer

KEY = "sk-test-7f3a"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(qwen2_folder):
    with live(create_app(qwen2_folder, max_batch=4, page_size=4, kv_pages=128)) as url:
        yield url


@pytest.fixture(scope="module")
def keyed(qwen2_folder):
    app = create_app(qwen2_folder, max_batch=2, page_size=4, kv_pages=64, api_key=KEY,
                     allowed_origins=[ORIGIN])
    with live(app) as url:
        yield url


@pytest.mark.parametrize("chat", [False, True])
def test_one_id_and_created_across_the_chunks(server, qwen2_folder, monkeypatch,
                                              chat: bool) -> None:
    """The clock moves a second at every read: the chunks still share one created."""
    ticks = itertools.count(1_700_000_000)
    monkeypatch.setattr(api_module.time, "time", lambda: next(ticks))
    api = client(server)
    common = {"model": qwen2_folder.name, "max_tokens": 8, "stream": True, "n": 2,
              "stream_options": {"include_usage": True}}
    if chat:
        chunks = list(api.chat.completions.create(
            messages=[{"role": "user", "content": "hello fox"}], **common))
    else:
        chunks = list(api.completions.create(prompt="once upon a", **common))
    assert len(chunks) > 3
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1


def test_unknown_fields_are_refused_as_openai_does(server, qwen2_folder) -> None:
    api = client(server)
    for extra, create in (({"unknown_field": 1}, api.completions.create),
                          ({"temprature": 0.5}, api.chat.completions.create)):
        args = ({"prompt": "hi"} if create == api.completions.create
                else {"messages": [{"role": "user", "content": "hi"}]})
        with pytest.raises(openai.BadRequestError) as error:
            create(model=qwen2_folder.name, max_tokens=2, extra_body=extra, **args)
        name = next(iter(extra))
        assert error.value.body["message"] == f"Unrecognized request argument supplied: {name}"
        assert error.value.body["param"] == name


def test_openai_fields_that_change_nothing_are_accepted(server, qwen2_folder) -> None:
    api = client(server)
    out = api.chat.completions.create(
        model=qwen2_folder.name, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        store=False, metadata={"run": "test"}, service_tier="auto", user="u1",
        parallel_tool_calls=True, prompt_cache_key="k", temperature=0)
    plain = api.chat.completions.create(
        model=qwen2_folder.name, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0)
    assert out.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(("field", "value"), [("best_of", 2), ("suffix", "x"),
                                              ("modalities", ["audio"])])
def test_fields_not_implemented_yet_are_refused_by_name(server, qwen2_folder, field: str,
                                                        value: object) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client(server).chat.completions.create(
            model=qwen2_folder.name, messages=[{"role": "user", "content": "hi"}],
            max_tokens=2, extra_body={field: value})
    assert error.value.body["param"] == field
    assert "not supported by this server" in error.value.body["message"]


def test_tokenize_and_detokenize(server, qwen2_folder) -> None:
    tok = Tokenizer.from_pretrained(qwen2_folder)
    status, _, text = raw(server, "POST", "/tokenize",
                          {"model": qwen2_folder.name, "prompt": "the fox said hello"})
    assert status == 200
    body = json.loads(text)
    assert body["tokens"] == tok.encode("the fox said hello") and body["count"] == len(
        body["tokens"]) and body["max_model_len"] == 256
    status, _, text = raw(server, "POST", "/detokenize",
                          {"model": qwen2_folder.name, "tokens": body["tokens"]})
    assert status == 200 and json.loads(text) == {"prompt": "the fox said hello"}
    messages = [{"role": "user", "content": "hi"}]
    status, _, text = raw(server, "POST", "/tokenize",
                          {"model": qwen2_folder.name, "messages": messages})
    assert json.loads(text)["tokens"] == tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    for path, body, param in (
            ("/detokenize", {"model": qwen2_folder.name, "tokens": [10**6]}, "tokens"),
            ("/tokenize", {"model": qwen2_folder.name}, None),
            ("/tokenize", {"model": "gpt-4", "prompt": "x"}, "model")):
        status, _, text = raw(server, "POST", path, body)
        error = json.loads(text)["error"]
        assert status in (400, 404) and error["param"] == param, text


def test_openapi_json_has_the_request_models(server) -> None:
    status, _, text = raw(server, "GET", "/openapi.json")
    assert status == 200
    schema = json.loads(text)
    for path, model in (("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatRequest"),
                        ("/tokenize", "TokenizeRequest")):
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert ref["schema"]["$ref"] == f"#/components/schemas/{model}"
    chat = schema["components"]["schemas"]["ChatRequest"]
    assert {"messages", "temperature", "top_k"} <= set(chat["properties"])
    assert chat["additionalProperties"] is False
    assert "ChatMessage" in schema["components"]["schemas"]  # the $defs, moved


def test_api_key_guards_every_route_but_health(keyed, qwen2_folder) -> None:
    assert raw(keyed, "GET", "/health")[0] == 200
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("GET", "/metrics"), ("GET", "/openapi.json"), ("POST", "/tokenize")):
        status, headers, text = raw(keyed, method, path, {} if method == "POST" else None)
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
        assert headers["www-authenticate"] == "Bearer"
    status, _, _ = raw(keyed, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert status == 401
    with pytest.raises(openai.AuthenticationError):
        client(keyed).models.list()  # the helper's key is "x"
    api = openai.OpenAI(base_url=f"{keyed}/v1", api_key=KEY, max_retries=0)
    assert api.completions.create(model=qwen2_folder.name, prompt="hi", max_tokens=2).choices


def test_cors_only_for_the_allowed_origin(server, keyed) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    status, headers, _ = raw(keyed, "OPTIONS", "/v1/completions", headers=preflight)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    _, headers, _ = raw(keyed, "OPTIONS", "/v1/completions",
                        headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in headers
    _, headers, _ = raw(server, "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in headers  # no --allowed-origin: CORS off


def test_serve_flags_reach_create_app(qwen2_folder, monkeypatch) -> None:
    args = build_parser().parse_args(["serve", "--model", str(qwen2_folder), "--allowed-origin",
                                      ORIGIN, "--allowed-origin", "*"])
    assert args.api_key is None and args.allowed_origin == [ORIGIN, "*"]
    seen = {}

    class SeenError(Exception):
        pass

    def fake_create_app(*args: object, **options: object) -> None:
        seen.update(options)
        raise SeenError  # no server: the options are what this test reads

    monkeypatch.setenv("ATTNLAB_API_KEY", KEY)  # the key from the environment
    monkeypatch.setattr("attnlab.cli.serve.create_app", fake_create_app)
    with pytest.raises(SeenError):
        args.handler(args)
    assert seen["api_key"] == KEY and seen["allowed_origins"] == [ORIGIN, "*"]


@pytest.mark.parametrize("key", ["", "caf\u00e9", "a\nb"])
def test_a_key_that_no_header_can_carry_is_refused_at_start(qwen2_folder, key: str) -> None:
    with pytest.raises(ValueError, match="api_key: expected a non-empty string of printable "
                                         "ASCII"):
        create_app(qwen2_folder, api_key=key)
