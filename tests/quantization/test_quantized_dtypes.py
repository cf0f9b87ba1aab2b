"""A quantized checkpoint's stored dtypes are checked against the format before anything is
read: codes in exactly their dtype (int8 for int8, uint8 for int4's packed pairs; a cast
would change them: 3.5 becomes 3, 300 wraps), scales and zeros in a float dtype, and a NaN
scale or zero refused as it is read. Each error names the file, the tensor, what was expected
and what was found."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab.models import DecoderLM, DecoderLMConfig, from_pretrained

CONFIG = DecoderLMConfig.llama(vocab_size=64, d_model=64, d_ff=128, num_layers=1, num_heads=4,
                               max_len=32)
Q = "layers.0.self_attn.q_proj"


@pytest.fixture(scope="module", params=["int8", "int4", "int4 coded"])
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    method, _, coded = request.param.partition(" ")
    folder = tmp_path_factory.mktemp(method) / "q"
    model = DecoderLM(CONFIG).eval()
    if method == "int8":
        model.quantize("int8")
    else:
        model.quantize("int4", 32, scale_dtype="int8" if coded else "float16")
    model.save_pretrained(folder)
    return folder, request.param


def damaged(saved, tmp_path, change):
    folder, method = saved
    copy = tmp_path / "damaged"
    copy.mkdir()
    (copy / "config.json").write_bytes((folder / "config.json").read_bytes())
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, copy / "model.safetensors")
    return copy, method


def test_the_saved_folder_loads(saved) -> None:
    from_pretrained(saved[0], kernels=False)


@pytest.mark.parametrize("stored", [torch.float32, torch.int32, "other int8"])
def test_a_qweight_of_another_dtype_is_refused_naming_it(saved, tmp_path, stored) -> None:
    def change(tensors):
        q = tensors[f"{Q}.qweight"]
        other = {torch.int8: torch.uint8, torch.uint8: torch.int8}[q.dtype]
        tensors[f"{Q}.qweight"] = q.to(other if stored == "other int8" else stored)

    folder, method = damaged(saved, tmp_path, change)
    want = "I8 (int8)" if method == "int8" else "U8 (uint8)"
    found = {torch.float32: "F32", torch.int32: "I32"}.get(stored, "U8" if method == "int8"
                                                             else "I8")
    with pytest.raises(ValueError, match=re.escape(f"model.safetensors: tensor "
                                                   f"'{Q}.qweight' has dtype {found}")) as error:
        from_pretrained(folder, kernels=False)
    assert f"expected {want} and shape" in str(error.value)


def test_scales_stored_as_integers_are_refused(saved, tmp_path) -> None:
    folder, method = damaged(saved, tmp_path,
                             lambda t: t.update({f"{Q}.scales": t[f"{Q}.scales"].to(torch.int32)}))
    # coded scales are codes: exactly uint8, as int4's packed pairs
    want = (r"U8 \(uint8\)" if method == "int4 coded"
            else r"a float dtype \(F32, BF16, F16\)")
    with pytest.raises(ValueError, match=rf"tensor '{Q}\.scales' has dtype I32 and shape "
                       rf"\(.*\), expected {want}"):
        from_pretrained(folder, kernels=False)


@pytest.mark.parametrize("which", ["scales", "zeros", "steps"])
def test_nan_scales_or_zeros_are_refused_naming_the_tensor(saved, tmp_path, which) -> None:
    if which == "zeros" and saved[1] == "int8":
        pytest.skip("int8 has no zeros")
    if (which == "steps") != (saved[1] == "int4 coded"):
        pytest.skip("only coded scales have steps, and their codes cannot be NaN")

    def change(tensors):
        tensors[f"{Q}.{which}"][1] = float("nan")

    folder, _ = damaged(saved, tmp_path, change)
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{Q}\.{which}' holds "
                       "NaN or infinite values"):
        from_pretrained(folder, kernels=False)
