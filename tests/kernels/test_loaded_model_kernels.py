"""``from_pretrained`` swaps in the calibrated inference kernels: every ``nn.Linear`` becomes
an ``InferenceLinear``, the logits equal the formula's, the model still trains, and
``kernels=False`` keeps plain ``nn.Linear`` modules."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import own_cache_fixture  # noqa: F401 (an autouse fixture: own cache, no pin)
from torch import nn

from attnlab.kernels import InferenceLinear
from attnlab.models import DecoderLM, DecoderLMConfig

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_model_runs_calibrated_kernels_equal_to_the_formula(folder, dtype) -> None:
    fast = DecoderLM.from_pretrained(folder, dtype=dtype)
    plain = DecoderLM.from_pretrained(folder, dtype=dtype, kernels=False)
    linears = [m for m in fast.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is InferenceLinear for m in linears)
    assert not any(isinstance(m, InferenceLinear) for m in plain.modules())
    ids = torch.randint(0, 96, (2, 9))
    with torch.inference_mode():
        for rows in (ids, ids[:, :1]):  # prefill and one-token decode buckets
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            torch.testing.assert_close(fast(rows), plain(rows), rtol=tol, atol=tol)


def test_loaded_model_with_kernels_still_trains(folder) -> None:
    model = DecoderLM.from_pretrained(folder).train()
    ids = torch.randint(0, 96, (2, 9))
    with torch.inference_mode():
        model(ids)  # the kernels' path first, then a training step on the same weights
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_kernels_argument_is_checked(folder) -> None:
    with pytest.raises(TypeError, match="kernels: expected a bool"):
        DecoderLM.from_pretrained(folder, kernels="yes")


def test_a_trained_config_model_saves_after_kernels(tmp_path) -> None:
    model = DecoderLM(DecoderLMConfig.llama(64, d_model=32, num_heads=4, num_layers=1))
    model.save_pretrained(tmp_path / "a")
    loaded = DecoderLM.from_pretrained(tmp_path / "a")  # column-major weights may be kept
    loaded.save_pretrained(tmp_path / "b")  # safetensors needs contiguous tensors
    again = DecoderLM.from_pretrained(tmp_path / "b", kernels=False)
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), rtol=1e-5, atol=1e-5)


class _Doubled(nn.Module):
    """A parametrization: ``W -> 2 W``."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


class _LowRank(nn.Module):
    """A LoRA wrapper: ``base(x) + x A^T B^T``, swapped in for a Linear."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / 8)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.T @ self.b.T


def test_parametrizations_and_a_swapped_module_take_effect_on_a_loaded_model(folder) -> None:
    # torch.nn.utils.parametrize moves `weight` out of the module's Parameters and a LoRA
    # wrapper replaces the module: the kernels, the fused decoding step included, must see
    # both, as the same edits made to a plain model's weights.
    fast = DecoderLM.from_pretrained(folder).eval()
    plain = DecoderLM.from_pretrained(folder, kernels=False).eval()
    first, second = fast.layers[0], fast.layers[1]
    torch.nn.utils.parametrize.register_parametrization(first.self_attn.q_proj, "weight",
                                                        _Doubled())
    torch.nn.utils.parametrize.register_parametrization(first.self_attn.q_proj, "bias",
                                                        _Doubled())
    torch.nn.utils.parametrize.register_parametrization(second.post_attention_layernorm,
                                                        "weight", _Doubled())
    torch.manual_seed(1)
    second.mlp.down_proj = _LowRank(second.mlp.down_proj)
    lora = second.mlp.down_proj
    with torch.no_grad():
        q_proj = plain.layers[0].self_attn.q_proj
        q_proj.weight.mul_(2)
        q_proj.bias.mul_(2)
        plain.layers[1].post_attention_layernorm.weight.mul_(2)
        plain.layers[1].mlp.down_proj.weight.add_(lora.b @ lora.a)
    ids = torch.randint(0, 96, (2, 9))
    with torch.inference_mode():
        for rows in (ids, ids[:, :1]):
            torch.testing.assert_close(fast(rows), plain(rows), rtol=1e-4, atol=1e-4)
        assert torch.equal(fast.generate(ids, 8), plain.generate(ids, 8))
    fast.train()
    fast(ids, labels=ids).loss.backward()
    original = first.self_attn.q_proj.parametrizations.weight.original
    assert original.grad is not None and lora.a.grad is not None and lora.b.grad is not None


def test_a_parametrized_linear_is_refused_by_the_swap() -> None:
    module = nn.Linear(4, 3)
    torch.nn.utils.parametrize.register_parametrization(module, "weight", _Doubled())
    with pytest.raises(TypeError, match=r"module: expected an nn.Linear without "
                                        r"parametrizations .* got one with \['weight'\]"):
        InferenceLinear.from_linear(module)
