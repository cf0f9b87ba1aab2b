"""Encoder-decoder greedy and beam search against full recomputation and brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnlab.generation import beam_search, generate_seq2seq, greedy_search
from attnlab.models import DecoderLM, DecoderLMConfig, Transformer, TransformerConfig
from conftest import assert_close

BOS, EOS = 1, 2


def make(vocab: int = 9, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    config = TransformerConfig(vocab, vocab, d_model=16, num_heads=2, num_encoder_layers=1,
                               num_decoder_layers=2, d_ff=32, dropout=0.0, max_len=12,
                               pad_id=None, tie_output=False)
    model = Transformer(config).eval()
    with torch.no_grad():  # spread-out, context-dependent next-token distributions
        torch.nn.init.normal_(model.output_proj.weight, std=0.15)
    return model


def sequence_score(model: Transformer, src: torch.Tensor, tokens: list[int],
                   length_penalty: float) -> float:
    """sum log p(y_t | y_<t) / n^lp, recomputed with one uncached forward pass."""
    tgt = torch.tensor([[BOS, *tokens]])
    with torch.no_grad():
        logp = torch.log_softmax(model(src, tgt[:, :-1]), dim=-1)[0]
    total = sum(float(logp[t, tok]) for t, tok in enumerate(tokens))
    return total / len(tokens) ** length_penalty


def test_greedy_matches_full_recomputation() -> None:
    model = make()
    src = torch.randint(3, 9, (3, 5), generator=torch.Generator().manual_seed(1))
    out = greedy_search(model, src, 6, bos_id=BOS, eos_id=EOS)
    ys = torch.full((3, 1), BOS)
    with torch.no_grad():
        for _ in range(out.shape[1] - 1):
            ys = torch.cat([ys, model(src, ys)[:, -1:].argmax(-1)], dim=1)
    for row in range(3):  # compare up to and including the first eos
        ref = ys[row].tolist()
        end = ref.index(EOS, 1) + 1 if EOS in ref[1:] else len(ref)
        assert out[row, :end].tolist() == ref[:end]
        assert (out[row, end:] == EOS).all()  # pad defaults to eos without a pad_id


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_beam_equals_greedy(seed: int) -> None:
    model = make(seed=seed)
    src = torch.randint(3, 9, (2, 4), generator=torch.Generator().manual_seed(seed))
    g_ids, g_scores = greedy_search(model, src, 7, bos_id=BOS, eos_id=EOS, return_scores=True)
    b_ids, b_scores = beam_search(model, src, 7, bos_id=BOS, eos_id=EOS, num_beams=1,
                                  return_scores=True)
    assert torch.equal(g_ids, b_ids)
    assert_close(b_scores, g_scores, atol=1e-5)
    assert torch.equal(generate_seq2seq(model, src, 7, bos_id=BOS, eos_id=EOS), g_ids)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("seed", [2, 5, 6, 7])  # seeds where greedy or 2 beams miss the best
def test_wide_beam_finds_the_brute_force_best(length_penalty: float, seed: int) -> None:
    vocab, T = 5, 3
    model = make(vocab, seed=seed)
    src = torch.tensor([[3, 4, 3, 0]])
    candidates = []
    for n in range(1, T + 1):
        for body in itertools.product([t for t in range(vocab) if t != EOS], repeat=n - 1):
            candidates.append([*body, EOS])
            if n == T:
                candidates += [[*body, t] for t in range(vocab) if t != EOS]
    scores = {tuple(c): sequence_score(model, src, c, length_penalty) for c in candidates}
    best = max(scores, key=scores.get)
    ids, score = beam_search(model, src, T, bos_id=BOS, eos_id=EOS, num_beams=vocab**T,
                             length_penalty=length_penalty, early_stopping=False,
                             return_scores=True)
    found = ids[0, 1:].tolist()[:len(best)]
    assert tuple(found) == best, (found, best)
    assert abs(float(score[0]) - scores[best]) < 1e-5


def reference_beam_search(model: Transformer, src: torch.Tensor, T: int, K: int, lp: float,
                          early_stopping: bool) -> tuple[list[int], float]:
    """The best hypothesis of ``reference_hypotheses``: (tokens, score)."""
    score, tokens = reference_hypotheses(model, src, T, K, lp, early_stopping)[0]
    return tokens, score


def reference_hypotheses(model: Transformer, src: torch.Tensor, T: int, K: int, lp: float,
                         early_stopping: bool) -> list[tuple[float, list[int]]]:
    """The beam-search rules written plainly (lists, no cache, a full forward per prefix): the
    ``K`` best finished hypotheses as (score, tokens), best first."""
    running: list[tuple[float, list[int]]] = [(0.0, [])]
    finished: list[tuple[float, list[int]]] = []
    for step in range(T):
        candidates = []
        for score, tokens in running:
            with torch.no_grad():
                logp = torch.log_softmax(model(src, torch.tensor([[BOS, *tokens]]))[0, -1], -1)
            candidates += [(score + float(lp_v), [*tokens, v]) for v, lp_v in enumerate(logp)]
        candidates.sort(key=lambda c: -c[0])
        running = []
        for rank, (score, tokens) in enumerate(candidates[:2 * K]):
            if tokens[-1] == EOS:
                if rank < K:
                    finished.append((score / len(tokens) ** lp, tokens))
            elif len(running) < K:
                running.append((score, tokens))
        finished = sorted(finished, key=lambda h: -h[0])[:K]
        if len(finished) == K and (early_stopping
                                   or finished[-1][0] >= running[0][0] / (step + 1) ** lp):
            return finished
    finished += [(score / T**lp, tokens) for score, tokens in running]
    return sorted(finished, key=lambda h: -h[0])[:K]


@pytest.mark.parametrize("num_beams", [2, 3])
@pytest.mark.parametrize("early_stopping", [True, False])
@pytest.mark.parametrize("seed", [0, 6, 7])
def test_beam_search_matches_plain_reference(num_beams: int, early_stopping: bool,
                                             seed: int) -> None:
    model = make(seed=seed)
    src = torch.randint(3, 9, (1, 5), generator=torch.Generator().manual_seed(seed))
    ids, score = beam_search(model, src, 5, bos_id=BOS, eos_id=EOS, num_beams=num_beams,
                             early_stopping=early_stopping, return_scores=True)
    tokens, ref_score = reference_beam_search(model, src, 5, num_beams, 1.0, early_stopping)
    assert ids[0, 1:1 + len(tokens)].tolist() == tokens
    assert abs(float(score[0]) - ref_score) < 1e-5


@pytest.mark.parametrize(("num_beams", "returned"), [(3, 3), (4, 2)])
@pytest.mark.parametrize("early_stopping", [True, False])
@pytest.mark.parametrize("seed", [0, 6])
def test_num_return_sequences_are_the_reference_beams_best_first(
        num_beams: int, returned: int, early_stopping: bool, seed: int) -> None:
    model = make(seed=seed)
    src = torch.randint(3, 9, (2, 5), generator=torch.Generator().manual_seed(seed))
    ids, scores = generate_seq2seq(model, src, 5, bos_id=BOS, eos_id=EOS, num_beams=num_beams,
                                   early_stopping=early_stopping, return_scores=True,
                                   num_return_sequences=returned)
    assert ids.shape[0] == scores.shape[0] == 2 * returned
    for b in range(2):
        expected = reference_hypotheses(model, src[b:b + 1], 5, num_beams, 1.0,
                                        early_stopping)[:returned]
        for i, (ref_score, tokens) in enumerate(expected):
            row = b * returned + i
            assert ids[row, 1:1 + len(tokens)].tolist() == tokens
            assert abs(float(scores[row]) - ref_score) < 1e-5
        assert scores[b * returned:(b + 1) * returned].diff().le(0).all()
    best = beam_search(model, src, 5, bos_id=BOS, eos_id=EOS, num_beams=num_beams,
                       early_stopping=early_stopping)
    first = ids[::returned, :best.shape[1]]
    assert torch.equal(first, best[:, :first.shape[1]])


def test_fewer_finished_hypotheses_than_asked_are_padded_rows_scored_minus_inf() -> None:
    model = make(vocab=3, seed=1)  # ids 0..2, eos = 2
    src = torch.tensor([[0, 1, 0]])
    ids, scores = beam_search(model, src, 1, bos_id=BOS, eos_id=EOS, num_beams=4,
                              num_return_sequences=4, return_scores=True)
    # One step over 3 tokens: exactly 3 hypotheses ([0], [1], [eos]); the 4th row is empty.
    assert torch.isfinite(scores[:3]).all() and scores[3] == float("-inf")
    assert ids[3, 1:].eq(EOS).all()  # pad defaults to eos


@pytest.mark.parametrize("returned", [0, 5, 1.0, True])
def test_num_return_sequences_out_of_range_is_refused(returned: object) -> None:
    model = make()
    with pytest.raises(ValueError, match=r"num_return_sequences: expected an int in \[1, "
                                         r"num_beams=4\]"):
        beam_search(model, torch.tensor([[3, 4]]), 3, bos_id=BOS, eos_id=EOS, num_beams=4,
                    num_return_sequences=returned)
    with pytest.raises(ValueError, match=r"num_beams=1\], got 2"):
        generate_seq2seq(model, torch.tensor([[3, 4]]), 3, bos_id=BOS, eos_id=EOS,
                         num_return_sequences=2)


@pytest.mark.parametrize("early_stopping", [True, False])
def test_beam_scores_are_those_of_the_returned_sequences(early_stopping: bool) -> None:
    model = make(seed=4)
    src = torch.randint(3, 9, (3, 5), generator=torch.Generator().manual_seed(4))
    ids, scores = beam_search(model, src, 6, bos_id=BOS, eos_id=EOS, num_beams=3,
                              length_penalty=0.7, early_stopping=early_stopping,
                              return_scores=True)
    for row in range(3):
        tokens = ids[row, 1:].tolist()
        if EOS in tokens:
            tokens = tokens[:tokens.index(EOS) + 1]
        assert abs(sequence_score(model, src[row:row + 1], tokens, 0.7) - scores[row]) < 1e-5


def test_padded_sources_decode_like_each_alone() -> None:
    torch.manual_seed(0)
    config = TransformerConfig(9, 9, d_model=16, num_heads=2, num_encoder_layers=1,
                               num_decoder_layers=1, d_ff=32, dropout=0.0, max_len=12, pad_id=0)
    model = Transformer(config).eval()
    src = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    batched = beam_search(model, src, 5, bos_id=BOS, eos_id=EOS, num_beams=2)
    for row, n in ((0, 4), (1, 2)):
        alone = beam_search(model, src[row:row + 1, :n], 5, bos_id=BOS, eos_id=EOS, num_beams=2)
        assert batched[row, :alone.shape[1]].tolist() == alone[0].tolist()


def test_bad_input() -> None:
    model = make()
    src = torch.tensor([[3, 4]])
    with pytest.raises(ValueError, match="num_beams"):
        generate_seq2seq(model, src, 3, bos_id=BOS, eos_id=EOS, num_beams=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_seq2seq(model, src, 12, bos_id=BOS, eos_id=EOS)
    with pytest.raises(ValueError, match="bos_id"):
        generate_seq2seq(model, src, 3, bos_id=99, eos_id=EOS)
    with pytest.raises(ValueError, match="src: expected at least one token"):
        generate_seq2seq(model, torch.zeros(1, 0, dtype=torch.long), 3, bos_id=BOS, eos_id=EOS)


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize(("src", "kwargs", "error", "message"), [
    (torch.tensor([[True, False]]), {}, ValueError,
     r"src: expected integer token ids \(torch.long or torch.int32\) of shape B x L, got dtype "
     "torch.bool"),
    (torch.tensor([[3, 9]]), {}, ValueError, r"src: expected ids in \[0, 9\)"),
    (torch.tensor([[3, -2]]), {}, ValueError, r"src: .* \(\[-2\]"),
    (torch.zeros(0, 2, dtype=torch.long), {}, ValueError, "src: expected at least one token"),
    (torch.tensor([[3, 4]]), {"eos_id": 9}, ValueError, r"eos_id: expected an id in \[0, 9\)"),
    (torch.tensor([[3, 4]]), {"pad_id": -1}, ValueError, r"pad_id: expected an id in \[0, 9\)"),
    (torch.tensor([[3, 4]]), {"bos_id": True}, ValueError, "bos_id: expected an id"),
    (torch.tensor([[3, 4]]), {"length_penalty": float("nan")}, ValueError,
     "length_penalty: expected a finite float, got nan"),
    (torch.tensor([[3, 4]]), {"length_penalty": 10**400}, ValueError,
     "length_penalty: expected a finite float"),
    (torch.tensor([[3, 4]]), {"length_penalty": "1"}, ValueError,
     "length_penalty: expected a finite float, got '1'"),
])
def test_bad_ids_are_refused_before_any_compute(num_beams: int, src: torch.Tensor,
                                                kwargs: dict, error: type,
                                                message: str) -> None:
    model = make()
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    model.encoder.register_forward_pre_hook(lambda *_: calls.append(1))
    model.decoder.register_forward_pre_hook(lambda *_: calls.append(1))
    args = {"bos_id": BOS, "eos_id": EOS, **kwargs}
    with pytest.raises(error, match=message):
        generate_seq2seq(model, src, 3, num_beams=num_beams, **args)
    assert not calls


@pytest.mark.parametrize("num_beams", [1, 3])
def test_nan_logits_are_refused(num_beams: int) -> None:
    model = make()
    with torch.no_grad():
        model.output_proj.weight[5] = float("nan")
    with pytest.raises(ValueError, match=r"logits \(the model's output for new token 1\): "
                                         r"row 0 \(of \d+\) holds NaN"):
        generate_seq2seq(model, torch.tensor([[3, 4]]), 3, bos_id=BOS, eos_id=EOS,
                         num_beams=num_beams)


def test_a_model_without_the_protocol_is_refused_by_name() -> None:
    lm = DecoderLM(DecoderLMConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=2, max_len=8))
    src = torch.zeros(1, 2, dtype=torch.long)
    for bad, name in ((lm, "DecoderLM"), (None, "NoneType")):
        for num_beams in (1, 2):
            with pytest.raises(TypeError, match=f"expected an encoder-decoder .*got {name}$"):
                generate_seq2seq(bad, src, 2, bos_id=1, eos_id=2, num_beams=num_beams)
