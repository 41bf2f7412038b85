"""The order inside one optimizer step, and the measurement helpers, without a full run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainers.loop import optimizer_step
from trainers.metrics import StepTimer, Window, bottleneck_verdict, iter_timed


class Recorder:
    """Stands in for the GradScaler, optimizer and scheduler; logs each call."""

    def __init__(self, calls: list[str], name: str) -> None:
        self.calls = calls
        self.name = name

    def __getattr__(self, method: str):
        def record(*args, **kwargs):
            self.calls.append(f"{self.name}.{method}")

        return record


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_unscale_before_clip_then_step_update_schedule_zero(monkeypatch, clip):
    calls: list[str] = []
    monkeypatch.setattr(
        torch.nn.utils,
        "clip_grad_norm_",
        lambda params, max_norm: calls.append("clip") or torch.tensor(0.0),
    )
    learner = SimpleNamespace(
        scaler=Recorder(calls, "scaler"),
        optimizer=Recorder(calls, "optimizer"),
        scheduler=Recorder(calls, "scheduler"),
        module=torch.nn.Linear(2, 2),
    )
    optimizer_step(learner, clip)
    expected = ["scaler.unscale_", "clip"] if clip else []
    expected += ["scaler.step", "scaler.update", "scheduler.step", "optimizer.zero_grad"]
    assert calls == expected


def test_timer_splits_wait_from_compute():
    timer = StepTimer()
    for _batch in iter_timed(range(3), timer):
        timer.record_wait(0.5)  # pretend the loader blocked for half a second
        timer.end_step(samples=4)
    window = timer.take()
    assert window.steps == 3 and window.samples == 12
    assert window.wait_s >= 1.5 and window.elapsed_s >= 0  # elapsed is wall time; wait is charged
    assert timer.take() == Window()
    assert timer.total.steps == 3


def test_verdict_names_the_bottleneck():
    assert bottleneck_verdict(0.38, 0.1, "cuda", 4) == (
        "input-bound: the GPU waited 38% of the time for data; raise --workers (now 4) or shrink --image-size"
    )
    assert bottleneck_verdict(0.02, 0.1, "cuda", 4).startswith("compute-bound: data wait is 2%")
