"""Where build-shards runs its shard tasks: inline, a local process pool, Ray; the same bytes.

Every build here is compared file by file (shards, markers, manifest) with the inline
build of `built_shards`. The pool runs real worker processes on the sample images; a
dead worker is a real `os._exit` in one of them.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import preprocess.job
import preprocess.pool
from preprocess.cli import format_summary, main
from preprocess.config import BuildConfig
from preprocess.job import PHASES, run_build
from preprocess.pool import LocalPool, iter_local, resolve_executor
from preprocess.ray_job import TASK_RETRIES, BuildError, build_with_options
from shards.storage.write import is_temp_name
from tests.conftest import small_build_config

REPO = Path(__file__).resolve().parents[2]


def all_files(directory: Path) -> dict[str, bytes]:
    """Every file under `directory`, hidden temp files included, by relative path."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def cli_args(sample_dir: Path, out: Path, *extra: str) -> list[str]:
    """`build-shards` flags equal to `small_build_config` (the `built_shards` build)."""
    return [
        "build-shards",
        f"--input={sample_dir}",
        f"--output={out}",
        "--image-size=64",
        "--shard-size=32",
        "--val-fraction=0.2",
        "--seed=3",
        "--row-group-size=16",
        "--no-progress",
        *extra,
    ]


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(preprocess.job, "start_ray", refuse)
    monkeypatch.setattr(preprocess.job, "iter_ray", refuse)


@pytest.mark.timeout(120)
def test_local_pool_writes_the_inline_build_byte_for_byte(sample_dir, built_shards, tmp_path):
    summary = run_build(small_build_config(sample_dir, tmp_path / "out", executor="local"))
    assert summary.executor == "local"
    assert summary.shards_built == sum(len(s.shards) for s in summary.manifest.splits.values())
    assert all_files(summary.output) == all_files(built_shards.output)


@pytest.mark.timeout(120)
def test_auto_is_the_local_pool_without_a_cluster(
    sample_dir, built_shards, tmp_path, monkeypatch, capsys, no_ray
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "out"
    assert main(cli_args(sample_dir, out, "--workers=2")) == 0  # --executor auto: the default
    printed = capsys.readouterr()
    assert "phases: plan " in printed.out and "local start " in printed.out
    assert "Ray" not in printed.err
    assert all_files(out) == all_files(built_shards.output)


def test_auto_resolves_to_ray_only_when_a_cluster_is_named(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert resolve_executor("auto", None) == "local"
    assert resolve_executor("auto", "ray://head:10001") == "ray"
    assert resolve_executor("inline", None) == "inline"
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")  # as under `ray job submit`
    assert resolve_executor("auto", None) == "ray"
    assert resolve_executor("local", None) == "local"
    with pytest.raises(ValueError, match=r"BuildConfig\.executor local does not use Ray"):
        BuildConfig(input="i", output="o", executor="local", ray_address="auto")
    with pytest.raises(ValueError, match="'dask' is not one of auto, ray, local, inline"):
        BuildConfig(input="i", output="o", executor="dask")
    with pytest.raises(ValueError, match=r"BuildConfig\.workers"):
        BuildConfig(input="i", output="o", workers=0)


@pytest.mark.timeout(120)
def test_phases_are_reported_in_order_and_non_negative(sample_dir, tmp_path):
    summary = run_build(small_build_config(sample_dir, tmp_path / "out", executor="local"))
    assert list(summary.phases) == list(PHASES)
    assert all(seconds >= 0 for seconds in summary.phases.values())
    assert summary.phases["encode"] > 0 and summary.tail_idle_s >= 0
    assert sum(summary.phases[p] for p in ("plan", "wait", "encode", "commit")) <= summary.seconds
    line = next(x for x in format_summary(summary).splitlines() if x.startswith("phases:"))
    for name in ("plan", "local start", "waited", "encode", "commit", "idle at the end"):
        assert name in line
    # A rerun with nothing to build starts no executor: its start and wait are 0.
    again = run_build(small_build_config(sample_dir, tmp_path / "out", executor="local"))
    assert again.shards_built == 0
    assert again.phases["start"] == again.phases["wait"] == 0.0


class CountingPool(LocalPool):
    """A real `LocalPool` that records what was sent and the most tasks in flight at once."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.ready()
        self.sent: list[tuple[str, int]] = []
        self.in_flight = 0
        self.most_in_flight = 0

    def submit(self, task, job):
        future = super().submit(task, job)
        self.sent.append((task.split, task.index))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return future

    def finished(self) -> None:
        self.in_flight -= 1


@pytest.mark.timeout(120)
def test_the_pool_keeps_exactly_workers_tasks_in_flight_largest_first(
    sample_dir, tmp_path, monkeypatch
):
    pools: list[CountingPool] = []

    def counting_iter_local(tasks, job, pool):
        counting = CountingPool(pool.workers)
        pools.append(counting)
        try:
            for result in iter_local(tasks, job, counting):
                counting.finished()
                yield result
        finally:
            counting.close()

    monkeypatch.setattr(preprocess.pool, "iter_local", counting_iter_local)
    config = small_build_config(sample_dir, tmp_path / "out", executor="local", workers=2)
    summary = run_build(config)
    (pool,) = pools
    assert pool.most_in_flight == 2
    assert not summary.manifest.skipped  # a shard's samples are then its planned size
    sizes = {
        (name, shard.index): shard.samples
        for name, split in summary.manifest.splits.items()
        for shard in split.shards
    }
    sent_sizes = [sizes[name] for name in pool.sent]
    assert sent_sizes == sorted(sent_sizes, reverse=True) and len(set(sent_sizes)) > 1
    assert sorted(pool.sent) == sorted(sizes)  # every shard sent once


class DieOnce:
    """A shard task that kills its worker process the first time it runs `shard`."""

    def __init__(self, flag: Path, shard: tuple[str, int], times: int = 1) -> None:
        self.flag = flag
        self.shard = shard
        self.times = times

    def __call__(self, task, job):
        if (task.split, task.index) == self.shard:
            deaths = int(self.flag.read_text()) if self.flag.exists() else 0
            if deaths < self.times:
                self.flag.write_text(str(deaths + 1))
                os._exit(9)  # as the kernel's OOM killer would end it: no cleanup
        return build_with_options(task, job)


@pytest.mark.timeout(180)
def test_a_dead_worker_is_replaced_and_its_shard_rebuilt(
    sample_dir, built_shards, tmp_path, monkeypatch
):
    flag = tmp_path / "deaths"
    monkeypatch.setattr(preprocess.pool, "build_with_options", DieOnce(flag, ("train", 2)))
    summary = run_build(small_build_config(sample_dir, tmp_path / "out", executor="local"))
    assert flag.read_text() == "1"
    assert not [p for p in summary.output.rglob("*") if is_temp_name(p.name)]
    assert all_files(summary.output) == all_files(built_shards.output)


@pytest.mark.timeout(180)
def test_a_shard_that_always_kills_its_worker_stops_the_build_naming_it(
    sample_dir, tmp_path, monkeypatch
):
    flag = tmp_path / "deaths"
    killer = DieOnce(flag, ("val", 0), times=100)
    monkeypatch.setattr(preprocess.pool, "build_with_options", killer)
    out = tmp_path / "out"
    with pytest.raises(BuildError, match=r"shard val-000000: a worker process died") as info:
        run_build(small_build_config(sample_dir, out, executor="local"))
    assert "rerun the same command to resume" in str(info.value)
    # Tried once beside another task (a death not yet its own), then alone 1 + retries times.
    assert int(flag.read_text()) in (TASK_RETRIES + 1, TASK_RETRIES + 2)
    assert not (out / "manifest.json").exists()
    monkeypatch.undo()
    resumed = run_build(small_build_config(sample_dir, out, executor="local"))
    assert resumed.shards_reused > 0 and resumed.shards_built >= 1


def children_of(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.timeout(240)
def test_killed_pool_build_resumes_with_nothing_lost_or_doubled(sample_dir, built_shards, tmp_path):
    out = tmp_path / "killed"
    args = cli_args(sample_dir, out, "--executor=local", "--workers=2")
    command = [sys.executable, "-m", "preprocess.cli", *args]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL)
    workers: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list((out / "_build").glob("train-*.json")):
        workers = children_of(process.pid) or workers
        time.sleep(0.01)
    workers = children_of(process.pid) or workers
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert workers, "the pool's workers were not seen"
    assert not (out / "manifest.json").exists(), "the build finished before it was killed"
    gone = time.monotonic() + 30
    while time.monotonic() < gone and any(alive(pid) for pid in workers):
        time.sleep(0.05)
    assert not any(alive(pid) for pid in workers)  # orphaned workers stop writing
    committed = len(list((out / "_build").glob("*-*.json")))
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert f"reused {committed}" in result.stdout
    assert all_files(out) == all_files(built_shards.output)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_writes_the_inline_build_byte_for_byte(sample_dir, built_shards, tmp_path):
    # In a process of its own: a driver keeps process-wide Ray state (see tests/cluster).
    out = tmp_path / "ray"
    command = [sys.executable, "-m", "preprocess.cli", *cli_args(sample_dir, out)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [*command, "--executor=ray", "--workers=2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ray start " in result.stdout and "starting Ray (local, 2 CPUs)" in result.stderr
    assert "SIGTERM handler" not in result.stderr  # Ray started in the background, quietly
    assert all_files(out) == all_files(built_shards.output)


def test_auto_picks_ray_by_the_inputs_left_to_build_and_says_why(monkeypatch):
    """The size rule: the local pool under `ray_min_inputs`, Ray from it; nothing to do: local."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = BuildConfig(input="i", output="o", workers=2)
    threshold = preprocess.pool.ray_min_inputs(2)
    assert threshold == math.ceil(
        preprocess.pool.RAY_START_S
        / preprocess.pool.RAY_START_SHARE
        * preprocess.pool.IMAGES_PER_CPU_S
        * 2
    )
    small, large, idle = (preprocess.job.choose_executor(config) for _ in range(3))
    small.decide(threshold - 1)
    large.decide(threshold)
    idle.decide(0)
    assert (small.kind, large.kind, idle.kind) == ("local", "ray", "local")
    assert small.reason.startswith(f"auto: {threshold - 1} inputs to build, under the {threshold}")
    assert large.reason.startswith(f"auto: {threshold} inputs to build, at least the {threshold}")
    assert idle.reason == "auto: nothing to build"
    named = preprocess.job.choose_executor(BuildConfig(input="i", output="o", ray_address="auto"))
    named.decide(1)  # a named cluster is Ray whatever the size
    assert named.kind == "ray"
    assert named.reason == "auto: a Ray cluster is named (--ray-address or RAY_ADDRESS)"
    forced = preprocess.job.choose_executor(BuildConfig(input="i", output="o", executor="local"))
    forced.decide(10**9)
    assert (forced.kind, forced.reason) == ("local", "--executor local")


@pytest.mark.timeout(120)
def test_a_small_auto_build_and_its_rerun_say_why_the_local_pool_ran(
    sample_dir, tmp_path, monkeypatch, no_ray
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = small_build_config(sample_dir, tmp_path / "out", executor="auto", workers=2)
    first = run_build(config)
    assert first.executor == "local"
    assert first.executor_reason.startswith("auto: 240 inputs to build, under the ")
    again = run_build(config)
    assert (again.executor, again.executor_reason) == ("local", "auto: nothing to build")
