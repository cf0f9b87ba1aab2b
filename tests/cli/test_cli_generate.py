"""`attnlab generate` on tiny checkpoint folders (a trained BPE tokenizer with weights of every
family that attnlab reads, written by transformers or by our save_pretrained)."""

from __future__ import annotations

import argparse
import json
import re
import shutil

import pytest
import torch

from attnlab.bench.versus import random_checkpoint
from attnlab.cli import build_parser, main
from attnlab.cli.generate import summary
from attnlab.generation import generate
from attnlab.models.families import FAMILIES
from attnlab.models.io import from_pretrained
from attnlab.tokenizer import Tokenizer
from tiny_folders import make_folder, make_tokenizer


def test_generate_streams_text_and_reports_speed(tmp_path, capsys) -> None:
    make_folder(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "once upon a",
                 "--max-new-tokens", "12"]) == 0
    captured = capsys.readouterr()
    tok = Tokenizer.from_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    prompt = tok.encode("once upon a")
    ids = generate(model, torch.tensor([prompt]), 12, eos_token_id=tok.eos_token_id)
    expected = tok.decode(ids[0, len(prompt):], skip_special_tokens=True)
    assert captured.out == expected + "\n"
    assert f"{len(prompt)} prompt tokens" in captured.err and "tokens/s" in captured.err


def test_generate_chat_and_sampling(tmp_path, capsys) -> None:
    make_folder(tmp_path)
    args = ["generate", "--model", str(tmp_path), "--prompt", "hello fox", "--chat",
            "--system", "be brief", "--max-new-tokens", "6", "--do-sample", "--top-k", "5",
            "--temperature", "0.8", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr()
    tok = Tokenizer.from_pretrained(tmp_path)
    chat = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hello fox"}],
                                   add_generation_prompt=True, tokenize=True)
    assert f"{len(chat)} prompt tokens" in first.err
    assert main(args) == 0
    assert capsys.readouterr().out == first.out  # same seed, same text


def test_generate_errors(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("model_type", sorted({f.model_types[0] for f in FAMILIES.values()}))
def test_every_family_generates_as_transformers_does(tmp_path, capsys, model_type) -> None:
    """A folder written by transformers for each family: the CLI prints what transformers'
    greedy generate makes from the same folder, token for token."""
    transformers = pytest.importorskip("transformers")
    vocab = make_tokenizer(tmp_path)
    random_checkpoint(tmp_path, model_type, {
        "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "head_dim": 8,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "initializer_range": 0.2})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tok = Tokenizer.from_pretrained(tmp_path)
    prompt = torch.tensor([tok.encode("the fox")])
    ends = [tok.eos_token_id, hf.config.eos_token_id]  # the CLI's: tokenizer's and config's
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                               do_sample=False, eos_token_id=ends, pad_token_id=0)
    code, out, err = run(tmp_path, capsys, "--max-new-tokens", "8", prompt="the fox")
    assert code == 0, err
    assert out == new_text(tmp_path, expected, prompt.shape[1]) + "\n"


@pytest.mark.parametrize(("config", "message"), [
    ({"model_type": "bert"}, r"config.json: model_type 'bert' is not supported; expected one "
                             r"of \[.*'llama'.*'qwen2'.*\]"),
    ({"architectures": ["X"]}, r"config.json: model_type None is not supported"),
    ({"format": "attnlab-checkpoint", "model_type": "decoder_lm", "model": {}},
     r"config.json is an attnlab training checkpoint .*attnlab sample --model"),
])
def test_unsupported_folders_are_refused_naming_what_is_read(tmp_path, capsys, config: dict,
                                                             message: str) -> None:
    make_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = run(tmp_path, capsys)
    assert code == 2 and out == ""
    assert re.search("--model: .*" + message, err), err


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    make_folder(folder)
    return folder


@pytest.fixture
def folder(base, tmp_path):
    """A fresh copy of the tiny checkpoint, for a test to add its generation_config.json."""
    return shutil.copytree(base, tmp_path / "model")


def run(folder, capsys, *flags: str, prompt: str = "once upon a") -> tuple[int, str, str]:
    code = main(["generate", "--model", str(folder), "--prompt", prompt, *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def new_text(folder, ids: torch.Tensor, prompt_length: int) -> str:
    tok = Tokenizer.from_pretrained(folder)
    return tok.decode(ids[0, prompt_length:], skip_special_tokens=True)


def test_generation_config_defaults_match_transformers_generate(folder, capsys) -> None:
    """Greedy with the file's repetition penalty, end-id list and max_new_tokens: the CLI
    prints what transformers' generate makes from the same folder (which reads the file)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2ForCausalLM.from_pretrained(folder).eval()
    tok = Tokenizer.from_pretrained(folder)
    prompt = torch.tensor([tok.encode("once upon a")])
    P = prompt.shape[1]
    with torch.no_grad():
        free = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=9,
                           do_sample=False, repetition_penalty=1.3, pad_token_id=0)
    new = free[0, P:].tolist()
    # The first new token from the third on that was not made before ends the text.
    k = next(i for i in range(2, len(new)) if new[i] not in new[:i])
    end = new[k]
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "repetition_penalty": 1.3, "max_new_tokens": 9,
         "eos_token_id": [tok.eos_token_id, end], "pad_token_id": 0, "temperature": 0.6,
         "top_k": 0}))
    hf = transformers.Qwen2ForCausalLM.from_pretrained(folder).eval()  # reads the file
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt))
    assert expected.shape[1] == P + k + 1 and int(expected[0, -1]) == end
    code, out, err = run(folder, capsys)
    assert code == 0 and f"{k + 1} new tokens" in err, err
    assert out == new_text(folder, expected, P) + "\n"
    # Flags win over the file: no penalty, 3 tokens.
    code, out, _ = run(folder, capsys, "--repetition-penalty", "1.0", "--max-new-tokens", "3")
    with torch.no_grad():
        plain = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                            repetition_penalty=1.0)
    assert code == 0 and out == new_text(folder, plain, P) + "\n"


def test_sampling_defaults_from_the_file_and_flags_over_them(folder, capsys) -> None:
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9,
         "max_length": 10}))
    tok = Tokenizer.from_pretrained(folder)
    model = from_pretrained(folder)
    prompt = torch.tensor([tok.encode("once upon a")])
    P = prompt.shape[1]
    code, out, _ = run(folder, capsys, "--seed", "4")
    sampled = generate(model, prompt, max_length=10, do_sample=True, temperature=0.7, top_k=5,
                       top_p=0.9, seed=4, eos_token_id=tok.eos_token_id)
    assert code == 0 and out == new_text(folder, sampled, P) + "\n"
    code, out, _ = run(folder, capsys, "--seed", "4", "--temperature", "1.5", "--top-k", "9")
    hotter = generate(model, prompt, max_length=10, do_sample=True, temperature=1.5, top_k=9,
                      top_p=0.9, seed=4, eos_token_id=tok.eos_token_id)
    assert code == 0 and out == new_text(folder, hotter, P) + "\n"
    greedy = new_text(folder, generate(model, prompt, max_length=10,
                                       eos_token_id=tok.eos_token_id), P) + "\n"
    for flags in (["--no-do-sample"], ["--temperature", "0"]):  # both mean greedy
        code, out, err = run(folder, capsys, *flags)
        assert code == 0 and out == greedy, flags
        assert "note" not in err


def test_stop_strings_match_transformers(folder, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2ForCausalLM.from_pretrained(folder).eval()
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(folder)
    model = from_pretrained(folder)
    prompt = torch.tensor([tok.encode("hello")])
    P = prompt.shape[1]
    free = generate(model, prompt, 20)[0, P:].tolist()
    # A stop string across a token boundary, ending inside the later token (an "overhang").
    for i in range(1, 20):
        before, upto = tok.decode(free[:i]), tok.decode(free[:i + 1])
        stop = upto[len(before) - 1:len(before) + 1]
        if (upto.startswith(before) and len(upto) > len(before) + 1 and "\ufffd" not in stop
                and stop not in before and len(stop) == 2):
            break
    else:
        pytest.fail(f"no token boundary to stop at in {tok.decode(free)!r}")
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                               do_sample=False, stop_strings=[stop], tokenizer=hf_tok,
                               pad_token_id=0)
    ours = generate(model, prompt, 20, stop_strings=[stop], tokenizer=tok)
    assert ours.tolist() == expected.tolist()
    assert ours.shape[1] == P + i + 1
    code, out, _ = run(folder, capsys, "--max-new-tokens", "20", "--stop", stop, "--stop", "@@",
                       prompt="hello")
    assert code == 0 and out == new_text(folder, ours, P) + "\n"
    # Nothing made past the stop: it is not in the text before the last token.
    assert stop in out and stop not in new_text(folder, ours[:, :-1], P)


@pytest.mark.parametrize(("flags", "message"), [
    (["--do-sample", "--temperature", "0"],
     r"--temperature: expected a temperature > 0 for sampling \(--do-sample\), got 0"),
    (["--max-new-tokens", "300"],
     r"--max-new-tokens: the prompt has 3 tokens and the model's limit of 256 positions "
     r"\(max_position_embeddings in config.json\), so at most 253 new tokens fit; got 300"),
    (["--max-length", "300"], "--max-length: the prompt has 3 tokens .* got 300"),
    (["--max-length", "2"], "--max-length: expected at least the prompt's 3 tokens"),
    (["--max-length", "10", "--max-new-tokens", "3"],
     r"--max-length: 10 contradicts --max-new-tokens 3 for a prompt of 3 tokens \(3 \+ 3 = "
     r"6\)"),
])
def test_errors_speak_of_flags(folder, capsys, flags: list[str], message: str) -> None:
    code, _, err = run(folder, capsys, *flags)
    assert code == 2
    assert re.search(message, err), err
    assert "do_sample=" not in err and "max_new_tokens" not in err


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--top-k", "0", "argument --top-k: expected a positive int, got '0'"),
    ("--top-p", "1.5", r"argument --top-p: expected a number in (0, 1], got '1.5'"),
    ("--temperature", "-1", "argument --temperature: expected a finite number >= 0"),
    ("--temperature", "nan", "argument --temperature: expected a finite number >= 0"),
    ("--repetition-penalty", "0", "argument --repetition-penalty: expected a finite number > 0"),
    ("--max-new-tokens", "-1", "argument --max-new-tokens: expected an int >= 0, got '-1'"),
    ("--max-new-tokens", "x", "argument --max-new-tokens: expected an int >= 0, got 'x'"),
    ("--stop", "", "argument --stop: expected a non-empty text, got ''"),
])
def test_bad_flag_values_are_refused_by_name(folder, capsys, flag: str, value: str,
                                             message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(folder), "--prompt", "x", flag, value])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_prompt_longer_than_the_model(folder, capsys) -> None:
    code, _, err = run(folder, capsys, prompt="the fox said hello to the world " * 40)
    assert code == 2
    assert "--prompt: encodes to" in err and "more than the model's limit of 256" in err


@pytest.mark.parametrize(("file", "message"), [
    ({"do_sample": True, "temperature": 0}, "temperature in .*generation_config.json: expected "
                                            r"a temperature > 0 for sampling \(do_sample in"),
    ({"top_p": "high"}, r"generation_config.json: top_p: expected a number in \(0, 1\]"),
    ({"eos_token_id": [1, 5000]}, r"eos_token_id in .*generation_config.json\[1\]: expected a "
                                  r"token id in \[0, \d+\)"),
    ({"pad_token_id": 5000}, "pad_token_id in .*generation_config.json: expected a token id"),
    ({"max_length": 2}, "generation_config.json: max_length 2 leaves no room after the "
                        "prompt's 3 tokens; give --max-new-tokens"),
])
def test_bad_generation_config_names_field_and_file(folder, capsys, file: dict,
                                                    message: str) -> None:
    (folder / "generation_config.json").write_text(json.dumps(file))
    code, _, err = run(folder, capsys)
    assert code == 2
    assert re.search(message, err), err


def test_default_length_is_capped_at_the_model_limit(folder, capsys) -> None:
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 1000}))
    code, _, err = run(folder, capsys, prompt="the fox said hello to the world " * 30)
    assert code == 0
    assert "capped at" in err and "by the model's limit of 256 positions" in err


@pytest.mark.parametrize(("n", "expected"), [
    ("0", "0 new tokens (the model was not run)"),
    ("1", "1 new token in"),
    ("2", "2 new tokens in"),
])
def test_summary_is_true_for_few_tokens(folder, capsys, n: str, expected: str) -> None:
    code, out, err = run(folder, capsys, "--max-new-tokens", n)
    assert code == 0 and expected in err, err
    assert "nan" not in err and "inf" not in err
    if n == "0":
        assert out == "\n"


def test_summary_without_measurable_decode_time() -> None:
    line = summary(3, 2, 0.0, 1.0, 1.0, note=None, machine="float32, 1 thread")
    assert "nan" not in line and "inf" not in line
    assert "a decode rate needs" in line or "tokens/s" not in line


def test_every_option_has_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    generate_parser = sub.choices["generate"]
    for action in generate_parser._actions:
        assert action.help and action.help.strip(), action.option_strings
    text = generate_parser.format_help()
    assert "(default: None)" not in text and "generation_config.json" in text


def test_sampling_flags_without_sampling_are_pointed_out(folder, capsys) -> None:
    code, out, err = run(folder, capsys, "--max-new-tokens", "3", "--top-k", "5",
                         "--temperature", "0.5")
    _, greedy_out, _ = run(folder, capsys, "--max-new-tokens", "3")
    assert code == 0 and out == greedy_out
    assert "note: --temperature, --top-k unused: greedy decoding (add --do-sample" in err


@pytest.mark.parametrize(("template", "error"), [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% import 'other.jinja' as other %}", "TypeError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ 'a' * 10**10 }}", "MemoryError"),  # refused by the render's 1 GiB, nothing allocated
])
def test_a_failing_chat_template_is_one_line_naming_its_file(qwen2_folder, tmp_path, capsys,
                                                              template, error) -> None:
    folder = tmp_path / "model"
    shutil.copytree(qwen2_folder, folder)
    (folder / "chat_template.jinja").write_text(template)
    assert main(["generate", "--model", str(folder), "--prompt", "hi", "--chat"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n")
    assert err.splitlines()[-1].startswith(
        f"attnlab: error: {folder / 'chat_template.jinja'}: the chat template cannot render the "
        f"messages ({error}, template line 1")


def test_a_rendered_prompt_longer_than_the_context_is_refused_before_tokenizing(
        qwen2_folder, tmp_path, capsys) -> None:
    """A template that prints far more characters than the context's tokens can hold is one
    line naming the template file, at once (it took two minutes to tokenize 30 M)."""
    folder = tmp_path / "model"
    shutil.copytree(qwen2_folder, folder)
    (folder / "chat_template.jinja").write_text("{{ 'a b ' * 1000000 }}")
    assert main(["generate", "--model", str(folder), "--prompt", "hi", "--chat"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith(
        f"attnlab: error: {folder / 'chat_template.jinja'}: the rendered prompt: text: 4000000 "
        "characters are more than")
