"""Speculative decoding in the engine is lossless and tidy: a greedy request's tokens are the
same with speculation on or off, alone or beside other requests (its drafts run as decode
rows, through the decoding kernels); the pages taken for drafts go back to the pool; sampled
tokens follow the target's distribution (and a wrong acceptor is caught by the same test);
what cannot run is refused by name; the engine counts what speculation did."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.kernels.install import optimize_for_inference
from attnlab.kernels.rule import batch_invariant, features, rule
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.serving import Engine, SamplingParams
from attnlab.serving import speculation as speculation_module
from attnlab.serving.params import Speculation
from attnlab.serving.speculation import speculation_from, split_draft
from distribution_checks import chi_square_p, exact_distribution

V = 61
NGRAM, SELF = Speculation("ngram", 4), Speculation("self", 3, layers=1)
DRAFT = Speculation("draft", 3)


def _draft(vocab: int = V, seed: int = 1, **sizes: int) -> DecoderLM:
    """A smaller model of the same vocabulary (other weights): the engine's draft model."""
    torch.manual_seed(seed)
    config = {"d_model": 32, "num_layers": 1, "num_heads": 2, "max_len": 128} | sizes
    return DecoderLM(DecoderLMConfig.llama(vocab, **config)).eval()


def _model() -> DecoderLM:
    """A tiny Llama with the fast modules, its kernels chosen by the rule (as
    ``test_engine_invariance``'s)."""
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(V, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                   max_len=128, initializer_range=0.3)
    return optimize_for_inference(DecoderLM(config).eval())


def _serve(model: DecoderLM, prompt: list[int], speculation: Speculation | None,
           others: list[list[int]], *, new: int = 16, **options: object
           ) -> tuple[list[int], Engine, dict[int, torch.Tensor]]:
    """The greedy tokens of ``prompt``, prefilled alone, then decoded beside ``others`` (each
    speculating as it does); the engine; and the logits row that chose each of its tokens,
    by the token's position (from a plain step or from a verification)."""
    engine = Engine(copy.deepcopy(model), max_batch=8, max_tokens_per_step=64, page_size=4,
                    **options)
    target = engine.add_request(prompt, SamplingParams(new, temperature=0,
                                                       speculation=speculation))
    rows: dict[int, torch.Tensor] = {}
    plain, verify = engine._next_token, engine.speculator.verify

    def next_token(request, row, *args):
        if request.request_id == target:
            rows[len(request.tokens)] = row.clone()
        return plain(request, row, *args)

    def verified(request, logits, *args):
        tokens = verify(request, logits, *args)
        if request.request_id == target:
            rows.update({len(request.tokens) + i: logits[i].clone()
                         for i in range(len(tokens))})
        return tokens

    engine._next_token, engine.speculator.verify = next_token, verified
    events = engine.step()  # the target's prompt, alone in every run
    for other in others:
        engine.add_request(other, SamplingParams(new, temperature=0, speculation=speculation))
    while engine.has_work():
        events += engine.step()
    return [e.token_id for e in events if e.request_id == target], engine, rows


@pytest.fixture(scope="module")
def invariant_model(tmp_path_factory) -> DecoderLM:
    """The model with the rule's kernels (not the session's pin to the formula), skipping
    where the rule names no batch-invariant kernel."""
    patch = pytest.MonkeyPatch()
    patch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path_factory.mktemp("kernels")))
    patch.delenv("ATTNLAB_KERNELS", raising=False)
    plan = {b: rule("float32", torch.float32, features())[b][0] for b in ("1", "2-8", "9-32")}
    if not batch_invariant(plan):
        patch.undo()
        pytest.skip(f"this machine's rule names no batch-invariant float32 kernel ({plan})")
    yield _model()
    patch.undo()


# Prompts over a few ids repeat themselves, so that prompt lookup finds matches.
prompts = st.lists(st.integers(0, 5), min_size=2, max_size=20).map(
    lambda p: [7 * t % V for t in p])


@pytest.mark.usefixtures("native_kernels")
@settings(max_examples=4, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(prompt=prompts, seed=st.integers(0, 10**6))
def test_greedy_tokens_are_the_same_with_speculation_on_or_off_alone_and_beside_others(
        invariant_model, prompt, seed):
    model = invariant_model
    rng = torch.Generator().manual_seed(seed)
    others = [torch.randint(0, 6, (n,), generator=rng).mul(7).remainder(V).tolist()
              for n in (3, 30, 5)]
    plain, _, plain_rows = _serve(model, prompt, None, [])
    assert len(plain) == 16 and len(plain_rows) == 16
    # alone and beside others, speculating beside them (at most 8 decoding) or switched off
    # while four decode (at most 2)
    runs = [(NGRAM, [], 8), (SELF, [], 8), (DRAFT, [], 8), (NGRAM, others, 8),
            (SELF, others, 8), (DRAFT, others, 8), (SELF, others, 2), (DRAFT, others, 2)]
    for speculation, crowd, most in runs:
        tokens, engine, rows = _serve(model, prompt, speculation, crowd,
                                      speculate_max_requests=most, draft_model=_draft())
        assert tokens == plain, (speculation, len(crowd), most)
        # bit for bit: every token's logits, from a verification row or a plain decode row
        assert rows.keys() == plain_rows.keys()
        for t, row in rows.items():
            assert torch.equal(row, plain_rows[t]), (t, (row - plain_rows[t]).abs().max())
        stats = engine.stats()
        assert stats["pages_used"] == 0
        assert 0 <= stats["spec_accepted"] <= stats["spec_proposed"]
        if speculation is not NGRAM:  # a draft model always proposes
            assert stats["spec_verifications"] > 0
        if most == 2:  # four requests decode at first: switched off then
            assert stats["spec_switched_off"] > 0


def test_a_repeating_text_accepts_drafts_and_verifies_several_tokens_a_step():
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4,
                                            max_len=128)).eval()
    plain, _, _ = _serve(model, [5, 6, 7], None, [], new=40)
    # the model's own greedy text as the prompt: prompt lookup proposes what it will say
    _, engine, _ = _serve(model, [5, 6, 7, *plain], NGRAM, [], new=20)
    stats = engine.stats()
    assert stats["spec_accepted"] > 0 and stats["spec_tokens_per_verification"] > 1
    assert stats["spec_acceptance_rate"] == stats["spec_accepted"] / stats["spec_proposed"]


@pytest.mark.parametrize("speculation", [NGRAM, SELF, DRAFT], ids=["ngram", "self", "draft"])
def test_the_pages_taken_for_drafts_go_back_to_the_pool(speculation):
    """Every step, a speculating request holds no page past the one its next token needs;
    once all requests end, every page is available again (prefix caching off, so that no
    page stays cached)."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4,
                                            max_len=128)).eval()
    engine = Engine(model, max_batch=4, max_tokens_per_step=64, page_size=2,
                    prefix_caching=False, speculate_max_requests=4, draft_model=_draft())
    start = engine.pool.available
    for i in range(3):
        engine.add_request([1, 2, 3, 1, 2, 3, i], SamplingParams(
            30, temperature=0 if i else 0.8, seed=i, speculation=speculation))
    while engine.has_work():
        engine.step()
        for r in engine.scheduler.running:
            assert len(r.table) <= -(-(len(r.tokens) + 1) // 2), (len(r.table), len(r.tokens))
    assert engine.stats()["spec_proposed"] > engine.stats()["spec_accepted"]  # some rejected
    assert engine.pool.available == start and engine.pool.used == 0


def test_drafts_the_pool_has_no_pages_for_are_cut_to_the_slots_held():
    """With no page to spare, a request verifies only the drafts its own pages hold room
    for (the slots of its last page), never pausing another request for a guess."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4,
                                            max_len=128)).eval()
    engine = Engine(model, max_batch=2, page_size=4, prefix_caching=False)
    allocate, reserve, refused = engine.pool.allocate, engine.speculator.reserve, []

    def reserve_from_a_full_pool(drafts):
        def none(count, **kwargs):
            refused.append(count)
            return None
        engine.pool.allocate = none
        try:
            return reserve(drafts)
        finally:
            engine.pool.allocate = allocate

    engine.speculator.reserve = reserve_from_a_full_pool
    proposed = []
    propose = engine.speculator.rows
    engine.speculator.rows = lambda drafts: proposed.append(
        {r.computed: len(d.tokens) for r, d in drafts.items()}) or propose(drafts)
    engine.add_request([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(
        20, temperature=0, speculation=Speculation("ngram", 8)))
    made = 0
    while engine.has_work():
        made += sum(e.token_id is not None for e in engine.step())
    assert made == 20 and refused and engine.stats()["preemptions"] == 0
    # the drafts run at computed c fill the slots of the pages held: at most 4 - (c + 1) % 4
    cut = [(c, n) for step in proposed for c, n in step.items()]
    assert cut and all(c + 1 + n <= -(-(c + 1) // 4) * 4 for c, n in cut), cut
    assert engine.pool.used == 0


# --- sampling: the distribution of the tokens is the target's -----------------------------

# 3^3 = 27 sequences of new tokens: the prefill makes the first, one verification the other
# two (a draft, accepted or not, and the token after it).
SMALL_V, NEW, SAMPLES = 3, 3, 600


def _peaked() -> DecoderLM:
    """A tiny model whose next-token distributions are neither uniform nor one token's
    (weights N(0, 0.3^2)): a wrong acceptor then moves some probability far enough to see."""
    torch.manual_seed(0)
    # max_len 64: a step packs up to max_tokens_per_step tokens in one sequence, which the
    # model checks against its max_len
    model = DecoderLM(DecoderLMConfig.llama(SMALL_V, d_model=16, num_layers=2, num_heads=2,
                                            max_len=64)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model






def _peaked_draft() -> DecoderLM:
    """A 1-layer draft of other peaked weights (seed 1): its ``q`` is far from the target's
    ``p``, so that a wrong acceptor's bias shows."""
    draft = _draft(SMALL_V, d_model=16, max_len=64)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    return draft


def _sample(model: DecoderLM, prompt: list[int], speculation: Speculation
            ) -> tuple[torch.Tensor, dict]:
    """Counts of the SAMPLES sequences of NEW tokens (seeds 0..), every request speculating
    (none switched off), and the engine's stats (``draft``: ``_peaked_draft``)."""
    engine = Engine(model, max_batch=16, max_tokens_per_step=64, page_size=4,
                    max_queue=SAMPLES, speculate_max_requests=16, draft_model=_peaked_draft())
    names = {engine.add_request(prompt, SamplingParams(NEW, seed=seed,
                                                       speculation=speculation)): []
             for seed in range(SAMPLES)}
    while engine.has_work():
        for e in engine.step():
            names[e.request_id].append(e.token_id)
    weights = SMALL_V ** torch.arange(NEW - 1, -1, -1)
    counts = torch.zeros(SMALL_V ** NEW)
    for tokens in names.values():
        counts[int((torch.tensor(tokens) * weights).sum())] += 1
    return counts, engine.stats()


def _resample_from_p(p, q, drafts, generator=None):
    """A wrong acceptor: on a rejection it draws from p, not from norm(max(0, p - q))."""
    n = drafts.shape[0]
    for i in range(n):
        d = int(drafts[i])
        q_d = 1.0 if q is None else q[i, d]
        if torch.rand((), generator=generator) * q_d >= p[i, d]:
            return torch.cat([drafts[:i], torch.multinomial(p[i], 1, generator=generator)])
    return torch.cat([drafts, torch.multinomial(p[n], 1, generator=generator)])


@pytest.mark.parametrize("speculation", [Speculation("ngram", 1), Speculation("self", 1, 1),
                                         Speculation("draft", 1)],
                         ids=["ngram", "self", "draft"])
def test_sampled_tokens_follow_the_target_distribution_and_a_wrong_acceptor_fails(
        monkeypatch, speculation):
    model, prompt = _peaked(), [1, 2, 0, 2, 1, 0, 1]
    probs = exact_distribution(model, prompt, SMALL_V, NEW)
    counts, stats = _sample(model, prompt, speculation)
    assert stats["spec_verifications"] > SAMPLES / 2  # most requests verified a draft
    assert chi_square_p(counts, probs) > 1e-3
    monkeypatch.setattr(speculation_module, "accept_sampled", _resample_from_p)
    # (seeds fixed, so both p-values are fixed: 1e-4 leaves the 1-layer draft's wrong
    # acceptor, whose q is close to p, a margin of 4x)
    assert chi_square_p(_sample(model, prompt, speculation)[0], probs) < 1e-4


# --- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize(("make", "message"), [
    (lambda: Speculation("beam"), r"speculative: expected 'ngram', 'self:N' or 'draft', got "
                                  r"'beam'"),
    (lambda: Speculation("ngram", 0), r"num_speculative_tokens: expected an int in \[1, 31\]"),
    (lambda: Speculation("self"), r"speculative: expected self:N with an int N >= 1"),
    (lambda: Speculation("self", 3, 1, (1, 2)), r"prediction: a predicted output is looked "
                                                r"up by ngram speculation"),
    (lambda: speculation_from("self"), r"speculative: expected ngram, ngram:K, self:N"),
    (lambda: speculation_from("draft:folder"), r"draft:FOLDER loads a draft model when the "
                                               r"server starts"),
    (lambda: speculation_from("ngram:0"), r"speculative: expected ngram, ngram:K, self:N"),
    (lambda: split_draft("draft:"), r"speculative: expected draft:FOLDER"),
])
def test_bad_speculation_is_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_draft_of_as_many_layers_as_the_model_is_refused():
    model = DecoderLM(DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4,
                                            max_len=64)).eval()
    with pytest.raises(ValueError, match=r"speculative: self:2 asks for a draft of 2 layers; "
                                         r"expected fewer than the model's 2"):
        Engine(model).add_request([1, 2], SamplingParams(4, speculation=Speculation(
            "self", 3, 2)))


def test_speculation_from_names_the_defaults():
    assert speculation_from("ngram") == Speculation("ngram", 10)
    assert speculation_from("ngram:3") == Speculation("ngram", 3)
    assert speculation_from("ngram:3", 5, (4, 5)) == Speculation("ngram", 5, None, (4, 5))
    assert speculation_from("self:1") == Speculation("self", 5, 1)
    assert speculation_from("draft") == Speculation("draft", 5)
    assert split_draft("draft:some/folder") == "some/folder" and split_draft("ngram") is None


def test_draft_without_a_draft_model_and_a_draft_that_does_not_fit_are_refused_by_name():
    model = DecoderLM(DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4,
                                            max_len=64)).eval()
    with pytest.raises(ValueError, match=r"speculative: draft asks for the server's draft "
                                         r"model, and this server has none"):
        Engine(model).add_request([1, 2], SamplingParams(4, speculation=DRAFT))
    with pytest.raises(ValueError, match=r"draft_model: expected the model's vocabulary of "
                                         r"61 tokens \(a draft shares the tokenizer\), got "
                                         r"vocab_size=60"):
        Engine(model, draft_model=_draft(V - 1))
    with pytest.raises(ValueError, match=r"draft_model: expected a context of at least the "
                                         r"model's max_len=64 tokens .* got max_len=32"):
        Engine(model, draft_model=_draft(max_len=32))
    with pytest.raises(TypeError, match=r"draft_model: expected an attnlab DecoderLM, got "
                                        r"Linear"):
        Engine(model, draft_model=torch.nn.Linear(2, 2))


def test_draft_caches_are_bounded_by_speculate_max_requests_and_freed_with_the_requests():
    """Five requests asking for a draft, at most two speculating a step: at most two draft
    caches live at any time (the least recently used dropped, refilled when its request
    speculates again); none once the requests end; every request's greedy tokens are the
    plain ones."""
    model = DecoderLM(DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4,
                                            max_len=128)).eval()
    prompts = [[1, 2, 3] * (i + 1) for i in range(5)]
    lengths = [6, 25, 9, 30, 14]

    def run(speculation, **options):
        engine = Engine(model, max_batch=8, max_tokens_per_step=64, page_size=4, **options)
        ids = [engine.add_request(p, SamplingParams(n, temperature=0, speculation=speculation))
               for p, n in zip(prompts, lengths, strict=True)]
        out, most = {i: [] for i in ids}, 0
        while engine.has_work():
            for e in engine.step():
                out[e.request_id].append(e.token_id)
            most = max(most, len(engine.speculator._proposers))
        return list(out.values()), engine, most

    plain, _, _ = run(None)
    tokens, engine, most = run(DRAFT, speculate_max_requests=2, draft_model=_draft())
    assert tokens == plain
    assert engine.stats()["spec_verifications"] > 0 and most == 2
    assert len(engine.speculator._proposers) == 0


def test_a_draft_cache_past_the_bound_drops_the_least_recently_used_which_refills():
    """With ``speculate_max_requests=1``, a second request's draft cache drops the first's;
    the first then refills one from its tokens and proposes what it proposed before."""
    model = DecoderLM(DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4,
                                            max_len=64)).eval()
    engine = Engine(model, page_size=4, speculate_max_requests=1, draft_model=_draft())
    for prompt in ([1, 2, 3, 4], [5, 6, 7]):
        engine.add_request(prompt, SamplingParams(8, temperature=0, speculation=DRAFT))
    engine.step()  # both prompts
    first, second = engine.scheduler.running
    spec = engine.speculator
    before = spec.propose([(first, 1)])[first].tokens
    assert spec.propose([(second, 1)])[second].tokens and list(spec._proposers) == [second]
    assert spec.propose([(first, 1)])[first].tokens == before
    assert list(spec._proposers) == [first]
