"""The epoch plan at scale: the same plan as the per-sample implementation, in O(shards).

`old_*` below is the per-sample implementation the interval plan replaced (np.arange of
the epoch, a Python loop per position), kept as the reference: over many random
datasets, partitions and resumes the new plan must give the same pieces, counts and
delivery order. A 10^9-sample epoch must then plan in a process capped in memory.

`python -m tests.pipeline.test_plan_scale` measures planning time and peak memory of
one worker, new and old, for 10^6 to 10^9 samples; `... old-cap` runs the capped
plan on the old implementation (it fails: it needs an 8 GB array).
"""

from __future__ import annotations

import ast
import random
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pipeline.assemble import batch_sizes
from pipeline.epoch import plan_epoch
from pipeline.plan import Partition, Segment, batches_for, rank_slice, shuffle_buffer
from pipeline.positions import Runs, shard_order
from pipeline.shuffle_quality import plan_delivery
from tests.pipeline.plan_helpers import remaining_runs, slot_pieces, worker_rng

REPO = Path(__file__).resolve().parents[2]

# ---- the per-sample implementation, as it was before the interval plan -------------


def old_rank_slice(total, part, rank):
    world = part.world_size
    if part.rule == "pad":
        per_rank = -(-total // world)
        padded = per_rank * world
        index = np.arange(rank * per_rank, (rank + 1) * per_rank) % max(total, 1)
        return (index if total else index[:0]), padded - total
    if part.rule == "drop":
        per_rank = total // world
        return np.arange(rank * per_rank, (rank + 1) * per_rank), 0
    bounds = [total * r // world for r in range(world + 1)]
    return np.arange(bounds[rank], bounds[rank + 1]), 0


def old_worker_slice(rank_samples, part, worker):
    total_batches = batches_for(rank_samples, part)
    used = min(rank_samples, total_batches * part.batch_size)
    nw = part.num_workers
    counts = [len(range(w, total_batches, nw)) for w in range(nw)]
    last_owner = (total_batches - 1) % nw if total_batches else nw - 1
    layout = [w for w in range(nw) if w != last_owner] + [last_owner]
    start = 0
    for w in layout:
        size = counts[w] * part.batch_size
        if w == last_owner:
            size = used - start
        if w == worker:
            return start, start + size, counts[w]
        start += size
    raise ValueError(worker)


def old_positions_to_pieces(positions, order, counts):
    ordered_counts = np.asarray([counts[s] for s in order], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(ordered_counts)])
    slot = np.searchsorted(starts, positions, side="right") - 1
    offsets = positions - starts[slot]
    pieces = []
    run_start = 0
    for i in range(1, len(positions) + 1):
        boundary = (
            i == len(positions) or slot[i] != slot[run_start] or offsets[i] != offsets[i - 1] + 1
        )
        if boundary:
            shard = order[int(slot[run_start])]
            pieces.append((shard, int(offsets[run_start]), int(offsets[i - 1]) + 1))
            run_start = i
    return pieces


def old_roles_consumed(consumed, num_workers):
    return [len(range(w, consumed, num_workers)) for w in range(num_workers)]


def old_worker_positions(remaining, part, rank, role):
    index, _ = old_rank_slice(len(remaining), part, rank)
    start, stop, batches = old_worker_slice(len(index), part, role)
    return remaining[index[start:stop]], batches


def old_consumed_positions(remaining, segment, seed, epoch):
    part = segment.partition
    done = old_roles_consumed(segment.consumed, part.num_workers)
    taken = []
    for rank in range(part.world_size):
        for role in range(part.num_workers):
            positions, _ = old_worker_positions(remaining, part, rank, role)
            count = min(done[role] * part.batch_size, len(positions))
            if count == 0:
                continue
            rng = worker_rng(seed, epoch, rank, role)
            order = shuffle_buffer(
                range(len(positions)), part.shuffle_buffer, part.shuffle_initial, rng
            )
            picked = [next(order) for _ in range(count)]
            taken.append(positions[np.asarray(picked, dtype=np.int64)])
    return np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)


def old_remaining_after(total, segments, seed, epoch):
    remaining = np.arange(total, dtype=np.int64)
    for segment in segments:
        used = old_consumed_positions(remaining, segment, seed, epoch)
        remaining = remaining[~np.isin(remaining, used)]
    return remaining


def old_plan_exact(counts, seed, epoch, segments, part, rank, role):
    """What `ShardStream.plan_exact` computed: (pieces, samples, batches)."""
    remaining = old_remaining_after(sum(counts), segments, seed, epoch)
    positions, batches = old_worker_positions(remaining, part, rank, role)
    order = shard_order(len(counts), seed, epoch)
    return old_positions_to_pieces(positions, order, counts), len(positions), batches


def old_plan_delivery(part, rank, counts, seed, epoch):
    """What `shuffle_quality.plan_delivery` computed: (shards, offsets, batch sizes)."""
    remaining = np.arange(sum(counts), dtype=np.int64)
    per_worker = []
    for role in range(part.num_workers):
        positions, batches = old_worker_positions(remaining, part, rank, role)
        rng = worker_rng(seed, epoch, rank, role)
        picks = shuffle_buffer(
            range(len(positions)), part.shuffle_buffer, part.shuffle_initial, rng
        )
        shuffled = positions[np.fromiter(picks, dtype=np.int64, count=len(positions))]
        bounds = np.cumsum([0, *batch_sizes(len(positions), batches, part.batch_size)])
        per_worker.append([shuffled[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    delivered = []
    for j in range(sum(len(w) for w in per_worker)):
        delivered.append(per_worker[j % part.num_workers][j // part.num_workers])
    positions = np.concatenate(delivered) if delivered else np.empty(0, dtype=np.int64)
    order = shard_order(len(counts), seed, epoch)
    ordered = np.asarray([counts[s] for s in order], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(ordered)])
    slot = np.searchsorted(starts, positions, side="right") - 1
    shards = np.asarray(order, dtype=np.int64)[slot] if len(positions) else slot
    return shards, positions - starts[slot], [len(b) for b in delivered]


# ---- random cases --------------------------------------------------------------------


def random_partition(rng: random.Random) -> Partition:
    buffer = rng.choice([1, 1, 2, 5, 16, 64])
    return Partition(
        world_size=rng.randint(1, 4),
        num_workers=rng.randint(1, 3),
        batch_size=rng.randint(1, 9),
        drop_last=rng.random() < 0.5,
        rule=rng.choice(["pad", "drop", "uneven"]),
        shuffle_buffer=buffer,
        shuffle_initial=rng.randint(1, buffer),
    )


def random_case(seed: int):
    """(counts, seed, epoch, segments, partition): an epoch resumed under 0-3 partitions."""
    rng = random.Random(seed)
    shards = rng.randint(0, 12)
    counts = [rng.choice([0, 1, 3, rng.randint(0, 60)]) for _ in range(shards)]
    data_seed, epoch = rng.randint(0, 5), rng.randint(0, 3)
    remaining, segments = sum(counts), []
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        part = random_partition(rng)
        index, _ = old_rank_slice(remaining, part, 0)
        consumed = rng.randint(0, batches_for(len(index), part))  # at most a rank's batches
        segments.append(Segment(part, consumed))
        remaining = len(old_remaining_after(sum(counts), segments, data_seed, epoch))
    return counts, data_seed, epoch, segments, random_partition(rng)


@pytest.mark.parametrize("chunk", range(25))
def test_interval_plan_matches_the_per_sample_plan(chunk):
    for case in range(chunk * 16, chunk * 16 + 16):
        counts, seed, epoch, segments, part = random_case(case)
        rest = remaining_runs(sum(counts), segments, seed, epoch)
        old_rest = old_remaining_after(sum(counts), segments, seed, epoch)
        assert rest.to_array().tolist() == old_rest.tolist(), f"case {case}"
        for rank in range(part.world_size):
            assert len(rank_slice(len(rest), part, rank)[0]) == len(
                old_rank_slice(len(old_rest), part, rank)[0]
            ), f"case {case}"
            epoch_plan = plan_epoch(counts, part, rank, seed, epoch, segments)
            for role in range(part.num_workers):
                plan = epoch_plan.worker(role)
                pieces, samples, batches = old_plan_exact(
                    counts, seed, epoch, segments, part, rank, role
                )
                got = [(p.shard, p.start, p.stop) for p in plan.parts[0].pieces]
                assert (got, plan.samples, plan.batches) == (pieces, samples, batches), (
                    f"case {case} rank {rank} role {role}"
                )


@pytest.mark.parametrize("chunk", range(5))
def test_inspect_shuffle_delivery_matches_the_per_sample_replay(chunk):
    for case in range(chunk * 20, chunk * 20 + 20):
        counts, seed, epoch, _, part = random_case(1000 + case)
        for rank in range(part.world_size):
            order = plan_delivery(part, rank, counts, seed, epoch)
            shards, offsets, sizes = old_plan_delivery(part, rank, counts, seed, epoch)
            assert order.shards.tolist() == shards.tolist(), f"case {case}"
            assert order.offsets.tolist() == offsets.tolist(), f"case {case}"
            assert order.batch_sizes == sizes, f"case {case}"


def test_runs_slice_take_and_remove_like_arrays():
    rng = np.random.default_rng(4)
    values = np.sort(rng.choice(500, size=200, replace=False))
    runs = Runs.from_positions(values)
    assert runs.to_array().tolist() == values.tolist() and len(runs) == 200
    assert runs.select(13, 171).to_array().tolist() == values[13:171].tolist()
    assert runs.select(50, 50).to_array().tolist() == []
    picks = rng.integers(0, 200, size=64)
    assert runs.take(picks).tolist() == values[picks].tolist()
    gone = np.unique(rng.choice(values, size=40))
    assert runs.without(gone).to_array().tolist() == np.setdiff1d(values, gone).tolist()
    index = Runs([150, 3], [190, 20])  # a padded rank's wrap-around: read order kept
    expected = np.concatenate([values[150:190], values[3:20]])
    assert runs.at(index).to_array().tolist() == expected.tolist()


# ---- 10^9 samples in capped memory ---------------------------------------------------

CAP_BYTES = 3 * 2**29  # 1.5 GiB of address space above the interpreter's baseline
SCALE_SHARDS, SCALE_SHARD_SAMPLES = 10**6, 1000
SCALE_PART = Partition(8, 8, 256, True, "pad", shuffle_buffer=2000, shuffle_initial=500)


def address_space() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def plan_at_scale(rank: int = 3, worker: int = 5) -> dict:
    """Rank `rank` of 8, worker `worker` of 8 of a 10^9-sample epoch: fresh and resumed."""
    counts = np.full(SCALE_SHARDS, SCALE_SHARD_SAMPLES, dtype=np.int64)
    part = SCALE_PART
    plan = plan_epoch(counts, part, rank, 7, 2)
    fresh = plan.worker(worker)
    # A resume under the same partition after 1,000 batches: the stream drops that segment
    # and plays slot (worker + consumed) % num_workers; the loader counts what is left.
    consumed = 1003
    same = plan.worker((worker + consumed) % part.num_workers)
    # A resume from another partition (16 ranks): only its consumed samples are replayed.
    earlier = Segment(Partition(16, 8, 256, True, "pad", 2000, 500), consumed=5)
    moved = plan_epoch(counts, part, rank, 7, 2, [earlier]).worker(worker)
    return {
        "fresh": (fresh.samples, fresh.batches, len(slot_pieces(fresh))),
        "same": (same.samples, same.batches, len(slot_pieces(same))),
        "left_batches": plan.batches - consumed,
        "moved": (moved.samples, moved.batches, len(slot_pieces(moved))),
        "moved_pieces": sum(p.stop - p.start for p in moved.parts[0].pieces),
    }


def old_plan_at_scale(rank: int = 3, worker: int = 5) -> dict:
    counts = [SCALE_SHARD_SAMPLES] * SCALE_SHARDS
    pieces, samples, batches = old_plan_exact(counts, 7, 2, [], SCALE_PART, rank, worker)
    return {"fresh": (samples, batches, len(pieces))}


def run_capped(which: str) -> None:
    """In this process: cap the address space, then plan (`which`: new | old)."""
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + CAP_BYTES, resource.RLIM_INFINITY))
    print(plan_at_scale() if which == "new" else old_plan_at_scale(), flush=True)


def worker_batches(total: int, part: Partition, rank: int, role: int) -> int:
    """Batches of slot `role` of `rank`, by the DataLoader's round robin (arithmetic)."""
    batches = batches_for(len(rank_slice(total, part, rank)[0]), part)
    return len(range(role, batches, part.num_workers))


@pytest.mark.timeout(120)
def test_a_billion_sample_epoch_plans_in_capped_memory():
    script = "from tests.pipeline.test_plan_scale import run_capped; run_capped('new')"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=110
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    part, total, batch = SCALE_PART, 10**9, SCALE_PART.batch_size
    fresh = worker_batches(total, part, 3, 5)  # 61,035 of the rank's 488,281 batches
    assert result["fresh"][:2] == (fresh * batch, fresh)
    assert fresh * batch / 1000 <= result["fresh"][2] <= fresh * batch / 1000 + 2  # ~ shards
    # Same partition after 1,003 batches: physical worker 5 plays slot (5 + 1003) % 8 = 0.
    slot0 = worker_batches(total, part, 3, 0)
    assert result["same"][:2] == (slot0 * batch, slot0) and slot0 == fresh + 1
    assert result["left_batches"] == batches_for(-(-total // 8), part) - 1003
    # 16 ranks x 5 batches were consumed before: the rest is re-split around their holes.
    moved = worker_batches(total - 16 * 5 * batch, part, 3, 5)
    assert result["moved"][:2] == (moved * batch, moved) == (result["moved_pieces"], moved)
    assert result["moved"][2] > result["fresh"][2]


# ---- measurement ---------------------------------------------------------------------


def measure_worker(total: int, old: bool) -> tuple[float, float]:
    """Seconds and peak MiB (tracemalloc) for worker 0 of 2 on one rank to plan an epoch."""
    shards = total // 1000
    counts = [1000] * shards if old else np.full(shards, 1000, dtype=np.int64)
    part = Partition(1, 2, 256, True, "pad", 2000, 500)
    tracemalloc.start()
    started = time.perf_counter()
    if old:
        old_plan_exact(counts, 0, 0, [], part, 0, 0)
    else:
        plan_epoch(counts, part, 0, 0, 0).worker(0)
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return seconds, peak


def main(argv: list[str]) -> None:
    if argv[:1] == ["old-cap"]:
        run_capped("old")
        return
    for total in (10**6, 10**7, 10**8, 10**9):
        for old in (False, True):
            if old and total > 10**8:
                print(f"{total:>13,} old: skipped (needs {total * 8 / 2**30:.0f} GiB arrays)")
                continue
            seconds, peak = measure_worker(total, old)
            name = "old" if old else "new"
            print(f"{total:>13,} {name}: {seconds:8.2f} s  peak {peak:8.1f} MiB", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
