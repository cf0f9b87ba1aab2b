"""The main job's code path end to end, at a tiny size: train, evaluate, draw, reuse."""

import json
import re

from attnlab.cli.demo import run_date_demo


def test_date_demo_trains_evaluates_draws_and_reuses(tmp_path, capsys):
    first = run_date_demo(tmp_path, steps=6, batch_size=16, n_test=30, num_beams=2, progress=False)
    assert first["trained_now"] and first["test_examples"] == 30
    assert 0.0 <= first["greedy_exact_match"] <= 1.0
    for name in ("best/model.safetensors", "last/trainer_state.safetensors",
                 "last/trainer_state.json", "metrics.jsonl", "results.json",
                 "cross_attention_0.png"):
        assert (tmp_path / name).is_file(), name
    assert json.loads((tmp_path / "results.json").read_text())["num_beams"] == 2
    out = capsys.readouterr().out
    assert "21 November 2026" in out and str(tmp_path) in out
    # How long the training will take, said before it starts (as attnlab train does).
    assert re.search(r"^about \S+ s/step, ~\S+ s for 6 steps", out, re.M)
    assert out.index(" s/step, ~") < out.index("21 November 2026")
    again = run_date_demo(tmp_path, steps=6, batch_size=16, n_test=30, num_beams=2,
                          progress=False)
    assert not again["trained_now"]
    assert again["greedy_exact_match"] == first["greedy_exact_match"]
    assert "Reusing" in capsys.readouterr().out
