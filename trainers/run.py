"""The `Run` a training job holds (its parts: `Learner`, `Feed`, `Logs`, `TrainState`), and
its round trip through a checkpoint.

A checkpoint is taken only between optimizer steps (no half-accumulated
gradients to save). It stores the model, optimizer, scaler and scheduler
states, the counters, the loader position (as of the batches trained, not
prefetched), every rank's RNG states, the config and the data identity that a
resume is checked against.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.plan import LoaderStateError
from pipeline.prefetch import CudaPrefetcher
from pipeline.sources import ResolvedSource
from shards.errors import UsageError
from shards.redact import redact_url
from shards.storage.write import atomic_write_bytes
from trainers.checkpoint import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainers.config import TrainConfig
from trainers.data import Loaders
from trainers.distributed import DistInfo, gather_objects
from trainers.metrics import (
    METRICS_NAME,
    MetricsLog,
    MultiLabelReport,
    StepTimer,
    Trace,
    Window,
    bottleneck_verdict,
)
from trainers.schedule import BatchPlan, LRSchedule, WarmupCosine

log = logging.getLogger("trainers")

# Resuming with any of these changed is refused unless --allow-data-change.
DATA_FIELDS = ("train_data", "global_batch", "seed", "aug_repeats")
# The loader's saved position holds only for the same samples in the same epoch plan.
ORDER_FIELDS = ("train_data", "seed", "aug_repeats")
# These can never change on resume: the weights would not fit (or mean something else).
MODEL_FIELDS = ("model", "num_classes", "task")
# What a checkpoint written before a field existed meant by it.
IDENTITY_DEFAULTS = {"task": "single-label", "aug_repeats": 1}


@dataclass
class TrainState:
    """Counters that a checkpoint restores (plain ints and floats)."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0  # epoch in progress, or the next one to start
    evals: int = 0  # evaluations completed
    window_loss: float = 0.0  # sum of step losses since the last metrics row
    window_steps: int = 0


@dataclass
class Learner:
    """What a step runs and changes: the model, its loss, optimizer, LR scheduler and scaler."""

    model: nn.Module  # what forward runs: the DDP wrapper when distributed
    module: nn.Module  # the bare model: state_dict and evaluation
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: WarmupCosine
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Mixed precision on `device` as `--amp` asks (a no-op context when off)."""
        return torch.autocast(device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)


@dataclass
class Feed:
    """The run's data: its loaders and the prefetchers that bring their batches to the device."""

    loaders: Loaders
    train: CudaPrefetcher
    val: CudaPrefetcher | None


@dataclass(frozen=True)
class VerdictRule:
    """What decides a window's bottleneck verdict (`trainers.metrics.bottleneck_verdict`)."""

    threshold: float  # --input-bound-threshold
    device: str  # the device type
    flag: str  # the flag that adds worker roles (`trainers.placement.scaling_flag`)
    workers: int  # its value, named in the advice

    def of(self, window: Window) -> str:
        return bottleneck_verdict(
            window.wait_frac, self.threshold, self.device, self.workers, self.flag
        )


@dataclass
class Logs:
    """What the run measures and writes as it goes: metrics rows, the debug trace, step times."""

    metrics: MetricsLog
    trace: Trace
    timer: StepTimer
    verdict: VerdictRule
    verdict_window: Window = field(default_factory=Window)
    last_window: Window | None = None  # the previous metrics row's, for `rate_window`
    last_report: MultiLabelReport | None = None  # the latest multi-label evaluation


@dataclass
class Run:
    """Everything a training run holds, built once by `trainers.train.setup_run`: the parts
    above, the counters, and the fixed figures (config, ranks, batch plan, LR schedule, the
    data identity a resume is checked against). Only the loop's conductors take it whole
    (`fit`, `train_epoch`, `after_step`, ...); the rest take the parts they use."""

    config: TrainConfig
    info: DistInfo
    learner: Learner
    feed: Feed
    logs: Logs
    state: TrainState
    plan: BatchPlan
    schedule: LRSchedule
    identity: dict[str, Any]


def data_identity(
    source: ResolvedSource, config: TrainConfig, world_size: int, num_classes: int
) -> dict[str, Any]:
    """What a resume must match: the train data (by shard names, counts and checksums), etc.

    Checksums are the shards' own, or for a manifest with a side table the table's,
    which records theirs (the loader leaves the per-shard digests unread).

    Shard names rather than full URLs, so a dataset moved to another directory
    or bucket is still the same data.
    """
    digest = hashlib.sha256()
    shards = source.shards  # columns: no ShardSpec per shard for a million shards
    if shards.table_sha256 is not None:
        # The manifest's side table covers every shard's digest: its checksum stands
        # for them, whether or not this loader read them (verify_checksums).
        digest.update(f"table {shards.table_sha256}\n".encode())
        checksums = itertools.repeat(None, len(shards))
    else:
        checksums = shards.iter_sha256()
    rows = zip(shards.iter_file_names(), shards.samples.tolist(), checksums, strict=True)
    for name, samples, sha256 in rows:
        digest.update(f"{name}|{samples}|{sha256 or ''}\n".encode())
    return {
        "train_data": f"{len(source.shards)} shards, {source.total_samples} samples, sha256 {digest.hexdigest()[:16]}",
        "train_manifest": redact_url(source.manifest_url) if source.manifest_url else None,
        "global_batch": config.schedule.batch_size * config.schedule.accum_steps * world_size,
        "seed": config.run.seed,
        "model": config.model.model,
        "num_classes": num_classes,
        "task": config.data.task,
        "aug_repeats": config.recipe.aug_repeats,  # the epoch plan repeats samples
    }


class RunDirError(UsageError, RuntimeError):
    """`--run-dir` cannot hold this run: a file, not writable, or already holding a run."""


def check_run_dir(run_dir: str | Path, resume: str | None, refuse_used: bool = True) -> None:
    """Before any data is read: the run directory can be made and written, and is ours to use.

    With `refuse_used`, a fresh run (no `--resume`) refuses a directory that already
    holds one, so a typo cannot mix two runs' metrics or prune another run's checkpoints.

    Raises:
        RunDirError: the directory is unusable; CheckpointError: `--resume PATH` is missing.
    """
    path = Path(run_dir)
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"cannot be made: {existing} is a file"
        raise RunDirError(f"--run-dir {path} {where}, not a directory; pick another --run-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirError(
            f"--run-dir {path}: {existing} is not writable by this user; pick another --run-dir"
        )
    fresh = refuse_used and resume is None
    if fresh and ((path / METRICS_NAME).exists() or latest_checkpoint(path) is not None):
        raise RunDirError(
            f"{path} already holds a run; pass --resume auto to continue it, or pick a new --run-dir"
        )
    if resume not in (None, "auto") and not Path(resume).is_file():
        raise CheckpointError(
            f"--resume {resume}: no such checkpoint; pass --resume auto (the latest in "
            "--run-dir) or the path of a step-*.pt file"
        )


def resume_problems(
    saved: dict[str, Any], current: dict[str, Any], allow_data_change: bool
) -> list[str]:
    """Diff lines for fields that forbid this resume (empty: compatible)."""
    names = MODEL_FIELDS + (() if allow_data_change else DATA_FIELDS)
    saved, current = {**IDENTITY_DEFAULTS, **saved}, {**IDENTITY_DEFAULTS, **current}
    return [
        f"  {n}: {saved.get(n)!r} -> {current.get(n)!r}"
        for n in names
        if saved.get(n) != current.get(n)
    ]


def checkpoint_payload(run: Run) -> dict[str, Any]:
    """The checkpoint contents; every rank must call this (it gathers the RNG states).

    Takes the whole run: a checkpoint is the learner, the counters, the loader position,
    the ranks' RNG states, the config and the data identity, together.
    """
    rngs = gather_objects(rng_state(), run.info)
    learner = run.learner
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "model": learner.module.state_dict(),
        "optimizer": learner.optimizer.state_dict(),
        "scaler": learner.scaler.state_dict(),
        "scheduler": learner.scheduler.state_dict(),
        "state": asdict(run.state),
        # The prefetcher's state counts batches handed to the loop, not those read ahead.
        "loader": run.feed.train.state_dict(),
        "rng": rngs,
        "world_size": run.info.world_size,
        "config": run.config.to_dict(),
        "identity": run.identity,
        "torch_version": str(torch.__version__),  # TorchVersion is a class weights_only refuses
    }


def save_run_checkpoint(run: Run) -> Path | None:
    """Checkpoint the run (rank 0 writes; all ranks take part in gathering RNG states).

    Takes the whole run, as `checkpoint_payload` does."""
    payload = checkpoint_payload(run)
    if not run.info.is_main:
        return None
    path = save_checkpoint(
        run.config.run.run_dir, payload, run.state.step, run.config.checkpoint.keep_checkpoints
    )
    log.info("checkpoint %s (step %d, epoch %d)", path, run.state.step, run.state.epoch)
    return path


def restore_run(run: Run, path: Path) -> None:
    """Load `path` into the run, refusing (with a diff) one from an incompatible run.

    Takes the whole run: a resume sets the learner, the counters, the loader position,
    the RNGs and the logs back to the checkpoint's step.
    """
    checkpoint = load_checkpoint(path)
    problems = resume_problems(
        checkpoint["identity"], run.identity, run.config.checkpoint.allow_data_change
    )
    if problems:
        raise CheckpointError(
            f"cannot resume from {path}: the run changed\n" + "\n".join(problems) + "\n"
            "Pass --allow-data-change to resume anyway (data, global batch, seed and "
            "--aug-repeats only; the loader then restarts the epoch if the data, seed or "
            "repeats changed), or use a new --run-dir."
        )
    learner = run.learner
    learner.module.load_state_dict(checkpoint["model"])
    learner.optimizer.load_state_dict(checkpoint["optimizer"])
    learner.scheduler.load_state_dict(checkpoint["scheduler"])
    if learner.scaler.is_enabled() and checkpoint["scaler"]:
        learner.scaler.load_state_dict(checkpoint["scaler"])
    run.state = TrainState(**checkpoint["state"])
    try:
        restore_loader(run.feed, run.state, run.identity, checkpoint)
    except LoaderStateError as error:  # a tampered or foreign position: one line, no traceback
        raise CheckpointError(f"cannot resume from {path}: {error}") from error
    restore_rng(checkpoint, run.info, run.config.run.seed + run.state.step)
    truncate_logs(run.logs, run.state)
    train = run.feed.loaders.train
    log.info(
        "resumed from %s: step %d, epoch %d, %d batches into the epoch",
        path,
        run.state.step,
        run.state.epoch,
        len(train) - train.batches_remaining(),
    )


def restore_loader(
    feed: Feed, state: TrainState, identity: dict[str, Any], checkpoint: dict[str, Any]
) -> None:
    """The train loader at the checkpoint's position, or at its epoch's start when the data,
    seed or repeats changed (`--allow-data-change`); `state.epoch` follows the loader."""
    saved = {**IDENTITY_DEFAULTS, **checkpoint["identity"]}
    same_data = all(saved.get(n) == identity.get(n) for n in ORDER_FIELDS)
    if same_data:
        # Same data and seed: continue the epoch exactly (re-split if the world size changed).
        feed.train.load_state_dict(checkpoint.get("loader"))
        state.epoch = feed.loaders.train.epoch
        return
    log.warning(
        "data, seed or --aug-repeats changed (--allow-data-change): epoch %d restarts from its beginning",
        state.epoch,
    )
    feed.loaders.train.set_epoch(state.epoch)


def restore_rng(checkpoint: dict[str, Any], info: DistInfo, reseed: int) -> None:
    """This rank's saved RNG states; on another world size, fresh ones from `reseed` (the
    run's seed plus its step) and the rank."""
    rngs = checkpoint["rng"]
    if checkpoint["world_size"] == info.world_size:
        set_rng_state(rngs[info.rank])
        return
    seed_generators(reseed + 1000 * info.rank)


def truncate_logs(logs: Logs, state: TrainState) -> None:
    """Drop metrics and trace rows written after the checkpoint (the resumed run redoes them)."""
    step, evals = state.step, state.evals
    dropped = logs.metrics.truncate(partial(keep_metrics_row, step=step, evals=evals))
    if dropped:
        log.info("dropped %d metrics rows written after the checkpoint", dropped)
    logs.trace.truncate(partial(keep_trace_row, step=step, evals=evals))


def keep_metrics_row(row: dict[str, Any], step: int, evals: int) -> bool:
    kind = row.get("kind")
    if kind == "eval":
        return row.get("evals", 0) <= evals
    if kind == "train":
        return row.get("step", 0) <= step
    return False  # the summary row of an earlier, finished segment


def keep_trace_row(row: dict[str, Any], step: int, evals: int) -> bool:
    kind = row.get("kind")
    if kind == "batch":
        return row["step"] < step
    if kind == "params":
        return row["step"] <= step
    return row.get("evals", 0) <= evals


def seed_generators(seed: int) -> None:
    """Seed Python, NumPy, torch and every CUDA device."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds all CUDA devices


def write_config(run_dir: str | Path, config: TrainConfig, extra: dict[str, Any]) -> Path:
    """`RUN_DIR/config.json`: the resolved config plus derived figures (batch plan, lr)."""
    path = Path(run_dir) / "config.json"
    document = {"config": config.to_dict(), **extra}
    atomic_write_bytes(path, (json.dumps(document, indent=1) + "\n").encode())
    return path
