"""A real multi-node Ray cluster on this machine, started and stopped by a test.

    with LocalRayCluster(tmp_path / "ray", workers=2) as cluster:
        subprocess.run([..., "build-shards", ..., f"--ray-address={cluster.address}"])
        cluster.kill_node(cluster.workers[0])  # SIGKILL one whole node

Each node is one `ray start --block` process in a session of its own, with its
own loopback IP (head 127.0.0.2, workers 127.0.0.3, ...), `--temp-dir` and
ports, as separate machines would have. Stopping or killing a node signals the
processes of its session only: never `ray stop`, which ends every Ray on the
machine, other engineers' and other tests' included.

By hand: `python -m tests.cluster.raycluster --workers 2 --dashboard` starts
one, prints its addresses and node sessions, and stops it on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Ray turns 127.0.0.1 and `localhost` into this host's network address; other
# loopback addresses are kept, so every port we open stays on 127.0.0.0/8.
HEAD_IP = "127.0.0.2"
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0
OBJECT_STORE_BYTES = 100 * 2**20  # the smallest Ray allows is 75 MiB
# A lost node is declared dead after about 3 missed 1 s health checks instead of 5
# missed 3 s ones (Ray's default, ~15 s), so its tasks and actors move on sooner.
FAST_NODE_DEATH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "3",
}
RAY_BIN = Path(sys.executable).with_name("ray")


class ClusterError(RuntimeError):
    """The local cluster did not come up, or what a test waited for did not happen."""


@dataclass
class RayNode:
    """One node: the `ray start --block` process that leads its session."""

    name: str
    ip: str
    temp_dir: Path
    log_path: Path
    process: subprocess.Popen

    @property
    def session_id(self) -> int:
        # start_new_session=True makes the leader's pid the session id, which
        # the raylet, its agents and its workers inherit.
        return self.process.pid

    def pids(self) -> list[int]:
        """Live processes of this node (the session's members)."""
        return session_pids(self.session_id)

    def task_pids(self, task_name: str) -> list[int]:
        """Workers of this node running a task named `task_name` right now.

        A Ray worker retitles itself `ray::<task name>` while it runs a task and
        `ray::IDLE` between tasks, as `ps` shows.
        """
        title = f"ray::{task_name}".encode()
        busy = []
        for pid in self.pids():
            try:
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
            except OSError:
                continue
            if argv0.split(b" ", 1)[0] == title:
                busy.append(pid)
        return busy

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def dashboard_available() -> bool:
    """True when Ray's dashboard, job server and state API can run (`ray[default]`)."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401  (what `ray start` itself checks)
    except ImportError:
        return False
    return True


def free_port() -> int:
    """A TCP port that is free now (the kernel's pick, released at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def session_pids(session_id: int) -> list[int]:
    """Pids of the processes whose session id is `session_id`, from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        # Fields after the `(comm)` one, which may hold spaces and parentheses.
        fields = stat.rsplit(")", 1)[1].split()
        state, session = fields[0], int(fields[3])
        if session == session_id and state != "Z":
            pids.append(int(entry.name))
    return pids


def kill_session(session_id: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to every process of one session."""
    for pid in session_pids(session_id):
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, sig)


def disconnect_driver(address: str) -> None:
    """`ray.shutdown()` if this process is a driver of the cluster at `address`.

    A driver whose cluster vanishes aborts its whole process a minute later, so
    a test process must leave the cluster before stopping it.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    if ray.get_runtime_context().gcs_address == address:
        ray.shutdown()


def open_files_in(pid: int, directory: Path) -> list[Path]:
    """Files that process `pid` holds open in `directory` or a directory of it (a build's
    format directories, `tar/` and `parquet/`)."""
    directory = directory.resolve()
    found = []
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # ended, or not ours to look at
        return found
    for fd in fds:
        try:
            target = Path(os.readlink(fd))
        except OSError:
            continue
        if directory in (target.parent, target.parent.parent):
            found.append(target)
    return found


class TaskWatch:
    """Records the nodes seen running a task, by looking at the nodes' workers every 10 ms.

    with TaskWatch(cluster, "build_with_options") as watch:
        run_build(...)
    assert len(watch.nodes) > 1
    """

    def __init__(self, cluster: LocalRayCluster, task_name: str) -> None:
        self.cluster = cluster
        self.task_name = task_name
        self.nodes: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="task-watch", daemon=True)

    def __enter__(self) -> TaskWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            for node in self.cluster.nodes:
                if node.name not in self.nodes and node.task_pids(self.task_name):
                    self.nodes.add(node.name)


class LocalRayCluster:
    """A head and `workers` worker nodes started with `ray start` on loopback addresses.

    Args:
        root: an empty or absent directory for the nodes' temp dirs and logs.
        workers: worker nodes to start with the head.
        head_cpus: CPUs the head offers to tasks (0: the head only coordinates).
        worker_cpus: CPUs each worker node offers.
        dashboard: start the dashboard and job server on the head (needs
            `ray[default]`); required by `ray job submit` and the state API.
        env: extra environment for every node, e.g. `RAY_health_check_*`.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        workers: int = 2,
        head_cpus: int = 1,
        worker_cpus: int = 1,
        dashboard: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = Path(root)
        # Every port handed to a node so far: the kernel may give a released port out
        # again at once, and `ray start` refuses two components on one port.
        self.taken_ports: set[int] = set()
        self.port = self.free_port()
        self.dashboard_port = self.free_port()
        self.dashboard = dashboard
        self.head_cpus = head_cpus
        self.worker_cpus = worker_cpus
        self.initial_workers = workers
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        # Token auth turns itself on when ~/.ray/auth_token happens to exist
        # (any earlier local `ray.init()` writes it), and then only clients that
        # also set RAY_AUTH_MODE=token get in. A cluster bound to loopback
        # addresses needs no token, so turn it off explicitly for determinism.
        self.env["RAY_AUTH_MODE"] = "disabled"
        # A job's entrypoint (`python -m ...`) must find this interpreter, as it
        # would on a cluster whose nodes run from one environment.
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env.get('PATH', '')}"
        self.env.update(env or {})
        self.head: RayNode | None = None
        self.workers: list[RayNode] = []
        self.killed: set[str] = set()  # names of nodes killed on purpose

    @property
    def address(self) -> str:
        """The GCS address for `ray.init(address=...)`, `--ray-address` and `ray start --address`."""
        return f"{HEAD_IP}:{self.port}"

    @property
    def dashboard_url(self) -> str:
        """The head's HTTP API: the state API, and with `dashboard=True` also jobs."""
        return f"http://{HEAD_IP}:{self.dashboard_port}"

    @property
    def nodes(self) -> list[RayNode]:
        return ([self.head] if self.head else []) + self.workers

    def __enter__(self) -> LocalRayCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        """Start the head, then the workers, and wait until every node is alive."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.head = self._start_node("head", HEAD_IP, self._head_args())
        self._wait_for_port(self.head, HEAD_IP, self.port)
        for _ in range(self.initial_workers):
            self.add_worker(wait=False)
        self.wait_for_nodes(len(self.nodes))

    def add_worker(self, wait: bool = True) -> RayNode:
        """Start one more worker node (on the next loopback IP) and join it to the head."""
        number = len(self.workers) + 1
        ip = f"127.0.0.{2 + number}"
        args = [f"--address={self.address}", f"--num-cpus={self.worker_cpus}"]
        node = self._start_node(f"worker{number}", ip, args)
        self.workers.append(node)
        if wait:
            self.wait_for_nodes(len(self.nodes) - len(self.killed))
        return node

    def kill_node(self, node: RayNode) -> None:
        """SIGKILL every process of `node` at once, as a lost machine would vanish."""
        self.killed.add(node.name)
        kill_session(node.session_id, signal.SIGKILL)
        node.process.wait()

    def kill_worker_mid_task(
        self,
        task_name: str,
        writing_into: str | os.PathLike | None = None,
        timeout: float = START_TIMEOUT_S,
        give_up: threading.Event | None = None,
    ) -> RayNode:
        """SIGKILL the first worker node caught running `task_name`, and return it.

        With `writing_into`, the task must also hold a file open in that
        directory (mid-write). The node is frozen (SIGSTOP) and checked again
        before the kill, so the task was certainly still running when it died.

        Raises:
            ClusterError: no such task was seen within `timeout`, or `give_up` was set.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (give_up and give_up.is_set()):
            for node in self.workers:
                if node.name in self.killed or not self._is_busy(node, task_name, writing_into):
                    continue
                kill_session(node.session_id, signal.SIGSTOP)
                if self._is_busy(node, task_name, writing_into):
                    self.kill_node(node)
                    return node
                kill_session(node.session_id, signal.SIGCONT)  # it finished meanwhile
            time.sleep(0.01)
        raise ClusterError(f"no worker node was seen running {task_name}")

    def wait_idle(self, task_name: str, timeout: float = START_TIMEOUT_S) -> None:
        """Block until no node runs `task_name` (e.g. after its driver was killed)."""
        deadline = time.monotonic() + timeout
        quiet = 0
        while time.monotonic() < deadline:
            busy = any(n.task_pids(task_name) for n in self.nodes if n.name not in self.killed)
            quiet = 0 if busy else quiet + 1
            if quiet >= 3:  # three looks in a row, so a task starting late is seen too
                return
            time.sleep(0.2)
        raise ClusterError(f"{task_name} still running after {timeout:.0f} s")

    def _is_busy(self, node: RayNode, task_name: str, directory: str | os.PathLike | None) -> bool:
        pids = node.task_pids(task_name)
        if directory is None:
            return bool(pids)
        return any(open_files_in(pid, Path(directory)) for pid in pids)

    def stop(self) -> None:
        """End every process this cluster started (workers first) and delete its temp dirs."""
        disconnect_driver(self.address)
        for node in reversed(self.nodes):
            kill_session(node.session_id, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(n.pids() for n in self.nodes):
            time.sleep(0.1)
        for node in self.nodes:
            kill_session(node.session_id, signal.SIGKILL)
            node.process.wait()
        for node in self.nodes:
            # Unix socket paths must stay short, so temp dirs live outside `root`.
            shutil.rmtree(node.temp_dir, ignore_errors=True)

    def alive_node_count(self) -> int:
        """Nodes the head reports alive (`ray status`, which reads the GCS, not the dashboard)."""
        result = subprocess.run(
            [str(RAY_BIN), "status", f"--address={self.address}"],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        )
        if result.returncode != 0:
            return 0
        active = result.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        return len(re.findall(r"^\s*1 node_[0-9a-f]+", active, flags=re.MULTILINE))

    def wait_for_nodes(self, count: int, timeout: float = START_TIMEOUT_S) -> None:
        """Block until the head reports `count` alive nodes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_running()
            if self.alive_node_count() == count:
                return
            time.sleep(0.5)
        logs = "\n".join(f"--- {n.name}:\n{n.log_tail(10)}" for n in self.nodes)
        raise ClusterError(f"fewer than {count} Ray nodes alive after {timeout:.0f} s\n{logs}")

    def free_port(self) -> int:
        """A free TCP port no node of this cluster has been given yet."""
        port = free_port()
        while port in self.taken_ports:
            port = free_port()
        self.taken_ports.add(port)
        return port

    def _head_args(self) -> list[str]:
        # Without the dashboard Ray still runs a headless API server on the
        # dashboard port (8265 by default), so it always gets a free port.
        return [
            "--head",
            f"--port={self.port}",
            f"--num-cpus={self.head_cpus}",
            f"--ray-client-server-port={self.free_port()}",
            f"--include-dashboard={str(self.dashboard).lower()}",
            f"--dashboard-host={HEAD_IP}",
            f"--dashboard-port={self.dashboard_port}",
        ]

    def _start_node(self, name: str, ip: str, role_args: list[str]) -> RayNode:
        # Ray puts Unix sockets under the temp dir: a pytest tmp_path can be too
        # long for them (108 bytes), so each node gets a short dir of its own.
        temp_dir = Path(f"/tmp/rc-{os.getpid()}-{self.port}-{name}")
        temp_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.root / f"{name}.log"
        command = [
            str(RAY_BIN),
            "start",
            "--block",
            *role_args,
            f"--node-ip-address={ip}",
            f"--temp-dir={temp_dir}",
            # Every port that has a fixed default gets a free one, so several
            # nodes (and other engineers' Ray) can share this machine.
            f"--node-manager-port={self.free_port()}",
            f"--object-manager-port={self.free_port()}",
            f"--metrics-export-port={self.free_port()}",
            f"--dashboard-agent-listen-port={self.free_port()}",
            f"--dashboard-agent-grpc-port={self.free_port()}",
            f"--runtime-env-agent-port={self.free_port()}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--disable-usage-stats",
        ]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        node = RayNode(name, ip, temp_dir, log_path, process)
        if name == "head":
            self.head = node
        return node

    def _wait_for_port(self, node: RayNode, host: str, port: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_running()
            try:
                with socket.create_connection((host, port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise ClusterError(f"{node.name} did not open {host}:{port}:\n{node.log_tail()}")

    def _check_running(self) -> None:
        for node in self.nodes:
            if node.process.poll() is not None and node.name not in self.killed:
                raise ClusterError(
                    f"`ray start` for {node.name} exited with {node.process.returncode}:\n"
                    f"{node.log_tail()}"
                )


def main(argv: list[str] | None = None) -> int:
    """Start a cluster, print how to reach it, and stop it on Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.raycluster")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dashboard", action="store_true", help="also the job server")
    parser.add_argument("--root", default=None, help="directory for node logs")
    args = parser.parse_args(argv)
    root = args.root or tempfile.mkdtemp(prefix="raycluster-")
    with LocalRayCluster(root, workers=args.workers, dashboard=args.dashboard) as cluster:
        print(f"address {cluster.address}")
        if args.dashboard:
            print(f"job server {cluster.dashboard_url}")
        for node in cluster.nodes:
            print(f"{node.name} ip {node.ip} session {node.session_id} log {node.log_path}")
        print("clients need RAY_AUTH_MODE=disabled; Ctrl-C or SIGTERM stops every node", flush=True)
        # Blocked only now, so the nodes started above keep the default handlers.
        stop_signals = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        signal.sigwait(stop_signals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
