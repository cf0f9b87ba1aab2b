"""Checkpoints of the ``DecoderLM`` of earlier attnlab versions (tensor names ``embed``,
``pos``, ``blocks.{i}.norm1``, ``blocks.{i}.attn.in_proj_weight`` = q, k, v stacked, ...)
still load, into today's names, with the same weights and logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.training.checkpoint import FORMAT, is_old_layout, load_model
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
def test_an_old_layout_checkpoint_loads_with_the_same_weights_and_logits(tmp_path, style: str,
                                                                         head: str) -> None:
    model = random_model(style)
    write_old_checkpoint(tmp_path / "old", model, head=head)
    assert is_old_layout(tmp_path / "old")
    loaded, config = load_model(tmp_path / "old")
    assert config["model_type"] == "decoder_lm" and not loaded.training
    assert loaded.config == model.config
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    if model.config.tie_embeddings:
        assert loaded.lm_head.weight is loaded.embed_tokens.weight
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_an_old_layout_that_does_not_fit_its_config_is_refused(tmp_path) -> None:
    model = random_model("llama-untied")
    write_old_checkpoint(tmp_path / "old", model)
    path = tmp_path / "old" / "config.json"
    saved = json.loads(path.read_text())
    for change, message in [
        ({"num_kv_heads": 4}, r"old-layout weights .*model\.safetensors.*RuntimeError"),
        ({"bias": True}, r"does not match the weights .*q_proj\.bias: not in the file"),
        ({"num_layers": 3}, r"does not match the weights .*layers\.2\..*: not in the file"),
        ({"d_model": 2**20, "d_ff": 2**22}, r"old-layout weights .*RuntimeError"),  # no alloc
    ]:
        path.write_text(json.dumps({**saved, "model": {**saved["model"], **change}}))
        with pytest.raises(ValueError, match=message):
            load_model(tmp_path / "old")
    path.write_text(json.dumps(saved))
    for extra, message in [("blocks.0.attn.bogus", r"unexpected tensor 'blocks\.0\.attn\.bogus'"),
                           ("blocks.0.attn.in_proj_bias", r"KeyError.*q_proj\.bias")]:
        state = {**old_state(model), extra: torch.zeros(48)}
        save_file(state, str(tmp_path / "old" / "model.safetensors"))
        with pytest.raises(ValueError, match="old-layout weights .*" + message):
            load_model(tmp_path / "old")


def test_an_old_layout_run_does_not_resume(tmp_path) -> None:
    """Its weights load, but its optimizer state follows the old parameters: resume says so
    instead of failing on a shape deep inside the optimizer."""
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
    assert not is_old_layout(tmp_path / "last")
    save_file({k: v.contiguous() for k, v in old_state(first.model).items()},
              str(tmp_path / "last" / "model.safetensors"))
    assert is_old_layout(tmp_path / "last")
    with pytest.raises(ValueError, match=r"resume: .*older attnlab.*start a new run"):
        trainer().resume()
