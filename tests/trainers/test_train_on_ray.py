"""`train --worker-placement ray` on a real multi-node Ray cluster on this machine (a head
with 0 CPUs plus three 1-CPU worker nodes, shared with tests/pipeline/test_remote_roles.py):
one epoch trained on batches decoded by roles on the worker nodes, the same losses as
the same two roles give as local workers (`--ray-fallback local`), and a cluster without
the asked-for resource is one line; under torchrun each rank runs its own roles."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.cluster.raycluster import LocalRayCluster
from tests.trainers.conftest import (
    REPO,
    base_args,
    read_rows,
    read_trace,
    split_samples,
    subprocess_env,
    torchrun_command,
    train_command,
)

BATCH = 16


@pytest.fixture
def cluster(cpu_ray_cluster):
    """The session's head with 0 CPUs and three 1-CPU worker nodes (tests/conftest.py)."""
    return cpu_ray_cluster


def run(command: list[str], cluster: LocalRayCluster) -> tuple[int, str]:
    """`command` (train, or train under torchrun) as a job on `cluster` would run it."""
    env = {**cluster.env, **{k: subprocess_env()[k] for k in ("PYTHONPATH", "OMP_NUM_THREADS")}}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    return done.returncode, done.stderr


def losses(run_dir) -> list[float]:
    return [row["loss"] for row in read_rows(run_dir, "train")]


@pytest.mark.ray
@pytest.mark.slow
def test_train_on_remote_roles_trains_the_epoch_local_workers_train(
    train_shards, tmp_path, cluster
):
    flags = dict(epochs=1, batch_size=BATCH, val_shards=None, workers=0)
    placement = ["--worker-placement", "ray", "--ray-address", cluster.address]
    placement += ["--remote-workers", "2"]
    remote = tmp_path / "remote"
    code, err = run(train_command([*base_args(train_shards, remote, **flags), *placement]), cluster)
    assert code == 0, err[-3000:]
    steps = split_samples(train_shards, "train") // BATCH  # one rank, drop_last
    rows = read_rows(remote, "train")
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert f"loader: 2 remote roles per rank on {cluster.address} (1 CPU each), 0 local" in err

    # Roles that ask for a resource no node has: with --ray-fallback local, the same two
    # roles as local workers; batch j from role j % 2 either way, so the same batches and
    # the same model, step by step.
    placement += ["--ray-resources", json.dumps({"cpu_node": 1})]
    local = tmp_path / "fallback"
    argv = [*base_args(train_shards, local, **flags), *placement, "--ray-fallback", "local"]
    code, err = run(train_command(argv), cluster)
    assert code == 0, err[-3000:]
    assert "the 2 remote roles run as local DataLoader workers instead" in err
    # ... and the run leaves the cluster rather than hold it for nothing to its end.
    assert "none of this loader's roles run there" in err.split("left the Ray cluster at ")[1]
    assert losses(remote) == pytest.approx(losses(local), rel=1e-5)
    # Without the fallback: one line, nothing trained.
    refused = tmp_path / "refused"
    code, err = run(
        train_command([*base_args(train_shards, refused, **flags), *placement]), cluster
    )
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        "train: error: the Ray cluster has cpu_node 0 but Workers(remote=2, ray_cpus=1, "
        "ray_resources={'cpu_node': 1}) needs cpu_node 2: add nodes with them, or ask for "
        "fewer --remote-workers, or pass --ray-fallback local"
    )
    assert not (refused / "metrics.jsonl").exists()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_each_run_their_own_roles_on_one_cluster(train_shards, tmp_path, cluster):
    flags = dict(epochs=1, batch_size=BATCH, val_shards=None, workers=0, debug_trace=True)
    placement = ["--worker-placement", "ray", "--ray-address", cluster.address]
    run_dir = tmp_path / "run"
    argv = [*base_args(train_shards, run_dir, **flags), *placement, "--remote-workers", "1"]
    code, err = run(torchrun_command(argv), cluster)
    assert code == 0, err[-3000:]
    assert "loader: 1 remote roles per rank on" in err
    # Each rank trained its own share from its own role: equal batches, disjoint samples.
    keys = [
        {k for row in read_trace(run_dir, rank, "batch") for k in row["keys"]} for rank in (0, 1)
    ]
    per_rank = split_samples(train_shards, "train") // 2 // BATCH
    assert len(keys[0]) == len(keys[1]) == per_rank * BATCH
    assert not keys[0] & keys[1]

    # Two ranks' two roles each want 4 CPUs of a cluster that has 3: each rank says so at
    # once, rather than the last ranks' actors waiting for room that never comes.
    argv = [*base_args(train_shards, tmp_path / "crowded", **flags), *placement]
    code, err = run(torchrun_command(argv), cluster)
    assert code != 0
    for rank in (0, 1):
        assert (
            f"train: error: [rank {rank}] 2 ranks each run --remote-workers 2 roles, and the "
            "Ray cluster has CPU 3 but Workers(remote=4, ray_cpus=1, ray_resources=None) needs "
            "CPU 4: add nodes with them, or ask for fewer --remote-workers"
        ) in err
