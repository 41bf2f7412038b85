"""`train find-batch-size` and `train scan-throughput`: measure before a long run.

find-batch-size measures the peak memory of full training steps at a few small
batches, fits `peak = fixed + per_sample x batch`, extrapolates to
`--memory-fraction` of the device's memory and confirms with a real step.
On CUDA the peak is the caching allocator's `max_memory_allocated`; on CPU it
is the process's peak resident set (VmHWM, reset through /proc/self/clear_refs),
which includes the Python/torch baseline and allocator slack, so it is an
estimate. scan-throughput times training steps across batch sizes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from pipeline.prefetch import CudaPrefetcher
from shards.errors import DataError, UsageError
from trainers.config import TrainConfig
from trainers.data import SOURCE_ERRORS, build_split_loader, loader_config
from trainers.distributed import DeviceError, DistInfo, init_distributed, setup_logging
from trainers.metrics import StepTimer, iter_timed, load_pyplot
from trainers.models import build_model
from trainers.numerics import build_optimizer, configure_determinism, resolve_amp
from trainers.placement import worker_cluster
from trainers.recipe import build_criterion, build_mix
from trainers.run import seed_generators

log = logging.getLogger("trainers")
KNEE_SHARE = 0.9


class MemoryMeter:
    """Peak memory of the work between `reset()` and `peak()`, and the capacity to budget from."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def what(self) -> str:
        if self.device.type == "cuda":
            return "CUDA caching-allocator peak (torch.cuda.max_memory_allocated)"
        return (
            "process peak RSS (VmHWM, reset via /proc/self/clear_refs); includes the torch baseline"
        )

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError as exc:
            raise RuntimeError(
                "cannot reset the peak RSS on this system (/proc/self/clear_refs); "
                "find-batch-size on CPU needs Linux"
            ) from exc

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return proc_status_kb("VmHWM") * 1024

    def capacity(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no MemTotal in /proc/meminfo")


def proc_status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


@dataclass
class Probe:
    """The model, optimizer and step settings both probes run."""

    config: TrainConfig
    info: DistInfo
    model: nn.Module
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    amp_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler
    num_classes: int


def build_probe(config: TrainConfig) -> Probe:
    configure_determinism(config.run.deterministic)
    info = init_distributed(config.run.device, config.run.dist_timeout_s)
    setup_logging(info)
    seed_generators(config.run.seed)
    num_classes = config.model.num_classes or classes_from_source(config) or 1000
    model = build_model(config.model.model, num_classes).to(info.device)
    if config.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return Probe(
        config=config,
        info=info,
        model=model,
        optimizer=build_optimizer(model, config.optimizer, config.schedule.lr),
        criterion=nn.CrossEntropyLoss(),
        amp_dtype=resolve_amp(config.run.amp, info.device),
        scaler=torch.amp.GradScaler(info.device.type, enabled=config.run.amp == "fp16"),
        num_classes=num_classes,
    )


def classes_from_source(config: TrainConfig) -> int | None:
    if not config.data.train_shards:
        return None
    from pipeline.sources import resolve_source

    try:
        classes = resolve_source(
            config.data.train_shards, config.data.train_split, config.loader.format
        ).classes
    except SOURCE_ERRORS as error:
        raise DataError(
            f"--train-shards {config.data.train_shards}: {' '.join(str(error).split())}"
        ) from error
    return len(classes) if classes else None


def synthetic_batch(probe: Probe, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    size = probe.config.loader.crop.image_size
    images = torch.randn(batch, 3, size, size, device=probe.info.device)
    if probe.config.model.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, probe.num_classes, (batch,), device=probe.info.device)
    return images, labels


def train_step(probe: Probe, images: torch.Tensor, labels: torch.Tensor) -> float:
    """One full optimizer step, as the trainer runs it (autocast, scaler); returns the loss."""
    device = probe.info.device.type
    with torch.autocast(device, dtype=probe.amp_dtype, enabled=probe.amp_dtype is not None):
        loss = probe.criterion(probe.model(images).float(), labels)
    probe.scaler.scale(loss).backward()
    probe.scaler.step(probe.optimizer)
    probe.scaler.update()
    probe.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def measure_peak(probe: Probe, meter: MemoryMeter, batch: int) -> int:
    images, labels = synthetic_batch(probe, batch)
    meter.reset()
    train_step(probe, images, labels)
    peak = meter.peak()
    del images, labels
    return peak


def fit_line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares `(fixed, per_sample)` for `peak = fixed + per_sample x batch`."""
    n = len(points)
    mean_x = sum(b for b, _ in points) / n
    mean_y = sum(p for _, p in points) / n
    var = sum((b - mean_x) ** 2 for b, _ in points)
    if var == 0:
        raise UsageError("--probe-batches needs at least two different batch sizes")
    slope = sum((b - mean_x) * (p - mean_y) for b, p in points) / var
    return mean_y - slope * mean_x, slope


def max_batch_for(fixed: float, per_sample: float, budget: float) -> int:
    """Largest batch whose predicted peak fits `budget`; a multiple of 8 from 16 up."""
    if per_sample <= 0:
        raise DeviceError(
            "memory did not grow with the batch, so no batch size can be extrapolated; "
            "use larger --probe-batches"
        )
    batch = math.floor((budget - fixed) / per_sample)
    if batch >= 16:
        batch -= batch % 8  # tensor-core friendly sizes
    return batch


@dataclass
class BatchSizeResult:
    """What find-batch-size measured and chose."""

    measured: str
    points: list[tuple[int, int]]
    fixed_bytes: float
    per_sample_bytes: float
    capacity_bytes: int
    budget_bytes: float
    batch_size: int
    confirmed_peak_bytes: int


def find_batch_size(config: TrainConfig) -> BatchSizeResult:
    """Largest per-device batch that fits `--memory-fraction` of memory; printed and saved."""
    probe = build_probe(config)
    meter = MemoryMeter(probe.info.device)
    capacity = (
        int(config.probe.memory_budget_mb * 2**20)
        if config.probe.memory_budget_mb
        else meter.capacity()
    )
    budget = capacity * config.probe.memory_fraction
    batches = sorted(set(config.probe.probe_batches))
    measure_peak(probe, meter, batches[0])  # first step allocates optimizer state and workspaces
    points = [(b, measure_peak(probe, meter, b)) for b in batches]
    fixed, per_sample = fit_line(points)
    batch = max_batch_for(fixed, per_sample, budget)
    if batch < 1:
        raise DeviceError(
            f"even a batch of 1 needs about {(fixed + per_sample) / 2**20:.0f} MB, over the budget of "
            f"{budget / 2**20:.0f} MB; lower --image-size or use a smaller --model"
        )
    batch, peak = confirm_batch(probe, meter, batch, budget)
    result = BatchSizeResult(meter.what, points, fixed, per_sample, capacity, budget, batch, peak)
    report_batch_size(config, result)
    return result


def confirm_batch(probe: Probe, meter: MemoryMeter, batch: int, budget: float) -> tuple[int, int]:
    """Run a real step at `batch`; back off by 15% while it runs out of memory or over budget."""
    for _ in range(6):
        try:
            peak = measure_peak(probe, meter, batch)
        except RuntimeError as error:
            if not is_out_of_memory(error):
                raise
            log.info("batch %d ran out of memory; trying smaller", batch)
            peak = None
        if peak is not None and peak <= budget:
            return batch, peak
        probe.optimizer.zero_grad(set_to_none=True)
        batch = max(1, int(batch * 0.85))
    raise DeviceError(
        f"no batch fit the budget of {budget / 2**20:.0f} MB after backing off; lower "
        "--image-size, use a smaller --model, or raise --memory-fraction"
    )


def report_batch_size(config: TrainConfig, result: BatchSizeResult) -> None:
    mb = 2**20
    lines = [
        f"measured: {result.measured}",
        *(f"  batch {b:5d}: peak {p / mb:9.1f} MB" for b, p in result.points),
        f"fit: {result.fixed_bytes / mb:.1f} MB fixed + {result.per_sample_bytes / mb:.3f} MB per sample",
        f"budget: {config.probe.memory_fraction:.0%} of {result.capacity_bytes / mb:.0f} MB = {result.budget_bytes / mb:.0f} MB",
        f"largest batch: {result.batch_size} (confirmed: peak {result.confirmed_peak_bytes / mb:.1f} MB)",
        f"use: --batch-size {result.batch_size}, and --accum-steps to reach a larger effective batch",
    ]
    print("\n".join(lines))
    out = Path(config.run.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "find-batch-size.json").write_text(json.dumps(asdict(result), indent=1) + "\n")


@dataclass
class ScanPoint:
    """One batch size of scan-throughput (`images_per_s` 0 when it ran out of memory)."""

    batch_size: int
    images_per_s: float
    step_ms: float
    data_wait_frac: float | None
    peak_mem_mb: float | None
    oom: bool = False


def knee_index(points: list[ScanPoint]) -> int | None:
    """Smallest batch reaching 90% of the best images/s: larger ones buy little speed."""
    ok = [p for p in points if not p.oom]
    if not ok:
        return None
    best = max(p.images_per_s for p in ok)
    for index, point in enumerate(points):
        if not point.oom and point.images_per_s >= KNEE_SHARE * best:
            return index
    return None


def time_synthetic(probe: Probe, batch: int) -> ScanPoint:
    config = probe.config
    images, labels = synthetic_batch(probe, batch)
    for _ in range(config.probe.scan_warmup):
        train_step(probe, images, labels)
    if probe.info.device.type == "cuda":
        torch.cuda.synchronize(probe.info.device)
        torch.cuda.reset_peak_memory_stats(probe.info.device)
    started = time.perf_counter()
    for _ in range(config.probe.scan_steps):
        train_step(probe, images, labels)  # float(loss) syncs every step, as training does
    elapsed = time.perf_counter() - started
    return ScanPoint(
        batch,
        batch * config.probe.scan_steps / elapsed,
        1000 * elapsed / config.probe.scan_steps,
        None,
        peak_mb(probe),
    )


def time_loader(probe: Probe, batch: int) -> ScanPoint:
    """Steps fed by the real train loader: the end-to-end rate and how long it waited for data."""
    from dataclasses import replace

    config = replace(probe.config, schedule=replace(probe.config.schedule, batch_size=batch))
    settings = loader_config(config, probe.info, config.data.train_split, True)
    loader = build_split_loader(settings, "--train-shards", config)
    mix = build_mix(config, probe.num_classes, probe.info.rank)
    if mix is not None:  # the run's batch mix and the loss of its soft targets, timed too
        probe = replace(probe, criterion=build_criterion(config))
    batches = CudaPrefetcher(
        loader, probe.info.device, channels_last=config.model.channels_last, mix=mix
    )
    timer = StepTimer()
    stream = iter_timed(batches, timer)
    try:
        for step, (images, labels) in enumerate(stream):
            if step == config.probe.scan_warmup:
                timer.take()  # discard the warmup (worker start, first batch)
            train_step(probe, images, labels)
            timer.end_step(len(labels))
            if step + 1 >= config.probe.scan_warmup + config.probe.scan_steps:
                break
    finally:
        stream.close()
    window = timer.take()
    if window.steps == 0:
        raise DataError(
            f"the train split has too few batches of {batch} for the scan; lower "
            "--scan-batch-sizes or --scan-warmup"
        )
    ips = window.samples / window.elapsed_s
    return ScanPoint(
        batch, ips, 1000 * window.elapsed_s / window.steps, window.wait_frac, peak_mb(probe)
    )


def peak_mb(probe: Probe) -> float | None:
    if probe.info.device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(probe.info.device) / 2**20


def scan_throughput(config: TrainConfig) -> list[ScanPoint]:
    """Images/s for each `--scan-batch-sizes`; stops at the first out-of-memory."""
    if config.probe.scan_source == "loader" and not config.data.train_shards:
        raise UsageError("--scan-source loader needs --train-shards")
    probe = build_probe(config)
    loader = config.probe.scan_source == "loader"
    timer = time_loader if loader else time_synthetic
    points: list[ScanPoint] = []
    # --worker-placement ray: the cluster joined once, its errors in flags, as `train`'s
    with worker_cluster(config.loader.workers, 1) if loader else contextlib.nullcontext():
        for batch in config.probe.scan_batch_sizes:
            try:
                points.append(timer(probe, batch))
            except RuntimeError as error:
                if not is_out_of_memory(error):
                    raise
                points.append(ScanPoint(batch, 0.0, 0.0, None, None, oom=True))
                probe.optimizer.zero_grad(set_to_none=True)
                break
            log.info("batch %d: %.1f images/s", batch, points[-1].images_per_s)
    report_scan(config, points)
    return points


def scan_table(points: list[ScanPoint], knee: int | None) -> str:
    lines = [
        "| batch | images/s | step ms | data wait | peak MB | |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for index, p in enumerate(points):
        wait = f"{p.data_wait_frac:.0%}" if p.data_wait_frac is not None else "-"
        mem = f"{p.peak_mem_mb:.0f}" if p.peak_mem_mb is not None else "-"
        mark = "out of memory" if p.oom else ("<- knee" if index == knee else "")
        lines.append(
            f"| {p.batch_size} | {p.images_per_s:.1f} | {p.step_ms:.1f} | {wait} | {mem} | {mark} |"
        )
    return "\n".join(lines)


def report_scan(config: TrainConfig, points: list[ScanPoint]) -> None:
    knee = knee_index(points)
    table = scan_table(points, knee)
    print(table)
    if knee is not None:
        print(
            f"knee: batch {points[knee].batch_size} reaches {KNEE_SHARE:.0%} of the best images/s"
        )
    out = Path(config.run.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "source": config.probe.scan_source,
        "knee": knee,
        "points": [asdict(p) for p in points],
    }
    (out / "scan-throughput.json").write_text(json.dumps(document, indent=1) + "\n")
    (out / "scan-throughput.md").write_text(table + "\n")
    if not plot_scan(points, knee, out / "scan-throughput.png"):
        log.info(
            "scan plot skipped: matplotlib is not installed; `pip install matplotlib` draws it"
        )


def plot_scan(points: list[ScanPoint], knee: int | None, png: Path) -> bool:
    plt = load_pyplot()
    if plt is None:
        return False
    ok = [p for p in points if not p.oom]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot([p.batch_size for p in ok], [p.images_per_s for p in ok], "o-")
    if knee is not None:
        point = points[knee]
        axis.plot([point.batch_size], [point.images_per_s], "r*", markersize=14, label="knee")
        axis.legend()
    axis.set_xscale("log", base=2)
    axis.set_xlabel("batch size per device")
    axis.set_ylabel("images/s")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    plt.close(figure)
    return True
