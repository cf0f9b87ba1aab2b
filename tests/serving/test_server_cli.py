"""``attnlab serve`` as a command: it prints its URL once it listens and answers the openai
client; bad options are refused by name; ``--quantize`` serves the quantized weights."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading

import pytest
import torch
from server_live import client, live

from attnlab.cli import build_parser
from attnlab.generation import generate
from attnlab.models.io import from_pretrained
from attnlab.serving.server import create_app
from attnlab.tokenizer import Tokenizer

# Hang guards, far above the expected times on a busy 2-core machine.
START_TIMEOUT_S, STOP_TIMEOUT_S = 600, 120


def test_serve_prints_its_url_and_answers(qwen2_folder) -> None:
    command = [sys.executable, "-m", "attnlab", "serve", "--model", str(qwen2_folder),
               "--port", "0", "--max-batch", "2", "--page-size", "8", "--kv-pages", "64"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True).start()
    try:
        line = lines.get(timeout=START_TIMEOUT_S)
        assert line.startswith("attnlab serve: http://127.0.0.1:"), line
        url = line.split()[2].removesuffix("/v1")
        api = client(url)
        assert [m.id for m in api.models.list().data] == [qwen2_folder.name]
        out = api.completions.create(model=qwen2_folder.name, prompt="the fox", max_tokens=4,
                                     temperature=0)
        assert out.usage.completion_tokens >= 1
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(STOP_TIMEOUT_S)
        finally:
            process.kill()
    assert process.returncode == 0, process.stderr.read()


@pytest.mark.parametrize(("args", "message"), [
    (["--max-batch", "0"], "--max-batch: expected a positive int"),
    (["--page-size", "x"], "--page-size"),
    (["--quantize", "int3"], "--quantize: invalid choice"),
    (["--dtype", "float8"], "--dtype: invalid choice"),
    (["--port", "-1"], "--port: expected a port in [0, 65535]"),
    (["--port", "70000"], "--port: expected a port in [0, 65535]"),
    (["--shutdown-grace", "-1"], "--shutdown-grace: expected a finite number >= 0"),
    (["--shutdown-grace", "inf"], "--shutdown-grace: expected a finite number >= 0"),
])
def test_bad_options_are_named(qwen2_folder, capsys, args, message) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--model", str(qwen2_folder), *args])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_folder_is_named(tmp_path) -> None:
    missing = tmp_path / "nothing"
    result = subprocess.run([sys.executable, "-m", "attnlab", "serve", "--model", str(missing)],
                            capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert result.returncode == 2 and str(missing) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("load", [{"quantize": "int8"}, {"dtype": "bfloat16"},
                                  {"extra_memory": True}])
def test_quantized_or_cast_serving_equals_the_model_loaded_so(qwen2_folder, load: dict) -> None:
    tok = Tokenizer.from_pretrained(qwen2_folder)
    ids = tok.encode("once upon a time")
    model = from_pretrained(qwen2_folder, **load)
    expected = generate(model, torch.tensor([ids]), 8, eos_token_id=tok.eos_token_id)
    app = create_app(qwen2_folder, kv_pages=64, **load)
    head = app.state.serving.model.lm_head
    assert getattr(head, "_extra_memory", False) == load.get("extra_memory", False)
    with live(app) as url:
        out = client(url).completions.create(model=qwen2_folder.name, prompt="once upon a time",
                                             max_tokens=8, temperature=0)
    assert out.choices[0].text == tok.decode(expected[0, len(ids):], skip_special_tokens=True)


def test_a_pair_takes_no_dtype(qwen2_folder) -> None:
    model, tok = from_pretrained(qwen2_folder), Tokenizer.from_pretrained(qwen2_folder)
    for load in ({"dtype": "float32"}, {"extra_memory": True}):
        with pytest.raises(ValueError, match="quantize, dtype, extra_memory: only for a folder"):
            create_app((model, tok), **load)
