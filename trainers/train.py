"""`train` console script and `python -m trainers.train`, also under torchrun (and so Slurm).

`main()` reads as a table of contents: parse the config, join the process
group, build the run (data, model, optimizer, schedule), resume, fit, report.
`train find-batch-size` and `train scan-throughput` are the probes in `trainers.probe`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipeline.mixing import ResolvedMix
from pipeline.mixup import MixupCutmix
from pipeline.prefetch import CudaPrefetcher
from pipeline.sources import ResolvedSource
from shards.errors import DataError, ShardpipeError
from shards.flags import CommandParser, changed_flags, check_command_word
from shards.redact import redact_url
from trainers.checkpoint import CheckpointError, latest_checkpoint
from trainers.config import COMMANDS, Model, Runtime, TrainConfig, parse_command_line
from trainers.data import Loaders, build_loaders, check_sources, overlap_error
from trainers.distributed import (
    DistInfo,
    all_reduce,
    broadcast_error,
    check_device,
    finish_together,
    init_distributed,
    setup_logging,
    shutdown_distributed,
)
from trainers.loop import fit
from trainers.metrics import (
    PLOT_NAME,
    MetricsLog,
    StepTimer,
    Trace,
    plot_metrics,
    summary_line,
)
from trainers.models import ModelError, build_model, resolve_model_name
from trainers.numerics import build_optimizer, configure_determinism, resolve_amp
from trainers.placement import scaling_flag, worker_cluster, workers_text
from trainers.recipe import build_criterion, build_mix, recipe_line
from trainers.run import (
    Feed,
    Learner,
    Logs,
    Run,
    RunDirError,
    TrainState,
    VerdictRule,
    check_run_dir,
    data_identity,
    restore_run,
    seed_generators,
    truncate_logs,
    write_config,
)
from trainers.schedule import BatchPlan, LRSchedule, WarmupCosine, build_schedule

log = logging.getLogger("trainers")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: `train [train|find-batch-size|scan-throughput] --flags`.

    A refused command line exits 2 (the parser). Our own errors (`ShardpipeError`: the
    data, a request this machine or run directory cannot honour) are one line on stderr
    and exit 1; anything else (`TypeError`, a bare `KeyError`, ...) is a bug in our code
    and keeps its traceback.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    check_command_word(CommandParser(prog="train"), argv, COMMANDS)
    command, config = parse_command_line(argv)
    try:
        check_config(command, config)
        if command == "find-batch-size":
            from trainers.probe import find_batch_size

            find_batch_size(config)
            return 0
        if command == "scan-throughput":
            from trainers.probe import scan_throughput

            scan_throughput(config)
            return 0
        return train(config)
    except ShardpipeError as error:
        report_error(error)
        return 1
    except KeyboardInterrupt:
        print(
            "interrupted; rerun with --resume auto to continue from the last checkpoint",
            file=sys.stderr,
        )
        return 130


def check_config(command: str, config: TrainConfig) -> None:
    """The mistakes that cost nothing to find, before any data is read or directory made.

    Device, precision, model name, local data paths, then the run directory.
    """
    check_device(config.run.device)
    if planned_device(config.run.device).type == "cpu":
        resolve_amp(config.run.amp, torch.device("cpu"))  # on CUDA it would start a CUDA context
    resolve_model_name(config.model.model)
    check_sources(config)
    # The probes write their report into --run-dir too, next to an earlier run's files.
    check_run_dir(config.run.run_dir, config.checkpoint.resume, refuse_used=command == "train")


def planned_device(name: str) -> torch.device:
    """The device type `--device` will give (its index comes with the rank, later)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def report_error(error: Exception) -> None:
    """`train: error: ...` on stderr, once (tagged with the rank under torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tag = f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""
    print(f"train: error: {tag}{error}", file=sys.stderr)


def train(config: TrainConfig) -> int:
    """Run a whole training job in this process (one rank of it under torchrun).

    `main` has run `check_config` on `config` first.
    """
    started = time.perf_counter()
    configure_determinism(config.run.deterministic)
    info = init_distributed(config.run.device, config.run.dist_timeout_s)
    setup_logging(info)
    try:
        with worker_cluster(config.loader.workers, info.world_size):
            run = setup_run(config, info, started)
            end = fit(run)
            finish(run.logs.metrics, info, config.run, end, run.plan.steps_per_epoch)
            finish_together(info)
    finally:
        shutdown_distributed()
    return 0


def setup_run(config: TrainConfig, info: DistInfo, started: float | None = None) -> Run:
    """Data, model, optimizer, schedule and logs; then resume when asked.

    Args:
        started: `time.perf_counter()` when the job began: the zero of `time_s`.
    """
    settings = config.run
    seed_generators(settings.seed)  # the same on every rank: identical initial weights
    loaders = build_loaders(config, info)
    check_batches(loaders, config.schedule.batch_size, info)
    check_splits(loaders, config.data.overlap_check, info)
    make_run_dir(settings.run_dir)  # only once the data is known to be usable
    num_classes = resolve_num_classes(config, loaders)
    module = prepare_model(config.model, info, num_classes)
    steps = config.schedule
    plan = BatchPlan(
        steps.batch_size, steps.accum_steps, info.world_size, len(loaders.train), steps.epochs
    )
    schedule = build_schedule(
        plan,
        steps.lr,
        steps.lr_ref_batch,
        steps.lr_scaling,
        steps.min_lr,
        steps.warmup_ratio,
        steps.warmup_steps,
    )
    mix = build_mix(config, num_classes, info.rank)
    run = Run(
        config=config,
        info=info,
        learner=build_learner(config, info, module, schedule),
        feed=Feed(
            loaders=loaders,
            train=prefetcher(loaders.train, config.model, info, mix),
            val=prefetcher(loaders.val, config.model, info) if loaders.val is not None else None,
        ),
        logs=build_logs(config, info, started),
        state=TrainState(),
        plan=plan,
        schedule=schedule,
        identity=data_identity(loaders.train.source, config, info.world_size, num_classes),
    )
    seed_generators(settings.seed + 1000 * info.rank)  # per-rank randomness from here on
    resume(run)
    if info.is_main:
        write_config(settings.run_dir, config, startup_figures(run))
    log_startup(run)
    return run


def build_learner(
    config: TrainConfig, info: DistInfo, module: nn.Module, schedule: LRSchedule
) -> Learner:
    """The model (DDP-wrapped when distributed), loss, optimizer, its scheduler and scaler."""
    optimizer = build_optimizer(module, config.optimizer, config.schedule.lr)
    return Learner(
        model=wrap_ddp(module, info),
        module=module,
        criterion=build_criterion(config),
        optimizer=optimizer,
        scheduler=WarmupCosine(optimizer, schedule),
        scaler=torch.amp.GradScaler(info.device.type, enabled=config.run.amp == "fp16"),
        amp_dtype=resolve_amp(config.run.amp, info.device),
    )


def build_logs(config: TrainConfig, info: DistInfo, started: float | None) -> Logs:
    """Metrics rows (rank 0), the per-rank debug trace, the step timer, the verdict's rule."""
    settings = config.run
    return Logs(
        metrics=MetricsLog(settings.run_dir, info.is_main, settings.tensorboard, started),
        trace=Trace(settings.run_dir, info.rank, settings.debug_trace),
        timer=StepTimer(),
        verdict=VerdictRule(
            settings.input_bound_threshold, info.device.type, *scaling_flag(config.loader.workers)
        ),
    )


def make_run_dir(run_dir: str) -> None:
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as error:  # checked by check_run_dir, but the disk may have changed since
        raise RunDirError(
            f"--run-dir {run_dir} cannot be made: {error.strerror or error}; pick another --run-dir"
        ) from error


def check_batches(loaders: Loaders, batch_size: int, info: DistInfo) -> None:
    """Every rank must train the same number of batches, and at least one."""
    batches = len(loaders.train)
    high, negative_low = all_reduce([batches, -batches], info, op="max")
    if high != -negative_low:
        raise DataError(
            f"ranks would train {-negative_low:.0f} to {high:.0f} batches per epoch; DDP would hang"
        )
    if batches == 0:
        samples = loaders.train.source.total_samples
        raise DataError(
            f"{samples} train samples give no full batch of {batch_size} per rank on "
            f"{info.world_size} ranks; lower --batch-size"
        )


def check_splits(loaders: Loaders, overlap_check: str, info: DistInfo) -> None:
    """Rank 0 compares train and val keys (`--overlap-check`); every rank stops if they overlap."""
    message = None
    if info.is_main and loaders.val is not None:
        message = overlap_error(
            loaders.train.source.shards, loaders.val.source.shards, overlap_check
        )
    message = broadcast_error(message, info)
    if message:
        raise DataError(message)


def resolve_num_classes(config: TrainConfig, loaders: Loaders) -> int:
    if loaders.target_classes is not None:  # multi-label: the loader's targets are this wide
        return loaders.target_classes
    if config.model.num_classes is not None:
        return config.model.num_classes
    if loaders.classes:
        return len(loaders.classes)
    raise DataError(
        f"--train-shards {redact_url(os.fspath(config.data.train_shards))}: no class list (no "
        "manifest.json beside the shards names the classes); pass --num-classes N"
    )


def prepare_model(settings: Model, info: DistInfo, num_classes: int) -> nn.Module:
    module = build_model(settings.model, num_classes)
    if settings.sync_bn:
        if info.device.type != "cuda":
            raise ModelError(
                "--sync-bn needs CUDA: torch's SyncBatchNorm only works with GPU modules"
            )
        if info.distributed:
            module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
        else:
            log.warning("--sync-bn has no effect in a single process")
    module = module.to(info.device)
    if settings.channels_last:
        module = module.to(memory_format=torch.channels_last)
    return module


def wrap_ddp(module: nn.Module, info: DistInfo) -> nn.Module:
    if not info.distributed:
        return module
    device_ids = [info.local_rank] if info.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids)


def prefetcher(
    loader, settings: Model, info: DistInfo, mix: MixupCutmix | None = None
) -> CudaPrefetcher:
    """Batches on the device, normalized there (on CPU: normalized in-process, no look-ahead),
    in the layout the model takes, then mixed there when the train loader's `mix` is given
    (evaluation never is)."""
    return CudaPrefetcher(loader, info.device, channels_last=settings.channels_last, mix=mix)


def resume(run: Run) -> None:
    """`--resume auto|PATH` (a fresh run's directory was checked by `check_run_dir`).

    Takes the whole run, which `restore_run` sets back to the checkpoint's step.
    """
    config = run.config
    run_dir = Path(config.run.run_dir)
    if config.checkpoint.resume is None:
        return
    path = (
        latest_checkpoint(run_dir)
        if config.checkpoint.resume == "auto"
        else Path(config.checkpoint.resume)
    )
    if path is None:
        log.info("no checkpoint in %s: starting at step 0", run_dir)
        truncate_logs(run.logs, run.state)  # rows of a run killed before its first checkpoint
        return
    if not path.exists():
        raise CheckpointError(f"--resume {path}: no such checkpoint")
    restore_run(run, path)


def startup_figures(run: Run) -> dict:
    """The derived numbers of the startup log, also stored in config.json.

    Takes the whole run: the figures come from its data, plan, schedule, ranks and model.
    """
    plan, schedule, loaders = run.plan, run.schedule, run.feed.loaders
    return {
        "train_samples": loaders.train.source.total_samples,
        "val_samples": loaders.val.source.total_samples if loaders.val else 0,
        "classes": loaders.classes,
        "world_size": run.info.world_size,
        "device": str(run.info.device),
        "effective_batch": plan.effective_batch,
        "batches_per_epoch": plan.batches_per_epoch,
        "steps_per_epoch": plan.steps_per_epoch,
        "total_steps": plan.total_steps,
        "warmup_steps": schedule.warmup_steps,
        "peak_lr": schedule.peak_lr,
        "lr_scaling": schedule.describe(),
        "parameters": sum(p.numel() for p in run.learner.module.parameters()),
    }


def log_startup(run: Run) -> None:
    """Every figure that decides what the run does, once, on rank 0, in short lines.

    The whole resolved config is in `RUN_DIR/config.json` (written just before); the
    log names that file and the options that differ from the defaults, by group. Takes
    the whole run: the log says what each of its parts is.
    """
    config, plan, schedule, info = run.config, run.plan, run.schedule, run.info
    f = startup_figures(run)
    train_source = run.feed.loaders.train.source
    dropped = (
        train_source.total_samples // info.world_size - plan.batches_per_epoch * plan.batch_size
    )
    lines = [
        *config_lines(config),
        f"data: train {f['train_samples']} samples in {len(train_source.shards)} shards, "
        f"val {f['val_samples']} samples; "
        f"{class_figure(run.feed.loaders.classes, run.identity['num_classes'])}",
        f"data source: {source_line(train_source)}",
        f"batch: {plan.batch_size} per device x {plan.accum_steps} accumulation x "
        f"{plan.world_size} ranks = effective batch {plan.effective_batch}",
        f"epoch: {plan.batches_per_epoch} batches per rank, {plan.steps_per_epoch} optimizer "
        f"steps; drop_last leaves out about {max(dropped, 0)} samples per rank",
        f"steps: {plan.total_steps} over {plan.epochs} epochs; an epoch's last step "
        f"accumulates {plan.last_window} of {plan.accum_steps} micro-batches",
        f"lr: peak {schedule.describe()}, linear warmup {schedule.warmup_steps} steps, cosine to "
        f"{schedule.min_lr:g} at step {schedule.total_steps}",
        f"optimizer: {config.optimizer.optimizer} momentum {config.optimizer.momentum} weight decay "
        f"{config.optimizer.weight_decay} (not on norms/biases), clip {config.optimizer.clip_grad or 'off'}",
        recipe_line(config),
        f"loader: {workers_text(config.loader.workers)}, image "
        f"{config.loader.crop.image_size} px, shuffle buffer {config.loader.shuffle.buffer}, "
        f"channels_last {config.model.channels_last}",
        f"device: {info.device}, amp {config.run.amp}, world size {info.world_size}, seed "
        f"{config.run.seed}, deterministic {config.run.deterministic}",
        f"model: {config.model.model} ({f['parameters'] / 1e6:.2f} M parameters)",
    ]
    if run.state.step:
        lines.append(
            f"resumed at step {run.state.step} of {plan.total_steps}, epoch {run.state.epoch}"
        )
    for line in lines:
        log.info("%s", line)


# A log line of the changed options wraps before this many characters (a terminal's
# width less the time and level in front of it).
CONFIG_LINE_WIDTH = 120


def config_lines(config: TrainConfig) -> list[str]:
    """`config: RUN_DIR/config.json ...`, then the options changed from the defaults, one
    short line per `--help` group (a long group goes on over more lines)."""
    path = Path(config.run.run_dir) / "config.json"
    changed = changed_flags(TrainConfig, config)
    if not changed:
        return [f"config: every option in {path}; all at their defaults"]
    lines = [f"config: every option in {path}; changed from the defaults:"]
    for section, flags in changed.items():
        line = f"  {section}:"
        for flag in flags:
            if len(line) + 1 + len(flag) > CONFIG_LINE_WIDTH and not line.endswith(":"):
                lines.append(line)
                line = f"  {section}:"
            line += f" {flag}"
        lines.append(line)
    return lines


def class_figure(classes: list[str] | None, count: int) -> str:
    """`10 classes`, or where they come from when the data names none."""
    return f"{count} classes" if classes else f"{count} classes (--num-classes; no class names)"


def finish(
    metrics: MetricsLog, info: DistInfo, settings: Runtime, end: dict, steps_per_epoch: int
) -> None:
    """Close the logs, draw the plot and log the summary line, last (rank 0)."""
    metrics.close()
    if not info.is_main:
        return
    if settings.plot:
        draw_plot(metrics.path, settings.run_dir, settings.input_bound_threshold)
    log.info("metrics: %s", metrics.path)
    log.info("%s", summary_line(end, steps_per_epoch))


def draw_plot(metrics: Path, run_dir: str, threshold: float) -> None:
    """`RUN_DIR/metrics.png` of the rows in `metrics`; a missing or broken matplotlib costs
    the plot, not the run."""
    png = Path(run_dir) / PLOT_NAME
    try:
        drawn = plot_metrics(metrics, png, threshold)
    except ImportError as error:  # installed, but it or a library it needs will not load
        log.warning(
            "plot skipped: matplotlib is installed but does not import (%s); "
            "reinstall it: pip install --force-reinstall matplotlib",
            error,
        )
        return
    if drawn:
        log.info("plot: %s", png)
    else:
        log.info("plot skipped: matplotlib is not installed; `pip install matplotlib` draws it")


def source_line(source: ResolvedSource | ResolvedMix) -> str:
    """What the train loader reads, for the start-up log: its manifest, or a mix's sources."""
    if any(source.names):
        shares = ", ".join(f"{n} {q}" for n, q in zip(source.names, source.quotas, strict=True))
        return f"a mix of {len(source.names)} sources (samples an epoch: {shares})"
    return redact_url(source.manifest_url or "shard URLs")


if __name__ == "__main__":
    sys.exit(main())
