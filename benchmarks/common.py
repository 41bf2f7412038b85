"""Helpers shared by the benchmark scripts: medians, the machine's description, disk checks,
and peak memory and CPU time of a process tree (driver plus its Ray or pool workers), read
from /proc so that no extra package is needed.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import queue
import shutil
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def median(values: Sequence[float]) -> float:
    """Median of `values` (NaN when empty)."""
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> float:
    """(max - min) / median: how far apart repeats were; 0 for a single value."""
    if len(values) < 2:
        return 0.0
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle else float("nan")


def package_version(name: str) -> str:
    """Installed version of distribution `name`, or `absent`."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def describe_machine(packages: Sequence[str] = ()) -> dict[str, str]:
    """Cores, CPU model, memory, OS, Python and the versions of `packages`."""
    machine = {
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu_model": _cpu_model(),
        "memory_gib": f"{_meminfo_kib('MemTotal') / 2**20:.1f}",
        "os": platform.platform(),
        "python": platform.python_version(),
    }
    for name in packages:
        machine[name] = package_version(name)
    return machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _meminfo_kib(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def free_disk_bytes(path: str | Path) -> int:
    """Free bytes on the file system holding `path` (or its nearest existing parent)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def directory_bytes(path: str | Path) -> int:
    """Bytes of all regular files under `path`; hard links to one file are counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            info = os.lstat(os.path.join(root, name))
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_size
    return total


def tree_pids(root: int) -> list[int]:
    """`root` and all its live descendants, found by scanning /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _read_stat(int(entry.name))
        if stat is not None:
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    pids, queue = [], [root]
    while queue:
        pid = queue.pop()
        pids.append(pid)
        queue.extend(children.get(pid, ()))
    return pids


def _read_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (index 0 is the state), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # the process ended between listing and reading
        return None
    return text[text.rindex(")") + 2 :].split()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 if it is gone)."""
    stat = _read_stat(pid)
    return (int(stat[11]) + int(stat[12])) / _CLOCK_TICKS if stat else 0.0


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds used so far by `root` and its live descendants.

    Processes that already exited are not counted: take the difference of two readings
    while long-lived workers (Ray's, a pool's) are up.
    """
    return sum(process_cpu_seconds(pid) for pid in tree_pids(root))


def tree_cpu_by_process(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (command name, CPU seconds so far) for `root` and its live descendants."""
    usage = {}
    for pid in tree_pids(root):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        usage[pid] = (name, process_cpu_seconds(pid))
    return usage


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (0 if it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size of one process: shared pages divided among their users.

    Summing PSS over a tree does not count the shared libraries and Ray's shared object store
    once per process, as summing RSS does. 0 when unreadable.
    """
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


@dataclass
class MemoryPeak:
    """Peaks seen while sampling a process tree, in bytes.

    Attributes:
        tree_rss: largest sum of RSS over the tree (counts shared pages once per process).
        tree_pss: largest sum of PSS over the tree (shared pages split among processes).
        root_rss: largest RSS of the root process (the driver).
        largest_child_rss: largest RSS of any single descendant (a worker, raylet, ...).
        processes: most processes seen in the tree at once.
        samples: how many samples were taken.
    """

    tree_rss: int = 0
    tree_pss: int = 0
    root_rss: int = 0
    largest_child_rss: int = 0
    processes: int = 0
    samples: int = 0


class TreeMemorySampler:
    """Samples a process tree's memory every `interval` seconds on a background thread.

    Use as a context manager around the work; read `peak` afterwards.
    """

    def __init__(self, root: int, interval: float = 0.2) -> None:
        self.root = root
        self.interval = interval
        self.peak = MemoryPeak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def __enter__(self) -> TreeMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        """Take one sample now."""
        pids = tree_pids(self.root)
        rss = {pid: rss_bytes(pid) for pid in pids}
        peak = self.peak
        peak.tree_rss = max(peak.tree_rss, sum(rss.values()))
        peak.tree_pss = max(peak.tree_pss, sum(pss_bytes(pid) for pid in pids))
        peak.root_rss = max(peak.root_rss, rss.get(self.root, 0))
        children = [value for pid, value in rss.items() if pid != self.root]
        peak.largest_child_rss = max(peak.largest_child_rss, max(children, default=0))
        peak.processes = max(peak.processes, len(pids))
        peak.samples += 1


class Stopwatch:
    """Wall-clock seconds since creation (`time.perf_counter`)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; numbers right-aligned."""
    text = [[str(cell) for cell in row] for row in rows]
    align = [
        "---:" if rows and all(_is_number(row[i]) for row in rows) else "---"
        for i in range(len(header))
    ]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in text]
    return "\n".join(lines)


def _is_number(cell: object) -> bool:
    if isinstance(cell, (int, float)):
        return True
    return str(cell).replace(",", "").replace(".", "", 1).replace("x", "").strip().isdigit()


def gib(count: int | float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{count / 2**30:.2f}"


def mib(count: int | float) -> str:
    """Bytes as MiB with no decimals."""
    return f"{count / 2**20:.0f}"


def child_report(child, results, poll_s: float = 1.0) -> dict | None:
    """The one report a benchmark child process puts on `results`, or None if it died first.

    Polls, so a child that crashes without reporting cannot hang the benchmark; a report put
    just before the child exited is still taken.
    """
    while True:
        try:
            return results.get(timeout=poll_s)
        except queue.Empty:
            if not child.is_alive():
                try:
                    return results.get_nowait()
                except queue.Empty:
                    return None
