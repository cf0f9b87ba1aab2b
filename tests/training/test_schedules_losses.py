import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.training.losses import label_smoothed_cross_entropy
from attnlab.training.schedules import (
    ConstantSchedule,
    NoamSchedule,
    WarmupCosineSchedule,
    make_schedule,
)
from conftest import assert_close


def test_noam_matches_the_paper_formula():
    s = NoamSchedule(d_model=512, warmup=4000, factor=2.0)
    for step in [0, 1, 100, 3998, 3999, 4000, 10_000, 100_000]:
        n = step + 1
        expected = 2.0 * 512**-0.5 * min(n**-0.5, n * 4000**-1.5)
        assert s.lr_at(step) == pytest.approx(expected, rel=1e-12)
    peak = max(range(8000), key=s.lr_at)
    assert peak == 3999  # the peak is at step number `warmup` (n = 4000)


def test_warmup_cosine_matches_its_formula():
    s = WarmupCosineSchedule(peak_lr=1e-3, warmup=10, total_steps=110, min_lr=1e-5)
    assert s.lr_at(0) == pytest.approx(1e-4)
    assert s.lr_at(9) == pytest.approx(1e-3)
    for step in [10, 35, 60, 85, 110, 500]:
        t = min(1.0, (step - 10) / 100)
        expected = 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * t))
        assert s.lr_at(step) == pytest.approx(expected, rel=1e-12)
    assert s.lr_at(60) == pytest.approx((1e-3 + 1e-5) / 2)


def test_constant_and_factory():
    assert ConstantSchedule(0.1, warmup=4).lr_at(1) == pytest.approx(0.05)
    assert ConstantSchedule(0.1, warmup=4).lr_at(50) == 0.1
    assert isinstance(
        make_schedule("noam", lr=1, warmup=10, total_steps=5, d_model=8), NoamSchedule
    )
    with pytest.raises(ValueError, match="schedule"):
        make_schedule("linear", lr=1, warmup=10, total_steps=5, d_model=8)


def test_schedule_drives_a_torch_optimizer():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    s = WarmupCosineSchedule(peak_lr=0.5, warmup=3, total_steps=10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, s.lr_at)
    for step in range(12):
        assert opt.param_groups[0]["lr"] == pytest.approx(s.lr_at(step))
        opt.step()
        sched.step()


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_label_smoothed_loss_equals_torch(smoothing):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g, dtype=torch.float64)
    target = torch.randint(0, 11, (3, 7), generator=g)
    target[0, 4:] = 0  # padding
    target[2, 1:] = 0
    ours = label_smoothed_cross_entropy(logits, target, smoothing=smoothing, ignore_index=0)
    ref = F.cross_entropy(
        logits.reshape(-1, 11), target.reshape(-1), label_smoothing=smoothing, ignore_index=0
    )
    assert_close(ours.double(), ref, rtol=1e-6, atol=1e-7)
    total = label_smoothed_cross_entropy(
        logits, target, smoothing=smoothing, ignore_index=0, reduction="sum"
    )
    assert_close(total.double(), ref * (target != 0).sum(), rtol=1e-6, atol=1e-6)


def test_loss_bad_input():
    with pytest.raises(ValueError, match="target"):
        label_smoothed_cross_entropy(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="smoothing"):
        label_smoothed_cross_entropy(
            torch.randn(2, 5), torch.zeros(2, dtype=torch.long), smoothing=1.0
        )
