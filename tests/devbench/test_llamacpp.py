"""``python -m devbench llamacpp``: the attnlab worker runs a GGUF file as attnlab loads it (the
greedy tokens and log-probabilities of an in-process load), the KL divergence is the formula,
the table states every target; with llama_cpp at hand, the whole benchmark runs on a tiny file
(else that test skips, saying why)."""

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.generation import generate
from attnlab.models import export_gguf, from_pretrained
from attnlab.tokenizer import Tokenizer
from devbench import llamacpp
from devbench.cli import main
from tiny_folders import make_folder

TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "texts" / "harbour.txt"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny Qwen2 model with a vocabulary (llama.cpp needs one), as a Q8_0 GGUF file."""
    folder = tmp_path_factory.mktemp("tiny")
    make_folder(folder)
    model = from_pretrained(folder)
    # GGUF has no field for the initializer's range: the one a file reads back with.
    model.config = replace(model.config, initializer_range=0.02)
    return export_gguf(model, folder / "tiny-q8_0.gguf", type="q8_0",
                       tokenizer=Tokenizer.from_pretrained(folder))


def test_attnlab_worker_runs_the_file_as_attnlab_loads_it(tiny_gguf):
    ids = Tokenizer.from_pretrained(tiny_gguf).encode(TEXT.read_text())
    speed = llamacpp.run_worker("ours", {
        "task": "speed", "file": str(tiny_gguf), "threads": 1, "prompt": ids[:16],
        "prefill": ids[:64], "new_tokens": 6})
    chunks = [ids[:20], ids[20:30]]
    out = tiny_gguf.parent / "ours.npy"
    logprobs = llamacpp.run_worker("ours", {"task": "logprobs", "file": str(tiny_gguf),
                                            "threads": 1, "chunks": chunks, "out": str(out)})
    assert "error" not in speed and "error" not in logprobs
    assert speed["decode_tps"] > 0 and speed["prefill_tps"] > 0
    assert 0 < speed["after_import_kib"] < speed["peak_kib"]
    model = from_pretrained(tiny_gguf)
    with torch.inference_mode():
        expected = generate(model, torch.tensor([ids[:16]]), 6)[0, 16:].tolist()
        expected_lp = torch.cat([torch.log_softmax(model(torch.tensor([c]))[0].float(), -1)
                                 for c in chunks])
    assert speed["tokens"] == expected
    assert logprobs["rows"] == 30
    torch.testing.assert_close(torch.from_numpy(np.load(out)), expected_lp)


def test_kl_and_top1_are_the_formula(tmp_path):
    p = torch.log_softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(0)), -1)
    q = p.clone()
    q[0] = torch.log_softmax(-p[0], -1)  # a different top token in the first row only
    np.save(tmp_path / "p.npy", p.numpy())
    np.save(tmp_path / "q.npy", q.numpy())
    kl, top1 = llamacpp.kl_and_top1(tmp_path / "p.npy", tmp_path / "q.npy", rows=2)
    expected = (p.double().exp() * (p.double() - q.double())).sum(-1).mean().item()
    assert kl == pytest.approx(expected, rel=1e-9) and kl > 0
    assert top1 == pytest.approx(4 / 5)
    assert llamacpp.kl_and_top1(tmp_path / "p.npy", tmp_path / "p.npy") == (0.0, 1.0)


def test_table_states_ratios_memory_and_every_target():
    def side(decode, prefill, peak_mib):
        return {"runs": [{"decode_tps": d, "prefill_tps": prefill, "tokens": [1, 2],
                          "peak_kib": peak_mib * 1024, "after_import_kib": 100 * 1024}
                         for d in decode], "errors": []}

    row = {"name": "m-q8_0.gguf", "label": "given", "types": "Q8_0 100%",
           "bits_per_weight": 8.5, "ours": side([90.0, 100.0, 110.0], 300.0, 900),
           "theirs": side([200.0, 200.0, 200.0], 150.0, 400), "kl": 0.002, "top1": 0.97,
           "greedy_equal": "2 of 2"}
    failed = {**row, "name": "m-f32.gguf", "theirs": {"runs": [], "errors": ["theirs exited"]}}
    text = llamacpp.markdown({
        "rows": [row, failed], "threads": 2, "rounds": 3, "text": str(TEXT), "quick": False,
        "workload": {"prompt_tokens": 16, "new_tokens": 128, "prefill": 512, "kl_tokens": 1024,
                     "context": 512},
        "machine": {"cpu": "a CPU", "load average (1 min)": "0.1 at start, 0.2 at end"}})
    assert ("| m-q8_0.gguf | given | Q8_0 100% | 8.50 | 100.0 (20%) | 200.0 (0%) | 0.50x "
            "| 300.0 (0%) | 150.0 (0%) | 2.00x | 900 (100) | 400 (100) | 0.0020 | 97.0% "
            "| 2 of 2 |") in text
    assert ("- m-q8_0.gguf: decode >= 1.0x: FAIL; prefill >= 1.0x: PASS; peak memory <= "
            "llama.cpp + 0.3 GiB: FAIL; KL <= 0.01: PASS") in text
    assert "- m-f32.gguf: decode >= 1.0x: not measured" in text
    assert "- m-f32.gguf, theirs: theirs exited" in text
    assert "> **Warning:** the rounds disagree (spread up to 20%" in text
    assert "- cpu: a CPU" in text


def test_a_python_without_llama_cpp_is_refused_naming_the_option(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'No module named llama_cpp' >&2\nexit 1\n")
    python.chmod(0o755)
    with pytest.raises(ValueError, match=r"--llama-python: llama_cpp does not import in "
                       r"--llama-python .*No module named llama_cpp"):
        llamacpp.find_llama_python(python)


def test_whole_benchmark_against_llama_cpp_on_a_tiny_file(tiny_gguf, tmp_path, capsys):
    """Both sides on one file: the figures, and the two agreeing on the next token
    (llama.cpp quantizes the activations of Q8_0 products to 8 bits, attnlab need not)."""
    python = Path(os.environ.get("LLAMA_PYTHON") or sys.executable)
    try:
        llamacpp.find_llama_python(python)
    except ValueError as error:
        pytest.skip(f"no llama_cpp for the llama.cpp side (set LLAMA_PYTHON): {error}")
    assert main(["llamacpp", "--quick", "--threads", "1", "--gguf", str(tiny_gguf),
                 "--llama-python", str(python), "--text", str(TEXT),
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "llamacpp.json").read_text())
    (row,) = result["rows"]
    assert not row["ours"]["errors"] and not row["theirs"]["errors"]
    assert row["theirs"]["runs"][0]["decode_tps"] > 0
    assert row["kl"] < 0.01 and row["top1"] > 0.9
    assert "KL <= 0.01: PASS" in (tmp_path / "llamacpp.md").read_text()
    assert str(tmp_path) in capsys.readouterr().out
