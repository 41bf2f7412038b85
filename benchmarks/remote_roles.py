"""Worker roles as Ray actors against local DataLoader workers (issue 30): the training
process's CPU per image, throughput, bytes per image on the wire, the per-batch receive
cost and one role's rate, and from those a paper model of images/s fed to one trainer
against the number of CPU nodes.

    python benchmarks/remote_roles.py --shards SHARDS [--rounds 3] [--batch-size 256] \
        [--warmup 3] [--probe-batches 8] [--output remote_roles.json]

    # a small build to try it on, and one round over it:
    .venv/bin/preprocess make-sample --output /tmp/rr/source --count 600
    .venv/bin/preprocess build-shards --input /tmp/rr/source --output /tmp/rr/shards
    python benchmarks/remote_roles.py --shards /tmp/rr/shards --rounds 1 --batch-size 32

Starts a real multi-node Ray cluster on this machine (tests/cluster/raycluster.py: a head
with 0 CPUs and 2 worker nodes of 1 CPU each, as the remote-roles tests do) and keeps it
for every round. Each round runs the contenders, in an order that rotates each round, for
one epoch each (train split, random-resized-crop 224 and flips into uint8 batches of
`--batch-size`, prefetch 2, pinned when CUDA is present), each in a fresh process that
plays the trainer:

- `local 2`: `build_loader` with `Workers(count=2)`: CPU seconds of the trainer's whole
  process tree (main process + its 2 DataLoader workers, from /proc) per image, and img/s;
- `ray 2`: `Workers(placement="ray", count=0, remote=2)` on the cluster, the pixels over
  the roles' channels (the default `ray_wire`): the trainer's own
  CPU seconds (getrusage RUSAGE_SELF: every thread of it, Ray's own included) per image;
  beside it, from /proc, the role actors' CPU and that of the rest of the cluster's
  processes per image: the head node's (the trainer's node: its raylet pulls the batches
  in, its GCS) and the worker nodes' (their raylets send them); and img/s. On a real
  cluster the head's share lands on the GPU node, the workers' on the CPU nodes;
- `ray 2 store`: the same through Ray's object store (`ray_wire="object_store"`).

Times and CPU count from the moment the `max(--warmup, roles + 1)`-th batch arrives to the
end of the epoch (start-up, actor placement and the shuffle buffers' first fill are not
steady state). Ratios are taken within each round; the tables give their median and the
min-max over rounds, for each remote contender: trainer CPU per image against local 2's
total (target <= 0.10), the same with the head node's Ray processes, and img/s against
local 2 on the same cores (target >= 0.9).

Then, each round, a probe in a fresh trainer process, through the object store (where a
batch made is ready in its node's store, so making and pulling time apart): one role's actor makes
`--probe-batches` batches after its first; measured are the role's rate (images/s of one
actor on its 1-CPU node, from the calls to the last batch being ready in that node's
object store), the bytes per image on the wire (the batch's arrays' nbytes / batch size)
and the trainer's receive cost per batch, from the object reference of a batch that is
ready on the other node to the batch as a tensor here (`ray.get`, which pulls it over, then
`pipeline.remote.from_wire`'s one copy): wall and CPU milliseconds. The paper model: N CPU
nodes of one role each feed one trainer min(N x role rate, what one core of the trainer
receives over the channel: 1 / `ray 2`'s trainer CPU seconds an image) images/s, printed
for N = 0..10 beside Ray Data's published 753 / 1,233 / 1,711 / 1,764 images/s with 0 / 1 /
5 / 10 extra CPU nodes (ray issue #42318; its 0 is the GPU node's own CPUs, which with us
would run `Workers.count` local roles besides).

Prints markdown tables; `--output` writes every round's raw figures and the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests.cluster.raycluster: the real local cluster

from common import (  # noqa: E402
    child_report,
    describe_machine,
    markdown_table,
    median,
    process_cpu_seconds,
    tree_cpu_seconds,
)

import tests.cluster.raycluster as raycluster  # noqa: E402
from pipeline import Batching, Crop, LoaderConfig, Workers, build_loader  # noqa: E402

CROP_SIZE = 224
ROLES = 2
LOCAL, RAY, STORE = "local 2", "ray 2", "ray 2 store"
CONTENDERS = (LOCAL, RAY, STORE)
CHILD_TIMEOUT_S = 1800
ACTOR_TITLE = b"ray::RoleActor"  # what a role actor's process calls itself (`ps`)
# Ray Data's image benchmark feeding one GPU trainer, by extra CPU nodes (ray #42318).
RAY_DATA = {0: 753, 1: 1233, 5: 1711, 10: 1764}
TARGET_CPU, TARGET_RATE = 0.10, 0.9


def loader_config(shards: str, workers: Workers, batch_size: int, seed: int) -> LoaderConfig:
    """Both contenders' settings; only `workers` differs."""
    return LoaderConfig(
        source=shards,
        split="train",
        batch=Batching(size=batch_size),
        crop=Crop(image_size=CROP_SIZE),
        workers=workers,
        seed=seed,
    )


def contender_workers(name: str, address: str) -> Workers:
    if name == LOCAL:
        return Workers(count=ROLES)
    wire = "object_store" if name == STORE else "channel"
    return Workers(placement="ray", ray_address=address, count=0, remote=ROLES, ray_wire=wire)


# --- the trainer processes -----------------------------------------------------------------


CPU_KEYS = ("trainer", "actors", "head_rest", "cluster_rest")


def cluster_pids(sessions: list[int]) -> tuple[list[int], list[int]]:
    """The cluster's processes (its nodes' sessions): role actors', and all the others'."""
    actors, others = [], []
    for session in sessions:
        for pid in raycluster.session_pids(session):
            try:
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
            except OSError:
                continue
            (actors if argv0.startswith(ACTOR_TITLE) else others).append(pid)
    return actors, others


def cpu_snapshot(name: str, sessions: list[int]) -> dict:
    """CPU seconds so far: the trainer's (`local 2`: with its workers), and the cluster's:
    the role actors', the head node's other processes (`head_rest`: the trainer's node,
    whose raylet pulls the batches in) and the worker nodes' (`cluster_rest`: theirs send
    them). `sessions[0]` is the head's."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    own = usage.ru_utime + usage.ru_stime
    actors, others = cluster_pids(sessions)
    head = set(cluster_pids(sessions[:1])[1])
    return {
        "at": time.perf_counter(),
        "trainer": tree_cpu_seconds(os.getpid()) if name == LOCAL else own,
        "actors": sum(process_cpu_seconds(pid) for pid in actors),
        "head_rest": sum(process_cpu_seconds(pid) for pid in others if pid in head),
        "cluster_rest": sum(process_cpu_seconds(pid) for pid in others if pid not in head),
    }


def run_epoch(name: str, args: dict, seed: int, results) -> None:
    """One epoch of one contender in this (child) process; puts its figures on `results`."""
    config = loader_config(
        args["shards"], contender_workers(name, args["address"]), args["batch_size"], seed
    )
    loader = build_loader(config)
    warm = max(args["warmup"], ROLES + 1)
    count = images = wire_bytes = 0
    before = None
    for images_batch, labels in loader:
        count += 1
        if count == warm:
            before = cpu_snapshot(name, args["sessions"])
        elif count > warm:
            images += len(labels)
            wire_bytes += images_batch.nbytes + labels.nbytes
    if before is None or not images:
        raise RuntimeError(f"{name}: {count} batches, too few for a warm-up of {warm} + 1")
    after = cpu_snapshot(name, args["sessions"])
    seconds = after["at"] - before["at"]
    used = {key: after[key] - before[key] for key in CPU_KEYS}
    results.put(
        {
            "name": name,
            "images": images,
            "seconds": seconds,
            "images_per_s": images / seconds,
            "batches": count,
            "bytes_per_image": wire_bytes / images,
            **{f"{key}_cpu_ms_per_image": 1000 * cpu / images for key, cpu in used.items()},
        }
    )


def probe_wire(args: dict, seed: int, results) -> None:
    """One role's rate, the bytes per image on the wire and the trainer's receive cost per
    batch (see the module docstring); puts them on `results`."""
    import ray
    import torch

    from pipeline.remote import RemoteRoles
    from pipeline.roles import RoleTask
    from shards.cluster import start_ray

    workers = Workers(count=ROLES)  # planned as the contenders' epoch: 2 roles
    loader = build_loader(loader_config(args["shards"], workers, args["batch_size"], seed))
    slot_batches = loader.epoch_plan().worker(0).batches
    batches = min(args["probe_batches"], slot_batches - 1)
    if batches < 1:
        raise RuntimeError(f"role 0 has {slot_batches} batches: too few for a probe")
    start_ray(args["address"], None, "--address")
    pin = torch.cuda.is_available()
    # The object store's wire: a batch made is ready in its node's store, so the role's rate
    # and the pull are timed apart (over the channel a frame waits for its reader).
    remote = Workers(
        placement="ray", ray_address=args["address"], count=0, remote=1, ray_wire="object_store"
    )
    roles = RemoteRoles(loader.dataset.source, remote, pin, loader.slot_bytes())
    actor = roles.actors[0]
    ray.get(actor.start.remote(RoleTask(role=0, num_workers=ROLES, epoch=0)))
    ray.get(actor.next_batch.remote())  # its first batch fills the shuffle buffer: not timed
    started = time.perf_counter()
    refs = [actor.next_batch.remote() for _ in range(batches)]
    ray.wait(refs, num_returns=len(refs), fetch_local=False)  # made, still on its node
    made_s = time.perf_counter() - started
    received = receive(refs, pin, roles.ring)
    role_rate = received["images"] / made_s
    results.put({"name": "probe", "pinned": pin, "role_images_per_s": role_rate, **received})


def receive(refs: list, pin: bool, ring) -> dict:
    """Each batch from its reference (ready on another node) to tensors here, timed: the
    pull and mapping (`ray.get`), the copy (`from_wire`, into `ring`'s reused slots when
    not pinned, as the loader does), and this process's CPU."""
    import ray

    from pipeline.remote import WireImages, from_wire

    images = wire = 0
    get_s = copy_s = cpu_s = 0.0
    for ref in refs:
        cpu, began = time.process_time(), time.perf_counter()
        values, size, _, _ = ray.get(ref)
        got = time.perf_counter()
        arrays = [v.nhwc if isinstance(v, WireImages) else v for v in values]
        wire += sum(a.nbytes for a in arrays if hasattr(a, "nbytes"))
        tuple(from_wire(value, pin, ring) for value in values)
        copy_s += time.perf_counter() - got
        get_s += got - began
        cpu_s += time.process_time() - cpu
        images += size
    return {
        "batches": len(refs),
        "images": images,
        "bytes_per_image": wire / images,
        "get_ms_per_batch": 1000 * get_s / len(refs),
        "copy_ms_per_batch": 1000 * copy_s / len(refs),
        "receive_cpu_ms_per_batch": 1000 * cpu_s / len(refs),
        "receive_us_per_image": 1e6 * (get_s + copy_s) / images,
    }


def in_child(label: str, target, *params) -> dict | None:
    """`target(*params, results)` in a fresh interpreter (a trainer of its own: a Ray
    driver is process-wide state, and DataLoader workers must not fork one); its report,
    or None."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=target, args=(*params, results))
    child.start()
    report = child_report(child, results)
    child.join(CHILD_TIMEOUT_S)
    if report is None:
        print(f"  {label}: FAILED (exit {child.exitcode}), see its traceback above", flush=True)
    return report


def wait_for_actors_gone(sessions: list[int], timeout_s: float = 60.0) -> None:
    """The last trainer's role actors exit with it: wait, so they cost the next one nothing."""
    deadline = time.monotonic() + timeout_s
    while cluster_pids(sessions)[0] and time.monotonic() < deadline:
        time.sleep(0.2)


# --- rounds and report ---------------------------------------------------------------------


def run_rounds(args: dict, rounds: int) -> list[dict]:
    """Each round: both contenders, in an order that rotates each round, then the probe."""
    done = []
    for index in range(rounds):
        shift = index % len(CONTENDERS)
        order = list(CONTENDERS[shift:] + CONTENDERS[:shift])
        record = {"round": index + 1, "order": order}
        for name in order:
            record[name] = in_child(name, run_epoch, name, args, index)
            wait_for_actors_gone(args["sessions"])
            if record[name]:
                rate = record[name]["images_per_s"]
                print(f"  round {index + 1}: {name}: {rate:,.0f} img/s", flush=True)
        record["probe"] = in_child("probe", probe_wire, args, index)
        wait_for_actors_gone(args["sessions"])
        done.append(record)
    return done


def ratios(rounds: list[dict], key: str, numerator: str, denominator: str) -> list[float]:
    """`numerator[key] / denominator[key]` in each round where both ran."""
    pairs = [(r.get(numerator), r.get(denominator)) for r in rounds]
    return [a[key] / b[key] for a, b in pairs if a and b and b[key]]


def spread_text(values: list[float], pattern: str) -> str:
    if not values:
        return "not measured"
    low, high = pattern.format(min(values)), pattern.format(max(values))
    return f"{pattern.format(median(values))} ({low}-{high})"


def summarize(rounds: list[dict]) -> dict:
    """Medians over rounds of each figure, and the paired ratios with their range."""
    figures = {}
    for name in (*CONTENDERS, "probe"):
        runs = [r[name] for r in rounds if r.get(name)]
        keys = [k for k, v in (runs[0].items() if runs else ()) if isinstance(v, float)]
        figures[name] = {k: median([run[k] for run in runs]) for k in keys}
    figures["ratios"] = {}
    for name in (RAY, STORE):
        node = [
            (r[name]["trainer_cpu_ms_per_image"] + r[name]["head_rest_cpu_ms_per_image"])
            / r[LOCAL]["trainer_cpu_ms_per_image"]
            for r in rounds
            if r.get(name) and r.get(LOCAL)
        ]
        figures["ratios"][name] = {
            "trainer_cpu_over_local": ratios(rounds, "trainer_cpu_ms_per_image", name, LOCAL),
            "trainer_node_cpu_over_local": node,
            "images_per_s_over_local": ratios(rounds, "images_per_s", name, LOCAL),
        }
    return figures


def paper_model(probe: dict, channel: dict) -> list[tuple[int, float]]:
    """(N, images/s fed to one trainer by N one-role CPU nodes): min(N x one role's rate,
    what one core of the trainer receives over the channel, 1 / its CPU an image)."""
    bound = 1e3 / channel["trainer_cpu_ms_per_image"]
    return [(n, min(n * probe["role_images_per_s"], bound)) for n in range(11)]


def print_report(rounds: list[dict], summary: dict) -> None:
    rows = []
    for name in CONTENDERS:
        runs = [r[name] for r in rounds if r.get(name)]
        rates = [r["images_per_s"] for r in runs]
        row = [name, spread_text(rates, "{:,.0f}")]
        for key in CPU_KEYS:
            row.append(spread_text([r[f"{key}_cpu_ms_per_image"] for r in runs], "{:.3f}"))
        rows.append(row)
    header = ["contender", "img/s", "trainer CPU ms/img", "actors CPU ms/img"]
    header += ["head node's Ray ms/img", "worker nodes' Ray ms/img"]
    print("\n" + markdown_table(header, rows))
    rows = []
    for name in (RAY, STORE):
        cpu, node, rate = summary["ratios"][name].values()
        rows += [
            [f"trainer CPU per image, {name} / local 2 total", spread_text(cpu, "{:.3f}"),
             f"<= {TARGET_CPU}", met(cpu, lambda v: v <= TARGET_CPU)],
            [f"trainer + its node's Ray processes, {name} / local 2 total",
             spread_text(node, "{:.3f}"), "", ""],
            [f"img/s, {name} / local 2", spread_text(rate, "{:.2f}x"),
             f">= {TARGET_RATE}x", met(rate, lambda v: v >= TARGET_RATE)],
        ]  # fmt: skip
    print(
        "\n"
        + markdown_table(["ratio (median of rounds, min-max)", "value", "target", "met?"], rows)
    )
    print_wire(rounds, summary["probe"], summary[RAY])


def met(values: list[float], test) -> str:
    return "" if not values else ("yes" if test(median(values)) else "no")


def print_wire(rounds: list[dict], probe: dict, channel: dict) -> None:
    """The probe's figures and the paper model from their medians."""
    if not probe:
        print("\nthe wire probe failed in every round")
        return
    probes = [r["probe"] for r in rounds if r.get("probe")]
    keys = (
        ("bytes per image on the wire", "bytes_per_image", "{:,.0f}"),
        ("one role's rate, img/s (1 CPU)", "role_images_per_s", "{:,.0f}"),
        ("receive: ray.get ms/batch", "get_ms_per_batch", "{:.2f}"),
        ("receive: copy ms/batch", "copy_ms_per_batch", "{:.2f}"),
        ("receive: trainer CPU ms/batch", "receive_cpu_ms_per_batch", "{:.2f}"),
        ("receive: us/image (wall)", "receive_us_per_image", "{:.1f}"),
    )
    rows = [[label, spread_text([p[key] for p in probes], f)] for label, key, f in keys]
    pinned = "copied into pinned memory" if probes[0]["pinned"] else "copied, no CUDA to pin"
    print(f"\n{markdown_table([f'object-store probe, {pinned}', 'median (min-max)'], rows)}")
    rows = [[n, f"{rate:,.0f}", f"{RAY_DATA[n]:,}" if n in RAY_DATA else ""] for n, rate in
            paper_model(probe, channel)]  # fmt: skip
    header = ["CPU nodes N", "ours, paper model img/s", "Ray Data, published img/s"]
    print(f"\n{markdown_table(header, rows)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=Path, required=True, help="a build's output folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3, help="batches before timing starts")
    parser.add_argument("--probe-batches", type=int, default=8)
    parser.add_argument("--output", type=Path, help="write the raw rounds and summary as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    batch_bytes = options.batch_size * (CROP_SIZE * CROP_SIZE * 3 + 8)
    # Room in each node's object store for the batches in flight (prefetch 2 a role, one
    # being received), so the figures never include Ray spilling them to disk.
    raycluster.OBJECT_STORE_BYTES = max(raycluster.OBJECT_STORE_BYTES, 8 * batch_bytes)
    with tempfile.TemporaryDirectory(prefix="remote-roles-") as root:
        cluster = raycluster.LocalRayCluster(Path(root), workers=ROLES, head_cpus=0)
        with cluster:
            os.environ["RAY_AUTH_MODE"] = cluster.env["RAY_AUTH_MODE"]  # the trainers join it
            args = {
                "shards": str(options.shards),
                "address": cluster.address,
                "sessions": [node.session_id for node in cluster.nodes],
                "batch_size": options.batch_size,
                "warmup": options.warmup,
                "probe_batches": options.probe_batches,
            }
            print(f"cluster at {cluster.address}: a head with 0 CPUs, {ROLES} nodes of 1 CPU")
            rounds = run_rounds(args, options.rounds)
    summary = summarize(rounds)
    print_report(rounds, summary)
    if options.output:
        report = {"machine": describe_machine(("torch", "ray")), "settings": args}
        report.update(rounds=rounds, summary=summary)
        if summary["probe"]:
            report["paper_model"] = [
                [n, rate] for n, rate in paper_model(summary["probe"], summary[RAY])
            ]
        options.output.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {options.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
