"""Checks of tutorial 6's exercises (``attnlab exercises check 6``)."""

import math

import torch

from attnlab.exercises.checks import assert_close, assert_equal, learner
from attnlab.training.losses import label_smoothed_cross_entropy
from attnlab.training.schedules import NoamSchedule


def chapter():
    return learner(__file__)


def test_6_1_smoothed_optimum():
    for V, y, eps in [(14, 3, 0.1), (5, 0, 0.3)]:
        q, gap = chapter().smoothed_optimum(V, y, eps)
        assert_close(q.sum(), torch.tensor(1.0),
                     name=f"sum of smoothed_optimum({V}, {y}, {eps})[0]")
        z = q.log().clone().requires_grad_(True)
        loss = label_smoothed_cross_entropy(z[None], torch.tensor([y]), smoothing=eps)
        (grad,) = torch.autograd.grad(loss, z)
        assert_close(grad, torch.zeros(V), atol=1e-6,
                     name=f"the loss's gradient at log q (V={V}, eps={eps}): q must be the optimum")
        others = torch.cat([q[:y], q[y + 1:]])
        expected_gap = math.log(q[y].item() / others.max().item())
        assert abs(float(gap) - expected_gap) < 1e-4, (
            f"smoothed_optimum({V}, {y}, {eps})[1] = {gap}, expected {expected_gap:.5f}")
    assert chapter().smoothed_optimum(10, 2, 0.0)[1] == math.inf, (
        "without smoothing the optimal gap is infinite (math.inf)")


def test_6_2_noam_peak():
    for E, w, f in [(512, 1000, 1.0), (512, 4000, 1.0), (64, 300, 2.0)]:
        schedule = NoamSchedule(d_model=E, warmup=w, factor=f)
        lrs = [schedule.lr_at(s) for s in range(3 * w)]
        step = max(range(len(lrs)), key=lrs.__getitem__)
        got_step, got_lr = chapter().noam_peak(E, w, f)
        assert_equal(got_step, step, name=f"noam_peak({E}, {w}, {f})[0], the peak's step")
        assert abs(got_lr - lrs[step]) < 1e-12, (
            f"noam_peak({E}, {w}, {f})[1] = {got_lr}, expected {lrs[step]}")


def test_6_3_compare_decoders():
    targets = ["a", "b", "c", "d", "e"]
    greedy = ["a", "x", "y", "d", "e"]
    beam = ["a", "b", "z", "q", "e"]
    assert_equal(tuple(chapter().compare_decoders(targets, greedy, beam)), (2, 1, 1),
                 name="compare_decoders: (greedy wrong, beam fixes, beam breaks)")
    assert_equal(tuple(chapter().compare_decoders(["a"], ["a"], ["a"])), (0, 0, 0),
                 name="compare_decoders when both are right")
