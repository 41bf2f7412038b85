"""`train --worker-placement ray` on a real multi-node Ray cluster on this machine (a head
with 0 CPUs plus two 1-CPU worker nodes, as tests/pipeline/test_remote_roles.py starts):
one epoch trained on batches decoded by roles on the worker nodes, the same losses as
two local workers give, and a cluster without the asked-for resource is one line."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.cluster.raycluster import LocalRayCluster
from tests.trainers.conftest import (
    REPO,
    base_args,
    read_rows,
    split_samples,
    subprocess_env,
    train_command,
)

BATCH = 16


def run_train(args: list[str], env: dict) -> tuple[int, str]:
    done = subprocess.run(
        train_command(args), cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    return done.returncode, done.stderr


def losses(run_dir) -> list[float]:
    return [row["loss"] for row in read_rows(run_dir, "train")]


@pytest.mark.ray
@pytest.mark.slow
def test_train_on_remote_roles_trains_the_epoch_two_local_workers_train(train_shards, tmp_path):
    flags = dict(epochs=1, batch_size=BATCH, val_shards=None)
    local = tmp_path / "local"
    code, err = run_train(base_args(train_shards, local, workers=2, **flags), subprocess_env())
    assert code == 0, err[-3000:]
    with LocalRayCluster(tmp_path / "ray", workers=2, head_cpus=0) as cluster:
        env = {**cluster.env, **{k: subprocess_env()[k] for k in ("PYTHONPATH", "OMP_NUM_THREADS")}}
        remote = tmp_path / "remote"
        placement = ["--worker-placement", "ray", "--ray-address", cluster.address]
        args = [*base_args(train_shards, remote, workers=0, **flags), *placement]
        code, err = run_train([*args, "--remote-workers", "2"], env)
        assert code == 0, err[-3000:]
        # Roles that ask for a resource no node has: one line, nothing trained.
        refused = tmp_path / "refused"
        resources = ["--remote-workers", "2", "--ray-resources", json.dumps({"cpu_node": 1})]
        argv = [*base_args(train_shards, refused, workers=0, **flags), *placement, *resources]
        refused_code, refused_err = run_train(argv, env)
    steps = split_samples(train_shards, "train") // BATCH  # one rank, drop_last
    rows = read_rows(remote, "train")
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert f"loader: 2 remote roles per rank on {cluster.address} (1 CPU each), 0 local" in err
    # Batch j from role j % 2 as a local loader takes it from worker j % 2: the same batches,
    # so the same model, step by step.
    assert losses(remote) == pytest.approx(losses(local), rel=1e-5)
    assert refused_code == 1
    last = refused_err.strip().splitlines()[-1]
    assert last.startswith("train: error: the Ray cluster has cpu_node 0 but Workers(remote=2")
    assert not (refused / "metrics.jsonl").exists()
