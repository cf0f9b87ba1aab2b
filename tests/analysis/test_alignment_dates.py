"""Cross-attention alignment: the logic on a tiny model trained for ~3 s on the reverse task
(output position t must look at input position n - 1 - t), and the date report's plumbing."""

from __future__ import annotations

import pytest
import torch

from attnlab.analysis.alignment import cross_alignment
from attnlab.analysis.dates import date_alignment_report, year_targets
from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.training.checkpoint import save_checkpoint
from attnlab.training.tasks.seq2seq import make_seq2seq_task


def _reverse_targets(src: str, tgt: str) -> dict[int, list[int]]:
    return {t: [len(src) - 1 - t] for t in range(len(tgt))}


def _model(task, heads=2):
    return Transformer(TransformerConfig(
        src_vocab_size=len(task.src_vocab), tgt_vocab_size=len(task.tgt_vocab), d_model=32,
        num_heads=heads, num_encoder_layers=1, num_decoder_layers=1, d_ff=64, dropout=0.0,
        norm_first=True, max_len=32))


def test_reverse_model_aligns_where_it_should(one_thread):
    torch.manual_seed(0)
    task = make_seq2seq_task("reverse", max_len=6, n_test=128, n_valid=8)
    pairs = [p for p in task.test if len(p[0]) >= 4][:32]  # long enough to tell places apart
    model = _model(task)
    before = cross_alignment(model.eval(), task, pairs, _reverse_targets)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(300):
        batch = task.batch(step, 0, 64)
        loss = task.loss(model, batch) / task.count(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = cross_alignment(model.eval(), task, pairs, _reverse_targets)
    assert after.examples == 32 and after.skipped == 0
    assert after.baseline == pytest.approx(before.baseline) and 0.15 < after.baseline < 0.25
    assert before.mass.max() < 2 * before.baseline  # untrained: about uniform
    assert after.mean_head_mass[0] > 0.5 > 2 * after.baseline  # trained: on the right place
    assert after.hits.max() > 0.8
    table = after.table()
    assert len(table) == 2 and table.columns == ["layer", "head", "mass", "hit_rate",
                                                 "baseline"]
    # The copy alignment is wrong for a reverse model: far less mass there.
    copy = cross_alignment(model, task, pairs,
                           lambda s, t: {i: [i] for i in range(len(t))})
    assert copy.mean_head_mass[0] < after.mean_head_mass[0] / 2


def test_year_targets():
    assert year_targets("21 November 2026", "2026-11-21") == {0: [12], 1: [13], 2: [14], 3: [15]}
    assert year_targets("2026年11月21日", "2026-11-21") == {0: [0], 1: [1], 2: [2], 3: [3]}
    assert year_targets("11/21/26", "2026-11-21") == {2: [6], 3: [7]}
    assert year_targets("11/11/11", "2011-11-11") is None  # ambiguous
    assert year_targets("the 3rd of march", "1901-03-03") is None  # absent


def test_date_report_from_a_checkpoint(tmp_path):
    task = make_seq2seq_task("dates", n_valid=1, n_test=40)
    torch.manual_seed(0)
    model = _model(task, heads=4)
    ckpt = save_checkpoint(tmp_path / "dates", model, model_type="transformer",
                           model_config=model.config.to_dict(),
                           extra={"task": "dates", "seed": 0, "src_chars": task.src_vocab.chars,
                                  "tgt_chars": task.tgt_vocab.chars})
    report = date_alignment_report(ckpt, n=40, out_dir=tmp_path / "out")
    r = report.result
    assert r.examples + r.skipped == 40 and r.examples > 30
    assert r.mass.shape == (1, 4) and r.similarity.shape == (1, 4, 4)
    assert [p.name for p in report.pictures] == ["head_similarity_layer0.png", "year_mass.png",
                                                 "cross_attention_heads.png"]
    assert all(p.stat().st_size > 1000 for p in report.pictures)
    assert "decoder layer 0" in report.summary()
    with pytest.raises(ValueError, match="checkpoint: expected a date-task Transformer"):
        other = save_checkpoint(tmp_path / "copy", model, model_type="transformer",
                                model_config=model.config.to_dict(), extra={"task": "copy"})
        date_alignment_report(other)
