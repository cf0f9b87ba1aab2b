"""The server's limits on a live server: with a KV cache smaller than one context, a request
that does not say how many tokens it wants gets what fits (it was refused, blaming a field it
never sent); the operator's ``max_tokens_limit`` and ``max_n`` (``--max-tokens-limit``,
``--max-n``) refuse larger requests by field and cap the default; a config whose context
cannot hold one request is refused naming its file."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from server_live import live, raw

from attnlab.cli import build_parser
from attnlab.cli import serve as cli_serve
from attnlab.serving.server import create_app

POOL = 64  # tokens: 16 pages of 4, under the folder's context of 256
LIMIT = 40


@pytest.fixture(scope="module")
def small_pool(qwen2_folder):
    app = create_app(qwen2_folder, max_batch=2, page_size=4, kv_pages=POOL // 4)
    with live(app) as url:
        yield app, url


@pytest.fixture(scope="module")
def limited(qwen2_folder):
    app = create_app(qwen2_folder, max_batch=2, page_size=4, kv_pages=POOL // 4,
                     max_tokens_limit=LIMIT, max_n=2)
    with live(app) as url:
        yield app, url


def post(server, path: str, body: dict) -> tuple[int, dict]:
    status, _, text = raw(server[1], "POST", path, body)
    return status, json.loads(text)


def chat(folder, **fields) -> dict:
    return {"model": folder.name, "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0, **fields}


def test_a_chat_without_max_tokens_gets_what_the_small_pool_holds(small_pool, qwen2_folder):
    status, body = post(small_pool, "/v1/chat/completions", chat(qwen2_folder))
    assert status == 200, body
    usage = body["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= POOL


def test_a_completion_without_max_tokens_takes_its_default_of_16_or_what_fits(small_pool,
                                                                              qwen2_folder):
    prompt = list(range(1, POOL - 4 + 1))  # 60 ids: 4 tokens of room, under the default 16
    status, body = post(small_pool, "/v1/completions",
                        {"model": qwen2_folder.name, "prompt": prompt, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] <= 4


def test_too_many_tokens_for_the_pool_blame_the_field_once_with_the_numbers(small_pool,
                                                                           qwen2_folder):
    prompt = list(range(1, 41))
    status, body = post(small_pool, "/v1/completions",
                        {"model": qwen2_folder.name, "prompt": prompt, "max_tokens": 25})
    error = body["error"]
    assert status == 400 and error["param"] == "max_tokens"
    assert error["message"].startswith("max_tokens: This server's KV cache holds 64 tokens a "
                                       "request (the model's context is 256). However, you "
                                       "requested 65 tokens (40 in the prompt, 25 for the "
                                       "completion).")
    assert error["message"].count("max_tokens:") == 1
    status, body = post(small_pool, "/v1/completions",
                        {"model": qwen2_folder.name, "prompt": list(range(1, 65))})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert "your prompt has 64 tokens, leaving no room" in body["error"]["message"]


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"max_tokens": LIMIT + 1}, "max_tokens",
     f"max_tokens: expected at most {LIMIT} (this server's --max-tokens-limit), got 41"),
    ({"max_completion_tokens": 50}, "max_completion_tokens",
     f"max_completion_tokens: expected at most {LIMIT} (this server's --max-tokens-limit), "
     "got 50"),
    ({"n": 3}, "n", "n: expected at most 2 (this server's --max-n), got 3"),
])
def test_requests_over_the_operators_limits_are_400_naming_the_field(limited, qwen2_folder,
                                                                     fields, param, message):
    status, body = post(limited, "/v1/chat/completions", chat(qwen2_folder, **fields))
    assert status == 400 and body["error"]["param"] == param
    assert body["error"]["message"] == message


def test_the_limits_let_smaller_requests_through_and_cap_the_default(limited, qwen2_folder):
    status, body = post(limited, "/v1/chat/completions", chat(qwen2_folder, n=2))
    assert status == 200, body
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] <= 2 * LIMIT
    status, body = post(limited, "/v1/chat/completions", chat(qwen2_folder, max_tokens=LIMIT))
    assert status == 200, body


def test_create_app_refuses_bad_limits_by_name(qwen2_folder) -> None:
    for kwargs, message in [
        ({"max_n": 0}, "max_n: expected an int in [1, 16], got 0"),
        ({"max_n": 17}, "max_n: expected an int in [1, 16], got 17"),
        ({"max_tokens_limit": 0}, "max_tokens_limit: expected a positive int, got 0"),
        ({"kv_pages": 2, "page_size": 4}, "kv_pages: 2 pages of 4 tokens hold 8 tokens; "
         "expected at least 4 pages"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            create_app(qwen2_folder, **kwargs)


def test_a_context_that_holds_no_request_is_refused_naming_the_config_file(qwen2_folder,
                                                                         tmp_path) -> None:
    folder = tmp_path / "one-token"
    shutil.copytree(qwen2_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(folder / 'config.json'))}: its "
                                         r"context max_len=1 \(config.json's "
                                         r"max_position_embeddings\) holds no prompt token"):
        create_app(folder, page_size=1)


@pytest.mark.parametrize(("args", "message"), [
    (["--max-n", "17"], "--max-n: expected an int in [1, 16]"),
    (["--max-n", "0"], "--max-n: expected an int in [1, 16]"),
    (["--max-tokens-limit", "0"], "--max-tokens-limit: expected a positive int"),
])
def test_bad_limit_options_are_named(qwen2_folder, capsys, args, message) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", str(qwen2_folder), *args])
    assert message in capsys.readouterr().err


def test_the_limit_options_reach_create_app(qwen2_folder, monkeypatch) -> None:
    seen: dict = {}

    def create(model, **kwargs):
        seen.update(kwargs)
        raise ValueError("stopped before serving")

    monkeypatch.setattr(cli_serve, "create_app", create)
    args = build_parser().parse_args(["serve", "--model", str(qwen2_folder),
                                      "--max-tokens-limit", "40", "--max-n", "3"])
    with pytest.raises(ValueError, match="stopped before serving"):
        cli_serve.run_serve(args)
    assert (seen["max_tokens_limit"], seen["max_n"]) == (40, 3)
    defaults = build_parser().parse_args(["serve", "--model", str(qwen2_folder)])
    assert (defaults.max_tokens_limit, defaults.max_n) == (None, 16)


@pytest.fixture(scope="module")
def short_queue(qwen2_folder):
    app = create_app(qwen2_folder, max_batch=1, page_size=4, kv_pages=POOL // 4, max_queue=4)
    with live(app) as url:
        yield app, url


def test_more_choices_than_the_queue_holds_are_400_before_any_prompt_is_tokenized(
        short_queue, qwen2_folder, monkeypatch) -> None:
    """Prompts times ``n`` over ``max_queue`` could never all be queued (it was a 429 once
    the queue filled, after tokenizing every prompt: a body of a million one-character
    prompts held the server for minutes)."""
    app, _ = short_queue
    tokenized = []
    monkeypatch.setattr(app.state.serving.tokenizer, "encode",
                        lambda text, *a, **k: tokenized.append(text) or [1])
    status, body = post(short_queue, "/v1/completions",
                        {"model": qwen2_folder.name, "prompt": ["x"] * 10_000, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert body["error"]["message"] == ("prompt: 10000 prompts with n=1 choices each make "
                                        "10000 requests; expected at most 4 in one request "
                                        "(this server's --max-queue)")
    status, body = post(short_queue, "/v1/completions", {"model": qwen2_folder.name,
                                                         "prompt": ["x", "y"], "n": 3})
    assert status == 400 and body["error"]["param"] == "prompt", body
    status, body = post(short_queue, "/v1/chat/completions", chat(qwen2_folder, n=5))
    assert status == 400 and body["error"]["param"] == "n", body
    assert tokenized == []
    status, body = post(short_queue, "/v1/completions", {"model": qwen2_folder.name,
                                                         "prompt": ["x", "y"], "n": 2,
                                                         "max_tokens": 1})
    assert status == 200 and len(body["choices"]) == 4, body


def test_a_prompt_too_long_for_the_context_is_400_before_it_is_tokenized(small_pool,
                                                                          qwen2_folder):
    """More characters than the context's tokens can hold (each at most the longest token's
    characters): a 400 naming the field, without tokenizing, for a prompt and for a chat
    template's rendering of the messages."""
    app, _ = small_pool
    state = app.state.serving
    longest = max(map(len, state.tokenizer.backend.get_vocab(with_added_tokens=True)))
    text = "ab " * (state.context * longest)
    status, body = post(small_pool, "/v1/completions",
                        {"model": qwen2_folder.name, "prompt": text, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert re.match(rf"prompt: text: {len(text)} characters are more than {state.context} "
                    r"tokens can hold .*: longer than the model's context$",
                    body["error"]["message"])
    status, body = post(small_pool, "/v1/chat/completions",
                        chat(qwen2_folder, messages=[{"role": "user", "content": text}]))
    assert status == 400 and body["error"]["param"] == "messages"
    assert "the rendered prompt: text:" in body["error"]["message"]
