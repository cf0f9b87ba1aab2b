"""Checkpoint files a user may receive from elsewhere: nothing is unpickled, a damaged or
hostile file gives a ValueError naming it (never code execution, never a traceback from
deep inside), and a crash at any moment of a save leaves a complete checkpoint."""

import json
import math
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from attnlab.cli import main
from attnlab.durable import existing_folder, new_folder, swap_in, write_text_atomic
from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.training.checkpoint import (
    checkpoint_folder,
    load_config,
    load_model,
    load_trainer_state,
    save_checkpoint,
)
from attnlab.training.tasks.seq2seq import make_seq2seq_task
from attnlab.training.tasks.text import CharLMTask
from attnlab.training.trainer import TrainConfig, Trainer

TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--no-progress"]


TEXT = "the quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished two-step CLI run; tests copy it before changing it."""
    text = tmp_path_factory.mktemp("text") / "corpus.txt"
    text.write_text(TEXT)
    out = tmp_path_factory.mktemp("run") / "run"
    args = ["train", "lm", "--text", str(text), "--block-size", "16", "--steps", "2",
            "--batch-size", "8", "--eval-every", "1000", *TINY, "--out", str(out)]
    assert main(args) == 0
    return out, args


@pytest.fixture
def copy(run, tmp_path):
    out, args = run
    mine = tmp_path / "run"
    shutil.copytree(out, mine)
    return mine, [*args[:-1], str(mine)]


class RunsCode:
    """Unpickling this runs a shell command (what a crafted trainer_state.pt does)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickled_trainer_state_never_runs_and_is_refused(copy, tmp_path, capsys):
    out, args = copy
    marker = tmp_path / "code-ran"
    for name in ("trainer_state.safetensors", "trainer_state.json"):
        (out / "last" / name).unlink()
    torch.save({"step": 1, "payload": RunsCode(marker)}, out / "last" / "trainer_state.pt")
    assert main([*args, "--steps", "4", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "trainer_state.pt" in err and "pickle" in err and "cannot be resumed" in err
    assert not marker.exists()
    load_model(out / "last")  # its weights still load


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.pop("step"), r"lacks \['step'\]"),
        (lambda s: s.update(step="7"), r"'step' is '7'; expected a non-negative int"),
        (lambda s: s.update(step=-1), r"'step' is -1"),
        (lambda s: s.update(step=True), r"'step' is True"),
        (lambda s: s.update(best="high"), r"'best' is 'high'; expected a finite number or null"),
        (lambda s: s.update(bad_evals=1.5), r"'bad_evals' is 1.5"),
        (lambda s: s.update(train_config=None), r"'train_config' is None; expected an object"),
        (lambda s: s.update(python_rng=[3, [1, 2], None]), r"'python_rng' is .* random"),
        (lambda s: s.update(format="other"), r"not an attnlab trainer state"),
    ],
)
def test_ill_formed_trainer_state_json_is_refused_by_name(copy, change, message):
    out, _ = copy
    path = out / "last" / "trainer_state.json"
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"trainer_state\.json.*" + message):
        load_trainer_state(out / "last")


def test_corrupt_files_are_named(copy, capsys):
    out, args = copy
    state = out / "last" / "trainer_state.safetensors"
    good = state.read_bytes()
    state.write_bytes((10**6).to_bytes(8, "little") + b"{}")  # "invalid header length"
    with pytest.raises(ValueError, match=r"trainer_state\.safetensors.*truncated or corrupt"):
        load_trainer_state(out / "last")
    assert main([*args, "--resume"]) == 2
    assert "trainer_state.safetensors" in capsys.readouterr().err
    state.write_bytes(good)
    (out / "last" / "trainer_state.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"trainer_state\.json.*not valid JSON"):
        load_trainer_state(out / "last")
    weights = out / "last" / "model.safetensors"
    weights.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated or corrupt"):
        load_model(out / "last")


@pytest.mark.parametrize("key", ["extra", "model", "model_type"])
def test_null_config_entries_are_refused_by_name(copy, capsys, key):
    out, _ = copy
    path = out / "last" / "config.json"
    config = json.loads(path.read_text())
    config[key] = None
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config\.json.*'{key}' is None; expected"):
        load_config(out / "last")
    assert main(["sample", "--checkpoint", str(out / "last")]) == 2
    assert f"'{key}' is None" in capsys.readouterr().err


def test_optimizer_tensors_that_do_not_fit_are_refused(copy):
    out, _ = copy
    path = out / "last" / "trainer_state.safetensors"
    tensors = load_file(path)
    name = next(n for n in tensors if n.endswith(".exp_avg"))
    for change, message in [
        ({name: torch.zeros(3, 3)}, r"exp_avg is a torch.float32 tensor of shape \(3, 3\)"),
        ({"optimizer.999.exp_avg": torch.zeros(1)}, "the model has only"),
        ({"surprise": torch.zeros(1)}, "unexpected tensor 'surprise'"),
        ({"rng.torch.0": torch.zeros(3, dtype=torch.uint8)}, "'rng.torch.0' is not an RNG"),
    ]:
        save_file({**tensors, **change}, path)
        with pytest.raises(ValueError, match=message):
            trainer_for(out).resume()
    save_file({k: v for k, v in tensors.items() if k != "rng.torch.0"}, path)
    with pytest.raises(ValueError, match="RNG states"):
        trainer_for(out).resume()


@pytest.mark.parametrize(("name", "value", "message"), [
    ("step", torch.tensor(-3.0), r"step is -3.0; expected a whole number from 0 to the run's "
                                 r"step 2"),
    ("step", torch.tensor(2.5), "step is 2.5"),
    ("step", torch.tensor(9.0), "step is 9.0"),
    ("exp_avg", None, r"exp_avg holds \[nan"),
    ("exp_avg_sq", None, r"exp_avg_sq holds \[-1.0.*expected finite values >= 0"),
])
def test_optimizer_values_adamw_cannot_have_are_refused_naming_the_file(copy, capsys, name,
                                                                         value, message):
    out, args = copy
    path = out / "last" / "trainer_state.safetensors"
    tensors = load_file(path)
    key = f"optimizer.0.{name}"
    if value is None:  # a moment tensor with one bad entry
        value = tensors[key].clone()
        value.view(-1)[0] = math.nan if name == "exp_avg" else -1.0
    save_file({**tensors, key: value}, path)
    with pytest.raises(ValueError, match=rf"trainer_state\.safetensors'?: optimizer state of "
                                         rf"parameter 0: {message}"):
        trainer_for(out).resume()
    # the command line says the same in one line, before any step (a negative step ended in
    # "ComplexFloat can't be cast" deep inside AdamW)
    assert main([*args, "--resume", "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "trainer_state.safetensors" in err and "Traceback" not in err


@pytest.mark.parametrize("key", ["best", "loss"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_best_or_loss_is_refused_naming_the_file(copy, key, value):
    out, _ = copy
    path = out / "last" / "trainer_state.json"
    state = json.loads(path.read_text())
    state[key] = value
    path.write_text(json.dumps(state))  # NaN / Infinity: what Python's json writes
    with pytest.raises(ValueError, match=rf"trainer_state\.json'?: '{key}' is .*; expected a "
                                         "finite number or null"):
        trainer_for(out).resume()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=4),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(key=st.sampled_from(["step", "best", "bad_evals", "loss", "train_config",
                            "python_rng", "format"]), value=json_values)
def test_any_hostile_trainer_state_value_resumes_or_gives_a_value_error(run, tmp_path_factory,
                                                                          key, value):
    out = tmp_path_factory.mktemp("hostile") / "run"
    shutil.copytree(run[0], out)
    path = out / "last" / "trainer_state.json"
    state = json.loads(path.read_text())
    state[key] = value
    path.write_text(json.dumps(state))
    trainer = trainer_for(out)
    try:
        trainer.resume()
    except ValueError as error:
        assert "trainer_state" in str(error) or "resume" in str(error)
    else:
        assert trainer.step == state["step"]


def trainer_for(out):
    """A Trainer of the run saved by the ``run`` fixture, reading ``out``."""
    task = CharLMTask(TEXT, block_size=16)
    cfg = DecoderLMConfig.gpt(len(task.vocab), d_model=16, num_layers=1, num_heads=2,
                              dropout=0.1, max_len=256)
    config = TrainConfig(steps=2, batch_size=8, eval_every=1000, checkpoint_every=1000)
    info = {"model_type": "decoder_lm", "model_config": cfg.to_dict()}
    return Trainer(DecoderLM(cfg), task, config, out_dir=out, save_info=info, d_model=16,
                   progress=False)


def test_swap_keeps_a_complete_copy_at_every_moment(tmp_path):
    target = tmp_path / "last"
    for version in ("one", "two"):
        new = new_folder(target)
        (new / "v").write_text(version)
        swap_in(new, target)
    assert (target / "v").read_text() == "two"
    # A crash between the two renames: only the previous version exists, hidden; loading
    # finds it, and the next save completes the swap and clears it.
    os.replace(target, tmp_path / ".last.old")
    assert existing_folder(target) == tmp_path / ".last.old"
    assert checkpoint_folder(target) == tmp_path / ".last.old"
    # A crash in the middle of a write leaves a temporary folder, removed by the next save.
    (tmp_path / ".last.tmp-killed").mkdir()
    new = new_folder(target)
    (new / "v").write_text("three")
    swap_in(new, target)
    assert (target / "v").read_text() == "three"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
    # A crash while the previous version was being removed: ``last`` is complete and wins.
    (tmp_path / ".last.old").mkdir()
    (tmp_path / ".last.old" / "v").write_text("tw")
    assert existing_folder(target) == target
    new = new_folder(target)
    (new / "v").write_text("four")
    swap_in(new, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]


def test_checkpoint_api_reads_the_kept_copy_after_a_crash(tmp_path):
    task = make_seq2seq_task("reverse", max_len=4)
    model = Transformer(TransformerConfig(len(task.src_vocab), len(task.tgt_vocab), d_model=16,
                                          num_heads=2, num_encoder_layers=1,
                                          num_decoder_layers=1, d_ff=32, max_len=32))
    save_checkpoint(tmp_path / "last", model, model_type="transformer",
                    model_config=model.config.to_dict())
    os.replace(tmp_path / "last", tmp_path / ".last.old")
    loaded, config = load_model(tmp_path / "last")
    assert config["model_type"] == "transformer"
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_model(tmp_path / "nothing")


def test_write_text_atomic_replaces_whole_and_clears_leftovers(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    (tmp_path / ".metrics.jsonl.tmp-999").write_text("killed writer")
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_huge_or_wrong_model_config_is_refused_before_allocating(copy):
    out, _ = copy
    path = out / "last" / "config.json"
    config = json.loads(path.read_text())
    good = dict(config["model"])
    for change, message in [
        ({"d_model": 2**20, "d_ff": 2**22}, r"config does not match the weights.*in the file"),
        ({"num_layers": 2}, r"layers\.1\..*: not in the file"),
        ({"num_layers": -1}, "bad model config"),
    ]:
        config["model"] = {**good, **change}
        path.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            load_model(out / "last")


def test_leftovers_are_matched_by_the_exact_name(tmp_path):
    target = tmp_path / "ck[1]"
    (tmp_path / ".ck[1].tmp-killed").mkdir()
    (tmp_path / ".ck1.tmp-someone-elses").mkdir()  # "[1]" is no pattern here
    new = new_folder(target)
    swap_in(new, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ck1.tmp-someone-elses", "ck[1]"]
