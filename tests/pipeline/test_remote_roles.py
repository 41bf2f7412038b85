"""Worker roles as Ray actors (`Workers(placement="ray")`, `pipeline.remote`): the same
epoch as local workers, batch for batch, on a real multi-node Ray cluster on this machine
(a head with 0 CPUs plus CPU worker nodes, as the build's cluster tests start), also when
a node running a role is SIGKILLed mid-epoch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline import Workers
from pipeline.loader import build_loader
from pipeline.remote import WireImages, add_counts, check_capacity, from_wire, to_wire
from shards.cluster import ClusterError
from tests.cluster.raycluster import LocalRayCluster
from tests.pipeline.remote_epoch import REMOTE_ROLES, batch_line, loader_config

REPO = Path(__file__).resolve().parents[2]
# A lost node is declared dead after ~3 missed 1 s health checks (Ray's default ~15 s).
FAST_NODE_DEATH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "3",
}


def test_a_batch_crosses_the_wire_as_numpy_and_comes_back_equal():
    nhwc = torch.randint(0, 256, (4, 5, 6, 3), dtype=torch.uint8)
    images = nhwc.permute(0, 3, 1, 2)  # a channels-last batch, as the loader builds it
    labels = torch.arange(4)
    wired = [to_wire(images), to_wire(labels), to_wire(["a", "b"])]
    assert isinstance(wired[0], WireImages) and wired[0].nhwc.shape == (4, 5, 6, 3)
    assert wired[0].nhwc.nbytes == 4 * 5 * 6 * 3  # H * W * 3 bytes an image, no more
    wired[0].nhwc.flags.writeable = False  # as Ray hands object-store arrays back
    back = [from_wire(value, pin=False) for value in wired]
    assert torch.equal(back[0], images) and back[0].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(back[1], labels) and back[2] == ["a", "b"]
    back[0][0, 0, 0, 0] = 7  # the trainer's own memory, writable


def test_a_cluster_without_room_for_the_roles_is_one_line():
    workers = Workers(placement="ray", remote=4, ray_resources={"cpu_node": 1})
    with pytest.raises(ClusterError, match=r"has CPU 2, cpu_node 0 but .* needs CPU 4, cpu_node 4"):
        check_capacity(workers, {"CPU": 2.0})
    check_capacity(workers, {"CPU": 4.0, "cpu_node": 8.0})


def test_a_restarted_roles_counters_add_up_over_its_actors():
    lost = {
        "worker": 3,
        "samples": 16,
        "skipped": {"corrupt": 1},
        "decode_s": 0.5,
        "bad_shard_examples": ["a"],
        "fetch": {"ahead_peak": 2},
    }
    latest = {
        "worker": 3,
        "samples": 8,
        "skipped": {"corrupt": 1, "short": 2},
        "decode_s": 0.25,
        "bad_shard_examples": ["b"],
        "fetch": {"ahead_peak": 1},
    }
    assert add_counts(lost, latest) == {
        "worker": 3,
        "samples": 24,
        "skipped": {"corrupt": 2, "short": 2},
        "decode_s": 0.75,
        "bad_shard_examples": ["a", "b"],
        "fetch": {"ahead_peak": 1},
    }
    assert add_counts({}, latest) == latest


def local_epoch(shard_dir) -> list:
    loader = build_loader(loader_config(str(shard_dir), Workers(count=REMOTE_ROLES)))
    return [batch_line(*batch) for batch in loader]


def driver(shard_dir, cluster: LocalRayCluster, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "tests.pipeline.remote_epoch", str(shard_dir), cluster.address]
    return subprocess.Popen(
        [*command, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cluster.env,
        cwd=REPO,
    )


def epoch_of(lines: list[str]) -> tuple[list, int]:
    """The driver's batches and its final counts (Ray may forward its workers' log lines
    to the driver's stdout too: only our JSON lines are read)."""
    return [json.loads(line) for line in lines if line.startswith("[")], final(lines)["samples"]


def final(lines: list[str]) -> dict:
    return json.loads([line for line in lines if line.startswith("{")][-1])


def role_nodes(cluster: LocalRayCluster) -> list:
    """The worker nodes running a role's actor now (`ray::RoleActor...` processes)."""
    found = []
    for node in cluster.workers:
        for pid in node.pids():
            try:
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
            except OSError:
                continue
            if argv0.startswith(b"ray::RoleActor"):
                found.append(node)
                break
    return found


@pytest.mark.ray
@pytest.mark.distributed
@pytest.mark.slow
def test_remote_roles_deliver_the_local_epoch_resume_both_ways_and_survive_a_lost_node(
    shard_dir, tmp_path
):
    expected = local_epoch(shard_dir)
    with LocalRayCluster(tmp_path / "ray", workers=3, head_cpus=0, env=FAST_NODE_DEATH) as cluster:
        # The whole epoch, on the worker nodes (the head has no CPU): keys and pixels.
        run = driver(shard_dir, cluster)
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        batches, samples = epoch_of(out.splitlines())
        assert batches == expected and samples == sum(len(keys) for keys, _ in expected)

        # One local role (a DataLoader worker) and one remote role: the same epoch.
        run = driver(shard_dir, cluster, "--count", "1", "--remote", "1")
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        assert epoch_of(out.splitlines())[0] == expected

        # Mid-epoch resume: stopped under Ray placement, continued by local workers...
        state = tmp_path / "state.json"
        run = driver(shard_dir, cluster, "--stop-after", "5", "--state-out", str(state))
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        local = build_loader(loader_config(str(shard_dir), Workers(count=REMOTE_ROLES)))
        local.load_state_dict(json.loads(state.read_text()))
        rest = [batch_line(*batch) for batch in local]
        assert epoch_of(out.splitlines() + ['{"samples": 0}'])[0] + rest == expected
        # ... and stopped by local workers, continued under Ray placement.
        local = build_loader(loader_config(str(shard_dir), Workers(count=REMOTE_ROLES)))
        first = [batch_line(*batch) for _, batch in zip(range(9), local, strict=False)]
        state.write_text(json.dumps(local.state_dict()))
        run = driver(shard_dir, cluster, "--state-in", str(state))
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        assert first + epoch_of(out.splitlines())[0] == expected
        # ... also into one local and one remote role.
        run = driver(shard_dir, cluster, "--state-in", str(state), "--count", "1", "--remote", "1")
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        assert first + epoch_of(out.splitlines())[0] == expected

        # More roles than the cluster has CPUs for: one line, before any actor waits.
        run = driver(shard_dir, cluster, "--remote", "8")
        out, err = run.communicate(timeout=300)
        assert run.returncode != 0
        assert "ClusterError: the Ray cluster has CPU 3 but Workers(remote=8" in err, err[-3000:]

        # Again, with a node that runs a role SIGKILLed after 5 batches: the role starts
        # on the spare node from its next batch; nothing lost, nothing twice.
        go = tmp_path / "go"
        run = driver(shard_dir, cluster, "--pause-after", "5", "--go", str(go))
        lines = []
        for line in run.stdout:
            lines.append(line.strip())
            if line.startswith("paused"):
                break
        nodes = role_nodes(cluster)
        assert len(nodes) == REMOTE_ROLES, "each role on a worker node of its own"
        cluster.kill_node(nodes[0])
        started = time.monotonic()
        go.touch()
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        batches, samples = epoch_of(lines + out.splitlines())
        assert batches == expected, "the epoch after a lost node differs"
        # The lost role's counters are kept: its actors' samples add up to what arrived.
        assert final(out.splitlines())["role_samples"] == samples
        assert "was lost" in err and "delivers again after a stall of" in err
        assert time.monotonic() - started < 120

        # Once more, and a second role node lost: the one node left has no room for two
        # roles, which is one line at once, not a wait for capacity that never comes.
        go_again = tmp_path / "go-again"
        run = driver(shard_dir, cluster, "--pause-after", "3", "--go", str(go_again))
        for line in run.stdout:
            if line.startswith("paused"):
                break
        cluster.kill_node(role_nodes(cluster)[0])
        go_again.touch()
        out, err = run.communicate(timeout=300)
        assert run.returncode != 0
        assert re.search(
            r"ClusterError: worker role \d was lost with its node, and the Ray cluster has "
            r"CPU 1 but Workers\(remote=2",
            err,
        ), err[-3000:]
