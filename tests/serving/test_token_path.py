"""One served token and one ``generate()`` step cross few attnlab files, in one direction
(issue 39): the trace of ``benchmarks/scripts/trace_token.py`` on a tiny model with the fast
modules installed and the native kernels chosen by the rule. Before the issue's work a served
token entered 22 files (three of them again from below: the fused layer list back into the
decoder, the paged attention formula and the fast module into each other) and a
``generate()`` step 18; now 14 and 12."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from attnlab.models import DecoderLM

SCRIPT = pathlib.Path(__file__).parents[2] / "benchmarks" / "scripts" / "trace_token.py"
# The counts reached, plus one of slack for a helper that earns its file.
SERVED_FILES, GENERATE_FILES = 14 + 1, 12 + 1

pytestmark = pytest.mark.usefixtures("native_kernels")


@pytest.fixture(scope="module")
def trace_token():
    spec = importlib.util.spec_from_file_location("trace_token", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.fixture
def model(trace_token, tmp_path, monkeypatch) -> DecoderLM:
    """A tiny Qwen2 loaded as ``from_pretrained`` loads (the fast modules installed), its
    kernels the rule's (not the formula the other tests pin) in a fresh kernel cache."""
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / "cache"))
    return DecoderLM.from_pretrained(trace_token.tiny_folder(tmp_path / "qwen2", "qwen2"))


def test_a_served_token_crosses_few_files_in_one_direction(trace_token, model) -> None:
    trace = trace_token.trace_engine(model)
    assert trace.files[0] == "serving/engine", trace.files
    assert len(trace.files) <= SERVED_FILES, trace.files
    assert not any(name.startswith(("_checks", "models/inputs", "kernels/rule",
                                    "kernels/catalog", "serving/speculation"))
                   for name in trace.files), trace.files
    assert trace.reentered == [], trace.reentered
    assert "paged_attention" in trace.native  # the token's work still runs in C++


def test_a_generate_step_crosses_few_files_in_one_direction(trace_token, model) -> None:
    trace = trace_token.trace_generate(model)
    assert trace.files[0] == "generation/generate", trace.files
    assert len(trace.files) <= GENERATE_FILES, trace.files
    assert not any(name.startswith(("kernels/rule", "kernels/catalog", "hook_point",
                                    "generation/controls"))
                   for name in trace.files), trace.files
    assert trace.reentered == [], trace.reentered
    assert "run" in trace.native  # the one-call step through every block
