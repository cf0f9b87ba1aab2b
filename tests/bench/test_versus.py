"""The measuring side of the ours-vs-transformers benches (``attnlab.bench.versus``): the
rates are the formulas of its docstring, the bound counts each weight a step reads once, the
batched prompts are left-padded, and one model's out-of-memory leaves the other's figure."""

from __future__ import annotations

import pytest
import torch

from attnlab.bench import versus
from attnlab.bench.harness import BandwidthProbe
from attnlab.bench.versus import MEASURES, Workload, compare, weight_bytes
from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.io import from_pretrained


def tiny(tie: bool) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig.llama(64, d_model=16, num_layers=1, num_heads=2,
                                           tie_embeddings=tie, max_len=64)).eval()


@pytest.mark.parametrize("tie", [True, False])
def test_weight_bytes_count_what_a_decode_step_reads(tie: bool) -> None:
    model = tiny(tie)
    every = {p.data_ptr(): p.numel() * 4 for p in model.parameters()}
    table = model.embed_tokens.weight.numel() * 4
    # Untied, the token table is read one row a step; tied, the head reads it in full.
    assert weight_bytes(model) == sum(every.values()) - (0 if tie else table)
    assert weight_bytes(model.to(torch.bfloat16)) == weight_bytes(model.float()) // 2


def test_weight_bytes_agree_with_transformers(tmp_path) -> None:
    pytest.importorskip("transformers")
    versus.random_checkpoint(tmp_path, "qwen2", {
        "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": False})
    reference, note = versus.load_reference(tmp_path, torch.float32, torch.device("cpu"))
    assert note.startswith("transformers") and reference is not None
    assert weight_bytes(from_pretrained(tmp_path)) == weight_bytes(reference) > 0


def test_rates_are_tokens_over_median_seconds(monkeypatch) -> None:
    """Prefill: real prompt tokens / s; decode: rows x (N - 1) / (t(N) - t(1))."""
    seconds = {"ours": 0.5, "ours N": 2.0, "ours 1": 0.4}
    calls = []

    def time_medians(fns, **kwargs):
        calls.append(sorted(fns))
        return {name: seconds[name] for name in fns}

    monkeypatch.setattr(versus, "time_medians", time_medians)
    work = Workload(prefill=12, prompt=8, new_tokens=5, batch=3, repeats=1)
    cells = compare(tiny(True), None, work, torch.device("cpu"))
    assert list(cells) == list(MEASURES)
    assert work.lengths() == [8, 7, 6]
    assert cells["prefill"]["ours"] == pytest.approx(12 / 0.5)
    assert cells["prefill batched"]["ours"] == pytest.approx((8 + 7 + 6) / 0.5)
    assert cells["decode"]["ours"] == pytest.approx(1 * 4 / 1.6)
    assert cells["decode batched"]["ours"] == pytest.approx(3 * 4 / 1.6)
    assert all(c["transformers"] is None for c in cells.values())
    assert calls == [["ours"], ["ours"], ["ours 1", "ours N"], ["ours 1", "ours N"]]


def test_the_bandwidth_is_timed_in_turns_with_each_decode_measure(monkeypatch) -> None:
    seconds = {"ours": 0.5, "ours N": 2.0, "ours 1": 0.4, "bandwidth": 0.001}
    calls = []

    def time_medians(fns, **kwargs):
        calls.append(sorted(fns))
        return {name: seconds[name] for name in fns}

    monkeypatch.setattr(versus, "time_medians", time_medians)
    probe = BandwidthProbe(2**20)  # 4 MiB read in 1 ms: 4.19 GB/s
    work = Workload(prefill=12, prompt=8, new_tokens=5, batch=3, repeats=1)
    cells = compare(tiny(True), None, work, torch.device("cpu"), bandwidth=probe)
    assert calls == [["ours"], ["ours"], ["bandwidth", "ours 1", "ours N"],
                     ["bandwidth", "ours 1", "ours N"]]
    assert cells["decode"]["bandwidth_gbs"] == pytest.approx(2**22 / 0.001 / 1e9)
    assert "bandwidth_gbs" not in cells["prefill"]
    versus._bound(cells, 2**20)  # rows x bandwidth / weight bytes
    assert cells["decode batched"]["bound"] == pytest.approx(3 * 4 / 0.001)
    assert "bound" not in cells["prefill"]
    assert versus.bandwidth_range(list(cells.values())) == "4.2-4.2 GB/s"


def test_batched_prompts_are_left_padded(monkeypatch) -> None:
    seen = []
    real = versus._ours_runner

    def runner(model, ids, mask):
        seen.append(mask.clone())
        return real(model, ids, mask)

    monkeypatch.setattr(versus, "_ours_runner", runner)
    monkeypatch.setattr(versus, "time_medians", lambda fns, **kw: dict.fromkeys(fns, 1.0))
    compare(tiny(True), None, Workload(prefill=4, prompt=6, new_tokens=2, batch=3, repeats=1),
            torch.device("cpu"))
    batched = seen[1]
    assert batched.tolist() == [[1] * 6, [0] + [1] * 5, [0, 0] + [1] * 4]


def test_one_models_out_of_memory_leaves_the_others_figure() -> None:
    def oom():
        raise torch.OutOfMemoryError("out of memory")

    got = versus._timed({"a": oom, "b": lambda: None}, 1, torch.device("cpu"))
    assert got["a"] == (None, "OOM") and got["b"][0] > 0 and got["b"][1] is None
    with pytest.raises(RuntimeError, match="inconsistent tensor size"):  # not an OOM
        versus._timed({"a": lambda: torch.ones(2) @ torch.ones(3)}, 1, torch.device("cpu"))


def test_workload_refuses_one_new_token() -> None:
    with pytest.raises(ValueError, match="--new-tokens: expected >= 2"):
        Workload(prefill=4, prompt=4, new_tokens=1, batch=1, repeats=1)


def test_reference_that_cannot_load_is_skipped_saying_why(tmp_path) -> None:
    pytest.importorskip("transformers")
    model, note = versus.load_reference(tmp_path, torch.float32, torch.device("cpu"))
    assert model is None and note.startswith("transformers could not load it on cpu:")
