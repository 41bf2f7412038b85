"""Batch arithmetic and the learning-rate schedule: pure functions of the config and world size.

Everything here counts *optimizer* steps. The total is recomputed from the
batch, accumulation and world size, so changing any of them keeps the shape of
warmup + cosine instead of silently stretching or cutting it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shards.errors import UsageError

LR_SCALINGS = ("linear", "sqrt", "none")


@dataclass(frozen=True)
class BatchPlan:
    """How batches become optimizer steps on every rank.

    Attributes:
        batch_size: samples per device per micro-step.
        accum_steps: micro-steps per optimizer step.
        world_size: data-parallel ranks.
        batches_per_epoch: micro-batches each rank trains per epoch (drop_last
            applied; equal on every rank).
        epochs: epochs the schedule spans.
    """

    batch_size: int
    accum_steps: int
    world_size: int
    batches_per_epoch: int
    epochs: int

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step across all ranks."""
        return self.batch_size * self.accum_steps * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: a final partial window is stepped, not dropped."""
        return -(-self.batches_per_epoch // self.accum_steps)

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @property
    def last_window(self) -> int:
        """Micro-batches in an epoch's final window (`accum_steps` when it divides evenly)."""
        rest = self.batches_per_epoch % self.accum_steps
        return rest or self.accum_steps


def window_size(batch_index: int, batches: int, accum_steps: int) -> int:
    """Micro-batches in the accumulation window holding `batch_index` of an epoch of `batches`.

    Windows start at batch 0 of every epoch; the last one may be shorter. The
    loss of each micro-batch is divided by this size, so a short window still
    averages its micro-batches instead of shrinking the gradient.
    """
    start = batch_index // accum_steps * accum_steps
    return min(accum_steps, batches - start)


def is_window_end(batch_index: int, batches: int, accum_steps: int) -> bool:
    """True on the micro-batch after which the optimizer steps."""
    return (batch_index + 1) % accum_steps == 0 or batch_index + 1 == batches


def scale_lr(lr: float, effective_batch: int, ref_batch: int, rule: str) -> float:
    """`lr` given for `ref_batch`, scaled to `effective_batch` (linear, sqrt or none)."""
    if rule == "linear":
        return lr * effective_batch / ref_batch
    if rule == "sqrt":
        return lr * math.sqrt(effective_batch / ref_batch)
    if rule == "none":
        return lr
    raise UsageError(f"lr scaling must be one of {LR_SCALINGS}, got {rule!r}")


def warmup_steps_for(total_steps: int, ratio: float, steps: int | None) -> int:
    """Warmup length in optimizer steps: explicit `steps` wins over `ratio`; never the whole run."""
    warmup = steps if steps is not None else round(ratio * total_steps)
    return max(0, min(warmup, max(total_steps - 1, 0)))


def lr_at(step: int, total_steps: int, warmup_steps: int, peak_lr: float, min_lr: float) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to `min_lr`.

    Warmup reaches `peak_lr` on its last step (step 0 already has a non-zero
    rate); the cosine then runs over the remaining steps, and steps past the
    total stay at `min_lr`.
    """
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LRSchedule:
    """The resolved schedule: what the startup log prints and `WarmupCosine` follows."""

    base_lr: float
    ref_batch: int
    scaling: str
    effective_batch: int
    peak_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def lr(self, step: int) -> float:
        return lr_at(step, self.total_steps, self.warmup_steps, self.peak_lr, self.min_lr)

    def describe(self) -> str:
        """`0.1 x 512/256 (linear) = 0.2`: how the peak was scaled."""
        ratio = f"{self.effective_batch}/{self.ref_batch}"
        factor = {"linear": ratio, "sqrt": f"sqrt({ratio})", "none": "1"}[self.scaling]
        return f"{self.base_lr:g} x {factor} ({self.scaling}) = {self.peak_lr:g}"


def build_schedule(
    plan: BatchPlan,
    lr: float,
    ref_batch: int,
    scaling: str,
    min_lr: float,
    warmup_ratio: float,
    warmup_steps: int | None,
) -> LRSchedule:
    """Scale the peak to the effective batch and size warmup from the recomputed total."""
    peak = scale_lr(lr, plan.effective_batch, ref_batch, scaling)
    total = plan.total_steps
    return LRSchedule(
        base_lr=lr,
        ref_batch=ref_batch,
        scaling=scaling,
        effective_batch=plan.effective_batch,
        peak_lr=peak,
        min_lr=min(min_lr, peak),
        warmup_steps=warmup_steps_for(total, warmup_ratio, warmup_steps),
        total_steps=total,
    )


class WarmupCosine:
    """Sets every param group's lr to `schedule.lr(step)`; `step()` once per optimizer step.

    Unlike a `LambdaLR` this holds no closure: its state is one integer, and the
    rate is always recomputed from the pure schedule, so a resumed run with a
    recomputed total continues on the new curve.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.steps = 0
        self.apply()

    @property
    def lr(self) -> float:
        """The rate the next optimizer step uses."""
        return self.schedule.lr(self.steps)

    def apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def step(self) -> None:
        """Advance after an optimizer step (also one the fp16 scaler skipped)."""
        self.steps += 1
        self.apply()

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["steps"])
        self.apply()
