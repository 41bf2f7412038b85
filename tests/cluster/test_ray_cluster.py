"""`preprocess build-shards` on a real multi-node Ray cluster on this machine, with faults.

A head and two worker nodes started with `ray start` (see `raycluster.py`).
Every build is compared file by file (shards, markers, manifest) with an inline
build of the same inputs: a lost node, a killed driver or stale state must
leave exactly the fault-free output, with nothing lost or doubled.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from preprocess.job import run_build
from shards.manifest import read_manifest
from shards.storage.write import is_temp_name
from shards.tar import iter_tar_samples
from tests.cluster.raycluster import (
    FAST_NODE_DEATH,
    RAY_BIN,
    LocalRayCluster,
    TaskWatch,
    dashboard_available,
)
from tests.conftest import shard_files, shard_path, small_build_config

pytestmark = [pytest.mark.ray, pytest.mark.distributed, pytest.mark.slow]

TASK = "build_with_options"  # the Ray task of one shard (preprocess/ray_job.py)
SHARD_SIZE = 16  # 16 shards from the 240 sample images: enough to spread and to interrupt
REPO = Path(__file__).resolve().parents[2]


def all_files(directory: Path) -> dict[str, bytes]:
    """Every file under `directory`, hidden temp files included, by relative path."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def cluster_config(input_dir: Path, output_dir: Path, **overrides):
    return small_build_config(input_dir, output_dir, shard_size=SHARD_SIZE, **overrides)


def cli_args(input_dir: Path, output_dir: Path, *extra: str) -> list[str]:
    """`build-shards` flags equal to `cluster_config`."""
    return [
        "build-shards",
        f"--input={input_dir}",
        f"--output={output_dir}",
        "--image-size=64",
        f"--shard-size={SHARD_SIZE}",
        "--val-fraction=0.2",
        "--seed=3",
        "--row-group-size=16",
        "--no-progress",
        *extra,
    ]


def shard_count(output_dir: Path) -> int:
    return sum(len(s.shards) for s in read_manifest(output_dir).splits.values())


def markers(output_dir: Path) -> list[Path]:
    return sorted((output_dir / "_build").glob("*-*.json"))


@pytest.fixture(scope="module")
def reference(sample_dir, tmp_path_factory) -> Path:
    """The fault-free output, built inline in this process."""
    out = tmp_path_factory.mktemp("reference") / "out"
    run_build(cluster_config(sample_dir, out))
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head + 2 workers shared by the tests that leave every node alive."""
    root = tmp_path_factory.mktemp("ray-cluster")
    with LocalRayCluster(root, workers=2, dashboard=dashboard_available()) as started:
        yield started


def build_command(input_dir: Path, output_dir: Path, address: str) -> list[str]:
    """The CLI against the cluster at `address`; the driver runs in a process of its own.

    A driver holds process-wide Ray state (a local `ray.init()` earlier in a
    pytest process switches it to token auth for good), so no test here makes
    the pytest process a driver.
    """
    args = cli_args(input_dir, output_dir, f"--ray-address={address}")
    return [sys.executable, "-m", "preprocess.cli", *args]


def run_command(command: list[str], cluster: LocalRayCluster) -> str:
    """Run to completion; returns stdout, and fails the test with the output otherwise."""
    result = subprocess.run(
        command, capture_output=True, text=True, env=cluster.env, cwd=REPO, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def summary_line(built: int, reused: int) -> str:
    return f"shards built {built}, reused {reused};"


def test_build_spreads_over_nodes_and_matches_inline(sample_dir, reference, cluster, tmp_path):
    out = tmp_path / "out"
    with TaskWatch(cluster, TASK) as watch:
        stdout = run_command(build_command(sample_dir, out, cluster.address), cluster)
    assert summary_line(shard_count(reference), 0) in stdout
    assert len(watch.nodes) >= 2, f"all tasks ran on {watch.nodes}"
    assert all_files(out) == all_files(reference)


def test_killed_worker_node_loses_nothing_and_doubles_nothing(sample_dir, reference, tmp_path):
    out = tmp_path / "out"
    with (
        # No CPU on the head: every task runs on the two workers, so each has work to lose.
        LocalRayCluster(tmp_path / "ray", workers=2, head_cpus=0, env=FAST_NODE_DEATH) as cluster,
        ThreadPoolExecutor(1) as pool,
    ):
        build_done = threading.Event()
        # Killed while its task holds a temp file open in the output: mid-write.
        killing = pool.submit(cluster.kill_worker_mid_task, TASK, out, give_up=build_done)
        try:
            stdout = run_command(build_command(sample_dir, out, cluster.address), cluster)
        finally:
            build_done.set()
        killed = killing.result()
        assert killed.process.poll() is not None and not killed.pids()
    assert summary_line(shard_count(reference), 0) in stdout
    # Every shard once, byte for byte; the killed attempt's temp files are gone.
    assert all_files(out) == all_files(reference)


def test_killed_driver_rerun_builds_only_missing_shards(sample_dir, reference, cluster, tmp_path):
    out = tmp_path / "out"
    command = build_command(sample_dir, out, cluster.address)
    log = tmp_path / "driver.log"
    with open(log, "wb") as stream:
        process = subprocess.Popen(
            command, stdout=stream, stderr=subprocess.STDOUT, env=cluster.env, cwd=REPO
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(markers(out)) < 3 and process.poll() is None:
        time.sleep(0.02)
    assert process.poll() is None, f"the driver ended by itself:\n{log.read_text()[-3000:]}"
    process.send_signal(signal.SIGKILL)
    process.wait()
    cluster.wait_idle(TASK)  # Ray ends a dead driver's tasks; none may commit during the rerun
    assert not (out / "manifest.json").exists()
    committed = len(markers(out))
    total = shard_count(reference)
    assert 3 <= committed < total
    shard_stems = {p.stem for p in shard_files(out, "tar")} | {
        p.stem for p in shard_files(out, "parquet")
    }
    assert {p.stem for p in markers(out)} <= shard_stems
    for tar in shard_files(out, "tar"):  # anything under a final name is a complete tar
        with open(tar, "rb") as stream:
            list(iter_tar_samples(stream, str(tar)))
    stdout = run_command(command, cluster)
    assert summary_line(total - committed, committed) in stdout
    assert all_files(out) == all_files(reference)


def test_stale_temps_and_markers_are_repaired_on_the_cluster(
    sample_dir, reference, cluster, tmp_path
):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    (out / "manifest.json").unlink()
    crashed = shard_path(out, "train", 1).with_name(".train-000001.tar.tmp-4242-deadbeef")
    crashed.write_bytes(b"half a shard")  # a crashed writer's temp, beside its shard
    shard_path(out, "train", 2).write_bytes(b"garbage")  # marker no longer matches the file
    stale = out / "_build" / "val-000000.json"  # marker of another build's shard
    stale.write_text(stale.read_text().replace('"digest": "', '"digest": "0'))
    (out / "_build" / "train-000003.json").unlink()  # shard written, never committed
    stdout = run_command(build_command(sample_dir, out, cluster.address), cluster)
    assert summary_line(3, shard_count(reference) - 3) in stdout
    assert not [p for p in out.rglob("*") if is_temp_name(p.name)]
    assert all_files(out) == all_files(reference)


def test_without_ray_address_a_local_ray_is_used_beside_a_cluster(
    sample_dir, reference, cluster, tmp_path
):
    # `ray start` records its cluster in <TMPDIR>/ray/ray_current_cluster, and a
    # plain ray.init() joins the cluster recorded there (then refuses num_cpus).
    short_tmp = Path(tempfile.mkdtemp(prefix="rl-", dir="/tmp"))  # Ray's socket paths are short
    try:
        (short_tmp / "ray").mkdir()
        (short_tmp / "ray" / "ray_current_cluster").write_text(cluster.address)
        command = [sys.executable, "-m", "preprocess.cli", *cli_args(sample_dir, tmp_path / "out")]
        env = {**cluster.env, "TMPDIR": str(short_tmp)}
        with TaskWatch(cluster, TASK) as watch:
            result = subprocess.run(
                [*command, "--workers=1"], capture_output=True, text=True, env=env, timeout=300
            )
    finally:
        shutil.rmtree(short_tmp, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not watch.nodes, f"tasks ran on the cluster: {watch.nodes}"
    assert all_files(tmp_path / "out") == all_files(reference)


@pytest.mark.skipif(
    not dashboard_available(), reason="`ray job submit` needs the job server: ray[default]"
)
def test_ray_job_submit_with_working_dir(sample_dir, reference, cluster, tmp_path):
    out = tmp_path / "out"
    command = [
        str(RAY_BIN),
        "job",
        "submit",
        f"--address={cluster.dashboard_url}",
        "--working-dir=.",  # the repo, less what .gitignore names (.venv)
        "--",
        "python",
        "-m",
        "preprocess.cli",
        *cli_args(sample_dir, out, "--ray-address=auto"),
    ]
    stdout = run_command(command, cluster)
    assert "succeeded" in stdout
    assert summary_line(shard_count(reference), 0) in stdout
    assert all_files(out) == all_files(reference)


def test_a_cluster_never_hands_one_port_to_two_components(tmp_path, monkeypatch):
    """The kernel may give a port it just released out again; `ray start` then refuses
    the node ("trying to use a port number ... used by other components")."""
    from tests.cluster import raycluster

    picks = iter([41000, 41001, 41001, 41000, 41002, 41003])
    monkeypatch.setattr(raycluster, "free_port", lambda: next(picks))
    cluster = raycluster.LocalRayCluster(tmp_path / "ray")  # takes the head's two ports
    assert (cluster.port, cluster.dashboard_port) == (41000, 41001)
    assert [cluster.free_port(), cluster.free_port()] == [41002, 41003]
