"""``attnlab serve`` driven by the official ``openai`` client against a live server on
127.0.0.1: models list, completions and chat equal to transformers' greedy generation and to
``attnlab.generation.generate``, streaming joined equal to non-streaming, usage counts, stop
strings, ``n``, seeds, ``/health`` and ``/metrics``."""

from __future__ import annotations

import json
import re
import threading

import openai
import pytest
import torch
from server_live import client, live, raw, server_fixtures, wait_for

from attnlab.generation import generate
from attnlab.models.io import from_pretrained
from attnlab.serving.server import create_app
from tiny_folders import make_folder

PROMPT = "once upon a time"


server, api, tok = server_fixtures(max_batch=4, page_size=4, kv_pages=256)


def hf_greedy(qwen2_folder, ids: list[int], new: int, eos: int) -> list[int]:
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2ForCausalLM.from_pretrained(qwen2_folder).eval()
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                          do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


def engine_idle(app) -> bool:
    stats = app.state.serving.engine.stats
    return stats["running"] == 0 and stats["waiting"] == 0 and stats["pages_used"] == 0


def test_models_list(api, qwen2_folder) -> None:
    models = api.models.list().data
    assert [m.id for m in models] == [qwen2_folder.name]
    assert api.models.retrieve(qwen2_folder.name).id == qwen2_folder.name
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4")


def test_concurrent_requests_equal_one_at_a_time(api, qwen2_folder) -> None:
    """Requests that arrive together are batched by the engine; each gets the text it gets
    alone."""
    prompts = ["once upon a time", "the fox said", "hello", "the world was"]
    alone = [api.completions.create(model=qwen2_folder.name, prompt=p, max_tokens=10,
                                    temperature=0).choices[0].text for p in prompts]
    together: dict[int, str] = {}

    def ask(i: int) -> None:
        together[i] = api.completions.create(model=qwen2_folder.name, prompt=prompts[i],
                                             max_tokens=10, temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert [together.get(i) for i in range(len(prompts))] == alone


@pytest.mark.parametrize("new", [1, 24])
def test_greedy_completion_equals_transformers_and_generate(api, qwen2_folder, tok, new) -> None:
    ids = tok.encode(PROMPT)
    expected = hf_greedy(qwen2_folder, ids, new, tok.eos_token_id)
    ours = generate(from_pretrained(qwen2_folder), torch.tensor([ids]), new,
                    eos_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    assert ours == expected  # what `attnlab generate` prints
    out = api.completions.create(model=qwen2_folder.name, prompt=PROMPT, max_tokens=new,
                                 temperature=0)
    [choice] = out.choices
    assert choice.text == tok.decode(expected, skip_special_tokens=True)
    ended = expected[-1] == tok.eos_token_id
    assert choice.finish_reason == ("stop" if ended else "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(expected))
    assert out.usage.total_tokens == len(ids) + len(expected)
    assert out.object == "text_completion" and out.model == qwen2_folder.name


def test_token_id_prompt_equals_text_prompt(api, qwen2_folder, tok) -> None:
    text = api.completions.create(model=qwen2_folder.name, prompt=PROMPT, max_tokens=8,
                                  temperature=0)
    ids = api.completions.create(model=qwen2_folder.name, prompt=tok.encode(PROMPT), max_tokens=8,
                                 temperature=0)
    assert ids.choices[0].text == text.choices[0].text
    assert ids.usage == text.usage


def test_chat_uses_the_template_and_equals_transformers(api, qwen2_folder, tok) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello fox"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = hf_greedy(qwen2_folder, ids, 10, tok.eos_token_id)
    out = api.chat.completions.create(model=qwen2_folder.name, messages=messages, max_tokens=10,
                                      temperature=0)
    [choice] = out.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == tok.decode(expected, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(expected)
    assert out.object == "chat.completion"
    # Text parts are joined as one content string.
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "hello "},
                                                       {"type": "text", "text": "fox"}]}]
    again = api.chat.completions.create(model=qwen2_folder.name, messages=parts, max_tokens=10,
                                        temperature=0)
    assert again.choices[0].message.content == choice.message.content


def test_chat_without_max_tokens_fills_the_context(api, qwen2_folder, tok) -> None:
    messages = [{"role": "user", "content": "the fox said"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    out = api.chat.completions.create(model=qwen2_folder.name, messages=messages, temperature=0)
    limit = 256  # make_folder's max_position_embeddings
    assert out.usage.completion_tokens <= limit - len(ids)
    if out.choices[0].finish_reason == "length":
        assert out.usage.completion_tokens == limit - len(ids)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_joined_equals_non_streaming(api, qwen2_folder, kind) -> None:
    """Sampled with a seed and n=2: the same request streamed and not streamed gives the
    same texts; the role comes first, finish_reason only on each choice's last chunk, then
    the usage chunk."""
    common = {"model": qwen2_folder.name, "max_tokens": 12, "temperature": 1.5, "seed": 7, "n": 2}
    if kind == "chat":
        make = api.chat.completions.create
        common["messages"] = [{"role": "user", "content": "once upon"}]
    else:
        make = api.completions.create
        common["prompt"] = PROMPT
    whole = make(**common)
    chunks = list(make(**common, stream=True, stream_options={"include_usage": True}))
    texts, finishes, roles = {0: "", 1: ""}, {}, {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        [c] = chunk.choices
        assert c.index not in finishes, "a chunk after the finish_reason"
        if kind == "chat":
            if c.delta.role is not None:
                assert c.index not in roles and texts[c.index] == ""
                roles[c.index] = c.delta.role
            texts[c.index] += c.delta.content or ""
        else:
            texts[c.index] += c.text
        if c.finish_reason is not None:
            finishes[c.index] = c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    if kind == "chat":
        assert roles == {0: "assistant", 1: "assistant"}
        assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]
    else:
        assert [c.text for c in whole.choices] == [texts[0], texts[1]]
    assert [c.finish_reason for c in whole.choices] == [finishes[0], finishes[1]]


def test_stream_ends_with_done(server, qwen2_folder) -> None:
    body = {"model": qwen2_folder.name, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    status, headers, text = raw(server[1], "POST", "/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line for line in text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])


def test_n_and_seed_reproducible(api, qwen2_folder) -> None:
    ask = {"model": qwen2_folder.name, "prompt": PROMPT, "max_tokens": 10, "temperature": 1.5}
    first = api.completions.create(**ask, n=3, seed=11)
    again = api.completions.create(**ask, n=3, seed=11)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    # The choices of one request differ (each has its own seed), and so does another seed.
    assert len({c.text for c in first.choices}) > 1
    other = api.completions.create(**ask, n=3, seed=12)
    assert [c.text for c in other.choices] != [c.text for c in first.choices]
    # usage: the prompt counted once per choice, as OpenAI does; every token made counted.
    made = api.completions.create(**ask, n=1, seed=11)
    assert made.choices[0].text == first.choices[0].text
    assert first.usage.prompt_tokens == 3 * made.usage.prompt_tokens


def test_several_prompts(api, qwen2_folder, tok) -> None:
    prompts = [PROMPT, "the fox"]
    out = api.completions.create(model=qwen2_folder.name, prompt=prompts, max_tokens=6,
                                 temperature=0, n=2)
    singles = [api.completions.create(model=qwen2_folder.name, prompt=p, max_tokens=6,
                                      temperature=0).choices[0].text for p in prompts]
    assert [c.text for c in out.choices] == [singles[0]] * 2 + [singles[1]] * 2
    assert out.usage.prompt_tokens == 2 * sum(len(tok.encode(p)) for p in prompts)


def test_stop_strings_cut_the_text_and_end_the_request(api, server, qwen2_folder) -> None:
    ask = {"model": qwen2_folder.name, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    full = api.completions.create(**ask).choices[0].text
    assert len(full) > 12, full
    stop = full[6:9]
    cut = full[:full.index(stop)]
    out = api.completions.create(**ask, stop=[stop, "\x00never"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 40
    streamed = "".join(c.choices[0].text for c in api.completions.create(**ask, stop=stop,
                                                                        stream=True))
    assert streamed == cut
    wait_for(lambda: engine_idle(server[0]), what="the stopped request's pages to be freed")


def test_health(server) -> None:
    status, _, text = raw(server[1], "GET", "/health")
    assert status == 200 and json.loads(text) == {"status": "ok"}


def metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name + labels)} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    assert found, f"{name}{labels} not in:\n{text}"
    return float(found.group(1))


def test_metrics_count_requests_and_tokens(api, server, qwen2_folder) -> None:
    wait_for(lambda: engine_idle(server[0]), what="an idle engine")
    before = raw(server[1], "GET", "/metrics")[2]
    out = api.completions.create(model=qwen2_folder.name, prompt=PROMPT, max_tokens=5,
                                 temperature=0)
    wait_for(lambda: engine_idle(server[0]), what="an idle engine")
    status, headers, after = raw(server[1], "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    label = '{endpoint="/v1/completions",status="200"}'
    assert metric(after, "attnlab_requests_total", label) \
        == metric(before, "attnlab_requests_total", label) + 1
    for name, n in (("attnlab_prompt_tokens_total", out.usage.prompt_tokens),
                    ("attnlab_generation_tokens_total", out.usage.completion_tokens)):
        assert metric(after, name) == metric(before, name) + n
    stats = server[0].state.serving.engine.stats
    assert metric(after, "attnlab_batch_size") == stats["running"] == 0
    assert metric(after, "attnlab_queue_length") == 0
    assert metric(after, "attnlab_kv_pages_used") == 0
    assert metric(after, "attnlab_kv_pages_total") == stats["pages_total"]
    for name in ("attnlab_requests_total", "attnlab_batch_size", "attnlab_kv_pages_used"):
        assert f"# TYPE {name} " in after


def test_end_ids_of_generation_config(tmp_path, tok) -> None:
    """generation_config.json's eos_token_id list ends the text (finish_reason "stop"), as
    in `attnlab generate` and transformers."""
    make_folder(tmp_path)
    ids = tok.encode(PROMPT)
    free = hf_greedy(tmp_path, ids, 12, tok.eos_token_id)
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.eos_token_id, free[k]]}))
    with live(create_app(tmp_path, kv_pages=64)) as url:
        out = client(url).completions.create(model=tmp_path.name, prompt=PROMPT,
                                             max_tokens=12, temperature=0)
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == k + 1
    assert out.choices[0].text == tok.decode(free[:k + 1], skip_special_tokens=True)
