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
from collections import Counter
from pathlib import Path

import pytest
import torch

from pipeline import Workers
from pipeline.batchring import BatchRing
from pipeline.loader import build_loader
from pipeline.remote import WireImages, add_counts, check_capacity, from_wire, to_wire
from shards.cluster import ClusterError
from shards.errors import UsageError
from tests.cluster.raycluster import LocalRayCluster
from tests.pipeline.remote_epoch import REMOTE_ROLES, batch_line, loader_config
from tests.pipeline.test_loader import split_keys

REPO = Path(__file__).resolve().parents[2]


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


def test_unpinned_batches_are_received_into_reused_slots_once_freed():
    nhwc = torch.randint(0, 256, (4, 5, 6, 3), dtype=torch.uint8)
    wire = to_wire(nhwc.permute(0, 3, 1, 2))
    wire.nhwc.flags.writeable = False
    ring = BatchRing(1, 2, nhwc.numel())
    first = from_wire(wire, pin=False, ring=ring)
    assert ring.holds(first) and torch.equal(first, nhwc.permute(0, 3, 1, 2))
    assert first.is_contiguous(memory_format=torch.channels_last)
    address = first.data_ptr()
    second = from_wire(wire, pin=False, ring=ring)
    third = from_wire(wire, pin=False, ring=ring)  # both slots held: new memory instead
    assert ring.holds(second) and not ring.holds(third) and torch.equal(third, second)
    third[0, 0, 0, 0] = 7  # the consumer's batches are writable either way
    del first, second
    again = from_wire(wire, pin=False, ring=ring)  # a freed slot is written again
    assert again.data_ptr() == address and torch.equal(again, nhwc.permute(0, 3, 1, 2))


def test_a_cluster_without_room_for_the_roles_is_one_line():
    workers = Workers(placement="ray", remote=4, ray_resources={"cpu_node": 1})
    with pytest.raises(ClusterError, match=r"has CPU 2, cpu_node 0 but .* needs CPU 4, cpu_node 4"):
        check_capacity(workers, {"CPU": 2.0})
    check_capacity(workers, {"CPU": 4.0, "cpu_node": 8.0})
    with pytest.raises(ClusterError, match=r"or ask for fewer remote roles or Workers\(fallback="):
        check_capacity(workers, {"CPU": 4.0})


def test_falling_back_runs_the_same_roles_as_local_workers():
    workers = Workers(placement="ray", count=1, remote=2, fallback="local", prefetch_factor=3)
    local = workers.as_local()
    assert (local.placement, local.count, local.prefetch_factor) == ("local", 3, 3)
    with pytest.raises(UsageError, match="fallback"):
        Workers(placement="ray", fallback="retry")


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


def run_driver(shard_dir, cluster: LocalRayCluster, *extra: str) -> tuple[int, list[str], str]:
    """One driver run to its end: its exit status, stdout lines and stderr."""
    run = driver(shard_dir, cluster, *extra)
    out, err = run.communicate(timeout=300)
    return run.returncode, out.splitlines(), err


# The real-cluster tests share the session's CPU cluster (a head with no CPU plus three
# 1-CPU nodes, tests/conftest.py) with tests/trainers/test_train_on_ray.py; the lost-node
# test, which kills two of its nodes, runs after all of them (`kills_nodes`).
@pytest.fixture
def cluster(cpu_ray_cluster):
    return cpu_ray_cluster


@pytest.fixture(scope="module")
def expected(shard_dir) -> list:
    return local_epoch(shard_dir)


@pytest.mark.ray
@pytest.mark.distributed
@pytest.mark.slow
def test_remote_roles_deliver_the_local_epoch_and_resume_both_ways(
    shard_dir, cluster, expected, tmp_path
):
    # The whole epoch, on the worker nodes (the head has no CPU): keys and pixels.
    code, out, err = run_driver(shard_dir, cluster)
    assert code == 0, err[-3000:]
    batches, samples = epoch_of(out)
    assert batches == expected and samples == sum(len(keys) for keys, _ in expected)
    assert final(out)["placement"] == "ray"

    # One local role (a DataLoader worker) and one remote role: the same epoch; here the
    # pixels come through Ray's object store, everywhere else over the channel.
    extra = ("--count", "1", "--remote", "1", "--wire", "object_store")
    code, out, err = run_driver(shard_dir, cluster, *extra)
    assert code == 0, err[-3000:]
    assert epoch_of(out)[0] == expected

    # Mid-epoch resume: stopped under Ray placement, continued by local workers...
    state = tmp_path / "state.json"
    code, out, err = run_driver(shard_dir, cluster, "--stop-after", "5", "--state-out", str(state))
    assert code == 0, err[-3000:]
    local = build_loader(loader_config(str(shard_dir), Workers(count=REMOTE_ROLES)))
    local.load_state_dict(json.loads(state.read_text()))
    rest = [batch_line(*batch) for batch in local]
    assert epoch_of(out)[0] + rest == expected
    # ... and stopped by local workers, continued under Ray placement.
    local = build_loader(loader_config(str(shard_dir), Workers(count=REMOTE_ROLES)))
    first = [batch_line(*batch) for _, batch in zip(range(9), local, strict=False)]
    state.write_text(json.dumps(local.state_dict()))
    code, out, err = run_driver(shard_dir, cluster, "--state-in", str(state))
    assert code == 0, err[-3000:]
    assert first + epoch_of(out)[0] == expected
    # ... also into one local and one remote role.
    extra = ("--state-in", str(state), "--count", "1", "--remote", "1")
    code, out, err = run_driver(shard_dir, cluster, *extra)
    assert code == 0, err[-3000:]
    assert first + epoch_of(out)[0] == expected


@pytest.mark.ray
@pytest.mark.distributed
@pytest.mark.slow
def test_a_cluster_without_room_is_one_line_or_falls_back_to_local_workers(
    shard_dir, cluster, expected
):
    # More roles than the cluster has CPUs for: one line, before any actor waits.
    code, _, err = run_driver(shard_dir, cluster, "--remote", "8")
    assert code != 0
    assert "ClusterError: the Ray cluster has CPU 3 but Workers(remote=8" in err, err[-3000:]
    # Roles asking for a resource no node has: the same line, naming it...
    spot = ("--resources", json.dumps({"cpu_node": 1}))
    code, _, err = run_driver(shard_dir, cluster, *spot)
    assert code != 0
    assert "ClusterError: the Ray cluster has cpu_node 0 but Workers(remote=2" in err, err[-3000:]
    assert "Workers(fallback='local')" in err
    # ... or, asked to fall back, one warning and the same epoch from local workers.
    code, out, err = run_driver(shard_dir, cluster, *spot, "--fallback", "local")
    assert code == 0, err[-3000:]
    assert epoch_of(out)[0] == expected and final(out)["placement"] == "local"
    warned = [line for line in err.splitlines() if "run as local DataLoader workers" in line]
    assert len(warned) == 1, err[-3000:]
    assert f"the Ray cluster at {cluster.address} has cpu_node 0 but" in warned[0]
    # A channel that cannot connect (nodes firewalled from each other): its role is
    # started again a few times, then one line pointing to the object store.
    code, _, err = run_driver(shard_dir, cluster, "--refuse-channel", "--remote", "1")
    assert code != 0
    last = err.strip().splitlines()[-1]
    assert "its batch channel failed 3 times in a row (cannot reach" in last, err[-3000:]
    assert last.endswith("(train --ray-wire object_store)")


@pytest.mark.ray
@pytest.mark.distributed
@pytest.mark.slow
def test_resume_under_ray_placement_on_another_world_size_loses_and_doubles_nothing(
    shard_dir, cluster, tmp_path
):
    # Two ranks, each with two roles on the cluster, stop after 3 batches; one rank
    # resumes (also on the cluster): every sample exactly once, as with local workers
    # (tests/pipeline/test_loader.py's world-size resume).
    consumed, states = Counter(), []
    for rank in range(2):
        state = tmp_path / f"rank{rank}.json"
        extra = ("--rank", str(rank), "--world-size", "2", "--uneven", "--stop-after", "3")
        code, out, err = run_driver(shard_dir, cluster, *extra, "--state-out", str(state))
        assert code == 0, err[-3000:]
        batches = epoch_of(out)[0]
        assert len(batches) == 3
        consumed.update(key for keys, _ in batches for key in keys)
        states.append(json.loads(state.read_text()))
    assert states[0]["segments"] == states[1]["segments"]
    resume = ("--uneven", "--state-in", str(tmp_path / "rank0.json"))
    code, out, err = run_driver(shard_dir, cluster, *resume)
    assert code == 0, err[-3000:]
    rest = Counter(key for keys, _ in epoch_of(out)[0] for key in keys)
    assert consumed + rest == Counter(split_keys(shard_dir, "train"))
    assert max((consumed + rest).values()) == 1


@pytest.mark.ray
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.kills_nodes
def test_remote_roles_survive_a_lost_node_and_a_cluster_left_too_small_is_one_line(
    shard_dir, cluster, expected, tmp_path
):
    # A node that runs a role SIGKILLed after 5 batches: the role starts on the spare
    # node from its next batch; nothing lost, nothing twice.
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
        r"CPU 1 but Workers\(remote=2.*resume from the last state_dict\(\)",
        err,
    ), err[-3000:]
