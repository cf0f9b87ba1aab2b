"""Speculative decoding through ``attnlab serve``, driven by the official ``openai`` client:
a request's ``speculative`` (``extra_body``), OpenAI's ``prediction`` and the server's
default give the plain greedy text; ``/metrics`` counts the verifications and reports the
acceptance rate; what cannot be combined with it, or cannot run, is refused naming the field;
``--speculative`` is checked on the command line."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from types import SimpleNamespace

import openai
import pytest
import torch
from server_live import client, live, raw, wait_for

from attnlab.cli import build_parser
from attnlab.models import DecoderLM
from attnlab.models.io import from_pretrained, save_pretrained
from attnlab.serving.params import Speculation
from attnlab.serving.server import create_app
from attnlab.serving.speculation import refuse_with_speculation, requested

PROMPT = "once upon a time once upon a time once upon"


@pytest.fixture(scope="module")
def server(qwen2_folder):
    # speculation for up to 4 decoding requests: a test's request is never switched off
    app = create_app(qwen2_folder, max_batch=4, page_size=4, kv_pages=256)
    app.state.serving.engine.engine.speculator.max_requests = 4
    with live(app) as url:
        yield app, url


@pytest.fixture(scope="module")
def api(server):
    return client(server[1])


def idle(app) -> bool:
    stats = app.state.serving.engine.stats
    return stats["running"] == 0 and stats["waiting"] == 0 and stats["pages_used"] == 0


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in:\n{text}"
    return float(found.group(1))


def test_speculative_requests_and_predictions_give_the_plain_greedy_text(
        api, server, qwen2_folder):
    app, url = server
    ask = {"model": qwen2_folder.name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    plain = api.completions.create(**ask).choices[0].text
    wait_for(lambda: idle(app), what="an idle engine")
    before = raw(url, "GET", "/metrics")[2]
    for extra in ({"speculative": "ngram"}, {"speculative": "ngram:2"},
                  {"speculative": "self:1", "num_speculative_tokens": 3},
                  {"prediction": {"type": "content", "content": plain}}):
        out = api.completions.create(**ask, extra_body=extra)
        assert out.choices[0].text == plain, extra
        assert out.usage.completion_tokens == 24
    chat = api.chat.completions.create(
        model=qwen2_folder.name, messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
        temperature=0)
    predicted = api.chat.completions.create(
        model=qwen2_folder.name, messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
        temperature=0, prediction={"type": "content", "content": chat.choices[0].message.content})
    assert predicted.choices[0].message.content == chat.choices[0].message.content
    wait_for(lambda: idle(app), what="an idle engine")
    after = raw(url, "GET", "/metrics")[2]
    name = "attnlab_spec_decode_verifications_total"
    assert metric(after, name) > metric(before, name)
    proposed = metric(after, "attnlab_spec_decode_draft_tokens_total")
    accepted = metric(after, "attnlab_spec_decode_accepted_tokens_total")
    assert 0 < accepted <= proposed  # the prediction of the exact text is accepted
    assert metric(after, "attnlab_spec_decode_acceptance_rate") == pytest.approx(
        accepted / proposed)
    assert metric(after, "attnlab_spec_decode_tokens_per_verification") > 1


def test_a_stream_of_several_tokens_a_step_joins_to_the_plain_text(api, qwen2_folder):
    ask = {"model": qwen2_folder.name, "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    plain = api.completions.create(**ask).choices[0].text
    chunks = list(api.completions.create(**ask, stream=True,
                                         extra_body={"speculative": "self:1"}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_server_default_serves_requests_that_do_not_choose(qwen2_folder):
    app = create_app(qwen2_folder, max_batch=4, page_size=4, kv_pages=256,
                     speculative="ngram:3")
    with live(app) as url:
        api = client(url)
        out = api.completions.create(model=qwen2_folder.name, prompt=PROMPT, max_tokens=16,
                                     temperature=0)
        # n > 1 cannot speculate: the default leaves such a request alone (no refusal)
        two = api.completions.create(model=qwen2_folder.name, prompt=PROMPT, max_tokens=16,
                                     temperature=0, n=2)
        assert [c.text for c in two.choices] == [out.choices[0].text] * 2
        wait_for(lambda: idle(app), what="an idle engine")
        assert metric(raw(url, "GET", "/metrics")[2],
                      "attnlab_spec_decode_verifications_total") > 0
    with pytest.raises(ValueError, match=r"speculative: self:2 asks for a draft of 2 layers; "
                                         r"expected fewer than the model's 2"):
        create_app(qwen2_folder, speculative="self:2")


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"speculative": "ngram", "n": 2}, "n", "n: not served with speculative decoding "
                                            "(speculative) yet"),
    ({"prediction": {"type": "content", "content": "a"}, "n": 2}, "n",
     "n: not served with speculative decoding (prediction) yet"),
    ({"speculative": "draft:folder"}, "speculative", "draft:FOLDER loads a draft model when "
                                                     "the server starts"),
    ({"speculative": "draft"}, "speculative", "draft asks for the server's draft model, and "
                                              "this server has none"),
    ({"speculative": "self:2"}, "speculative", "expected fewer than the model's 2"),
    ({"speculative": "ngram", "num_speculative_tokens": 32}, "num_speculative_tokens",
     "expected an int in [1, 31]"),
    ({"num_speculative_tokens": 3}, "num_speculative_tokens", "only with speculative"),
    ({"speculative": "self:1", "prediction": {"type": "content", "content": "a"}},
     "prediction", "looked up by ngram speculation"),
])
def test_what_cannot_run_is_refused_naming_the_field(api, qwen2_folder, extra, param,
                                                     message):
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model=qwen2_folder.name, prompt=PROMPT, max_tokens=4,
                               temperature=0, extra_body=extra)
    error = refused.value.body
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize(("field", "value"), [
    ("logprobs", True), ("top_logprobs", 2), ("presence_penalty", 0.5),
    ("frequency_penalty", -1.0), ("repetition_penalty", 1.2), ("logit_bias", {"5": 1}),
    ("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}]),
    ("n", 3)])
def test_fields_speculation_cannot_serve_are_refused_with_it_and_drop_the_default(
        field, value):
    body = SimpleNamespace(speculative="ngram", **{field: value})
    assert refuse_with_speculation(body) == field
    with pytest.raises(ValueError, match=rf"^{field}: not served with speculative decoding"):
        requested(body, None)
    default = Speculation("ngram", 4)
    assert requested(SimpleNamespace(**{field: value}), default) is None
    assert requested(SimpleNamespace(), default) is default


@pytest.mark.parametrize(("value", "message"), [
    ("draft:", "expected draft:FOLDER"), ("draft", "expected draft:FOLDER"),
    ("self", "ngram, ngram:K, self:N"), ("ngram:x", "ngram, ngram:K, self:N")])
def test_bad_speculative_option_is_named(qwen2_folder, capsys, value, message):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--model", str(qwen2_folder),
                                   "--speculative", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative" in err and message in err


# --- a draft model --------------------------------------------------------------------------

def _draft_folder(target, folder, tokenizer_swap: bool = False):
    """A 1-layer model of the target's config (other weights) with the target's tokenizer
    files, or with two of its tokens' ids swapped (``tokenizer_swap``: another tokenizer of
    the same size)."""
    config = dataclasses.replace(from_pretrained(target).config, num_layers=1)
    torch.manual_seed(1)
    save_pretrained(DecoderLM(config).eval(), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, folder / name)
    if tokenizer_swap:
        data = json.loads((folder / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        a, b = "a", "b"
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def test_a_draft_folder_serves_draft_requests_and_the_default_with_the_plain_text(
        api, qwen2_folder, tmp_path):
    ask = {"model": qwen2_folder.name, "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    plain = api.completions.create(**ask).choices[0].text  # the module's server: no draft
    draft = _draft_folder(qwen2_folder, tmp_path)
    app = create_app(qwen2_folder, max_batch=4, page_size=4, kv_pages=256,
                     speculative=f"draft:{draft}")
    assert app.state.serving.speculation == Speculation("draft", 5)
    app.state.serving.engine.engine.speculator.max_requests = 4
    with live(app) as url:
        drafting = client(url)
        assert drafting.completions.create(**ask).choices[0].text == plain  # the default
        for extra in ({"speculative": "draft"},
                      {"speculative": "draft", "num_speculative_tokens": 2}):
            assert drafting.completions.create(**ask, extra_body=extra).choices[0].text \
                == plain, extra
        chunks = list(drafting.completions.create(**ask, stream=True,
                                                  extra_body={"speculative": "draft"}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
        wait_for(lambda: idle(app), what="an idle engine")  # every page back
        assert metric(raw(url, "GET", "/metrics")[2],
                      "attnlab_spec_decode_verifications_total") > 0
        assert len(app.state.serving.engine.engine.speculator._proposers) == 0


def test_a_draft_model_object_is_served_and_a_draft_of_another_tokenizer_is_refused(
        qwen2_folder, tmp_path):
    model = from_pretrained(qwen2_folder)
    draft = DecoderLM(dataclasses.replace(model.config, num_layers=1)).eval()
    app = create_app(qwen2_folder, speculative=draft)
    assert app.state.serving.engine.engine.speculator.draft is draft
    assert app.state.serving.speculation == Speculation("draft", 5)
    other = _draft_folder(qwen2_folder, tmp_path / "other", tokenizer_swap=True)
    with pytest.raises(ValueError, match=r"speculative: draft:.*other: its tokenizer differs "
                                         r"from the served model's"):
        create_app(qwen2_folder, speculative=f"draft:{other}")
    small = DecoderLM(dataclasses.replace(model.config, vocab_size=100)).eval()
    with pytest.raises(ValueError, match=r"draft_model: expected the model's vocabulary"):
        create_app(qwen2_folder, speculative=small)
    with pytest.raises(ValueError, match=r"speculative: draft:.*missing: "):
        create_app(qwen2_folder, speculative=f"draft:{tmp_path / 'missing'}")


def test_serve_takes_a_draft_folder_on_the_command_line(qwen2_folder):
    args = build_parser().parse_args(["serve", "--model", str(qwen2_folder),
                                      "--speculative", "draft:some/folder"])
    assert args.speculative == "draft:some/folder"  # read by create_app when it starts
