"""`train --worker-placement ray` on a real multi-node Ray cluster on this machine (a head
with 0 CPUs plus two 1-CPU worker nodes, as tests/pipeline/test_remote_roles.py starts):
one epoch trained on batches decoded by roles on the worker nodes, the same losses as
the same two roles give as local workers (`--ray-fallback local`), and a cluster without
the asked-for resource is one line."""

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
def test_train_on_remote_roles_trains_the_epoch_local_workers_train(train_shards, tmp_path):
    flags = dict(epochs=1, batch_size=BATCH, val_shards=None, workers=0)
    with LocalRayCluster(tmp_path / "ray", workers=2, head_cpus=0) as cluster:
        env = {**cluster.env, **{k: subprocess_env()[k] for k in ("PYTHONPATH", "OMP_NUM_THREADS")}}
        placement = ["--worker-placement", "ray", "--ray-address", cluster.address]
        placement += ["--remote-workers", "2"]
        remote = tmp_path / "remote"
        code, err = run_train([*base_args(train_shards, remote, **flags), *placement], env)
        assert code == 0, err[-3000:]
        # Roles that ask for a resource no node has: with --ray-fallback local, the same
        # two roles as local workers; without, one line and nothing trained.
        placement += ["--ray-resources", json.dumps({"cpu_node": 1})]
        local = tmp_path / "fallback"
        argv = [*base_args(train_shards, local, **flags), *placement, "--ray-fallback", "local"]
        code, fallback_err = run_train(argv, env)
        assert code == 0, fallback_err[-3000:]
        refused = tmp_path / "refused"
        refused_code, refused_err = run_train(
            [*base_args(train_shards, refused, **flags), *placement], env
        )
    steps = split_samples(train_shards, "train") // BATCH  # one rank, drop_last
    rows = read_rows(remote, "train")
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert f"loader: 2 remote roles per rank on {cluster.address} (1 CPU each), 0 local" in err
    # Batch j from role j % 2 as a local loader takes it from worker j % 2: the same batches,
    # so the same model, step by step.
    assert "the 2 remote roles run as local DataLoader workers instead" in fallback_err
    assert losses(remote) == pytest.approx(losses(local), rel=1e-5)
    assert refused_code == 1
    assert refused_err.strip().splitlines()[-1] == (
        "train: error: the Ray cluster has cpu_node 0 but Workers(remote=2, ray_cpus=1, "
        "ray_resources={'cpu_node': 1}) needs cpu_node 2: add nodes with them, or ask for "
        "fewer --remote-workers, or pass --ray-fallback local"
    )
    assert not (refused / "metrics.jsonl").exists()
