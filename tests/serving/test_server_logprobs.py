"""``attnlab serve``'s logprobs, driven by the official openai client: completions'
``logprobs: k`` and ``echo`` (the prompt's logprobs, ``max_tokens: 0`` included, as evaluation
harnesses ask), chat's ``logprobs`` + ``top_logprobs``, streamed and not, single, batched and
with ``n > 1``; the values equal transformers' ``log_softmax`` of its logits."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from server_live import raw, server_fixtures

from conftest import assert_close

PROMPTS = ["once upon a time", "the fox said hello", "hello", "the world was a fox",
           "there was", "said the fox to", "a time", "once the world"]


server, api, tok = server_fixtures(max_batch=8, page_size=4, kv_pages=512)


@functools.cache
def _hf(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen2ForCausalLM.from_pretrained(folder).eval()


def hf_logprobs(folder, ids: list[int]) -> torch.Tensor:
    """transformers' ``log_softmax`` of its logits over ``ids``: row ``i`` predicts token
    ``i + 1``; ``P x V``."""
    with torch.no_grad():
        logits = _hf(folder)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_against_hf(folder, ids: list[int], first: int, values: list[float],
                      tops: list[dict] | None = None, tok=None) -> None:
    """``values[j]`` is the logprob of ``ids[first + j]``; ``tops[j]`` its alternatives."""
    lp = hf_logprobs(folder, ids)
    expected = torch.stack([lp[i - 1, ids[i]] for i in range(first, len(ids))])
    assert_close(torch.tensor(values), expected, what="token logprobs")
    for j, top in enumerate(tops or []):
        best = lp[first + j - 1].topk(len(top))
        assert_close(torch.tensor(sorted(top.values(), reverse=True)), best.values,
                     what="top logprobs")


def test_echo_max_tokens_0_gives_the_prompt_logprobs(api, qwen2_folder, tok) -> None:
    """What lm-eval's local-completions sends to score a text: token ids, echo, logprobs=1,
    max_tokens=0. The first token has no value (null); the others equal transformers'."""
    ids = tok.encode(PROMPTS[1])
    out = api.completions.create(model=qwen2_folder.name, prompt=ids, echo=True, logprobs=1,
                                 max_tokens=0, temperature=0)
    [choice] = out.choices
    lp = choice.logprobs
    assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(ids) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == choice.text
    _check_against_hf(qwen2_folder, ids, 1, lp.token_logprobs[1:], lp.top_logprobs[1:])
    # a text prompt tokenizes as these ids: the same answer
    text = api.completions.create(model=qwen2_folder.name, prompt=PROMPTS[1], echo=True,
                                  logprobs=1, max_tokens=0)
    assert text.choices[0].logprobs.token_logprobs == lp.token_logprobs


def test_completion_logprobs_with_echo_and_new_tokens(api, qwen2_folder, tok) -> None:
    ids = tok.encode(PROMPTS[0])
    out = api.completions.create(model=qwen2_folder.name, prompt=PROMPTS[0], echo=True,
                                 logprobs=3, max_tokens=6, temperature=0)
    [choice] = out.choices
    lp = choice.logprobs
    new = out.usage.completion_tokens
    assert len(lp.tokens) == len(ids) + new
    assert all(len(t) == 3 for t in lp.top_logprobs[1:])
    assert choice.text.startswith(tok.decode(ids))
    # the offsets are the characters before each token in the text (a token that is part
    # of a character, written "bytes:\\x..", has no characters of its own)
    ends = [len("".join(lp.tokens[:i])) for i in range(len(ids) + 1)]
    assert lp.text_offset[:len(ids) + 1] == ends
    assert lp.text_offset == sorted(lp.text_offset)
    alone = api.completions.create(model=qwen2_folder.name, prompt=PROMPTS[0], logprobs=3,
                                   max_tokens=6, temperature=0).choices[0]
    assert alone.logprobs.token_logprobs == lp.token_logprobs[len(ids):]
    assert alone.logprobs.text_offset[0] == 0
    full = ids + [_id_of(tok, t) for t in alone.logprobs.tokens]
    _check_against_hf(qwen2_folder, full, 1, lp.token_logprobs[1:], lp.top_logprobs[1:])


def _id_of(tok, token_text: str) -> int:
    """The id of a token as the server names it (text, or ``bytes:\\x..``)."""
    if token_text.startswith("bytes:"):
        data = bytes.fromhex(token_text.removeprefix("bytes:").replace("\\x", ""))
        return next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == data)
    [token] = tok.encode(token_text, add_special_tokens=False)
    return token


def test_chat_logprobs_streamed_and_not(api, qwen2_folder, tok) -> None:
    messages = [{"role": "user", "content": "hello fox"}]
    ask = {"model": qwen2_folder.name, "messages": messages, "max_tokens": 8,
           "temperature": 0, "logprobs": True, "top_logprobs": 4}
    out = api.chat.completions.create(**ask)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 4 for c in content)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    new = [_id_of(tok, c.token) for c in content]
    assert [c.bytes for c in content] == [list(tok.token_bytes(i)) for i in new]
    _check_against_hf(qwen2_folder, ids + new, len(ids), [c.logprob for c in content],
                      [{t.token: t.logprob for t in c.top_logprobs} for c in content])
    streamed = []
    for chunk in api.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    # the same tokens; the values within float tolerance: the second request finds the
    # prompt's keys in the prefix cache, computed by the prefill's kernel, not its own
    assert [c.token for c in streamed] == [c.token for c in content]
    assert_close(torch.tensor([c.logprob for c in streamed]),
                 torch.tensor([c.logprob for c in content]))
    # logprobs without top_logprobs: no alternatives
    plain = api.chat.completions.create(**{**ask, "top_logprobs": None})
    assert [c.top_logprobs for c in plain.choices[0].logprobs.content] == [[]] * len(content)


@pytest.mark.parametrize("new", [0, 8])
def test_completion_logprobs_streamed_equal_non_streamed(api, qwen2_folder, new) -> None:
    ask = {"model": qwen2_folder.name, "prompt": PROMPTS[2], "max_tokens": new, "logprobs": 2,
           "echo": True, "temperature": 1.0, "seed": 3, "n": 2}
    whole = api.completions.create(**ask)
    tokens: dict[int, list] = {0: [], 1: []}
    values: dict[int, list] = {0: [], 1: []}
    texts = {0: "", 1: ""}
    for chunk in api.completions.create(**ask, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs is not None:
                tokens[c.index] += c.logprobs.tokens
                values[c.index] += c.logprobs.token_logprobs
    for i, c in enumerate(whole.choices):
        assert texts[i] == c.text and c.text.startswith(PROMPTS[2])
        assert tokens[i] == c.logprobs.tokens
        assert values[i][0] is None and c.logprobs.token_logprobs[0] is None
        assert_close(torch.tensor(values[i][1:]), torch.tensor(c.logprobs.token_logprobs[1:]))


def test_eight_clients_at_once_equal_one_at_a_time(api, qwen2_folder, tok) -> None:
    """Batched logprobs and penalties: 8 concurrent requests with n=2 answer as each does
    alone (temperature 0)."""
    def ask(prompt: str):
        out = api.completions.create(model=qwen2_folder.name, prompt=prompt, max_tokens=6,
                                     temperature=0, logprobs=2, echo=True, n=2,
                                     presence_penalty=0.5, frequency_penalty=0.3,
                                     logit_bias={"7": 2.0},
                                     extra_body={"repetition_penalty": 1.2, "min_p": 0.1})
        return [(c.text, c.logprobs.tokens, c.logprobs.token_logprobs) for c in out.choices]

    alone = [ask(p) for p in PROMPTS]
    together: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(PROMPTS[i])))
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for i, answer in enumerate(alone):
        # n=2 at temperature 0: the same choice twice; concurrent: the same as alone. The
        # texts and tokens equal; the values within float tolerance (a prompt's rows run in
        # the prefill kernel, over whichever chunks share the step)
        for text, tokens, values in [answer[1], *together[i]]:
            assert (text, tokens) == answer[0][:2]
            assert values[0] is None
            assert_close(torch.tensor(values[1:]), torch.tensor(answer[0][2][1:]))
        # and the batched values are transformers' (before the penalties and the bias)
        text, tokens, values = together[i][0]
        ids = [_id_of(tok, t) for t in tokens]
        _check_against_hf(qwen2_folder, ids, 1, values[1:])


def test_penalties_and_bias_reach_the_engine(api, qwen2_folder, tok) -> None:
    """logit_bias 100 forces its token (OpenAI: "exclusive selection"); -100 bans the
    greedy one. (Each control against generate's: tests/serving/test_engine_controls.py.)"""
    ask = {"model": qwen2_folder.name, "prompt": PROMPTS[0], "max_tokens": 4,
           "temperature": 0, "logprobs": 0}
    forced = api.completions.create(**ask, logit_bias={"50": 100})
    assert [_id_of(tok, t) for t in forced.choices[0].logprobs.tokens] == [50] * 4
    plain = api.completions.create(**ask).choices[0].logprobs.tokens
    banned = api.completions.create(**ask, logit_bias={str(_id_of(tok, plain[0])): -100})
    assert banned.choices[0].logprobs.tokens[0] != plain[0]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"3": 101}}, "logit_bias"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_values_are_a_400_naming_the_field(server, qwen2_folder, path, body, param) -> None:
    base = ({"prompt": "hello"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hello"}]})
    status, _, text = raw(server[1], "POST", path,
                          {"model": qwen2_folder.name, **base, **body})
    assert status == 400, text
    assert f'"param": "{param}"' in text or f'"param":"{param}"' in text, text
