"""The Hugging Face call surface of ``DecoderLM`` and ``Transformer``: ``labels`` -> the loss
transformers computes, ``past_key_values``/``use_cache`` == the full forward, ``generate``,
``save_pretrained``/``from_pretrained`` round trips, trainable weights after loading, and
the errors a wrong keyword gets."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import attnlab.models.hf_loading as hf_loading
from attnlab.attention.kv_cache import KVCache
from attnlab.generation import generate, generate_seq2seq
from attnlab.layers.rope_scaling import RopeScaling
from attnlab.models import DecoderLM, DecoderLMConfig, Transformer, TransformerConfig
from attnlab.models.io import from_pretrained, save_pretrained
from attnlab.models.outputs import CausalLMOutput, Seq2SeqLMOutput
from conftest import assert_close

transformers = pytest.importorskip("transformers")

V = 64
_SIZES = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# Every family, each with what sets it apart where a tiny size allows (GPT-2 spells its sizes
# its own way and learns its positions: the left padding must not shift them).
HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **_SIZES, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2": lambda: transformers.Qwen2Config(**_SIZES),
    "mistral": lambda: transformers.MistralConfig(**_SIZES, sliding_window=4),
    "qwen3": lambda: transformers.Qwen3Config(**_SIZES, head_dim=16),
    "gemma": lambda: transformers.GemmaConfig(**_SIZES, head_dim=8),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                                            n_positions=64, initializer_range=0.1, bos_token_id=1,
                                            eos_token_id=2),
    "phi3": lambda: transformers.Phi3Config(**_SIZES),
}


def hf_pair(tmp_path, family: str) -> tuple[torch.nn.Module, DecoderLM]:
    """A tiny random transformers model saved to ``tmp_path`` and ours loaded from it."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[family]()).eval()
    hf.save_pretrained(tmp_path)
    return hf, from_pretrained(tmp_path)


def batch(seed: int = 1, lengths: tuple[int, ...] = (9, 5, 7)) -> tuple[torch.Tensor, ...]:
    """Left-padded ``ids``, ``mask`` and ``labels`` (the ids, ``-100`` on the padding)."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(0, V, (len(lengths), L), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, L - n:] = 1
    ids = ids * mask
    return ids, mask, ids.masked_fill(mask == 0, -100)


def tiny_decoder(**overrides: object) -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4, max_len=32,
                                   **overrides)
    return DecoderLM(config).eval()


def tiny_transformer() -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(src_vocab_size=V, tgt_vocab_size=V - 5, d_model=32,
                                         num_heads=4, num_encoder_layers=2,
                                         num_decoder_layers=2, d_ff=48, dropout=0.0,
                                         max_len=32)).eval()


@pytest.mark.parametrize("family", list(HF_CONFIGS))
def test_loss_and_logits_equal_transformers(tmp_path, family: str) -> None:
    hf, ours = hf_pair(tmp_path, family)
    ids, mask, labels = batch()
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as transformers' generate makes them
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels)
        got = ours(ids, attention_mask=mask, labels=labels)
    assert isinstance(got, CausalLMOutput) and got.past_key_values is None
    assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-5, what="loss")
    real = mask.bool()
    assert_close(got.logits[real], expected.logits[real], rtol=1e-4, atol=1e-4, what="logits")


def test_loss_is_the_shifted_cross_entropy_formula() -> None:
    model = tiny_decoder()
    ids, mask, labels = batch(2)
    with torch.no_grad():
        out = model(ids, mask, labels=labels)
    logp = torch.log_softmax(out.logits.double(), -1)
    terms = [-logp[b, t, labels[b, t + 1]] for b in range(ids.shape[0])
             for t in range(ids.shape[1] - 1) if labels[b, t + 1] != -100]
    assert_close(out.loss.double(), torch.stack(terms).mean(), rtol=1e-6, atol=1e-6)
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0


@pytest.mark.parametrize("family", list(HF_CONFIGS))
def test_decoding_through_past_key_values_equals_the_full_forward(tmp_path, family: str
                                                                  ) -> None:
    _, ours = hf_pair(tmp_path, family)
    ids, mask, _ = batch(3)
    with torch.no_grad():
        full = ours(ids, mask)
        out = ours(ids[:, :4], mask[:, :4], use_cache=True)  # room for 4: grows below
        steps = [out.logits]
        for t in range(4, ids.shape[1]):
            out = ours(ids[:, t:t + 1], mask[:, :t + 1], past_key_values=out.past_key_values)
            steps.append(out.logits)
    assert isinstance(out.past_key_values, KVCache)
    assert out.past_key_values.length == ids.shape[1] and out.past_key_values.max_len >= 9
    real = mask.bool()
    assert_close(torch.cat(steps, 1)[real], full[real], rtol=1e-5, atol=1e-5)


def test_plain_call_still_returns_the_logits_tensor() -> None:
    model = tiny_decoder()
    ids, mask, _ = batch()
    with torch.no_grad():
        plain = model(ids, mask)
        wrapped = model(ids, mask, return_dict=True)
        no_cache = model(ids, mask, use_cache=False)
    assert isinstance(plain, torch.Tensor)
    assert wrapped.loss is None and wrapped.past_key_values is None
    assert torch.equal(wrapped.logits, plain) and torch.equal(no_cache.logits, plain)


def test_generate_methods_call_the_generation_loops() -> None:
    model = tiny_decoder()
    ids, mask, _ = batch(4)
    assert torch.equal(model.generate(ids, 6, attention_mask=mask),
                       generate(model, ids, 6, attention_mask=mask))
    sampled = model.generate(ids, max_length=14, attention_mask=mask, do_sample=True, seed=3)
    assert torch.equal(sampled, generate(model, ids, max_length=14, attention_mask=mask,
                                         do_sample=True, seed=3))
    seq2seq = tiny_transformer()
    src = torch.randint(1, V, (2, 6), generator=torch.Generator().manual_seed(5))
    for beams in (1, 3):
        assert torch.equal(seq2seq.generate(src, 5, bos_id=1, eos_id=2, num_beams=beams),
                           generate_seq2seq(seq2seq, src, 5, bos_id=1, eos_id=2,
                                            num_beams=beams))


def test_transformer_loss_and_cached_decoding() -> None:
    model = tiny_transformer()
    g = torch.Generator().manual_seed(6)
    src = torch.randint(1, V, (2, 7), generator=g)
    tgt = torch.randint(1, V - 5, (2, 6), generator=g)
    labels = tgt.clone()
    labels[0, 4:] = -100
    with torch.no_grad():
        out = model(src, tgt, labels=labels)
        full = model(src, tgt)
        expected = F.cross_entropy(full[:, :-1].reshape(-1, V - 5), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        first = model(src, tgt[:, :2], use_cache=True)
        steps = [first.logits]
        cache = first.past_key_values
        for t in range(2, tgt.shape[1]):
            step = model(src, tgt[:, t:t + 1], past_key_values=cache)
            steps.append(step.logits)
    assert isinstance(out, Seq2SeqLMOutput) and out.encoder_last_hidden_state.shape == (2, 7, 32)
    assert_close(out.logits, full)
    assert_close(out.loss, expected)
    assert step.past_key_values is cache and cache.length == tgt.shape[1]
    assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_decoder_lm_save_and_load_round_trip(tmp_path) -> None:
    model = tiny_decoder(rope_scaling=RopeScaling.from_hf({"rope_type": "linear", "factor": 2.0}),
                         eos_token_id=3)
    ids, mask, _ = batch()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "attnlab_decoder" and saved["torch_dtype"] == "float32"
    for loaded in (DecoderLM.from_pretrained(tmp_path), from_pretrained(tmp_path)):
        assert type(loaded) is DecoderLM and loaded.config == model.config
        assert all(p.requires_grad for p in loaded.parameters()) and not loaded.training
        assert loaded.lm_head.weight is loaded.embed_tokens.weight  # still tied
        for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
            assert torch.equal(a, b), name
        assert torch.equal(loaded(ids, mask), model(ids, mask))
    half = DecoderLM.from_pretrained(tmp_path, dtype="bfloat16", device="cpu")
    assert half.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(half.layers[1].mlp.up_proj.weight,
                       model.layers[1].mlp.up_proj.weight.bfloat16())
    save_pretrained(half, tmp_path / "half")  # io writes the own format for family None
    assert json.loads((tmp_path / "half" / "config.json").read_text())["torch_dtype"] == \
        "bfloat16"
    assert from_pretrained(tmp_path / "half").embed_tokens.weight.dtype == torch.bfloat16


def test_transformer_save_and_load_round_trip(tmp_path) -> None:
    model = tiny_transformer()
    save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == \
        "attnlab_transformer"
    src = torch.randint(1, V, (2, 5), generator=torch.Generator().manual_seed(7))
    tgt = src[:, :4] % (V - 5)
    for loaded in (Transformer.from_pretrained(tmp_path), from_pretrained(tmp_path)):
        assert type(loaded) is Transformer and loaded.config == model.config
        assert all(p.requires_grad for p in loaded.parameters()) and not loaded.training
        assert loaded.output_proj.weight is loaded.decoder.embed.weight
        assert torch.equal(loaded(src, tgt), model(src, tgt))
    half = Transformer.from_pretrained(tmp_path, dtype=torch.float16)
    assert half.decoder.embed.weight.dtype == torch.float16
    assert half.encoder.pos.pe.dtype == torch.float32  # computed, not stored: kept exact


def test_loaded_weights_train(tmp_path) -> None:
    """One SGD step on a checkpoint loaded from a transformers folder changes every weight
    that the loss reaches and lowers the loss on that batch."""
    _, model = hf_pair(tmp_path, "qwen2")
    assert all(p.requires_grad for p in model.parameters())
    ids, mask, labels = batch(8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    loss = model(ids, mask, labels=labels).loss
    loss.backward()
    optimizer.step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    with torch.no_grad():
        after = model(ids, mask, labels=labels).loss
    assert after < loss.detach()


def test_hf_keywords_are_checked_by_name() -> None:
    model = tiny_decoder()
    ids, mask, labels = batch()
    cache = model.make_cache(3, 16)
    too_big, negative = labels.clone(), labels.clone()
    too_big[0, -1], negative[1, -1] = V, -1
    cases = [
        ({"labels": labels[:, 1:]}, ValueError, r"labels: expected .* shape B x L = \(3, 9\)"),
        ({"labels": labels.float()}, ValueError, "labels: expected integer ids"),
        ({"labels": too_big}, ValueError,
         rf"labels: expected ids in \[0, {V}\) or -100 \(no loss\), got \[{V}\]"),
        ({"labels": negative}, ValueError, r"got \[-1\]"),
        ({"labels": labels.tolist()}, TypeError, "labels: expected a tensor"),
        ({"labels": labels, "logits_to_keep": 1}, ValueError, "logits_to_keep: the loss needs"),
        ({"past_key_values": (1, 2)}, TypeError, "past_key_values: expected a KVCache"),
        ({"past_key_values": cache, "cache": cache}, ValueError, "got both"),
        ({"past_key_values": cache, "use_cache": False}, ValueError, "use_cache: False"),
        ({"use_cache": "yes"}, TypeError, "use_cache: expected True, False or None, got 'yes'"),
        ({"return_dict": 1}, TypeError, "return_dict: expected True, False or None, got 1"),
        ({"labels": labels, "return_dict": False}, ValueError, "return_dict: False"),
        ({"use_cache": True, "return_dict": False}, ValueError, "return_dict: False"),
        ({"past_key_values": model.make_cache(2, 16)}, ValueError, "cache: expected 2 layers "
         "for batch size 3"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            model(ids, mask, **kwargs)
    with pytest.raises(ValueError, match="input_ids: expected integer token ids"):
        model(ids.float(), labels=labels)  # the input is named first, not the labels
    seq2seq = tiny_transformer()
    with pytest.raises(ValueError, match=r"labels: expected .* shape B x L = \(3, 9\)"):
        seq2seq(ids, ids % (V - 5), labels=labels[:, 1:])
    with pytest.raises(TypeError, match="past_key_values: expected a KVCache"):
        seq2seq(ids, ids % (V - 5), past_key_values=[])
    with pytest.raises(ValueError, match="cache: expected 2 layers for batch size 3"):
        seq2seq(ids, ids % (V - 5), past_key_values=KVCache(1, 3, 4, 8, 8))
    with pytest.raises(TypeError, match="cache: expected a KVCache"):
        seq2seq.decode(ids % (V - 5), seq2seq.encode(ids), cache=object())


def test_bad_folders_are_refused_by_name(tmp_path) -> None:
    model = tiny_decoder()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model_type 'attnlab_decoder' is not Transformer's"):
        Transformer.from_pretrained(tmp_path)
    for change, error, message in [
        ({"d_model": 2**16, "num_heads": 4}, ValueError,
         r"config does not match the weights .*embed_tokens.weight: \(64, 32\) in the file"),
        ({"num_layers": 3}, ValueError, r"layers\.2\..*: not in the file"),
        ({"n_layer": 2}, ValueError, r"config\.json: unknown DecoderLMConfig fields \['n_layer'\]"),
        ({"num_heads": "4"}, TypeError, r"config\.json: num_heads: expected an int"),
        ({"torch_dtype": "int8"}, ValueError, r"config\.json: torch_dtype: expected one of"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(error, match=message):
            DecoderLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match=r"model\.safetensors.*(truncated or corrupt|missing)"):
        DecoderLM.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        DecoderLM.from_pretrained(tmp_path / "absent")


def test_a_family_model_is_written_by_its_family(tmp_path) -> None:
    _, ours = hf_pair(tmp_path / "hf", "qwen2")
    ours.save_pretrained(tmp_path / "mine")
    save_pretrained(ours, tmp_path / "again")
    for folder in ("mine", "again"):
        assert json.loads((tmp_path / folder / "config.json").read_text())["model_type"] == "qwen2"
        again = DecoderLM.from_pretrained(tmp_path / folder)
        ids = torch.tensor([[1, 2, 3]])
        assert torch.equal(again(ids), ours(ids))
    with pytest.raises(ValueError, match=r"model_type 'bert' is not supported; expected one of"):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "bert"}))
        DecoderLM.from_pretrained(tmp_path / "hf")


def test_hostile_paths_devices_and_config_values(tmp_path) -> None:
    model = tiny_decoder()
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(FileExistsError, match=r"path: .*file is a file; expected a folder"):
        model.save_pretrained(tmp_path / "file")
    with pytest.raises(TypeError, match=r"path: expected a folder path .*got NoneType"):
        model.save_pretrained(None)
    model.save_pretrained(tmp_path / "ok")
    with pytest.raises(ValueError, match=r"device: expected a device such as 'cpu'.*'gpu7'"):
        DecoderLM.from_pretrained(tmp_path / "ok", device="gpu7")
    with pytest.raises(ValueError, match="dtype: expected one of"):
        DecoderLM.from_pretrained(tmp_path / "ok", dtype="int8")
    path = tmp_path / "ok" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "torch_dtype": None}))  # absent: float32
    assert DecoderLM.from_pretrained(tmp_path / "ok").lm_head.weight.dtype == torch.float32
    path.write_text(json.dumps({**config, "model_type": ["attnlab_decoder"]}))
    with pytest.raises(ValueError, match=r"model_type \['attnlab_decoder'\] is not supported"):
        from_pretrained(tmp_path / "ok")
    with pytest.raises(TypeError, match="model: expected a DecoderLM or a Transformer, got "
                                        "Linear"):
        save_pretrained(torch.nn.Linear(2, 2), tmp_path / "linear")


@pytest.mark.parametrize("family", [None, "qwen2"])
def test_a_save_killed_mid_write_leaves_the_earlier_checkpoint(tmp_path, monkeypatch,
                                                                family) -> None:
    """Each file is replaced in one step: a crash while writing the weights leaves the
    folder as it was (the earlier model loads, other files such as a tokenizer stay)."""
    if family is None:
        model = tiny_decoder()
    else:
        _, model = hf_pair(tmp_path / "hf", family)
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def crash(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\x00" * 64)  # a partial file, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_loading, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    DecoderLM.from_pretrained(folder, kernels=False)  # still loads
