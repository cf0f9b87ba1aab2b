"""``attnlab bench quantization``: a tiny run through the command line and through
``measure_accuracy``; the figures checked against computations made here (perplexity as
exp(mean cross-entropy), argmax agreement, greedy exact match); bad options refused by name."""

from __future__ import annotations

import copy
import math
import re
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from attnlab.bench import quantization as bench
from attnlab.bench import timed_training
from attnlab.bench.harness import machine_info
from attnlab.bench.quantization import (
    AccuracySettings,
    lm_scores,
    measure_accuracy,
    measure_dates,
    measure_lm,
)
from attnlab.bench.quantization_report import Target, targets, write_report
from attnlab.cli import main
from attnlab.training.tasks.seq2seq import exact_match, make_seq2seq_task
from devbench.history import keep_history

# Plain English, long enough for windows of 16 characters and a held-out tenth.
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it "
        "was the age of foolishness, it was the epoch of belief, it was the epoch of "
        "incredulity, it was the season of Light, it was the season of Darkness.\n") * 6

TINY = ["--train-seconds", "0.2", "--steps", "3", "--d-model", "64", "--layers", "1",
        "--heads", "2", "--block-size", "16", "--batch-size", "4", "--group-sizes", "32,64",
        "--date-seconds", "0.2", "--date-steps", "2", "--date-examples", "8"]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny_settings(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return AccuracySettings(text=path, train_seconds=0.2, steps=3, d_model=64, layers=1,
                            heads=2, block_size=16, batch_size=4, group_sizes=(32, 64),
                            date_seconds=0.2, date_steps=2, date_examples=8)


@pytest.fixture(scope="module")
def tiny_lm(tiny_settings):
    """One tiny run of the LM part, shared by the checks of its figures."""
    with _one_thread():
        return measure_lm(tiny_settings)


@pytest.fixture(scope="module")
def tiny_dates(tiny_settings):
    with _one_thread():
        return measure_dates(tiny_settings)


@contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_cli_run_writes_the_table_names_the_cpu_and_prints_the_targets(
        text_file, tmp_path, one_thread, capsys) -> None:
    out = tmp_path / "out"
    assert main(["bench", "quantization", "--text", str(text_file), *TINY,
                 "--out", str(out)]) == 0
    table = (out / "quantization-accuracy.md").read_text()
    printed = capsys.readouterr().out
    assert f"results written to {out / 'quantization-accuracy.md'}" in printed
    assert f"Measured on {machine_info()['cpu']}" in table
    assert f"- cpu: {machine_info()['cpu']}" in table
    for label in ("float32", "bfloat16", "int8", "int4 g32", "int4 g64"):
        assert f"\n| {label} | " in table.split("The date translator")[0]
        assert f"\n| {label} | " in table.split("The date translator")[1]
    assert "| float32 | float32 | " in table and "| 100.00% |" in table
    for target in ("int8 perplexity within 1%", "int4 g64 perplexity within 5%"):
        assert target in table
        assert f"PASS: {target}" in printed or f"FAIL: {target}" in printed


def test_python_function_writes_the_table(tiny_settings, tmp_path, one_thread) -> None:
    result = measure_accuracy(tiny_settings)
    path = write_report(result, tmp_path / "quantization-accuracy.md")
    table = path.read_text()
    for row in result.lm.scores:
        assert f"| {row.variant.label} | {row.variant.activations} | " in table
        assert f"| {row.perplexity:.4f} |" in table
    for row in result.dates.scores:
        assert f"| {row.exact_match:.2%} |" in table
    assert f"- cpu: {result.machine['cpu']}" in table
    write_report(result, path)  # attnlab bench: the new table alone
    assert "## History" not in path.read_text()
    # An earlier run on another machine is there: devbench puts the new one on top of it.
    path.write_text(table.replace(f"- cpu: {result.machine['cpu']}", "- cpu: Old CPU"))
    with keep_history(tmp_path):
        write_report(result, path)
    current, history = path.read_text().split("\n## History\n")
    assert current.startswith("# Quantized weights: accuracy")
    assert history.lstrip().startswith("### Old CPU")


def test_perplexity_is_exp_of_the_mean_cross_entropy_computed_here(tiny_lm,
                                                                    tiny_settings) -> None:
    r = tiny_lm
    rows = {_key(row.variant): row for row in r.scores}
    window = tiny_settings.block_size
    ids = r.held_out
    assert len(ids) >= 2 * window  # the last window is partial or not: both are covered

    def reference(model):
        # One window at a time, log-softmax in float64: every id after the first once.
        total, argmax = 0.0, []
        with torch.no_grad():
            for start in range(0, len(ids) - 1, window):
                x = ids[start : min(start + window, len(ids) - 1)]
                y = ids[start + 1 : start + 1 + len(x)]
                logits = model.eval()(x[None])[0].double()
                total -= logits.log_softmax(-1).gather(1, y[:, None]).sum().item()
                argmax.append(logits.argmax(-1))
        return math.exp(total / (len(ids) - 1)), torch.cat(argmax)

    ppl32, argmax32 = reference(r.model)
    assert rows["float32"].perplexity == pytest.approx(ppl32, rel=1e-5)
    assert rows["float32"].agreement == 1.0
    half = copy.deepcopy(r.model).to(torch.bfloat16)
    ppl16, argmax16 = reference(half)
    assert rows["bfloat16"].perplexity == pytest.approx(ppl16, rel=1e-5)
    assert rows["bfloat16"].agreement == pytest.approx(
        (argmax16 == argmax32).double().mean().item())
    assert r.scores[0].variant.label == "float32"  # the reference comes first
    for label in ("int8", "int4 g32", "int4 g64", "int8 bfloat16", "int4 g64 bfloat16"):
        quantized = bench.weights_as(r.model, rows[label].variant)
        ppl, argmax = reference(quantized)
        # bfloat16: scored DECODING_ROWS positions a forward (other kernels, other roundings)
        assert rows[label].perplexity == pytest.approx(ppl, rel=1e-5 if "bf" not in label
                                                       else 1e-2)
        if "bf" not in label:
            assert rows[label].agreement == pytest.approx(
                (argmax == argmax32).double().mean().item())
        assert rows[label].weight_bytes == bench.weight_bytes(quantized)
        assert rows[label].weight_bytes < rows["float32"].weight_bytes
        assert rows[label].kl > 0  # KL(float32 || row): zero only for float32 itself
    assert rows["float32"].kl == 0.0


def _key(variant: bench.Variant) -> str:
    """A row's label, with its activations where they are not the weights' default."""
    default = "bfloat16" if variant.weights == "bfloat16" else "float32"
    return variant.label + ("" if variant.activations == default else f" {variant.activations}")


def test_lm_scores_a_few_rows_a_forward_as_in_one(tiny_lm) -> None:
    """``rows``: the windows run a few positions a forward on a KV cache, the same numbers
    (float32) as one forward a window."""
    ids = tiny_lm.held_out[:40]
    whole = lm_scores(tiny_lm.model, ids, 16)
    for rows in (1, 5, 16):
        ppl, predicted = lm_scores(tiny_lm.model, ids, 16, rows=rows)
        assert ppl == pytest.approx(whole[0], rel=1e-5)
        assert torch.equal(predicted, whole[1])
    with pytest.raises(ValueError, match="rows: expected a positive int"):
        lm_scores(tiny_lm.model, ids, 16, rows=0)


def test_lm_scores_matches_the_formula_on_any_length(tiny_lm) -> None:
    # Lengths with and without a partial last window, and shorter than one window.
    model = tiny_lm.model
    for n in (2, 16, 17, 33, 40):
        ids = tiny_lm.held_out[:n]
        perplexity, predicted = lm_scores(model, ids, 16)
        assert predicted.shape == (n - 1,)
        total = 0.0
        for start in range(0, n - 1, 16):
            x, y = ids[start : min(start + 16, n - 1)], ids[start + 1 : min(start + 17, n)]
            with torch.no_grad():
                total += torch.nn.functional.cross_entropy(model(x[None])[0], y,
                                                           reduction="sum").item()
        assert perplexity == pytest.approx(math.exp(total / (n - 1)), rel=1e-5)


def test_date_exact_match_is_the_projects_greedy_exact_match(tiny_dates, tiny_settings,
                                                            tiny_lm) -> None:
    r = tiny_dates
    task = make_seq2seq_task("dates", seed=tiny_settings.seed, n_valid=100,
                             n_test=tiny_settings.date_examples)
    assert r.examples == len(task.test) == 8
    rows = {_key(row.variant): row for row in r.scores}
    assert [row.variant for row in r.scores] == [row.variant for row in tiny_lm.scores]
    assert rows["float32"].exact_match == exact_match(task, r.model, task.test)
    assert rows["float32"].same_as_float32 == 1.0
    float32_outputs = task.translate(r.model, [s for s, _ in task.test])
    for label in ("bfloat16", "int8", "int4 g32", "int4 g64", "int8 bfloat16",
                  "int4 g64 bfloat16"):
        other = bench.weights_as(r.model, rows[label].variant)
        batch = bench.DECODING_ROWS if rows[label].variant.decoding else 256
        outputs = task.translate(other, [s for s, _ in task.test], batch_size=batch)
        assert rows[label].exact_match == sum(
            out == t for out, (_, t) in zip(outputs, task.test)) / len(outputs)
        assert rows[label].same_as_float32 == sum(
            a == b for a, b in zip(outputs, float32_outputs)) / len(outputs)


def test_training_stops_at_the_deadline_and_says_how_far_it_got(tiny_settings,
                                                                 one_thread) -> None:
    """On a clock that each training step moves (10 ms a step while the run is planned, then
    50 ms: the machine slows down), not the machine's: the run stops after the step that
    crosses the deadline."""
    settings = replace(tiny_settings, train_seconds=0.3, steps=None)
    calls, now = [], [0.0]
    real = timed_training.Trainer._train_step

    def slower(self):
        calls.append(1)
        now[0] += 0.05 if len(calls) > timed_training._PROBE_STEPS + 1 else 0.01
        return real(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(timed_training.Trainer, "_train_step", slower)
        patch.setattr(timed_training, "time", SimpleNamespace(perf_counter=lambda: now[0]))
        training = measure_lm(settings).training
        assert 1 <= training.steps < training.planned
        assert 0.3 < training.seconds <= 0.3 + 0.05 + 1e-9  # one slowed step past the deadline
        planned = measure_lm(replace(tiny_settings, train_seconds=60, steps=4)).training
    assert planned.steps == planned.planned == 4


@pytest.mark.parametrize(("seconds", "most", "message"), [
    (0, None, "seconds: expected a finite number > 0, got 0"),
    (float("inf"), None, "seconds: expected a finite number > 0, got inf"),
    (1.0, 0, "most: expected a positive int, got 0"),
])
def test_train_for_refuses_a_bad_budget_by_name(seconds, most, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        timed_training.train_for(torch.nn.Linear(1, 1), None, timed_training.TrainConfig(),
                                 seconds, most)


def test_targets_pass_and_fail_by_the_ratio(tiny_lm) -> None:
    assert Target("int8", 1.0099, 1.01).passed and not Target("int8", 1.0101, 1.01).passed
    assert not Target("int8", None, 1.01).passed  # not measured is no pass
    found = {t.label: t for t in targets(SimpleNamespace(lm=tiny_lm))}
    rows = {_key(row.variant): row for row in tiny_lm.scores}
    base = rows["float32"].perplexity
    for label in ("int8", "int4 g64"):
        expected = rows[label].perplexity / base if label in rows else None
        assert found[label].ratio == expected
        assert found[f"{label} (bfloat16 activations)"].ratio == (
            rows[f"{label} bfloat16"].perplexity / base)


@pytest.mark.parametrize(("argv", "message"), [
    (["--train-seconds", "0"], "argument --train-seconds: expected a finite number > 0, "
                               "got '0'"),
    (["--train-seconds", "-5"], "argument --train-seconds: expected a finite number > 0"),
    (["--train-seconds", "nan"], "argument --train-seconds: expected a finite number > 0"),
    (["--date-seconds", "inf"], "argument --date-seconds: expected a finite number > 0"),
    (["--group-sizes", "32,0"], "argument --group-sizes: expected positive ints"),
    (["--group-sizes", "a"], "argument --group-sizes: expected comma-separated ints"),
    (["--date-examples", "100000"], "argument --date-examples: expected an int in "
                                    "[1, 10000], got '100000'"),
    (["--steps", "0"], "argument --steps: expected a positive int, got '0'"),
    (["--seed", str(2**64)], "argument --seed: expected an int in [0, 2**63), got "
                             f"'{2**64}'"),
])
def test_bad_flags_are_refused_by_name(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "quantization", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--group-sizes", "32,48"], "--group-sizes: int4 groups run along each layer's input, "
                                 "so every size must divide the hidden size --d-model=128; "
                                 "got 32,48, of which 48 do not"),
    (["--d-model", "64"], "--group-sizes: int4 groups run along each layer's input, so every "
                          "size must divide the hidden size --d-model=64; got 32,64,128, of "
                          "which 128 do not"),
    (["--group-sizes", "64,64"], "--group-sizes: expected a non-empty tuple of positive ints, "
                                 "each once, got (64, 64)"),
    (["--d-model", "96", "--heads", "5", "--group-sizes", "32"],
     "--d-model: expected a multiple of --heads=5, got 96"),
])
def test_options_that_do_not_fit_together_are_refused_before_training(
        argv, message, text_file, tmp_path, capsys) -> None:
    assert main(["bench", "quantization", "--text", str(text_file), *argv,
                 "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "training" not in captured.out
    assert not (tmp_path / "out").exists()


def test_a_missing_text_is_named(tmp_path, monkeypatch, capsys) -> None:
    missing = tmp_path / "nope.txt"
    assert main(["bench", "quantization", "--text", str(missing), "--out",
                 str(tmp_path / "out")]) == 2
    assert f"--text: {str(missing)!r} does not exist; expected a UTF-8 text file" in \
        capsys.readouterr().err
    assert main(["bench", "quantization", "--text", str(tmp_path), "--out",
                 str(tmp_path / "out")]) == 2
    assert f"--text: {str(tmp_path)!r} is not a file" in capsys.readouterr().err
    # Without --text on a machine that lacks the default: what to pass instead.
    monkeypatch.setattr(bench, "DEFAULT_TEXT", missing)
    assert main(["bench", "quantization", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--text: the default {str(missing)!r} is not on this machine" in err
    assert "pass --text FILE" in err


@pytest.mark.parametrize(("content", "message"), [
    (b"\xff\xfe not utf-8", "is not UTF-8"),
    (b"   \n", "is empty"),
    (b"too short", "characters are too few for block_size=64"),
])
def test_a_text_that_cannot_train_is_refused_by_name(content, message, tmp_path,
                                                      capsys) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    assert main(["bench", "quantization", "--text", str(path), "--out",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "text:" in err and message in err


def test_an_out_that_is_a_file_fails_before_training(text_file, tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    assert main(["bench", "quantization", "--text", str(text_file), *TINY, "--out",
                 str(tmp_path / "file")]) == 2
    assert "training" not in capsys.readouterr().out


@pytest.mark.parametrize(("changes", "message"), [
    ({"train_seconds": 0}, "train_seconds: expected a finite number of seconds > 0, got 0"),
    ({"date_seconds": float("nan")}, "date_seconds: expected a finite number of seconds"),
    ({"train_seconds": True}, "train_seconds: expected a finite number of seconds > 0"),
    ({"group_sizes": (32, 48)}, "group_sizes: int4 groups run along each layer's input, so "
                                "every size must divide the hidden size d_model=128"),
    ({"group_sizes": ()}, "group_sizes: expected a non-empty tuple of positive ints, each "
                          "once, got ()"),
    ({"group_sizes": [64]}, "group_sizes: expected a non-empty tuple of positive ints"),
    ({"group_sizes": (64, 64)}, "group_sizes: expected a non-empty tuple of positive ints, "
                                "each once, got (64, 64)"),
    ({"steps": 0}, "steps: expected a positive int, got 0"),
    ({"d_model": 100, "heads": 3, "group_sizes": (4,)}, "d_model: expected a multiple of "
                                                        "heads=3, got 100"),
    ({"date_examples": 10_001}, "date_examples: expected at most 10,000"),
    ({"seed": -1}, "seed: expected an int in [0, 2**63), got -1"),
])
def test_bad_settings_are_refused_by_name(changes, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        AccuracySettings(**changes)


def test_wrong_types_and_variants_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match=re.escape("text: expected a path (str or Path), got int")):
        AccuracySettings(text=3)
    with pytest.raises(TypeError, match=re.escape("seed: expected an int, got 1.5")):
        AccuracySettings(seed=1.5)
    with pytest.raises(ValueError, match=r"weights: expected one of .*got 'int3'"):
        bench.Variant("int3")
    with pytest.raises(ValueError, match="group_size: expected a group size for int4"):
        bench.Variant("int4")
    with pytest.raises(ValueError, match="none for int8, got 64"):
        bench.Variant("int8", 64)
    with pytest.raises(ValueError, match=r"activations: expected one of \('float32',\) for "
                                         "float32 weights, got 'bfloat16'"):
        bench.Variant("float32", activations="bfloat16")
    with pytest.raises(ValueError, match=r"activations: expected one of .* for int8 weights"):
        bench.Variant("int8", activations="float16")
    assert bench.Variant("int4", 64, "bfloat16").decoding
    assert not bench.Variant("int4", 64).decoding and not bench.Variant("bfloat16").decoding


def test_measure_accuracy_names_a_missing_text_and_wrong_settings(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="text: no such file"):
        measure_accuracy(AccuracySettings(text=tmp_path / "nope.txt"))
    with pytest.raises(TypeError, match="settings: expected AccuracySettings, got dict"):
        measure_accuracy({"text": "x"})
