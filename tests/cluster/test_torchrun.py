"""torchrun across two "nodes" on this machine, training from shards served over HTTP.

Two `torchrun` agents (`--nnodes 2 --nproc-per-node 1`, c10d rendezvous on
127.0.0.1, gloo) stand for two machines. The tests kill or freeze a rank and
check that its peer exits instead of hanging and that a restart continues exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pipeline.sources import ShardSpec
from preprocess.config import BuildConfig
from preprocess.images import ImageConfig
from preprocess.job import run_build
from preprocess.sample import make_sample
from tests.conftest import shard_files
from tests.httpserver import LocalHTTPServer
from tests.trainers.conftest import REPO, base_args, read_rows, read_trace, subprocess_env
from trainers.checkpoint import checkpoint_dir
from trainers.data import iter_shard_keys
from trainers.train import main

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds workers through /proc"),
]

IMAGES = 400  # about 320 train samples in 13 shards, 80 val in 4
BATCH = 16  # per rank: 10 batches per rank and epoch on 2 ranks
RUN = dict(epochs=2, batch_size=BATCH, workers=1, checkpoint_every=2, debug_trace=True, plot=False)
DIST_TIMEOUT_S = 20  # --dist-timeout-s of the runs that lose a rank (the default is 600)
EXIT_MARGIN_S = 90  # beyond the collective timeout, for torchrun's teardown on a busy machine
RUN_TIMEOUT_S = 240  # a whole run; past this it counts as hung
STACK_DUMP_S = 2.0  # for hung trainers to print their stacks before they are killed


@dataclass
class Served:
    """Shards on disk, and the HTTP server that serves them for the module's tests."""

    root: Path
    server: LocalHTTPServer
    manifest_url: str


@dataclass
class Launched:
    """One torchrun agent (the process that starts and watches the trainers), logging to a file."""

    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Killed:
    """A two-node run whose rank on node 1 was SIGKILLed after a checkpoint."""

    run_dir: Path
    untouched: Path  # a copy of run_dir as the kill left it
    step: int  # step of the checkpoint a restart continues from
    codes: list[int | None]  # agents' exit codes; None: still running past the bound
    outputs: list[str]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    """Sample images built into tar shards, served over HTTP on 127.0.0.1."""
    root = tmp_path_factory.mktemp("torchrun-data")
    make_sample(root / "images", IMAGES, classes=4, seed=11, workers=1)
    config = BuildConfig(
        input=str(root / "images"),
        output=str(root / "shards"),
        image=ImageConfig(image_size=32),
        shard_size=25,
        formats=("tar",),
        val_fraction=0.2,
        seed=2,
        executor="inline",
        progress=False,
    )
    run_build(config)
    server = LocalHTTPServer(root / "shards")
    with server as url:
        yield Served(root / "shards", server, f"{url}/manifest.json")


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The in-process run shares two busy cores with the servers and other tests."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_flags(node: int, port: int) -> list[str]:
    """torchrun flags of node `node` of two, one process each, meeting at node 0's store."""
    return [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=test",
        # Both agents see 127.0.0.1 as their own address: say which one hosts the store.
        f"--rdzv-conf=is_host={int(node == 0)}",
        "--local-addr=127.0.0.1",
    ]


def launch(flags: list[str], args: list[str], log: Path) -> Launched:
    command = [sys.executable, "-m", "torch.distributed.run", *flags, "-m", "trainers.train", *args]
    env = subprocess_env()
    # torchrun shares its rendezvous store with the workers by default, and restarted workers
    # then read the gloo addresses of the dead ones: they fail with "Connection refused" or
    # hang (pytorch/pytorch#135712, #167288). A store per round avoids it.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # see dump_stacks
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    return Launched(process, log)


@contextlib.contextmanager
def launched(commands: list[tuple[list[str], list[str]]], logs: Path) -> Iterator[list[Launched]]:
    """Start one agent per (flags, args); whatever still runs at the end is killed."""
    logs.mkdir(parents=True, exist_ok=True)
    agents = [launch(f, a, logs / f"node{i}.log") for i, (f, a) in enumerate(commands)]
    try:
        yield agents
    finally:
        for agent in agents:
            if agent.process.poll() is None:
                for pid in [*descendants(agent.process.pid), agent.process.pid]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                agent.process.wait()


def children(pid: int) -> list[int]:
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        return [int(c) for task in tasks for c in (task / "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
        return []


def descendants(pid: int) -> list[int]:
    """Children first, then theirs: torchrun starts each worker in a session of its own."""
    found = children(pid)
    return found + [grandchild for child in found for grandchild in descendants(child)]


def two_nodes(args: list[str]) -> list[tuple[list[str], list[str]]]:
    port = free_port()
    return [(node_flags(0, port), args), (node_flags(1, port), args)]


def wait_exit(agents: list[Launched], timeout: float) -> list[int | None]:
    """The agents' exit codes; None for one still running `timeout` seconds from now.

    Where one hangs, every trainer still running first prints its Python stack
    into the log (faulthandler, on SIGABRT), so that a failure shows where it hung.
    """
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for agent in agents:
        try:
            codes.append(agent.process.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    if None in codes:
        dump_stacks(agents)
    return codes


def dump_stacks(agents: list[Launched]) -> None:
    for agent in agents:
        if agent.process.poll() is None:
            for pid in descendants(agent.process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGABRT)
    time.sleep(STACK_DUMP_S)


def without_module_lists(text: str) -> str:
    """`text` less faulthandler's "Extension modules: ..." lines, a few KB each per process.

    They would push the stacks that say where a trainer hung out of the log's tail.
    """
    lines = text.splitlines()
    return "\n".join(
        line
        for line in lines
        if "Extension modules:" not in line and not re.fullmatch(r"\s*\(total: \d+\)", line)
    )


def log_tails(agents: list[Launched]) -> str:
    return "\n".join(
        f"--- {a.log.name}\n{without_module_lists(a.output())[-6000:]}" for a in agents
    )


def run_to_end(commands: list[tuple[list[str], list[str]]], logs: Path) -> None:
    with launched(commands, logs) as agents:
        codes = wait_exit(agents, RUN_TIMEOUT_S)
        assert codes == [0] * len(agents), f"exit codes {codes}\n{log_tails(agents)}"


def worker_pid(agent: Launched, local_rank: int) -> int:
    """The trainer process of `agent` with LOCAL_RANK `local_rank` (a child of the agent).

    torchrun starts it in a session of its own, so its process group is the rank
    and its loader workers: signalling the group stops the rank as a lost machine would.
    """
    for pid in children(agent.process.pid):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"LOCAL_RANK={local_rank}".encode() in environ:
            assert os.getpgid(pid) == pid
            return pid
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank} under {agent.log.name}")


def wait_for_checkpoint(run_dir: Path, agents: list[Launched]) -> int:
    """Poll until a checkpoint is committed; return its step."""
    latest = checkpoint_dir(run_dir) / "latest"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not latest.exists():
        for agent in agents:
            if agent.process.poll() is not None:
                raise AssertionError(f"{agent.log.name} ended early:\n{agent.output()[-4000:]}")
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.01)
    return checkpoint_step(run_dir)


def checkpoint_step(run_dir: Path) -> int:
    name = (checkpoint_dir(run_dir) / "latest").read_text().strip()
    return int(name[len("step-") : -len(".pt")])


def train_args(served: Served, run_dir: Path, **overrides) -> list[str]:
    return base_args(served.manifest_url, run_dir, **{**RUN, **overrides})


def split_keys(served: Served, split: str) -> list[str]:
    """Every key of `split`, read from the shard files."""
    manifest = json.loads((served.root / "manifest.json").read_text())
    keys = []
    for shard in manifest["splits"][split]["shards"]:
        url = str(served.root / shard["files"]["tar"]["name"])
        keys += iter_shard_keys(ShardSpec(url, "tar", shard["samples"]))
    return keys


def epoch_keys(run_dir: Path, rank: int, epoch: int) -> list[str]:
    rows = read_trace(run_dir, rank, "batch")
    return [k for r in rows if r["epoch"] == epoch for k in r["keys"]]


def assert_same_run(expected: Path, got: Path) -> None:
    """Same steps, losses, learning rates, evaluations, sample order and parameters."""
    want, have = read_rows(expected, "train"), read_rows(got, "train")
    assert [r["step"] for r in have] == [r["step"] for r in want]
    for row, reference in zip(have, want, strict=True):
        assert row["loss"] == pytest.approx(reference["loss"], rel=1e-6, abs=1e-7)
        assert row["lr"] == reference["lr"]
    accuracy = [(r["step"], r["val_accuracy"]) for r in read_rows(expected, "eval")]
    assert [(r["step"], r["val_accuracy"]) for r in read_rows(got, "eval")] == accuracy
    for rank in (0, 1):
        order = [(r["step"], r["batch"], r["keys"]) for r in read_trace(expected, rank, "batch")]
        assert [(r["step"], r["batch"], r["keys"]) for r in read_trace(got, rank, "batch")] == order
        digests = [r["digest"] for r in read_trace(expected, rank, "params")]
        assert [r["digest"] for r in read_trace(got, rank, "params")] == digests


@pytest.fixture(scope="module")
def straight(served, tmp_path_factory) -> Path:
    """An uninterrupted two-node run: the reference the interrupted ones must match."""
    base = tmp_path_factory.mktemp("straight")
    run_to_end(two_nodes(train_args(served, base / "run")), base / "logs")
    return base / "run"


@pytest.fixture(scope="module")
def killed(served, tmp_path_factory) -> Killed:
    """Two nodes; node 1's rank SIGKILLed right after the first checkpoint."""
    base = tmp_path_factory.mktemp("killed")
    run_dir = base / "run"
    args = train_args(served, run_dir, dist_timeout_s=DIST_TIMEOUT_S)
    with launched(two_nodes(args), base / "logs") as agents:
        wait_for_checkpoint(run_dir, agents)
        os.killpg(worker_pid(agents[1], 0), signal.SIGKILL)
        codes = wait_exit(agents, DIST_TIMEOUT_S + EXIT_MARGIN_S)
        outputs = [a.output() for a in agents]
    untouched = base / "untouched"
    shutil.copytree(run_dir, untouched)
    return Killed(run_dir, untouched, checkpoint_step(run_dir), codes, outputs)


def test_two_nodes_take_equal_steps_on_disjoint_samples_read_over_http(served, straight):
    figures = json.loads((straight / "config.json").read_text())
    assert figures["world_size"] == 2 and figures["effective_batch"] == 2 * BATCH
    steps = figures["total_steps"]
    digests = [[r["digest"] for r in read_trace(straight, rank, "params")] for rank in (0, 1)]
    assert len(digests[0]) == len(digests[1]) == steps  # equal optimizer steps
    assert digests[0] == digests[1]  # identical parameters after every step

    train_keys = set(split_keys(served, "train"))
    padded = -len(train_keys) % 2  # the `pad` rule repeats at most world-1 samples
    for epoch in range(RUN["epochs"]):
        keys = [epoch_keys(straight, rank, epoch) for rank in (0, 1)]
        assert len(keys[0]) == len(keys[1]) == figures["batches_per_epoch"] * BATCH
        assert len(set(keys[0]) & set(keys[1])) <= padded  # disjoint samples
        assert set(keys[0] + keys[1]) <= train_keys

    val_keys = sorted(split_keys(served, "val"))
    for evals in range(1, RUN["epochs"] + 1):
        seen = [
            k
            for rank in (0, 1)
            for r in read_trace(straight, rank, "val")
            if r["evals"] == evals
            for k in r["keys"]
        ]
        assert sorted(seen) == val_keys  # every val sample exactly once across ranks
    assert {r["val_samples"] for r in read_rows(straight, "eval")} == {len(val_keys)}
    shard_paths = {
        "/" + p.relative_to(served.root).as_posix() for p in shard_files(served.root, "tar")
    }
    assert shard_paths <= {r.path for r in served.server.requests}  # read over HTTP
    # Forked beside gloo's threads a worker can hang as it starts (LOADER.md, How workers start)
    log = (straight.parent / "logs" / "node0.log").read_text()
    assert "loader workers are spawned, not forked: torch.distributed is initialized" in log


def test_a_killed_rank_makes_its_peer_exit_instead_of_hanging(killed):
    assert killed.codes[1] not in (0, None), killed.outputs[1][-3000:]
    assert killed.codes[0] is not None, "node 0 still ran long after its peer died"
    assert killed.codes[0] != 0, killed.outputs[0][-3000:]


def test_both_nodes_resume_from_the_last_checkpoint_as_if_never_killed(served, straight, killed):
    steps_per_epoch = json.loads((straight / "config.json").read_text())["steps_per_epoch"]
    assert killed.step % steps_per_epoch != 0  # the kill came mid-epoch
    args = train_args(served, killed.run_dir, resume="auto")
    run_to_end(two_nodes(args), killed.run_dir.parent / "resume-logs")
    assert_same_run(straight, killed.run_dir)


def test_resume_on_one_rank_loses_and_doubles_no_sample_of_the_epoch(served, killed):
    """The killed 2 x 16 run continues on 1 x 32 (same global batch) to the epoch's end."""
    run_dir, step = killed.untouched, killed.step
    steps_per_epoch = json.loads((run_dir / "config.json").read_text())["steps_per_epoch"]
    args = train_args(
        served, run_dir, batch_size=2 * BATCH, workers=0, resume="auto", max_steps=steps_per_epoch
    )
    assert main(args) == 0
    before = [
        k
        for rank in (0, 1)
        for r in read_trace(run_dir, rank, "batch")
        if r["step"] < step
        for k in r["keys"]
    ]
    after = [k for r in read_trace(run_dir, 0, "batch") if r["step"] >= step for k in r["keys"]]
    assert len(before) == step * 2 * BATCH
    seen = before + after
    assert len(seen) == len(set(seen))  # nothing doubled within the epoch
    train_keys = set(split_keys(served, "train"))
    assert set(seen) <= train_keys
    assert len(seen) > len(train_keys) - 2 * BATCH  # nothing lost but the drop_last remainder


def test_a_frozen_rank_makes_its_peer_time_out(served, tmp_path):
    """SIGSTOP stands for a node gone silent: no socket is closed, only the timeout helps."""
    run_dir = tmp_path / "run"
    args = train_args(served, run_dir, dist_timeout_s=DIST_TIMEOUT_S)
    with launched(two_nodes(args), tmp_path / "logs") as agents:
        wait_for_checkpoint(run_dir, agents)
        frozen = worker_pid(agents[1], 0)
        os.killpg(frozen, signal.SIGSTOP)
        (code,) = wait_exit(agents[:1], DIST_TIMEOUT_S + EXIT_MARGIN_S)
        os.killpg(frozen, signal.SIGKILL)
        assert code is not None, "node 0 still ran long after its collective timeout"
        assert code != 0
        assert "timed out" in agents[0].output().lower()


def restarting_layout(layout: str, args: list[str]) -> list[tuple[list[str], list[str]]]:
    """torchrun commands of 2 ranks with one restart: one node x 2, or two nodes x 1."""
    if layout == "one-node":
        return [(["--standalone", "--nproc-per-node=2", "--max-restarts=1"], args)]
    return [(flags + ["--max-restarts=1"], node_args) for flags, node_args in two_nodes(args)]


@pytest.mark.parametrize(
    ("layout", "victim"), [("one-node", (0, 1)), ("two-nodes", (1, 0))], ids=["1x2", "2x1"]
)
def test_torchrun_max_restarts_resumes_a_killed_worker_exactly(
    served, straight, tmp_path, layout, victim
):
    """`--max-restarts 1`: torchrun restarts every rank, `--resume auto` does the rest."""
    run_dir = tmp_path / "run"
    commands = restarting_layout(layout, train_args(served, run_dir, resume="auto"))
    agent, local_rank = victim
    with launched(commands, tmp_path / "logs") as agents:
        wait_for_checkpoint(run_dir, agents)
        os.killpg(worker_pid(agents[agent], local_rank), signal.SIGKILL)
        codes = wait_exit(agents, RUN_TIMEOUT_S)
        output = "".join(a.output() for a in agents)
        assert codes == [0] * len(agents), f"exit codes {codes}\n{log_tails(agents)}"
    resumed = re.findall(r"resumed from \S+step-(\d+)\.pt", output)
    assert len(resumed) == 1  # torchrun restarted the ranks once, and they resumed
    steps_per_epoch = json.loads((straight / "config.json").read_text())["steps_per_epoch"]
    assert int(resumed[0]) % steps_per_epoch != 0  # from a mid-epoch checkpoint
    assert_same_run(straight, run_dir)


def test_a_killed_mixed_run_resumes_on_one_rank_with_each_sources_exact_quota(served, tmp_path):
    """Two weighted sources on two nodes, node 1 SIGKILLed mid-epoch, continued on 1 x 32:
    the epoch still gives each source exactly its quota, no sample of either twice."""
    mix = ["--train-weights", "3,1", "--train-epoch-samples", "320"]  # 10 steps of 2 x 16

    def mixed(args: list[str]) -> list[str]:
        at = args.index("--train-shards")
        args[at + 1] = f"{served.manifest_url}::{served.manifest_url}"
        return args + mix

    run_dir = tmp_path / "run"
    args = mixed(train_args(served, run_dir, dist_timeout_s=DIST_TIMEOUT_S))
    with launched(two_nodes(args), tmp_path / "logs") as agents:
        wait_for_checkpoint(run_dir, agents)
        os.killpg(worker_pid(agents[1], 0), signal.SIGKILL)
        wait_exit(agents, DIST_TIMEOUT_S + EXIT_MARGIN_S)
    step = checkpoint_step(run_dir)
    steps_per_epoch = json.loads((run_dir / "config.json").read_text())["steps_per_epoch"]
    assert steps_per_epoch == 10 and 0 < step < steps_per_epoch  # killed mid-epoch
    resume = train_args(
        served, run_dir, batch_size=2 * BATCH, workers=0, resume="auto", max_steps=steps_per_epoch
    )
    assert main(mixed(resume)) == 0
    before = [
        k
        for rank in (0, 1)
        for r in read_trace(run_dir, rank, "batch")
        if r["epoch"] == 0 and r["step"] < step
        for k in r["keys"]
    ]
    after = [
        k
        for r in read_trace(run_dir, 0, "batch")
        if r["epoch"] == 0 and r["step"] >= step
        for k in r["keys"]
    ]
    seen = before + after
    assert len(before) == step * 2 * BATCH and len(seen) == 320
    assert len(seen) == len(set(seen))  # no sample twice: keys name their source
    assert sorted(Counter(k.split("/", 1)[0] for k in seen).values()) == [80, 240]
