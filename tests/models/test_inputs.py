"""Token ids out of ``[0, vocab)``, bool, float or unsigned ids: a clear error naming the
argument before any compute (an ``IndexError`` from deep inside the embedding before)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.models import DecoderLM, DecoderLMConfig, Transformer, TransformerConfig
from attnlab.models.families import family_for
from attnlab.models.inputs import check_token_ids, decoder_inputs

V = 13
torch.manual_seed(0)
LM = DecoderLM(DecoderLMConfig.llama(V, d_model=16, num_layers=1, num_heads=2, max_len=16)).eval()
QWEN = DecoderLM(family_for("qwen2").config_from_hf(
    {"vocab_size": V, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
     "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 16})).eval()
SEQ2SEQ = Transformer(TransformerConfig(src_vocab_size=V, tgt_vocab_size=V + 2, d_model=16,
                                        num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                                        d_ff=16, max_len=16, dropout=0.0)).eval()
GOOD = torch.tensor([[1, 2, 3]])


def calls():
    """(argument name, vocab size, function of the ids) for every model input."""
    return [
        ("input_ids", V, lambda ids: LM(ids)),
        ("input_ids", V, lambda ids: QWEN(ids)),
        ("src", V, lambda ids: SEQ2SEQ(ids, GOOD)),
        ("tgt", V + 2, lambda ids: SEQ2SEQ(GOOD, ids)),
        ("src", V, lambda ids: SEQ2SEQ.encode(ids)),
    ]


@pytest.mark.parametrize(("name", "vocab", "call"), calls())
@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda v: torch.tensor([[1, v]]), ValueError, r"expected ids in \[0, {v}\), got min 1 "
                                                   r"and max {v}"),
    (lambda v: torch.tensor([[-1, 2]]), ValueError, r"expected ids in \[0, {v}\), got min -1"),
    (lambda v: torch.tensor([[True, False]]), ValueError, "got dtype torch.bool"),
    (lambda v: torch.tensor([[1.0, 2.0]]), ValueError, "got dtype torch.float32"),
    (lambda v: torch.tensor([[1, 2]], dtype=torch.uint8), ValueError, "got dtype torch.uint8"),
    (lambda v: [[1, 2]], TypeError, "expected a tensor of integer token ids"),
    (lambda v: torch.tensor([1, 2]), ValueError, r"shape B x L, got shape \(2,\)"),
])
def test_bad_ids_name_the_argument(name, vocab, call, make, error, message) -> None:
    with pytest.raises(error, match=f"^{name}: .*" + message.format(v=vocab)):
        call(make(vocab))


def test_one_token_decode_step_is_checked_too() -> None:
    for model, vocab in ((LM, V), (QWEN, V)):
        cache = model.make_cache(1)
        model(GOOD, cache=cache)
        with pytest.raises(ValueError, match=rf"input_ids: expected ids in \[0, {vocab}\)"):
            model(torch.tensor([[vocab]]), cache=cache)
        assert cache.length == 3  # refused before anything was written
    cache = SEQ2SEQ.make_cache(1)
    memory = SEQ2SEQ.encode(GOOD)
    with pytest.raises(ValueError, match=rf"tgt: expected ids in \[0, {V + 2}\)"):
        SEQ2SEQ.decode(torch.tensor([[V + 2]]), memory, cache=cache)


def test_int32_ids_give_the_same_logits() -> None:
    with torch.no_grad():
        for model in (LM, QWEN):
            assert torch.equal(model(GOOD.int()), model(GOOD))


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.lists(st.integers(-3, V + 3), min_size=3, max_size=3), min_size=1,
                    max_size=2))
def test_ids_accepted_exactly_when_in_range(ids) -> None:
    """Property: ``[0, V)`` ids give logits (what the embedding rows give), others raise."""
    t = torch.tensor(ids)
    if all(0 <= i < V for row in ids for i in row):
        assert check_token_ids("input_ids", t, V) == tuple(t.shape)
        with torch.no_grad():
            assert LM(t).shape == (*t.shape, V)
    else:
        with pytest.raises(ValueError, match=r"input_ids: expected ids in \[0, 13\)"):
            LM(t)


@pytest.mark.parametrize("model", [LM, QWEN])
@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"attention_mask": [[1, 1, 1]]}, TypeError, "attention_mask: expected a tensor, got list"),
    ({"cache": object()}, TypeError, "cache: expected a KVCache"),
    ({"logits_to_keep": -1}, ValueError, "logits_to_keep: expected an int >= 0, got -1"),
    ({"logits_to_keep": True}, ValueError, "logits_to_keep: expected an int >= 0, got True"),
    ({"logits_to_keep": "1"}, ValueError, "logits_to_keep: expected an int >= 0"),
    ({"position_ids": torch.tensor([[0, 1, 99]])}, ValueError,
     r"position_ids: expected positions in \[0, 16\), got min 0 and max 99"),
    ({"position_ids": torch.tensor([[0, -1, 2]])}, ValueError, "position_ids: expected "
                                                               "positions in"),
    ({"position_ids": torch.tensor([[0.0, 1, 2]])}, ValueError,
     r"position_ids: expected integer positions of shape B x L = \(1, 3\) or L"),
    ({"position_ids": torch.tensor([[0, 1]])}, ValueError, "position_ids: expected integer "
                                                           "positions of shape"),
])
def test_decoder_arguments_are_named(model, kwargs, error, message) -> None:
    """DecoderLM let ``logits_to_keep=-1`` through (all logits) and read True as 1; both
    models named ``offset`` for bad ``position_ids`` and gave AttributeErrors for the rest."""
    with pytest.raises(error, match=f"^{message}"):
        model(GOOD, **kwargs)


def test_explicit_positions_match_the_default_ones() -> None:
    with torch.no_grad():
        for model in (LM, QWEN):
            positions = torch.tensor([[0, 1, 2]])
            assert torch.equal(model(GOOD, position_ids=positions), model(GOOD))
            assert torch.equal(model(GOOD, position_ids=positions[0]), model(GOOD))


def test_seq2seq_masks_and_memory_are_named() -> None:
    memory = SEQ2SEQ.encode(GOOD)
    with pytest.raises(TypeError, match=r"^src_mask: expected a bool key mask tensor, got list"):
        SEQ2SEQ(GOOD, GOOD, src_mask=[[1, 1, 1]])
    with pytest.raises(TypeError, match=r"^tgt_mask: expected a bool key mask tensor"):
        SEQ2SEQ(GOOD, GOOD, tgt_mask=[[1, 1, 1]])
    with pytest.raises(TypeError, match=r"^memory: expected the encoder's output tensor"):
        SEQ2SEQ.decode(GOOD, memory.tolist())
    with pytest.raises(ValueError, match=r"^memory: expected dtype torch.float32"):
        SEQ2SEQ.decode(GOOD, memory.double())


def test_a_mask_without_padding_is_dropped_and_positions_are_the_offset(monkeypatch) -> None:
    cache = LM.make_cache(2)
    LM(torch.tensor([[1, 2], [3, 4]]), cache=cache)  # offset 2
    cumsums: list[object] = []
    monkeypatch.setattr(torch.Tensor, "cumsum", lambda t, *a, **k: cumsums.append(a))
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    got = decoder_inputs(ids, torch.ones(2, 5, dtype=torch.long), cache, None, 0, vocab_size=V,
                         max_len=16, num_layers=1)
    assert got == (2, 3, 2, None, 2) and not cumsums  # no positions computed to throw away
    monkeypatch.undo()
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    padded = decoder_inputs(ids, mask, cache, None, 0, vocab_size=V, max_len=16,
                            num_layers=1)
    assert torch.equal(padded.key_mask, mask.bool())
    assert torch.equal(padded.positions, torch.tensor([[1, 2, 3], [2, 3, 4]]))
