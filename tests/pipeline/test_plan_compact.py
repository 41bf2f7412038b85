"""The epoch plan's compact arrays: int32 shard indices and offsets, the same pieces.

A worker holds the shard permutation and its pieces; below 2**31 shards (and shard
counts) they are int32, and the slots' stream starts are summed in blocks instead of
held. The shard table's byte counts, which every forked worker inherits, are int32 too.
The reference below is the plain int64 computation (every slot's start as one
cumulative sum, each run cut at the shard boundaries it spans): whatever the block
size, the partition, a resume's holes or positions past 2**31, the plan's pieces must
hold the same values.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from pipeline import positions as positions_module
from pipeline.epoch import plan_epoch
from pipeline.plan import Partition, Segment
from pipeline.positions import EpochLayout, Runs, compact_dtype, shard_order, shard_permutation
from pipeline.sources import ShardSpecs, resolve_source
from tests.conftest import shard_path
from tests.pipeline.plan_helpers import remaining_runs, slot_chunk, worker_runs


def int64_pieces(order, counts, positions: Runs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(shards, starts, stops)` of the pieces of `positions`, all in int64."""
    order = np.asarray(order, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64)[order])])
    first = np.searchsorted(starts, positions.starts, side="right") - 1
    last = np.searchsorted(starts, positions.stops - 1, side="right") - 1
    parts = []
    for a, b, f, g in zip(positions.starts, positions.stops, first, last, strict=True):
        slots = np.arange(f, g + 1)
        base = starts[slots]
        lo = np.maximum(a, base) - base
        hi = np.minimum(b, starts[slots + 1]) - base
        keep = hi > lo
        parts.append((order[slots[keep]], lo[keep], hi[keep]))
    if not parts:
        return tuple(np.empty(0, dtype=np.int64) for _ in range(3))
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def assert_same_pieces(pieces, expected, where: str = "") -> None:
    """The same values (whatever the dtypes) in each of the three columns."""
    got = (pieces.shards, pieces.starts, pieces.stops)
    for name, column, want in zip(("shards", "starts", "stops"), got, expected, strict=True):
        assert np.array_equal(column, want), f"{name} differ {where}"


def random_runs(rng: random.Random, total: int) -> Runs:
    """A few disjoint runs of `[0, total)`, not in order (as a padded rank's wrap is)."""
    cuts = sorted(rng.sample(range(total + 1), min(total + 1, 2 * rng.randint(1, 6))))
    runs = [(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if b > a]
    rng.shuffle(runs)
    return Runs([a for a, _ in runs], [b for _, b in runs])


@pytest.mark.parametrize("block", [1, 2, 3, 5, 64])
def test_pieces_cut_in_any_block_size_equal_the_int64_computation(monkeypatch, block):
    # Small blocks put run starts, run ends and empty shards on every side of a block edge.
    monkeypatch.setattr(positions_module, "_SLOT_BLOCK", block)
    for case in range(120):
        rng = random.Random(case)
        counts = [rng.choice([0, 0, 1, 2, rng.randint(0, 40)]) for _ in range(rng.randint(1, 30))]
        if not sum(counts):
            continue
        layout = EpochLayout.build(counts, case % 4, case % 3)
        positions = random_runs(rng, sum(counts))
        expected = int64_pieces(layout.order, counts, positions)
        assert_same_pieces(layout.pieces(positions), expected, f"case {case} block {block}")


def test_a_normal_manifest_plans_int32_arrays_with_the_int64_values():
    # 2*10^5 shards of 0-2,000 samples (~2*10^8 in all): several blocks of slots and of
    # pieces; three ranks padded (one wraps around the epoch's end), resumed from another
    # partition (the remaining positions have holes).
    rng = np.random.default_rng(11)
    counts = rng.integers(0, 2001, size=200_000)
    counts[rng.integers(0, len(counts), size=5000)] = 0
    counts[1] += counts.sum() % 3 == 0  # 3 ranks do not divide it: the last rank wraps
    seed, epoch = 3, 1
    layout = EpochLayout.build(counts, seed, epoch)
    assert layout.order.dtype == np.int32 and layout.total == int(counts.sum())
    part = Partition(3, 2, 64, False, "pad", shuffle_buffer=64, shuffle_initial=16)
    earlier = Segment(Partition(4, 2, 32, False, "uneven", 100, 20), consumed=30)
    wraps = False
    for segments in ([], [earlier]):
        remaining = remaining_runs(layout.total, segments, seed, epoch)
        for rank in range(part.world_size):
            epoch_plan = plan_epoch(counts, part, rank, seed, epoch, segments)
            for role in range(part.num_workers):
                plan = epoch_plan.worker(role)
                pieces = slot_chunk(plan)
                positions, _ = worker_runs(remaining, part, rank, role)
                wraps = wraps or bool(len(positions.starts) and positions.starts[-1] == 0)
                assert (pieces.shards.dtype, pieces.starts.dtype) == (np.int32,) * 2
                where = f"rank {rank} role {role} segments {len(segments)}"
                expected = int64_pieces(layout.order, counts, positions)
                assert_same_pieces(pieces, expected, where)
                assert sum(p.stop - p.start for p in pieces) == plan.samples == len(positions)
    assert wraps


def test_positions_and_counts_past_int32_keep_their_values():
    # Past 2**31 samples in all, positions are int64 while offsets still fit int32; a shard
    # of more than 2**31 samples makes the offsets int64. Five shards: no large array.
    big = 2**31
    for counts, offset_type in (
        ([big - 1, big - 1, 0, 3, big - 1, 10], np.int32),
        ([5, big + 7, 0, 3, 2 * big, 1], np.int64),
    ):
        layout = EpochLayout.build(counts, 0, 0)
        total = layout.total
        assert total == sum(counts) > big
        edges = np.cumsum([0, *(np.asarray(counts)[layout.order])])
        probes = sorted({int(e) + d for e in edges for d in (-2, -1, 0, 1) if 0 <= e + d <= total})
        positions = Runs(probes[:-1], probes[1:])  # every stretch between shard edges
        pieces = layout.pieces(positions)
        assert pieces.starts.dtype == offset_type and pieces.shards.dtype == np.int32
        assert_same_pieces(pieces, int64_pieces(layout.order, counts, positions))
        tail = Runs([total - 3, 0], [total, 2])  # a padded rank's wrap: read order kept
        assert_same_pieces(layout.pieces(tail), int64_pieces(layout.order, counts, tail))


def test_the_permutation_is_the_list_shuffle_in_int32_or_int64(monkeypatch):
    assert compact_dtype(2**31 - 1) is np.int32 and compact_dtype(2**31) is np.int64
    listed = list(range(1000))
    random.Random("shards:5:2").shuffle(listed)
    compact = shard_permutation(1000, 5, 2)
    assert compact.dtype == np.int32 and compact.tolist() == listed == shard_order(1000, 5, 2)
    # Past 2**31 shards the permutation is int64 (too large to run here): the same values.
    monkeypatch.setattr(positions_module, "compact_dtype", lambda largest: np.int64)
    wide = shard_permutation(1000, 5, 2)
    assert wide.dtype == np.int64 and wide.tolist() == listed


def test_positions_outside_the_epoch_are_refused():
    layout = EpochLayout.build([3, 0, 4], 0, 0)
    with pytest.raises(ValueError, match=r"outside \[0, 7\)"):
        layout.locate(np.array([2, 7]))
    with pytest.raises(ValueError, match="outside"):
        layout.locate(np.array([-1]))


def test_shard_byte_counts_are_int32_with_the_files_sizes(shard_dir):
    source = resolve_source(str(shard_dir), "train")
    sizes = source.shards.sizes
    assert sizes.dtype == np.int32 and not sizes.flags.writeable
    on_disk = [os.path.getsize(shard_path(shard_dir, "train", i)) for i in range(len(sizes))]
    assert sizes.tolist() == on_disk == [spec.bytes for spec in source.shards]
    assert source.counts.dtype == np.int64  # epoch positions are summed from the counts
    # A shard past 2 GiB keeps every byte count int64; -1 still means "unknown".
    wide = ShardSpecs(
        "tar", [3, 4, 5], names=["a.tar", "b.tar", "c.tar"], sizes=[10, 2**31 + 3, -1]
    )
    assert wide.sizes.dtype == np.int64
    assert [spec.bytes for spec in wide] == [10, 2**31 + 3, None]
