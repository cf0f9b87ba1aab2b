"""Checkpoints of the ``DecoderLM`` of the development versions before the one decoder stack
(tensor names ``embed``, ``pos``, ``blocks.{i}.norm1``, ``blocks.{i}.attn.in_proj_weight`` = q,
k, v stacked, ...) are refused with an error that names the file and the commit that converts
them; today's checkpoints load."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.training.checkpoint import (
    FORMAT,
    check_current_layout,
    load_model,
    save_checkpoint,
)
from attnlab.training.tasks.text import CharLMTask
from attnlab.training.trainer import TrainConfig, Trainer

V = 30
# The fields of the earlier DecoderLMConfig (a checkpoint of then holds only these).
OLD_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff",
              "max_len", "position", "norm", "mlp", "bias", "tie_embeddings", "norm_eps",
              "rope_base", "rope_traditional", "dropout", "backend")
STYLES = {
    "gpt-tied": DecoderLMConfig.gpt(V, d_model=16, num_layers=2, num_heads=4, max_len=12),
    "llama-untied": DecoderLMConfig.llama(V, d_model=16, num_layers=2, num_heads=4,
                                          max_len=12, tie_embeddings=False),
}


def old_state(model: DecoderLM, head: str = "embed.weight") -> dict[str, torch.Tensor]:
    """``model``'s weights under the earlier names, spelled out as that version's modules
    named them (a tied head stored once, under ``head``, as safetensors' save_model does)."""
    s, c = model.state_dict(), model.config
    old = {"norm.weight": s["norm.weight"]}
    if c.tie_embeddings:
        old[head] = s["embed_tokens.weight"]
    else:
        old["embed.weight"], old["lm_head.weight"] = s["embed_tokens.weight"], s["lm_head.weight"]
    if c.position == "learned":
        old["pos.weight"] = s["embed_positions.weight"]
    if c.bias:
        old["norm.bias"] = s["norm.bias"]
    for i in range(c.num_layers):
        new, was = f"layers.{i}.", f"blocks.{i}."
        attn = new + "self_attn."
        kinds = ("weight", "bias") if c.bias else ("weight",)
        for kind in kinds:
            old[was + "norm1." + kind] = s[new + "input_layernorm." + kind]
            old[was + "norm2." + kind] = s[new + "post_attention_layernorm." + kind]
            old[was + "attn.in_proj_" + kind] = torch.cat(
                [s[attn + p + "_proj." + kind] for p in "qkv"])
            old[was + "attn.out_proj." + kind] = s[attn + "o_proj." + kind]
        for name, t in s.items():
            if name.startswith(new + "mlp."):
                old[was + name.removeprefix(new)] = t
    return old


def write_old_checkpoint(folder, model: DecoderLM, **kwargs: str) -> None:
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in old_state(model, **kwargs).items()},
              str(folder / "model.safetensors"))
    config = {k: v for k, v in model.config.to_dict().items() if k in OLD_FIELDS}
    (folder / "config.json").write_text(json.dumps(
        {"format": FORMAT, "model_type": "decoder_lm", "model": config, "extra": {}}))


def random_model(style: str) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(STYLES[style]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms and biases off their initial values
    return model


@pytest.mark.parametrize(("style", "head"), [("gpt-tied", "embed.weight"),
                                             ("gpt-tied", "lm_head.weight"),
                                             ("llama-untied", "embed.weight")])
def test_an_old_layout_checkpoint_is_refused_naming_the_file_and_the_way_to_convert_it(
        tmp_path, style: str, head: str) -> None:
    write_old_checkpoint(tmp_path / "old", random_model(style), head=head)
    weights = str(tmp_path / "old" / "model.safetensors")
    for load in (load_model, check_current_layout):
        with pytest.raises(ValueError, match=re.escape(repr(weights)) + r" holds the tensor "
                           r"names of the DecoderLM before .*\(embed, blocks\.\*\).* does "
                           r"not read; convert it with attnlab at commit d2db3a7 \(load_model, "
                           r"then save_checkpoint"):
            load(tmp_path / "old")


def test_a_current_checkpoint_passes_the_layout_check(tmp_path) -> None:
    model = random_model("llama-untied")
    save_checkpoint(tmp_path / "new", model, model_type="decoder_lm",
                    model_config=model.config.to_dict())
    check_current_layout(tmp_path / "new")
    loaded, _ = load_model(tmp_path / "new")
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


def test_an_old_layout_run_does_not_resume(tmp_path) -> None:
    """Its optimizer state follows the old parameters: resume refuses it by the file's name
    before reading that state, instead of failing on a shape deep inside the optimizer."""
    task = CharLMTask("the quick brown fox jumps over the lazy dog. " * 4, block_size=8)
    config = DecoderLMConfig.gpt(len(task.vocab), d_model=16, num_layers=1, num_heads=2,
                                 max_len=16)

    def trainer() -> Trainer:
        torch.manual_seed(0)
        return Trainer(DecoderLM(config), task,
                       TrainConfig(steps=2, batch_size=4, eval_every=1000, checkpoint_every=2),
                       out_dir=tmp_path, d_model=16, progress=False,
                       save_info={"model_type": "decoder_lm", "model_config": config.to_dict()})

    first = trainer()
    first.fit()
    check_current_layout(tmp_path / "last")
    save_file({k: v.contiguous() for k, v in old_state(first.model).items()},
              str(tmp_path / "last" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors' holds the tensor names .*d2db3a7"):
        trainer().resume()
