"""The kernel rule: each case of its table; a load never times a kernel; two loads with empty
caches give the same logits and generations, bit for bit; a plan that ``attnlab calibrate``
wrote is used by the next load; and a sequence's logits do not depend on the other sequences
decoded beside it wherever the rule picks batch-invariant kernels."""

from __future__ import annotations

import json
import types

import pytest
import torch
from kernel_helpers import (  # noqa: F401 (an autouse fixture)
    grouped_int8,
    own_cache_fixture,
    thread_count,
)
from torch import nn

from attnlab.cli import main as cli_main
from attnlab.kernels import KERNELS, InferenceLinear, calibration, optimize_for_inference, rule
from attnlab.kernels.cache import _VERSION, entry_key
from attnlab.kernels.calibration import weight_like
from attnlab.kernels.native import build_id
from attnlab.kernels.rule import (
    BATCH_INVARIANT,
    BUCKETS,
    DECODING,
    DECODING_ROWS,
    QUANTIZED_NAMES,
    Features,
    batch_invariant,
    features,
    largest,
)
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.quantization import QUANTIZED_KERNELS, QuantizedLinear
from attnlab.quantization import kernels as quantized_kernels

AMX = Features(native=True, pairs=True, tiles=True, integers=True, bfloat16_gemm=True)
BF16 = Features(native=True, pairs=True, tiles=False, integers=True, bfloat16_gemm=True)
V3 = Features(native=True, pairs=False, tiles=False, integers=False, bfloat16_gemm=False)
BARE = Features(native=False, pairs=False, tiles=False, integers=False, bfloat16_gemm=False)
F32, B16 = torch.float32, torch.bfloat16


def _first(scheme, dtype, cpu, **kwargs):
    """The rule's first choice per bucket."""
    return {b: names[0] for b, names in rule(scheme, dtype, cpu, **kwargs).items()}


@pytest.mark.parametrize(("scheme", "dtype", "cpu", "expected"), [
    # float32: our GEMV for every decoding bucket (one batch-invariant loop), oneDNN's GEMM
    # from 33 rows; BLAS for decoding without the build.
    ("float32", F32, AMX, ("native_gemv", "native_gemv", "native_gemv", "onednn")),
    ("float32", F32, V3, ("native_gemv", "native_gemv", "native_gemv", "onednn")),
    ("float32", F32, BARE, ("formula", "formula", "formula", "onednn")),
    # bfloat16: tiles, else pairs, for every decoding bucket (one batch-invariant loop).
    ("bfloat16", B16, AMX, ("native_tiles", "native_tiles", "native_tiles", "formula")),
    ("bfloat16", B16, BF16, ("native_pairs", "native_pairs", "native_pairs", "formula")),
    ("bfloat16", B16, V3, ("native_gemv", "native_gemv", "widened", "widened")),
    ("bfloat16", B16, BARE, ("formula", "formula", "widened", "widened")),
    # int8 / int4: integer products with VNNI and bfloat16 x, else our GEMVs, else torch's.
    ("int8", B16, BF16, ("int8_integers", "int8_integers", "int8_integers",
                         "native_dequantize")),
    ("int8", B16, V3, ("int8_native", "int8_native", "int8_native", "native_widened")),
    ("int8", F32, BF16, ("int8_native", "int8_native", "int8_native", "native_dequantize")),
    ("int8", B16, BARE, ("int8_mm", "int8_mm", "int8_mm", "dequantize")),
    ("int4", B16, BF16, ("int4_integers", "int4_integers", "int4_integers",
                         "native_dequantize")),
    ("int4", B16, Features(native=True, pairs=True, tiles=False, integers=False,
                           bfloat16_gemm=True),
     ("int4_native_pairs", "int4_native_pairs", "int4_native_pairs", "native_dequantize")),
    ("int4", B16, V3, ("int4_native", "int4_native", "int4_native", "native_widened")),
    ("int4", F32, AMX, ("int4_native", "int4_native", "int4_native", "native_dequantize")),
    ("int4", F32, BARE, ("int4_mm", "int4_mm", "int4_mm", "dequantize")),
])
def test_the_rule_names_each_case_of_its_table(scheme, dtype, cpu, expected):
    assert tuple(_first(scheme, dtype, cpu).values()) == expected
    assert list(rule(scheme, dtype, cpu)) == list(BUCKETS)


def test_the_rule_falls_back_in_order_and_names_only_real_kernels():
    assert rule("int4", B16, BF16)["1"] == ("int4_integers", "int4_native_pairs",
                                            "int4_native", "int4_mm")
    assert rule("int8", B16, BF16)["2-8"] == ("int8_integers", "int8_native", "int8_mm")
    # extra_memory: oneDNN's packed copy first for a server's batch (not batch-invariant).
    assert rule("float32", F32, AMX, extra_memory=True)["9-32"] == ("onednn_packed",
                                                                     "native_gemv")
    assert rule("float32", F32, AMX, extra_memory=True)["33+"] == ("onednn", "formula")
    assert tuple(QUANTIZED_KERNELS) == QUANTIZED_NAMES
    for cpu in (AMX, BF16, V3, BARE):
        for scheme, dtype in (("float32", F32), ("bfloat16", B16), ("int8", B16),
                              ("int8", F32), ("int8 grouped", B16), ("int8 grouped", F32),
                              ("int4", B16), ("int4", F32)):
            for names in rule(scheme, dtype, cpu).values():
                catalog = KERNELS if scheme.startswith(("float", "bfloat")) else QUANTIZED_KERNELS
                assert names and set(names) <= set(catalog)
    assert set(KERNELS) | set(QUANTIZED_KERNELS) >= BATCH_INVARIANT
    with pytest.raises(ValueError, match="scheme: expected 'float32', 'bfloat16', 'int8', "
                                         "'int8 grouped' or 'int4', got 'int2'"):
        rule("int2", B16, BF16)


def test_one_bucket_table_serves_float_and_quantized_kernels():
    assert BUCKETS == {"1": (1, 1), "2-8": (2, 8), "9-32": (9, 16), "33+": (33, 512)}
    assert calibration.BUCKETS is BUCKETS and quantized_kernels.BUCKETS is BUCKETS
    assert [largest(b) for b in BUCKETS] == [1, 8, 32, 512]
    with pytest.raises(ValueError, match="bucket: expected one of 1, 2-8"):
        largest("8")


def test_the_plan_follows_the_rule_on_this_machine():
    cpu = features()
    assert cpu == features()  # asked once: one machine, one answer
    for dtype in (F32, B16):
        layout, picks = calibration.plan(dtype, 64, 32)
        ruled = rule(str(dtype)[6:], dtype, cpu)
        assert layout == "rows"
        for bucket, pick in picks.items():
            like = weight_like(dtype, 64, 32)
            runs = [n for n in ruled[bucket] if KERNELS[n].available(like, dtype, largest(bucket))]
            assert pick == (runs[0] if runs else "formula")
    assert calibration.plan(torch.float64, 64, 32) == ("rows", dict.fromkeys(BUCKETS, "formula"))


@pytest.mark.parametrize("plan, invariant", [
    ({"1": "native_pairs", "2-8": "native_pairs", "9-32": "native_pairs", "33+": "formula"},
     True),
    ({"1": "native_gemv", "2-8": "native_gemv", "9-32": "native_gemv", "33+": "formula"},
     True),
    ({"1": "native_gemv", "2-8": "native_gemv", "9-32": "formula", "33+": "formula"}, False),
    ({"1": "int4_integers", "2-8": "int4_native", "9-32": "int4_native", "33+": "x"}, False),
])
def test_batch_invariance_needs_one_invariant_kernel_for_every_decoding_bucket(plan,
                                                                               invariant):
    assert batch_invariant(plan) is invariant
    assert DECODING == ("1", "2-8", "9-32")


def _invariant_cases() -> list[tuple[str, torch.dtype]]:
    """(kernel, activations' dtype) for each kernel of ``BATCH_INVARIANT`` that runs here
    (float32 only for ``native_gemv``: the AVX2 build's bfloat16 loop is not invariant)."""
    cases = []
    for name in sorted(BATCH_INVARIANT):
        for dtype in ((F32,) if name == "native_gemv" else (F32, B16)):
            if name in KERNELS:
                runs = KERNELS[name].available(weight_like(dtype, 40, 8), dtype, DECODING_ROWS)
            else:
                weight = _quantized(name, torch.zeros(_shape(name)))
                runs = QUANTIZED_KERNELS[name].takes(weight, dtype)
            if runs:
                cases.append((name, dtype))
    return cases


def _shape(name: str) -> tuple[int, int]:
    """The weight's shape for kernel ``name`` in the test below."""
    if name == "int8_grouped":
        return (40, 160)
    return (128, 192) if name.startswith("int4") else (40, 136)


def _wide_shape(name: str) -> tuple[int, int]:
    """A weight's shape for kernel ``name`` wide enough to be read in several chunks."""
    if name == "int8_grouped":
        return (40, 8224)
    return (192, 8192) if name.startswith("int4") else (40, 8200)


def _prepared(name: str, w: torch.Tensor, dtype: torch.dtype):
    """``(stored, run)``: ``w`` as kernel ``name`` stores it for ``dtype`` activations, and
    the kernel's ``run``."""
    if name in KERNELS:
        kernel = KERNELS[name]
        return kernel.prepare(w.to(dtype), dtype), kernel.run
    kernel = QUANTIZED_KERNELS[name]
    return kernel.prepare(_quantized(name, w), dtype), kernel.run


def _quantized(name: str, w: torch.Tensor):
    """``w`` quantized as quantized kernel ``name`` reads it (int8 per row, int4 in groups of
    64, grouped int8 as GGUF's Q5_1 in groups of 32), in the layout it needs."""
    if name == "int8_grouped":
        return grouped_int8(w, 32, offsets=True)
    bits = 8 if name.startswith("int8") else 4
    weight = quantized_kernels.quantize(w, bits, 64 if bits == 4 else None)
    layout = QUANTIZED_KERNELS[name].layout
    return weight if layout is None else weight.with_layout(layout)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("name", "dtype"), _invariant_cases())
def test_an_invariant_kernel_gives_a_row_the_same_sums_beside_any_rows(name, dtype, threads):
    """Row 0 of ``x W^T + b`` bit for bit the same with 1 to 32 rows beside it, on 1 and 2
    threads, for a shape with the remainder paths (136 inputs: 4 blocks of 32 and 8 more;
    40 outputs, not a multiple of the row groups; int4 128 x 192, 3 groups of 64, in the
    blocks of 64 rows of PyTorch's layout; grouped int8 40 x 160, 5 groups of 32: an odd
    count)."""
    torch.manual_seed(0)
    outputs, inputs = _shape(name)
    w, b = torch.randn(outputs, inputs), torch.randn(outputs)
    x = torch.randn(DECODING_ROWS, inputs).to(dtype)
    stored, run = _prepared(name, w, dtype)
    with thread_count(threads):
        alone = run(x[:1].contiguous(), stored, b.to(dtype))
        for rows in range(2, DECODING_ROWS + 1):
            beside = run(x[:rows].contiguous(), stored, b.to(dtype))
            assert torch.equal(beside[0], alone[0]), f"{name} with {rows} rows"


@pytest.mark.parametrize(("name", "dtype"), _invariant_cases())
def test_a_wide_weight_read_in_chunks_gives_every_row_the_sums_of_one_row(name, dtype):
    """More than one block of rows of x goes through a weight's rows in chunks of about
    256 KiB (each read from memory once): with 8,200 inputs a chunk is 12 rows of the 40
    (bfloat16 pairs: 14, two rows of W at a time; grouped int8: 8,224 inputs in groups of 32,
    chunks of 31 rows; int4: 192 x 8,192, chunks of 64 rows), so every row of a 9- to 32-row
    product must still equal that row alone, bit for bit."""
    torch.manual_seed(0)
    outputs, inputs = _wide_shape(name)
    w, b = torch.randn(outputs, inputs), torch.randn(outputs)
    x = torch.randn(DECODING_ROWS, inputs).to(dtype)
    stored, run = _prepared(name, w, dtype)
    alone = torch.cat([run(x[m:m + 1].contiguous(), stored, b.to(dtype)) for m in range(32)])
    for rows in (9, 16, 32):
        assert torch.equal(run(x[:rows].contiguous(), stored, b.to(dtype)), alone[:rows]), rows


def _model(seed: int = 0) -> DecoderLM:
    """A tiny random Llama-like decoder (RMSNorm, SwiGLU, RoPE, grouped-query attention)."""
    torch.manual_seed(seed)
    config = DecoderLMConfig.llama(96, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                   d_ff=128, max_len=64)
    return DecoderLM(config).eval()


def _loaded(folder, scheme: str) -> DecoderLM:
    """``from_pretrained`` as a user calls it: ``scheme`` a float dtype or int8/int4 of
    bfloat16."""
    if scheme in ("float32", "bfloat16"):
        return DecoderLM.from_pretrained(folder, dtype=scheme)
    return DecoderLM.from_pretrained(folder, dtype="bfloat16", quantize=scheme,
                                     group_size=64 if scheme == "int4" else None)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    _model().save_pretrained(path)
    return path


def _no_timer():
    def timer():
        raise AssertionError("a kernel was timed")
    return types.SimpleNamespace(perf_counter=timer)


SCHEMES = ["float32", "bfloat16", "int8", "int4"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_load_times_no_kernel(folder, scheme, monkeypatch, own_cache):
    """With the timer made to raise (and the measuring functions too), a model loads, runs
    and generates; nothing is written to the kernel cache."""
    monkeypatch.setattr(calibration, "time", _no_timer())  # both kinds' only timer
    monkeypatch.setattr(calibration, "measure_rows", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr(quantized_kernels, "_time_kernels",
                        lambda *a, **k: pytest.fail("measured"))
    model = _loaded(folder, scheme)
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert model(ids).shape == (2, 5, 96)
        assert model.generate(ids, max_new_tokens=3).shape == (2, 8)
    assert not own_cache.exists()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_two_loads_with_empty_caches_give_bit_identical_logits_and_generations(
        folder, scheme, tmp_path, monkeypatch):
    """Each load in its own empty cache folder, as two processes on one machine: the same
    kernels, so the same sums in the same order."""
    ids = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(1))
    results = []
    for turn in range(2):
        monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / f"load{turn}"))
        monkeypatch.setattr(calibration, "_TIMINGS", {})
        model = _loaded(folder, scheme)
        with torch.inference_mode():
            results.append((model(ids), model(ids[:, :1]), model.generate(ids, 12)))
    for first, second in zip(*results):
        assert torch.equal(first, second)


def _planted(path, scheme: str, timings: dict[str, dict[str, float]], shapes) -> None:
    """Write a measured plan into the cache file for ``shapes`` ((O, I, bias) each)."""
    entries = {}
    for out_features, in_features, bias in shapes:
        for bucket in BUCKETS:
            key = entry_key(F32, out_features, in_features, bucket, bias=bias, build=build_id())
            entries[f"{scheme} | {key}" if scheme else key] = timings[bucket]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": _VERSION, "entries": entries}))


def test_a_written_plan_is_used_by_the_next_load(own_cache, monkeypatch):
    """A plan in the cache for the exact key decides, read without timing; another shape
    (or another bias) has none and runs the rule."""
    monkeypatch.setattr(calibration, "measure_rows", lambda *a, **k: pytest.fail("measured"))
    timings = {key: {"formula": 100.0, "onednn": 10.0, "columns": 50.0} for key in BUCKETS}
    _planted(own_cache, "", timings, [(24, 16, True)])
    planned = InferenceLinear.from_linear(nn.Linear(16, 24))
    assert {b: k.name for b, k in planned._kernels[F32, torch.get_num_threads()].items()} == \
        dict.fromkeys(BUCKETS, "onednn")
    ruled = InferenceLinear.from_linear(nn.Linear(16, 24, bias=False))
    assert {b: k.name for b, k in ruled._kernels[F32, torch.get_num_threads()].items()} == \
        calibration.rule_plan(F32, 24, 16)[1]


def test_a_written_quantized_plan_is_used_by_the_next_load(own_cache, monkeypatch):
    monkeypatch.setattr(quantized_kernels, "_time_kernels", lambda *a, **k: pytest.fail("timed"))
    timings = {key: {"dequantize": 100.0, "int8_mm": 10.0} for key in BUCKETS}
    _planted(own_cache, "int8", timings, [(128, 64, True)])
    linear = nn.Linear(64, 128)
    module = QuantizedLinear.from_linear(linear, bits=8)
    assert {b: k.name for b, k in module.plan(F32).items()} == dict.fromkeys(BUCKETS, "int8_mm")
    other = QuantizedLinear.from_linear(nn.Linear(64, 128, bias=False), bits=8)
    assert {b: k.name for b, k in other.plan(F32).items()} == quantized_kernels.rule_plan(
        other.weight_format, F32)


def test_attnlab_calibrate_writes_the_plan_that_the_next_load_uses(folder, own_cache,
                                                                  monkeypatch, capsys):
    """``attnlab calibrate FOLDER`` times every kernel for the model's shapes (a few copies
    here, to be quick) and writes them into the cache; the next load reads them back."""
    monkeypatch.setattr(calibration, "cold_copies", lambda bytes_each: 2)
    monkeypatch.setattr(quantized_kernels, "cold_copies", lambda bytes_each: 2)
    assert cli_main(["calibrate", str(folder), "--dtype", "bfloat16", "--quantize", "int8"]) == 0
    out = capsys.readouterr()
    assert "timing every kernel" in out.err and str(own_cache) in out.out
    entries = json.loads(own_cache.read_text())["entries"]
    assert entries and all(key.startswith("int8 | ") for key in entries)
    monkeypatch.setattr(calibration, "_TIMINGS", {})  # a new process: only the file is left
    monkeypatch.setattr(quantized_kernels, "_time_kernels", lambda *a, **k: pytest.fail("timed"))
    model = _loaded(folder, "int8")
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            weight = module.weight_format
            timings = {b: quantized_kernels.cached(weight, B16, b, list(QUANTIZED_KERNELS),
                                                   bias=module.bias is not None)
                       for b in BUCKETS}
            assert all(timings.values())  # a measured plan for every bucket of every weight
            picks = {b: k.name for b, k in module.plan(B16).items()}
            assert picks == quantized_kernels.plan(weight, B16, bias=module.bias is not None)


def _decode(model: DecoderLM, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The last-position logits of a greedy decode: the prompt's, then each new token's
    (``steps`` of them), a ``B x V`` tensor each."""
    cache = model.make_cache(ids.shape[0], 64)
    logits = [model(ids, cache=cache)[:, -1]]
    for _ in range(steps):
        logits.append(model(logits[-1].argmax(-1, keepdim=True), cache=cache)[:, -1])
    return logits


@pytest.mark.parametrize("scheme", [*SCHEMES, "int4 float32"])
def test_a_sequence_decodes_alike_alone_and_in_a_batch(scheme):
    """Prompts of 4 tokens: alone the prefill is 4 rows and each step 1; beside 5 others,
    24 rows and 6, every count within the decoding buckets. Where the rule picks a
    batch-invariant kernel for every weight, sequence 0's logits are the same bit for bit."""
    model = _model(1)
    bits, _, dtype = scheme.partition(" ")
    dtype = getattr(torch, dtype) if dtype else B16 if bits.startswith("int") else \
        getattr(torch, bits)
    model = model.to(dtype)
    if bits.startswith("int"):
        model.quantize(bits, 64 if bits == "int4" else None)
    else:
        optimize_for_inference(model)
    plans = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            plans[name] = {b: k.name for b, k in module.plan(dtype).items()}
        elif isinstance(module, InferenceLinear):
            plans[name] = {b: k.name for b, k in module._choose().items()}
    assert plans
    variant = sorted({p[b] for p in plans.values() if not batch_invariant(p) for b in DECODING})
    if variant:
        pytest.skip(f"the rule picks {', '.join(variant)} for decoding on this machine, not "
                    "batch-invariant (see attnlab.kernels.rule.BATCH_INVARIANT)")
    ids = torch.randint(0, 96, (6, 4), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        alone = _decode(model, ids[:1], 6)
        batch = _decode(model, ids, 6)
    for step, (one, many) in enumerate(zip(alone, batch)):
        assert torch.equal(one[0], many[0]), f"step {step}: the batch changed sequence 0"
