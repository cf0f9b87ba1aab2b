"""`attnlab bench serve`: the quick run through the CLI writes the table, JSON and plot with
figures that agree with each other; the percentiles are the formula; the load generator stops
at its time limit (a stalled server, a stream that stalls midway), closes a stream after
``cut_after`` tokens (the server aborts it) and counts refused requests; bad options are
named. No test depends on the machine's speed: streams are cut by a token count or at a
stall, and every wait for the server is a hang guard (``HANG_S``)."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import statistics
import threading
import time
from dataclasses import asdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.bench import serve, serve_report
from attnlab.bench.serve_report import targets
from attnlab.bench.versus import QWEN2_QUICK as QUICK
from attnlab.bench.versus import random_checkpoint
from attnlab.cli import build_parser, main
from attnlab.tokenizer import Tokenizer
from conftest import pause_until_abort
from devbench.cli import main as devbench_main

pytestmark = pytest.mark.usefixtures("one_thread")

# A hang guard: far above what any wait here takes on a busy 2-core machine.
HANG_S = 600.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("serve-bench")
    random_checkpoint(path, "qwen2", QUICK)
    serve.write_tokenizer(path, QUICK["vocab_size"])
    return path


def test_bench_serve_quick(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "serve.md").write_text("# attnlab serve under load\n\nan earlier run\n\n"
                                       "## Machine\n\n- cpu: Old CPU\n- measured: 2026-01-01\n")
    # Through devbench, which keeps a committed table's earlier runs below the new one.
    assert devbench_main(["serve", "--quick", "--clients", "1,4", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    work = serve.QUICK_WORK
    jobs = serve.make_jobs(work, QUICK["vocab_size"], 0)
    runs = {run["clients"]: run for run in data["runs"]}
    assert list(runs) == [1, 4]
    for run in runs.values():
        assert (run["done"], run["cut"], run["failed"]) == (work.requests, 0, 0)
        # greedy, so a request ends at max_tokens unless it draws an end id
        assert 0 < run["tokens"] <= sum(job.max_tokens for job in jobs)
        assert run["tokens_per_s"] == pytest.approx(run["tokens"] / run["wall_s"])
        assert run["ttft_p50_ms"] <= run["ttft_p95_ms"]
        assert run["itl_p50_ms"] <= run["itl_p95_ms"]
    # Batched greedy decoding gives what one at a time gives: the same tokens in all.
    assert runs[1]["tokens"] == runs[4]["tokens"]
    on, off = data["prefix"]
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)
    system_pages = work.system // data["engine"]["page_size"]
    # every request after the warm-up finds the system prompt's full pages in the cache
    assert on["engine_stats"]["prefix_hits"] >= work.prefix_requests * system_pages
    assert off["engine_stats"]["prefix_hits"] == 0
    assert [t["result"] for t in data["targets"]] == [
        "PASS" if runs[4]["tokens_per_s"] >= 5 * runs[1]["tokens_per_s"] else "FAIL",
        "PASS" if runs[4]["itl_p95_ms"] <= 3 * runs[1]["itl_p95_ms"] else "FAIL",
        "PASS" if off["ttft_p50_ms"] >= 3 * on["ttft_p50_ms"] else "FAIL"]
    table = (tmp_path / "serve.md").read_text()
    one, four = runs[1], runs[4]
    assert (f"| 4 | {work.requests} | 0 | 0 | {four['tokens']} | {four['wall_s']:.1f} "
            f"| {four['tokens_per_s']:.1f} | "
            f"{four['tokens_per_s'] / one['tokens_per_s']:.2f}x | {four['ttft_p50_ms']:.1f} |"
            ) in table
    assert f"| off | {work.prefix_requests} | {off['ttft_p50_ms']:.1f} |" in table
    assert f"- cpu: {data['machine']['cpu']}" in table
    assert "attnlab bench serve --quick" in table
    out = capsys.readouterr().out
    for target in data["targets"]:
        assert f"{target['result']}: {target['target']}" in out
    assert (tmp_path / "serve.png").stat().st_size > 1000
    current, history = table.split("\n## History\n")  # the earlier run is kept below
    assert "| 4 |" in current and "an earlier run" not in current
    assert history.lstrip().startswith("### Old CPU, 2026-01-01") and "an earlier run" in history


def test_percentile_by_hand() -> None:
    values = [3.0, 1.0, 4.0, 2.0]  # sorted 1 2 3 4
    assert serve.percentile(values, 50) == 2.5  # rank 1.5: halfway between 2 and 3
    assert serve.percentile(values, 95) == pytest.approx(3.85)  # rank 2.85: 3 + 0.85 * 1
    assert serve.percentile(values, 0) == 1.0
    assert serve.percentile(values, 100) == 4.0
    assert serve.percentile([7.0], 95) == 7.0
    assert serve.percentile([], 50) is None
    with pytest.raises(ValueError, match=r"q: expected a percentile in \[0, 100\], got 101"):
        serve.percentile(values, 101)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=30), st.floats(0, 100))
def test_percentile_is_numpys_linear(values, q) -> None:
    assert serve.percentile(values, q) == pytest.approx(np.percentile(values, q), abs=1e-6)


def test_summary_of_outcomes() -> None:
    outcomes = [serve.Outcome(0.1, (0.01, 0.03), 3, 1.0),
                serve.Outcome(0.3, (0.02,), 2, 2.0),
                serve.Outcome(0.2, (), 1, 1.5, "cut"),
                serve.Outcome(None, (), 0, 0.5, "HTTP 400: x")]
    s = serve.summarize(outcomes, 2.0)
    assert (s["done"], s["cut"], s["failed"], s["errors"]) == (2, 1, 1, ["HTTP 400: x"])
    assert s["tokens"] == 6 and s["tokens_per_s"] == 3.0
    assert s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["itl_p50_ms"] == pytest.approx(1e3 * statistics.median([0.01, 0.03, 0.02]))


def test_load_generator_stops_at_its_time_limit_on_a_stalled_server() -> None:
    # A socket that accepts connections (the kernel's backlog) and never answers.
    with socket.socket() as stalled:
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(8)
        url = f"http://127.0.0.1:{stalled.getsockname()[1]}"
        jobs = [serve.Job((1, 2, 3), 4)] * 5
        t0 = time.perf_counter()
        # drive raises if a client still runs GRACE_S after the limit: returning is stopping
        outcomes, _ = serve.drive(url, jobs, 2, 2.0)
        took = time.perf_counter() - t0
    assert took >= 2.0  # it waited for the limit, not gave up before
    assert len(outcomes) == 2  # one per client: none started after the limit
    assert all(o.error == "cut" and o.ttft is None for o in outcomes)


def test_load_generator_cuts_a_stream_that_stalls_midway() -> None:
    """Two tokens, then nothing: at the time limit the stream is closed and counted as cut,
    with the tokens that came before it."""
    tokens = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": " b"}]}\n\n'
    url, thread, listener = _one_answer(tokens, then_stall=True)
    with listener:
        (outcome,), _ = serve.drive(url, [serve.Job((1,), 4)], 1, 2.0)
    thread.join(HANG_S)
    assert outcome.error == "cut" and outcome.tokens <= 2  # both, unless the limit came first
    assert len(outcome.gaps) == max(outcome.tokens - 1, 0)
    assert serve.summarize([outcome], 2.0)["cut"] == 1


def test_load_generator_cuts_a_long_stream_after_k_tokens_and_counts_refusals(
        folder, monkeypatch) -> None:
    """A refused request (an id out of range) is a failure named by the server's answer; a
    500-token stream closed after 5 tokens is cut, and the server aborts it while it runs.

    So that the server cannot finish the stream before it sees the client leave (a tiny
    model makes 500 tokens in a fraction of a second), its engine pauses once it has made
    ``paused_at`` tokens until the server asks to abort (the abort itself runs on the
    engine's thread, between steps): an event, not a time."""
    vocab, cut_after, paused_at = QUICK["vocab_size"], 5, 50
    long, refused = serve.Job((1, 2, 3), 500), serve.Job((vocab,), 4)  # id out of range
    with serve.serving(folder, max_batch=2, max_tokens_per_step=16) as (url, state):
        asked, aborted = pause_until_abort(state.engine, monkeypatch, paused_at, HANG_S)
        outcomes, wall = serve.drive(url, [refused, long], 2, HANG_S, cut_after=cut_after)
        assert aborted.wait(HANG_S), "the server did not abort the stream its client closed"
        deadline = time.monotonic() + HANG_S
        while state.engine.stats["running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = state.engine.stats
    assert stats["running"] == 0 and stats["pages_used"] == 0
    assert len(asked) == 1  # the long stream, aborted while it ran: not finished on its own
    assert stats["tokens_generated"] < 500
    first, cut = outcomes
    assert first.error.startswith("HTTP 400") and "token id 512 is out of range" in first.error
    assert cut.error == "cut" and cut.tokens == cut_after and len(cut.gaps) == cut_after - 1
    s = serve.summarize(outcomes, wall)
    assert (s["done"], s["cut"], s["failed"]) == (0, 1, 1)


def _one_answer(body: bytes, *, then_stall: bool = False
                ) -> tuple[str, threading.Thread, socket.socket]:
    """A server on 127.0.0.1 that answers one request with 200 and ``body`` as an event
    stream, then closes the connection (``then_stall``: once the client has closed it)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(HANG_S)

    def answer() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(HANG_S)
            request = b""
            while b"\r\n\r\n" not in request:
                request += connection.recv(65536)
            # Read the whole body too: closing a socket with unread bytes sends a reset,
            # which the client may see before the answer's last bytes.
            head, _, rest = request.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length:\s*(\d+)", head)
            while length and len(rest) < int(length[1]):
                rest += connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                               b"Connection: close\r\n\r\n" + body)
            if then_stall:
                with contextlib.suppress(OSError):  # a reset is a close too
                    while connection.recv(65536):
                        pass

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", thread, listener


def test_stream_parsing_of_a_hand_written_stream() -> None:
    body = (b'data: {"choices": [{"text": "a"}]}\n\n: a comment\n\n'
            b'data: {"choices": [{"text": ""}]}\n\n'
            b'data: {"choices": [{"text": " b"}]}\n\ndata: {"choices": [{"text": " c"}]}\n\n'
            b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n\ndata: [DONE]\n\n')
    url, thread, listener = _one_answer(body)
    with listener:
        (outcome,), _ = serve.drive(url, [serve.Job((1,), 4)], 1, HANG_S)
    thread.join(HANG_S)
    assert outcome.error is None and outcome.ttft > 0
    assert outcome.tokens == 4  # the usage chunk's count, not the 3 events with text
    assert len(outcome.gaps) == 2


@pytest.mark.parametrize("body, error", [
    (b"data: [1, 2]\n\n", "a malformed event b'[1, 2]': expected a JSON object, got list"),
    (b'data: {"choices": 5}\n\n', "a malformed event"),
    (b"data: {not json\n\n", "a malformed event"),
    (b'data: {"usage": {"completion_tokens": "7"}}\n\n',
     "usage.completion_tokens: expected an int >= 0, got '7'"),
    (b'data: {"error": {"message": "boom"}}\n\n', "server error: {'message': 'boom'}"),
    (b'data: {"choices": [{"text": "a"}]}\n\n', "the stream ended without data: [DONE]"),
])
def test_a_malformed_stream_is_a_failed_request(body, error) -> None:
    url, thread, listener = _one_answer(body)
    with listener:
        (outcome,), _ = serve.drive(url, [serve.Job((1,), 4)], 1, HANG_S)
    thread.join(HANG_S)
    assert error in outcome.error
    assert serve.summarize([outcome], 1.0)["failed"] == 1


def test_every_token_is_its_own_event(folder) -> None:
    """The word-level tokenizer decodes every id of the vocabulary to text."""
    tokenizer = Tokenizer.from_pretrained(folder)
    assert tokenizer.vocab_size == QUICK["vocab_size"]
    assert tokenizer.decode([0, 5, QUICK["vocab_size"] - 1]) == "w0 w5 w511"
    with serve.serving(folder) as (url, _):
        (outcome,), _ = serve.drive(url, [serve.Job((7, 8, 9), 6)], 1, HANG_S)
    assert outcome.error is None
    assert len(outcome.gaps) == outcome.tokens - 1 and outcome.ttft > 0


def test_jobs_are_seeded_and_within_their_ranges() -> None:
    work = serve.QUICK_WORK
    jobs = serve.make_jobs(work, 100, seed=3)
    assert jobs == serve.make_jobs(work, 100, seed=3) != serve.make_jobs(work, 100, seed=4)
    assert len(jobs) == work.requests
    for job in jobs:
        assert work.prompt[0] <= len(job.prompt) <= work.prompt[1]
        assert work.output[0] <= job.max_tokens <= work.output[1]
        assert all(0 <= t < 100 for t in job.prompt)
    warmup, prefixed = serve.prefix_jobs(work, 100, seed=3)
    assert len(prefixed) == work.prefix_requests
    for job in [warmup, *prefixed]:
        assert job.prompt[:work.system] == warmup.prompt[:work.system]
        assert work.user[0] <= len(job.prompt) - work.system <= work.user[1]


def test_request_lengths_are_options_and_in_the_regenerate_command() -> None:
    args = build_parser().parse_args(["bench", "serve", "--prompt-tokens", "8,16",
                                 "--output-tokens", "100,200"])
    assert (args.prompt_tokens, args.output_tokens) == ((8, 16), (100, 200))
    work = serve.Workload(requests=20, prompt=args.prompt_tokens, output=args.output_tokens,
                          system=10, **serve.FULL_WORK)
    jobs = serve.make_jobs(work, 1000, 0)
    assert all(8 <= len(j.prompt) <= 16 and 100 <= j.max_tokens <= 200 for j in jobs)
    r = {"quick": False, "runs": [{"clients": 1}], "workload": asdict(work), "seed": 0,
         "engine": {"max_batch": 4, "max_tokens_per_step": 8, "page_size": 16},
         "sizes": {"num_hidden_layers": 2}, "time_limit_s": 5.0}
    assert serve_report._command(r).endswith(
        "--dtype float32 --prompt-tokens 8,16 --output-tokens 100,200")
    default = {**r, "workload": {**asdict(work), "prompt": [32, 512], "output": [16, 96]}}
    command = serve_report._command(default)
    assert "--prompt-tokens" not in command and "--output-tokens" not in command


def test_targets_need_both_runs() -> None:
    r = {"runs": [{"clients": 4, "tokens_per_s": 10.0, "itl_p95_ms": 5.0}],
         "prefix": [], "workload": {"system": 1000}}
    assert [t["result"] for t in targets(r)] == ["not measured"] * 3


@pytest.mark.parametrize("argv, named", [
    (["--clients", "0"], "argument --clients: expected positive ints, got '0'"),
    (["--clients", "4,4"], "argument --clients: expected each number of clients once"),
    (["--clients", "1,1025"], "each at most 1024, got '1,1025'"),
    (["--requests", "100001"], "argument --requests: expected an int in [1, 10000]"),
    (["--time-limit", "nan"], "argument --time-limit: expected a number of seconds"),
    (["--time-limit", "0"], "argument --time-limit: expected a number of seconds"),
    (["--layers", "25"], "argument --layers: expected a number of layers in [1, 24]"),
    (["--max-batch", "-1"], "argument --max-batch: expected a positive int, got '-1'"),
    (["--seed", "-1"], "argument --seed: expected an int >= 0, got '-1'"),
    (["--prompt-tokens", "64,32"], "argument --prompt-tokens: expected LO,HI with 1 <= LO <= HI"),
    (["--output-tokens", "16"], "argument --output-tokens: expected LO,HI with 1 <= LO <= HI"),
    (["--output-tokens", "0,8"], "argument --output-tokens: expected positive ints"),
])
def test_bad_options_are_named(argv, named, capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--out", str(tmp_path), *argv])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "serve.md").exists()


@pytest.mark.parametrize("argv, named", [
    (["--max-batch", "16", "--max-tokens-per-step", "8"],
     "--max-tokens-per-step: expected at least --max-batch=16 (one decode token per running "
     "request), got 8"),
    (["--page-size", "5000"], "--page-size: expected at most the model's context of 4096 "
     "tokens, got 5000"),
    (["--system-tokens", "4090"], "--system-tokens: a prompt of 4090 + 48 tokens and 4 new "
     "ones exceed the model's context of 4096 tokens; expected at most 4044"),
    (["--prompt-tokens", "32,4000", "--output-tokens", "16,100"], "--prompt-tokens, "
     "--output-tokens: the longest prompt (4000) and output (100) exceed the model's context "
     "of 4096 tokens"),
])
def test_options_the_server_would_refuse_are_named_first(argv, named, capsys, tmp_path,
                                                         monkeypatch) -> None:
    made = []
    monkeypatch.setattr(serve, "random_checkpoint", lambda *a, **k: made.append(a))
    assert main(["bench", "serve", "--out", str(tmp_path), *argv]) == 2
    assert named in capsys.readouterr().err
    assert made == []  # refused before the 200 M parameter checkpoint is made


def test_an_out_that_is_a_file_is_named(tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("")
    assert main(["bench", "serve", "--quick", "--out", str(tmp_path / "file")]) == 2
    assert f"--out: expected a folder (made if missing), got the file {tmp_path / 'file'}" \
        in capsys.readouterr().err


def test_drive_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="clients: expected a positive int, got 0"):
        serve.drive("http://127.0.0.1:1", [], 0, 1.0)
    with pytest.raises(ValueError, match=r"time_limit: expected seconds in \(0, 86400\], "
                       "got inf"):
        serve.drive("http://127.0.0.1:1", [], 1, float("inf"))
    with pytest.raises(ValueError, match="cut_after: expected a positive int, got 0"):
        serve.drive("http://127.0.0.1:1", [], 1, 1.0, cut_after=0)
