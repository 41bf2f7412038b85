"""Batch arithmetic and the LR schedule as pure functions, for several batch/accum/world."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.schedule import (
    BatchPlan,
    WarmupCosine,
    build_schedule,
    is_window_end,
    lr_at,
    scale_lr,
    window_size,
)


def reference_lr(step, total, warmup, peak, low):
    """The formula, written out independently of the implementation."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return low + (peak - low) * (1 + math.cos(math.pi * min(t, 1.0))) / 2


@pytest.mark.parametrize(
    ("batch", "accum", "world", "batches", "epochs"),
    [(64, 1, 1, 100, 3), (32, 4, 1, 99, 2), (16, 3, 8, 10, 5), (256, 2, 64, 7, 1), (8, 5, 2, 4, 4)],
)
def test_plan_and_schedule_for_batch_accum_world(batch, accum, world, batches, epochs):
    plan = BatchPlan(batch, accum, world, batches, epochs)
    assert plan.effective_batch == batch * accum * world
    assert plan.steps_per_epoch == math.ceil(batches / accum)  # the partial window is stepped
    assert plan.total_steps == plan.steps_per_epoch * epochs
    schedule = build_schedule(plan, 0.1, 256, "linear", 0.001, 0.1, None)
    assert schedule.peak_lr == pytest.approx(0.1 * plan.effective_batch / 256)
    assert schedule.warmup_steps == min(round(0.1 * plan.total_steps), plan.total_steps - 1)
    for step in range(plan.total_steps + 2):
        expected = reference_lr(
            step, plan.total_steps, schedule.warmup_steps, schedule.peak_lr, 0.001
        )
        assert schedule.lr(step) == pytest.approx(expected, rel=1e-12)


def test_schedule_shape_is_kept_when_the_batch_changes():
    # The same 12800-sample dataset: 400 batches of 32 on one rank, or 200 per rank on two.
    small = build_schedule(BatchPlan(32, 1, 1, 400, 10), 0.1, 256, "linear", 0.0, 0.05, None)
    big = build_schedule(BatchPlan(32, 4, 2, 200, 10), 0.1, 256, "linear", 0.0, 0.05, None)
    assert big.total_steps == small.total_steps // 8 == 500
    assert big.peak_lr == pytest.approx(8 * small.peak_lr)
    assert small.warmup_steps / small.total_steps == pytest.approx(
        big.warmup_steps / big.total_steps, abs=0.01
    )
    # Half way through, both are half way down the cosine.
    assert small.lr(
        small.total_steps // 2 + small.warmup_steps // 2
    ) / small.peak_lr == pytest.approx(
        big.lr(big.total_steps // 2 + big.warmup_steps // 2) / big.peak_lr, abs=0.02
    )


def test_lr_scaling_rules():
    assert scale_lr(0.1, 1024, 256, "linear") == pytest.approx(0.4)
    assert scale_lr(0.1, 1024, 256, "sqrt") == pytest.approx(0.2)
    assert scale_lr(0.1, 1024, 256, "none") == 0.1
    with pytest.raises(ValueError):
        scale_lr(0.1, 1, 1, "cubic")


def test_warmup_then_cosine_endpoints():
    assert lr_at(0, 100, 10, 1.0, 0.0) == pytest.approx(0.1)
    assert lr_at(9, 100, 10, 1.0, 0.0) == pytest.approx(1.0)
    assert lr_at(10, 100, 10, 1.0, 0.0) == pytest.approx(1.0)
    assert lr_at(100, 100, 10, 1.0, 0.01) == pytest.approx(0.01)
    assert lr_at(500, 100, 10, 1.0, 0.01) == pytest.approx(0.01)
    assert lr_at(0, 100, 0, 1.0, 0.0) == pytest.approx(1.0)


@pytest.mark.parametrize(("batches", "accum"), [(10, 3), (9, 3), (7, 1), (2, 4)])
def test_windows_cover_every_batch_and_average_it(batches, accum):
    ends = [i for i in range(batches) if is_window_end(i, batches, accum)]
    assert len(ends) == math.ceil(batches / accum) and ends[-1] == batches - 1
    # Each window's micro-batches carry weights 1/window that sum to one: a mean, not a sum.
    start = 0
    for end in ends:
        sizes = {window_size(i, batches, accum) for i in range(start, end + 1)}
        assert sizes == {end + 1 - start}
        start = end + 1


def test_scheduler_sets_the_rate_of_each_optimizer_step():
    plan = BatchPlan(8, 2, 1, 9, 2)
    schedule = build_schedule(plan, 0.5, 16, "linear", 0.0, 0.0, 2)
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD(
        [{"params": [parameter]}, {"params": [], "weight_decay": 0.0}], lr=9.9
    )
    scheduler = WarmupCosine(optimizer, schedule)
    seen = []
    for _ in range(plan.total_steps):
        seen.append(optimizer.param_groups[0]["lr"])
        assert optimizer.param_groups[1]["lr"] == seen[-1]
        scheduler.step()
    assert seen == [schedule.lr(s) for s in range(plan.total_steps)]
    restored = WarmupCosine(optimizer, schedule)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.steps == plan.total_steps
