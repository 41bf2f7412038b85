"""Epoch partition math: exactly-once coverage, equal batch counts, replayable shuffles."""

import random
from collections import Counter

import numpy as np
import pytest

from pipeline.plan import (
    Partition,
    batches_for,
    positions_to_pieces,
    rank_slice,
    shard_order,
    shuffle_buffer,
    worker_slice,
)
from pipeline.resume import Segment, consumed_positions, remaining_after, worker_positions


def all_positions(total, part, rank):
    """Positions a rank reads, over all its worker slots, as the workers plan them."""
    out, batches = [], 0
    for role in range(part.num_workers):
        positions, count = worker_positions(np.arange(total), part, rank, role)
        out.extend(positions.tolist())
        batches += count
    return out, batches


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("total", [0, 1, 97, 256, 1000])
def test_uneven_rule_reads_every_sample_exactly_once(world, workers, total):
    part = Partition(world, workers, batch_size=16, drop_last=False, rule="uneven")
    seen = Counter()
    for rank in range(world):
        positions, batches = all_positions(total, part, rank)
        seen.update(positions)
        index, _ = rank_slice(total, part, rank)
        assert batches == batches_for(len(index), part)
    assert seen == Counter(range(total))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("total", [97, 1000, 1024])
def test_pad_rule_gives_equal_batches_and_misses_nothing(world, workers, total):
    part = Partition(world, workers, batch_size=8, drop_last=False, rule="pad")
    seen, batch_counts = Counter(), set()
    for rank in range(world):
        positions, batches = all_positions(total, part, rank)
        seen.update(positions)
        batch_counts.add(batches)
    assert len(batch_counts) == 1  # DDP never waits on a rank with fewer batches
    assert set(seen) == set(range(total))
    repeats = sum(seen.values()) - total
    assert repeats == -(-total // world) * world - total < world


@pytest.mark.parametrize("world,workers,total", [(2, 2, 1000), (3, 1, 97), (4, 3, 1024)])
def test_drop_last_equal_full_batches_and_no_sample_twice(world, workers, total):
    part = Partition(world, workers, batch_size=16, drop_last=True, rule="drop")
    seen, counts = Counter(), set()
    for rank in range(world):
        positions, batches = all_positions(total, part, rank)
        assert len(positions) == batches * 16
        seen.update(positions)
        counts.add(batches)
    assert len(counts) == 1 and max(seen.values()) == 1


def test_worker_batch_counts_follow_dataloader_round_robin():
    part = Partition(1, 3, batch_size=10, drop_last=False, rule="uneven")
    sizes = [worker_slice(95, part, w) for w in range(3)]
    # 10 batches: workers 0,1,2 own batches {0,3,6,9}, {1,4,7}, {2,5,8}; batch 9 is partial.
    assert [s[2] for s in sizes] == [4, 3, 3]
    spans = sorted((s[0], s[1]) for s in sizes)
    assert spans[0][0] == 0 and spans[-1][1] == 95
    assert sizes[0][1] == 95  # the partial batch's owner reads the tail


def test_positions_become_runs_within_shards():
    counts = [5, 3, 4]
    order = [2, 0, 1]  # stream: shard2[0:4], shard0[0:5], shard1[0:3]
    pieces = positions_to_pieces(np.array([2, 3, 4, 5, 9, 10]), order, counts)
    assert [(p.shard, p.start, p.stop) for p in pieces] == [(2, 2, 4), (0, 0, 2), (1, 0, 2)]


def test_shard_order_is_seeded_same_everywhere_and_changes_per_epoch():
    assert shard_order(50, 1, 0) == shard_order(50, 1, 0)
    assert shard_order(50, 1, 0) != shard_order(50, 1, 1)
    assert sorted(shard_order(50, 1, 3)) == list(range(50))


def test_shuffle_buffer_is_a_bounded_deterministic_permutation():
    out = list(shuffle_buffer(range(1000), 100, 10, random.Random(5)))
    assert sorted(out) == list(range(1000))
    assert out == list(shuffle_buffer(range(1000), 100, 10, random.Random(5)))
    assert out != list(range(1000))
    # An item can only leave the buffer after it entered: bounded displacement forward.
    assert all(item <= index * 2 + 10 for index, item in enumerate(out))


def test_replay_finds_exactly_what_was_consumed_then_the_rest_covers_the_epoch():
    total = 500
    old = Partition(
        2, 2, batch_size=8, drop_last=False, rule="uneven", shuffle_buffer=32, shuffle_initial=8
    )
    segment = Segment(old, consumed=7)
    used = consumed_positions(np.arange(total), segment, seed=3, epoch=0)
    assert len(used) == len(set(used.tolist())) == 2 * 7 * 8
    rest = remaining_after(total, [segment], seed=3, epoch=0)
    assert sorted(set(rest.tolist()) | set(used.tolist())) == list(range(total))
    new = Partition(
        1, 3, batch_size=8, drop_last=False, rule="uneven", shuffle_buffer=32, shuffle_initial=8
    )
    later = Counter()
    for role in range(3):
        positions, _ = worker_positions(rest, new, 0, role)
        later.update(positions.tolist())
    assert not set(later) & set(used.tolist()) and max(later.values()) == 1
    assert len(later) + len(used) == total
