"""``attnlab translate`` and ``attnlab sample`` on tiny checkpoints: every input checked, every
bad flag named, and the model's output never passed off as an answer it is not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab.cli import infer as cli_infer
from attnlab.cli import main
from attnlab.training.tasks import seq2seq
from attnlab.training.tasks.vocab import BOS, EOS, PAD, SPECIALS

TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--dropout", "0", "--no-progress"]
STEPS = ["--steps", "1", "--batch-size", "4", "--eval-every", "1"]


@pytest.fixture(scope="module")
def dates_checkpoint(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("dates") / "run"
    assert main(["train", "seq2seq", "--task", "dates", "--out", str(out), *STEPS, *TINY]) == 0
    return str(out / "last")


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("lm")
    text = folder / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    out = folder / "run"
    args = ["train", "lm", "--text", str(text), "--block-size", "16", "--out", str(out)]
    assert main([*args, *STEPS, *TINY]) == 0
    return str(out / "last")


def fake_decoder(monkeypatch, outputs: dict[str, str]) -> None:
    """Make the model "answer" ``outputs[input]`` (the task's vocabularies, as a trained date
    model would write them), so that the checks of its outputs can be tested."""
    task = seq2seq.make_seq2seq_task("dates", n_test=1, n_valid=1)

    def generate(model, src, max_new_tokens, *, bos_id, eos_id, num_beams=1):
        rows = [[BOS, *task.tgt_vocab.encode(outputs[task.src_vocab.decode(row)]), EOS]
                for row in src.tolist()]
        width = max(len(r) for r in rows)
        return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])

    monkeypatch.setattr(seq2seq, "generate_seq2seq", generate)


def lines_of(capsys) -> tuple[list[str], str]:
    captured = capsys.readouterr()
    return captured.out.rstrip("\n").split("\n"), captured.err


def test_translate_reports_each_bad_input_and_translates_the_rest(
    dates_checkpoint, monkeypatch, capsys
):
    fake_decoder(monkeypatch, {"21 nov 2026": "2026-11-21", "31 feb 2026": "2026-02-31"})
    texts = ["21 nov 2026", "", "31 feb 2026", "21 nov 2026 §€", "   ", "21 nov"]
    assert main(["translate", "--checkpoint", dates_checkpoint, *texts]) == 1
    lines, err = lines_of(capsys)
    assert len(lines) == len(texts)
    assert lines[0] == "21 nov 2026\t2026-11-21"
    assert lines[1] == "\terror: input 2: empty input; expected some text to translate"
    assert lines[2].startswith("31 feb 2026\terror: input 3: the model's output '2026-02-31' "
                               "is not a calendar date")
    assert lines[3] == ("21 nov 2026 §€\terror: input 4: characters not in the model's "
                        "vocabulary: '§' (U+00A7), '€' (U+20AC)")
    assert lines[4].startswith("   \terror: input 5: only whitespace")
    assert lines[5].startswith("21 nov\terror: input 6: 2 digit(s); a date needs its day and year")
    assert "5 of 6 inputs failed" in err


def test_translate_all_good_exits_zero_and_beams_are_checked(dates_checkpoint, monkeypatch,
                                                            capsys):
    fake_decoder(monkeypatch, {"21.11.2026": "2026-11-21", "Jan 1st '50": "1950-01-01"})
    assert main(["translate", "--checkpoint", dates_checkpoint, "21.11.2026", "Jan 1st '50"]) == 0
    lines, err = lines_of(capsys)
    assert lines == ["21.11.2026\t2026-11-21", "Jan 1st '50\t1950-01-01"] and err == ""
    assert main(["translate", "--checkpoint", dates_checkpoint, "--beams", "0", "1.1.2000"]) == 2
    assert "--beams: expected a positive int, got 0" in capsys.readouterr().err


def test_translate_too_long_input_names_its_length_and_the_model_limit(dates_checkpoint,
                                                                       monkeypatch, capsys):
    fake_decoder(monkeypatch, {"1.1.2000": "2000-01-01"})
    assert main(["translate", "--checkpoint", dates_checkpoint, "1" * 1440, "1.1.2000"]) == 1
    lines, _ = lines_of(capsys)
    assert lines[0] == "1" * 1440 + "\terror: input 1: 1440 characters, the model reads at most 128"
    assert lines[1] == "1.1.2000\t2000-01-01"


def test_translate_model_output_that_is_not_a_date_is_an_error(dates_checkpoint, monkeypatch,
                                                              capsys):
    outputs = {"1.1.2000": "2000-1-01", "2.1.2000": "", "3.1.2000": "2150-01-01",
               "4.1.2000": "2000-13-01"}
    fake_decoder(monkeypatch, outputs)
    assert main(["translate", "--checkpoint", dates_checkpoint, *outputs]) == 1
    lines, _ = lines_of(capsys)
    assert [line.split("\t")[1].split(": ", 2)[-1] for line in lines] == [
        "the model's output '2000-1-01' is not a date written YYYY-MM-DD",
        "the model's output is empty",
        "the model's output '2150-01-01' lies outside 1900-01-01..2099-12-31, the dates it knows",
        "the model's output '2000-13-01' is not a calendar date (month must be in 1..12)",
    ]


def test_translate_keeps_one_line_per_input_for_control_characters(dates_checkpoint, capsys):
    assert main(["translate", "--checkpoint", dates_checkpoint, "1\t1\n2000"]) == 1
    lines, _ = lines_of(capsys)
    assert lines == ["1\\t1\\n2000\terror: input 1: characters not in the model's vocabulary: "
                     "'\\t' (U+0009), '\\n' (U+000A)"]


def test_translate_real_model_lines_match_inputs(dates_checkpoint, capsys):
    # The untrained model's outputs are whatever they are; each line is an answer that is a
    # real date, or an error, never anything else.
    texts = ["21 November 2026", "Saturday, the 21st of November 2026", "2026年11月21日"]
    code = main(["translate", "--checkpoint", dates_checkpoint, *texts])
    lines, _ = lines_of(capsys)
    assert [line.split("\t")[0] for line in lines] == texts
    for line in lines:
        answer = line.split("\t")[1]
        assert answer.startswith("error: ") or seq2seq.dates.output_error(answer) is None
    assert code == (1 if any("\terror: " in line for line in lines) else 0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt", "x" * 300], "--prompt: 300 characters, the model's context is 256"),
        (["--prompt", "x" * 256], "--prompt: 256 characters, the model's context is 256"),
        (["--prompt", ""], "--prompt: expected at least one character"),
        (["--prompt", "the QUICK fox"], "--prompt: characters not in the model's vocabulary: "
                                        "'Q' (U+0051), 'U' (U+0055), 'I' (U+0049)"),
        (["--max-new-tokens", "0"], "--max-new-tokens: expected a positive int, got 0"),
        (["--max-new-tokens", "-3"], "--max-new-tokens: expected a positive int, got -3"),
        (["--temperature", "0"], "--temperature: expected a finite number > 0"),
        (["--temperature", "nan"], "--temperature: expected a finite number > 0"),
        (["--temperature", "-1"], "--temperature: expected a finite number > 0"),
        (["--top-k", "0"], "--top-k: expected None or a positive int, got 0"),
        (["--top-p", "1.5"], "--top-p: expected None or a float in (0, 1], got 1.5"),
        (["--top-p", "0"], "--top-p: expected None or a float in (0, 1], got 0.0"),
        (["--seed", str(2**64)], f"--seed: expected an int from -2**63 to 2**64 - 1, got {2**64}"),
    ],
)
def test_sample_bad_flags_name_the_flag(lm_checkpoint, capsys, flags, message):
    assert main(["sample", "--checkpoint", lm_checkpoint, *flags]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def model_writes(monkeypatch, replace) -> None:
    """Run the real sampler, then ``replace(new_ids)`` the new tokens: control over what an
    untrained model samples (its vocabulary holds the special tokens too)."""
    real = cli_infer.generate

    def generate(model, prompt, max_new_tokens, **kwargs):
        ids = real(model, prompt, max_new_tokens, **kwargs)
        P = prompt.shape[1]
        return torch.cat([ids[:, :P], replace(ids[:, P:])], dim=1)

    monkeypatch.setattr(cli_infer, "generate", generate)


def test_sample_says_when_the_context_runs_out(lm_checkpoint, monkeypatch, capsys):
    model_writes(monkeypatch, lambda new: new.clamp(min=len(SPECIALS)))
    prompt = "the lazy dog. " * 17 + "the"  # 241 characters; the context is 256
    assert main(["sample", "--checkpoint", lm_checkpoint, "--prompt", prompt,
                 "--max-new-tokens", "40"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(prompt) and len(captured.out) == 256 + 1
    assert captured.err == ("attnlab sample: stopped after 15 of 40 new characters: the prompt "
                            "(241) and the new characters fill the model's context of 256 "
                            "(max_len)\n")


def test_sample_stops_at_a_special_token_and_says_so(lm_checkpoint, monkeypatch, capsys):
    def eos_after_five(new):
        new = new.clamp(min=len(SPECIALS))
        new[:, 5] = EOS
        return new

    model_writes(monkeypatch, eos_after_five)
    assert main(["sample", "--checkpoint", lm_checkpoint, "--prompt", "the ",
                 "--max-new-tokens", "20"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("the ") and len(captured.out) == 4 + 5 + 1
    assert captured.err == ("attnlab sample: stopped after 5 of 20 new characters: the model "
                            "produced <eos>, which is no character\n")


def test_sample_is_reproducible_and_writes_only_the_model_s_characters(lm_checkpoint, capsys):
    args = ["sample", "--checkpoint", lm_checkpoint, "--prompt", "the ", "--max-new-tokens", "30",
            "--top-k", "3", "--top-p", "0.9", "--seed", "7"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert first.out.startswith("the ") and len(first.out) <= 4 + 30 + 1
    assert set(first.out[:-1]) <= set("the quick brown fox jumps over the lazy dog. ")
    assert (first.err == "") == (len(first.out) == 4 + 30 + 1)
    assert main(args) == 0
    assert capsys.readouterr() == first


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"task": "lm"}, "has no vocabulary of its model's 32 tokens (extra.chars in config.json, "
                         "got None)"),
        ({"task": "lm", "chars": "abc"}, "got 'abc'"),
    ],
)
def test_sample_refuses_a_checkpoint_without_its_vocabulary(lm_checkpoint, tmp_path, capsys,
                                                            extra, message):
    folder = edited_checkpoint(lm_checkpoint, tmp_path, extra)
    assert main(["sample", "--checkpoint", folder]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tgt_chars": "0123456789/"}, "was trained with another vocabulary"),
        ({"max_len": "12"}, "extra.max_len in"),
    ],
)
def test_translate_refuses_a_checkpoint_whose_task_does_not_fit(dates_checkpoint, tmp_path,
                                                                capsys, change, message):
    extra = json.loads((Path(dates_checkpoint) / "config.json").read_text())["extra"]
    folder = edited_checkpoint(dates_checkpoint, tmp_path, {**extra, **change})
    assert main(["translate", "--checkpoint", folder, "1.1.2000"]) == 2
    assert message in capsys.readouterr().err


def edited_checkpoint(folder: str, tmp_path, extra: dict) -> str:
    """A copy of the checkpoint ``folder`` whose config.json has ``extra`` instead."""
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "extra": extra}))
    return str(copy)


def test_sample_default_prompt_is_a_character_the_model_knows(lm_checkpoint, tmp_path, capsys):
    # The corpus has no newline: the default prompt is its first character, a space.
    assert main(["sample", "--checkpoint", lm_checkpoint, "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith(" ")
    text = tmp_path / "lines.txt"
    text.write_text("ab\ncd\n" * 40, encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "lm", "--text", str(text), "--block-size", "8", "--out", str(out),
                 *STEPS, *TINY]) == 0
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(out / "last"), "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("\n")


@given(st.text())
def test_printed_inputs_stay_on_one_line(text):
    shown = cli_infer._printable(text)
    assert shown.isprintable() or shown == ""
    assert len(shown) >= len(text)
