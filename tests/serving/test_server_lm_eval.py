"""A real evaluation client against ``attnlab serve``: lm-eval's ``local-completions`` model
(``LocalCompletionsAPI``, which asks for ``echo`` + ``logprobs``) scores the choices of a small
multiple-choice set, and its loglikelihoods equal those of lm-eval's Hugging Face backend on
the same checkpoint."""

from __future__ import annotations

import pytest
from server_live import live

from attnlab.serving.server import create_app

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from lm_eval.api.instance import Instance  # noqa: E402 (lm-eval is optional)
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402

# (question, choices, the index of the answer): the model is random, so what is compared is
# the score of every choice, not the accuracy
QUESTIONS = [
    ("the fox said", [" hello", " once upon a time", " to the world"], 0),
    ("once upon a time there was", [" a fox", " the world", " hello"], 0),
    ("hello to the", [" world", " fox", " time"], 0),
]


def _requests() -> list[Instance]:
    return [Instance(request_type="loglikelihood", doc={"question": q}, arguments=(q, c),
                     idx=i)
            for q, choices, _ in QUESTIONS for i, c in enumerate(choices)]


def test_local_completions_scores_equal_the_hf_backend(qwen2_folder) -> None:
    app = create_app(qwen2_folder, max_batch=4, page_size=4, kv_pages=256)
    with live(app) as url:
        served = LocalCompletionsAPI(base_url=f"{url}/v1/completions",
                                     model=qwen2_folder.name, tokenizer=str(qwen2_folder),
                                     tokenizer_backend="huggingface", max_length=256)
        ours = served.loglikelihood(_requests())
    hf = HFLM(pretrained=str(qwen2_folder), device="cpu", batch_size=1, max_length=256)
    theirs = hf.loglikelihood(_requests())
    assert len(ours) == len(theirs) == sum(len(c) for _, c, _ in QUESTIONS)
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-4)
        assert greedy_a == greedy_b
    # each question's choice ranking is the same
    k = 0
    for _, choices, _ in QUESTIONS:
        scores_a = [ours[k + i][0] for i in range(len(choices))]
        scores_b = [theirs[k + i][0] for i in range(len(choices))]
        assert max(range(len(choices)), key=scores_a.__getitem__) == \
            max(range(len(choices)), key=scores_b.__getitem__)
        k += len(choices)
