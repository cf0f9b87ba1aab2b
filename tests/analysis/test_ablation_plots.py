"""Head ablation (zero and mean), head_importance, and the PNG pictures."""

from __future__ import annotations

import pytest
import torch

from attnlab.analysis import (
    ablate_heads,
    capture,
    head_importance,
    plot_attention_heads,
    plot_head_similarity,
    plot_masks,
    plot_metric_map,
    plot_single_vs_multi,
    run_with_cache,
)
from attnlab.analysis.ablation import head_means, seq2seq_metrics, token_metrics
from attnlab.analysis.hooks import attention_modules, hook_points
from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.training.tasks.seq2seq import make_seq2seq_task
from conftest import assert_close

PNG = b"\x89PNG\r\n\x1a\n"


def _model():
    torch.manual_seed(0)
    return Transformer(TransformerConfig(src_vocab_size=14, tgt_vocab_size=14, d_model=16,
                                         num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                                         d_ff=32, dropout=0.0)).eval()


def test_zero_and_mean_ablation_edit_one_heads_output():
    model = _model()
    src, tgt = torch.randint(4, 14, (3, 5)), torch.randint(4, 14, (3, 4))
    name = "decoder.layers.0.cross_attn"
    with ablate_heads(model, {name: [1]}):
        _, cache = run_with_cache(model, (src, tgt), f"{name}.z")
    z = cache[f"{name}.z"]
    assert z[:, 1].abs().max() == 0 and z[:, 0].abs().max() > 0
    with ablate_heads(model, {name: [0]}, mode="mean"):
        _, cache = run_with_cache(model, (src, tgt), f"{name}.z")
    z0 = cache[f"{name}.z"][:, 0]
    assert torch.allclose(z0, z0[:1, :1].expand_as(z0))  # one vector everywhere
    means = head_means(model, (src, tgt))
    assert means[name].shape == (2, 8)
    with ablate_heads(model, {name: [0]}, mode="mean", means=means):
        _, cache = run_with_cache(model, (src, tgt), f"{name}.z")
    assert_close(cache[f"{name}.z"][0, 0, 0], means[name][0])
    assert not any(p.has_hooks for p in hook_points(model).values())
    with pytest.raises(ValueError, match="mode: expected one of"):
        ablate_heads(model, {name: [0]}, mode="half").__enter__()
    with pytest.raises(ValueError, match=r"heads: 'decoder.layers.0.cross_attn' has heads"):
        ablate_heads(model, {name: [2]}).__enter__()


def test_head_importance_finds_the_head_that_matters():
    model = _model()
    task = make_seq2seq_task("copy", max_len=5, n_test=8, n_valid=8)
    batch = task.encode(task.test)
    name = "decoder.layers.0.cross_attn"
    with torch.no_grad():  # head 0 of the cross-attention writes nothing: ablating it is free
        attention_modules(model)[name].out_proj.weight[:, :8] = 0
    table = head_importance(model, seq2seq_metrics(model, batch))
    assert table.columns == ["kind", "layer", "head", "loss", "delta_loss", "accuracy",
                             "delta_accuracy"]
    rows = {(r["kind"], r["layer"], r["head"]): r for r in table.to_dicts()}
    assert len(rows) == 3 * 2
    assert rows[("cross", 0, 0)]["delta_loss"] == pytest.approx(0.0, abs=1e-6)
    assert abs(rows[("cross", 0, 1)]["delta_loss"]) > 1e-4
    mean_table = head_importance(model, seq2seq_metrics(model, batch), mode="mean",
                                 modules=[name])
    assert len(mean_table) == 2


def test_pictures_are_pngs(tmp_path):
    model = _model()
    src, tgt = torch.randint(4, 14, (1, 5)), torch.randint(4, 14, (1, 4))
    maps = capture(model, (src, tgt))["cross"]
    w, q, k = maps.example(0)
    paths = [
        plot_attention_heads(w[0], q, k, tmp_path / "grid.png", title="heads"),
        plot_metric_map(torch.rand(3, 8), tmp_path / "map.png", title="entropy"),
        plot_masks(6, 4, tmp_path / "masks.png"),
        plot_single_vs_multi(w[0, 0], w[0], q, k, tmp_path / "single_multi.png"),
        plot_head_similarity(torch.eye(4), tmp_path / "sim.png"),
    ]
    for p in paths:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 1000
    with pytest.raises(ValueError, match=r"valid: expected an int in 0 \.\. 6"):
        plot_masks(6, 7, tmp_path / "x.png")
    with pytest.raises(ValueError, match="multi: expected shape H x"):
        plot_single_vs_multi(w[0, 0], w[0, :, :2], q, k, tmp_path / "x.png")
    with pytest.raises(ValueError, match="values: expected a 2-d tensor"):
        plot_metric_map(torch.rand(3), tmp_path / "x.png")


def test_ablation_and_head_importance_on_a_gqa_decoder_lm():
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama(30, d_model=32, num_layers=2, num_heads=4,
                                            num_kv_heads=2, max_len=16)).eval()
    ids = torch.randint(0, 30, (2, 6))
    name = "layers.1.self_attn"
    with torch.no_grad():  # head 2 of layer 1 writes nothing: ablating it is free
        model.layers[1].self_attn.o_proj.weight[:, 16:24] = 0
    with ablate_heads(model, {name: [0, 3]}):
        _, cache = run_with_cache(model, ids, f"{name}.z")
    z = cache[f"{name}.z"]
    assert z.shape == (2, 4, 6, 8) and z[:, [0, 3]].abs().max() == 0
    assert z[:, [1, 2]].abs().min(-1).values.max() > 0

    def evaluate():
        return token_metrics(model(ids[:, :-1]), ids[:, 1:], ignore_index=None)

    table = head_importance(model, evaluate)
    rows = {(r["kind"], r["layer"], r["head"]): r for r in table.to_dicts()}
    assert sorted(rows) == [("self", layer, h) for layer in (0, 1) for h in range(4)]
    assert rows[("self", 1, 2)]["delta_loss"] == 0.0
    assert all(abs(rows[("self", 1, h)]["delta_loss"]) > 1e-6 for h in (0, 1, 3))
    assert not any(p.has_hooks for p in hook_points(model).values())


def test_ablation_refuses_bad_arguments_by_name():
    model = _model()
    name = "decoder.layers.0.cross_attn"
    with pytest.raises(TypeError, match=r"heads: expected a mapping"):
        ablate_heads(model, [name]).__enter__()
    with pytest.raises(TypeError, match=r"heads\['decoder.layers.0.cross_attn'\]: expected a "
                                        r"list of ints, got True"):
        ablate_heads(model, {name: [True]}).__enter__()
    with pytest.raises(ValueError, match=r"modules: \['nope'\] are not attention modules"):
        head_importance(model, dict, modules=["nope"])
    with pytest.raises(TypeError, match="modules: expected a list of strs, got str"):
        head_importance(model, dict, modules=name)
