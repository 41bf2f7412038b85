"""The training step, the epoch loop and evaluation: the batch mechanics in one place.

One optimizer step = `accum_steps` micro-batches on every rank. Each micro-batch's
loss is divided by its window size; DDP all-reduces gradients only on the last
micro-step (`no_sync` before); the optimizer, the fp16 scaler and the LR
scheduler then step exactly once. An epoch's final, shorter window is stepped
too (its losses divided by its own size).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from pipeline.mixing import ResolvedMix
from pipeline.prefetch import CudaPrefetcher
from pipeline.sources import ResolvedSource
from shards.errors import DataError
from trainers.data import locate_source_keys
from trainers.distributed import DistInfo, all_reduce, all_reduce_tensor, gather_objects
from trainers.metrics import (
    MultiLabelReport,
    Trace,
    Window,
    iter_timed,
    multi_label_report,
    rate_window,
    write_thresholds,
)
from trainers.run import Learner, Logs, Run, TrainState, VerdictRule, save_run_checkpoint
from trainers.schedule import is_window_end, window_size

log = logging.getLogger("trainers")
MULTI_LABEL_FIGURES = ("val_map", "val_f1_micro", "val_f1_macro", "val_f1_tuned")
MAX_THRESHOLDS_SHOWN = 10  # in the log line; thresholds.json holds every class


class NonFiniteLossError(DataError, RuntimeError):
    """The loss became NaN or infinite; the run stops before applying that step."""


def forward_backward(
    learner: Learner,
    info: DistInfo,
    images: torch.Tensor,
    labels: torch.Tensor,
    window: int,
    sync: bool,
) -> torch.Tensor:
    """One micro-step; gradients accumulate in `.grad`. Returns the detached loss."""
    # Without no_sync, DDP would all-reduce gradients after every micro-batch.
    skip_sync = info.distributed and not sync
    context = learner.model.no_sync() if skip_sync else contextlib.nullcontext()
    with context:
        with learner.autocast(info.device):
            logits = learner.model(images)
            loss = learner.criterion(logits.float(), labels)
        # Dividing by the window makes K accumulated micro-batches of B equal one batch of K x B.
        learner.scaler.scale(loss / window).backward()
    return loss.detach()


def optimizer_step(learner: Learner, clip_grad: float) -> float | None:
    """Unscale -> clip -> step -> update -> scheduler -> zero_grad, in that order.

    Clipping must see the true gradients, so the fp16 scaler unscales them first
    (torchvision's reference script once clipped scaled gradients). The scaler
    skips the update when fp16 gradients overflowed; the schedule still advances,
    so it follows the step counter. Returns the pre-clip gradient norm when clipping.
    """
    norm = None
    if clip_grad > 0:
        learner.scaler.unscale_(learner.optimizer)
        norm = float(nn.utils.clip_grad_norm_(learner.module.parameters(), clip_grad))
    learner.scaler.step(learner.optimizer)
    learner.scaler.update()
    learner.scheduler.step()
    learner.optimizer.zero_grad(set_to_none=True)
    return norm


def step_loss(loss_sum: torch.Tensor, window: int, info: DistInfo) -> tuple[float, bool, bool]:
    """Global mean loss of the step, whether it is finite everywhere, and locally.

    This `.item()` is the one host-device sync per optimizer step.
    """
    local = loss_sum / window
    local_bad = ~torch.isfinite(local)
    values = torch.stack([torch.where(local_bad, 0.0, local), local_bad.float()]).double()
    values = all_reduce_tensor(values, info)
    mean, bad = values.tolist()
    return mean / info.world_size, bad == 0, not bool(local_bad)


def non_finite_error(
    source: ResolvedSource | ResolvedMix, state: TrainState, keys: list[str], locally: bool
) -> NonFiniteLossError:
    """The stop of a step whose loss is not finite, naming the shards its batches came from."""
    where = "this rank's" if not locally else "another rank's"
    found = locate_source_keys(source, keys) if keys else {}
    shards = ", ".join(f"{url} ({len(k)} keys, e.g. {k[0]})" for url, k in found.items())
    return NonFiniteLossError(
        f"non-finite loss at optimizer step {state.step + 1} (epoch {state.epoch}) on "
        f"{where} batch; this rank's last batches came from: {shards or 'unknown shards'}; "
        f"keys {keys[:8]}. Lower --lr, set --clip-grad, or check these samples. "
        "The step was not applied; the last checkpoint is intact."
    )


def train_epoch(run: Run) -> bool:
    """Train the rest of the current epoch. Returns True when --max-steps was reached.

    A conductor: it takes the whole run (loaders, counters, learner, logs, settings).
    """
    state, plan = run.state, run.plan
    loader = run.feed.loaders.train
    loader.set_epoch(state.epoch)
    batches = len(loader)
    start = batches - loader.batches_remaining()  # > 0 when resumed mid-epoch
    run.learner.model.train()
    run.logs.timer.mark()
    bar = tqdm(
        total=plan.steps_per_epoch,
        initial=start // plan.accum_steps,
        desc=f"epoch {state.epoch}",
        # Off a TTY (a log file, a Slurm job) a bar is only noise in the log.
        disable=not (run.config.run.progress and run.info.is_main and sys.stderr.isatty()),
        leave=False,
    )
    stream = iter_timed(run.feed.train, run.logs.timer)
    # Log lines written while the bar is drawn go above it instead of through it.
    redirect = logging_redirect_tqdm(
        loggers=[logging.getLogger("trainers"), logging.getLogger("pipeline")]
    )
    try:
        with redirect:
            if train_batches(run, stream, bar, start, batches):
                return True
    finally:
        stream.close()
        bar.close()
    state.epoch += 1
    return False


def train_batches(run: Run, stream, bar: tqdm, start: int, batches: int) -> bool:
    """The batch loop of `train_epoch`: micro-steps, then one optimizer step per window."""
    state, learner, info, logs = run.state, run.learner, run.info, run.logs
    accum_steps, max_steps = run.plan.accum_steps, run.config.schedule.max_steps
    loss_sum = torch.zeros((), device=info.device)
    window_keys: list[str] = []
    for index, (images, labels, keys) in enumerate(stream, start):
        window = window_size(index, batches, accum_steps)
        last = is_window_end(index, batches, accum_steps)
        loss_sum += forward_backward(learner, info, images, labels, window, sync=last)
        window_keys.extend(keys)
        trace_batch(logs.trace, state, index, keys)
        if not last:
            continue
        loss, finite, locally = step_loss(loss_sum, window, info)
        if not finite:
            source = run.feed.loaders.train.source
            raise non_finite_error(source, state, window_keys, locally)
        optimizer_step(learner, run.config.optimizer.clip_grad)
        state.step += 1
        state.window_loss += loss
        state.window_steps += 1
        logs.timer.end_step(window * run.plan.batch_size)
        loss_sum.zero_()
        window_keys = []
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{learner.scheduler.lr:.3g}")
        after_step(run, epoch_end=index + 1 == batches)
        if max_steps is not None and state.step >= max_steps:
            return True
    return False


def trace_batch(trace: Trace, state: TrainState, index: int, keys: list[str]) -> None:
    """`--debug-trace`: which samples micro-batch `index` held, and the step it belongs to."""
    row = {"kind": "batch", "step": state.step, "epoch": state.epoch, "batch": index}
    trace.write({**row, "keys": list(keys)})


def after_step(run: Run, epoch_end: bool) -> None:
    """Trace, metrics row, verdict, evaluation and checkpoint, each when due.

    A conductor: each of these takes the run's parts it needs, a checkpoint the whole run.
    """
    settings, state, logs = run.config.run, run.state, run.logs
    max_steps = run.config.schedule.max_steps
    if logs.trace.enabled:
        digest = parameter_digest(run.learner.module)
        logs.trace.write({"kind": "params", "step": state.step, "digest": digest})
    last_step = max_steps is not None and state.step >= max_steps
    if state.step % settings.log_every == 0 or last_step or epoch_end:
        log_metrics(run)
    if epoch_end or last_step:
        return  # the epoch end (or the final stop) evaluates and checkpoints
    if settings.eval_every and state.step % settings.eval_every == 0:
        run_evaluation(run)
    every = run.config.checkpoint.checkpoint_every
    if every and state.step % every == 0:
        save_run_checkpoint(run)
        logs.timer.mark()


def log_metrics(run: Run) -> None:
    """One metrics row: mean loss since the last row, lr, images/s and data wait over all ranks.

    Takes the whole run: a row reads the counters, the timer, the LR schedule and
    scheduler, the loader's first-batch time and the device.
    """
    state, logs, info, settings = run.state, run.logs, run.info, run.config.run
    reduced = reduced_window(logs.timer.take(), info)
    logs.verdict_window.add(reduced)
    rated = rate_window(reduced, logs.last_window, (settings.log_every + 1) // 2)
    logs.last_window = reduced
    row = {
        "kind": "train",
        "step": state.step,
        "epoch": state.epoch,
        "loss": state.window_loss / max(1, state.window_steps),
        "lr": run.schedule.lr(state.step - 1),
        "images_per_s": rated.images_per_s,
        "data_wait_frac": rated.wait_frac,
        "rate_steps": rated.steps,
        "scheduler_steps": run.learner.scheduler.steps,
    }
    first = run.feed.loaders.train.stats.first_batch_s
    if state.step <= settings.log_every and first is not None:
        row["first_batch_s"] = first
        log.info(
            "time to first batch: %.2f s (worker start, shard open, shuffle buffer fill)", first
        )
    if info.device.type == "cuda":
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated(info.device) / 2**30
    state.window_loss, state.window_steps = 0.0, 0
    logs.metrics.write(row)
    log.info(metrics_line(row))
    if logs.verdict_window.steps >= settings.verdict_every:
        report_verdict(logs.verdict, logs.verdict_window, state.step)
        logs.verdict_window = Window()


def metrics_line(row: dict) -> str:
    """A metrics row as one log line, as timm and open_clip log every N steps, so a run
    writing to a log file says how it goes (`--log-every`)."""
    return (
        f"step {row['step']} (epoch {row['epoch']}): loss {row['loss']:.4f}, lr {row['lr']:.3g}, "
        f"{row['images_per_s']:.0f} images/s, data wait {row['data_wait_frac']:.0%}"
    )


def reduced_window(window: Window, info: DistInfo) -> Window:
    """`window` over all ranks: samples summed, wait and elapsed time averaged."""
    samples, wait_s, elapsed_s = all_reduce([window.samples, window.wait_s, window.elapsed_s], info)
    world = info.world_size
    return Window(window.steps, int(samples), wait_s / world, elapsed_s / world)


def report_verdict(rule: VerdictRule, window: Window, step: int) -> str:
    verdict = rule.of(window)
    log.info("step %d: %s (%.0f images/s)", step, verdict, window.images_per_s)
    return verdict


@torch.no_grad()
def evaluate(
    learner: Learner, batches: CudaPrefetcher, info: DistInfo, trace: Trace, evals: int
) -> dict[str, float]:
    """Loss and accuracy over the whole val split, each sample counted once across ranks.

    Runs the bare model, not the DDP wrapper: with the `uneven` rule ranks may
    hold one batch more or less, and DDP's forward would wait for the others.
    `evals` numbers this evaluation in the trace. Multi-label: `evaluate_multi_label`.
    """
    broadcast_buffers(learner.module, info)
    learner.module.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=info.device)  # loss, correct, count
    for images, labels, *rest in batches:
        with learner.autocast(info.device):
            logits = learner.module(images).float()
        totals[0] += F.cross_entropy(logits, labels, reduction="sum").double()
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += labels.numel()
        if rest and trace.enabled:
            trace.write({"kind": "val", "evals": evals, "keys": list(rest[0])})
    loss_sum, correct, count = all_reduce_tensor(totals, info).tolist()
    learner.module.train()
    return {
        "val_loss": loss_sum / max(count, 1),
        "val_accuracy": correct / max(count, 1),
        "val_samples": int(count),
    }


@torch.no_grad()
def evaluate_multi_label(
    learner: Learner,
    batches: CudaPrefetcher,
    info: DistInfo,
    trace: Trace,
    evals: int,
    classes: int,
) -> tuple[dict[str, float], MultiLabelReport]:
    """BCE loss, mAP, F1 and per-class thresholds over the whole val split.

    AP needs every score of a class at once, so each rank's sigmoid scores (float32
    `[n, C]`) and targets are gathered; every rank computes the same report.
    """
    broadcast_buffers(learner.module, info)
    learner.module.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
    scores, targets = [], []
    for images, labels, *rest in batches:
        with learner.autocast(info.device):
            logits = learner.module(images).float()
        loss_sum += F.binary_cross_entropy_with_logits(logits, labels, reduction="sum").double()
        scores.append(torch.sigmoid(logits).cpu().numpy())
        targets.append(labels.cpu().numpy() > 0.5)
        if rest and trace.enabled:
            trace.write({"kind": "val", "evals": evals, "keys": list(rest[0])})
    learner.module.train()
    local = (
        np.concatenate(scores) if scores else np.zeros((0, classes), np.float32),
        np.concatenate(targets) if targets else np.zeros((0, classes), bool),
        float(loss_sum),
    )
    gathered = gather_objects(local, info)
    report = multi_label_report(
        np.concatenate([g[0] for g in gathered]), np.concatenate([g[1] for g in gathered])
    )
    elements = max(report.samples * classes, 1)
    figures = {
        "val_loss": sum(g[2] for g in gathered) / elements,
        "val_map": report.mean_ap,
        "val_f1_micro": report.f1_micro,
        "val_f1_macro": report.f1_macro,
        "val_f1_tuned": report.f1_tuned,
        "val_samples": report.samples,
    }
    return figures, report


def broadcast_buffers(module: nn.Module, info: DistInfo) -> None:
    """Give every rank rank 0's BatchNorm statistics, so all ranks evaluate one model.

    DDP broadcasts buffers at the start of each forward; the forward itself then
    updates them from the rank's own batch, so after training they differ slightly.
    """
    if info.distributed:
        for buffer in module.buffers():
            torch.distributed.broadcast(buffer, src=0)


def run_evaluation(run: Run) -> None:
    """Evaluate (when there is a val split), then its metrics row and log line.

    Takes the whole run: the learner, val batches, counters, logs, and (multi-label)
    the run directory for the thresholds (rank 0 writes `RUN_DIR/thresholds.json`).
    """
    if run.feed.val is None:
        return
    state, info, logs = run.state, run.info, run.logs
    parts = (run.learner, run.feed.val, info, logs.trace, state.evals + 1)
    if run.config.data.task == "multi-label":
        result, logs.last_report = evaluate_multi_label(*parts, run.identity["num_classes"])
        if info.is_main:
            thresholds = (logs.last_report, run.feed.loaders.classes, state.step)
            write_thresholds(run.config.run.run_dir, *thresholds)
    else:
        result = evaluate(*parts)
    state.evals += 1
    total = logs.timer.total
    row = {
        "kind": "eval",
        "step": state.step,
        "epoch": state.epoch,
        "evals": state.evals,
        "loss": result["val_loss"],
        "lr": run.learner.scheduler.lr,
        "images_per_s": total.samples * info.world_size / total.elapsed_s
        if total.elapsed_s
        else 0.0,
        "data_wait_frac": total.wait_frac,
        **result,
    }
    logs.metrics.write(row)
    log.info("eval after step %d: %s", state.step, describe_evaluation(result, logs.last_report))
    logs.timer.mark()


def describe_evaluation(result: dict[str, float], report: MultiLabelReport | None) -> str:
    """The figures of one evaluation in a line (multi-label: with the thresholds chosen)."""
    if "val_accuracy" in result:
        return (
            f"val accuracy {result['val_accuracy']:.4f}, val loss {result['val_loss']:.4f} "
            f"over {result['val_samples']} samples"
        )
    shown = ", ".join(f"{t:.2f}" for t in report.thresholds[:MAX_THRESHOLDS_SHOWN])
    more = " ..." if len(report.thresholds) > MAX_THRESHOLDS_SHOWN else ""
    return (
        f"val mAP {result['val_map']:.4f}, F1 micro {result['val_f1_micro']:.4f} / macro "
        f"{result['val_f1_macro']:.4f} at 0.5, macro {result['val_f1_tuned']:.4f} at per-class "
        f"thresholds [{shown}{more}] (thresholds.json), val loss {result['val_loss']:.4f} over "
        f"{result['val_samples']} samples"
    )


def fit(run: Run) -> dict[str, Any]:
    """Epochs from the current state to `--epochs` (or `--max-steps`), evaluating and checkpointing.

    A conductor: it takes the whole run and hands each step its parts.

    Returns:
        The `end` metrics row (see `final_summary`).
    """
    epochs, max_steps = run.config.schedule.epochs, run.config.schedule.max_steps
    stopped = max_steps is not None and run.state.step >= max_steps
    while not stopped and run.state.epoch < epochs:
        stopped = train_epoch(run)
        run_evaluation(run)
        save_run_checkpoint(run)
        run.logs.timer.mark()
    return final_summary(run.logs, run.state, run.info)


def final_summary(logs: Logs, state: TrainState, info: DistInfo) -> dict[str, Any]:
    """The `end` row: this segment's images/s and verdict, the last train loss and evaluation.

    The summary line made of it is logged last, by `trainers.train.finish`.
    """
    reduced = reduced_window(logs.timer.total, info)
    last_train = logs.metrics.last.get("train", {})
    last_eval = logs.metrics.last.get("eval", {})
    row: dict[str, Any] = {
        "kind": "end",
        "step": state.step,
        "epoch": state.epoch,
        "loss": last_train.get("loss"),
        "images_per_s": reduced.images_per_s,
        "data_wait_frac": reduced.wait_frac,
        "val_loss": last_eval.get("val_loss"),
        "val_accuracy": last_eval.get("val_accuracy"),
        "val_samples": last_eval.get("val_samples"),
        **{name: last_eval.get(name) for name in MULTI_LABEL_FIGURES},
        "verdict": logs.verdict.of(reduced),
    }
    if info.device.type == "cuda":
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated(info.device) / 2**30
    return logs.metrics.write({name: value for name, value in row.items() if value is not None})


def parameter_digest(module: nn.Module) -> str:
    """sha256 of every parameter's bytes: equal on all DDP ranks after each step."""
    digest = hashlib.sha256()
    for parameter in module.parameters():
        digest.update(parameter.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()
