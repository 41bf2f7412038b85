"""Epoch partition math: exactly-once coverage, equal batch counts, replayable shuffles."""

import random
from collections import Counter

import numpy as np
import pytest

from pipeline import roles as roles_module
from pipeline.config import Batching, Shuffle, Workers
from pipeline.epoch import Mix, plan_epoch
from pipeline.plan import (
    SEGMENT_INTS,
    Partition,
    Segment,
    batches_for,
    rank_slice,
    shuffle_buffer,
    worker_slice,
)
from pipeline.positions import Runs, positions_to_pieces, shard_order
from tests.pipeline.conftest import epoch_keys, loader_for
from tests.pipeline.plan_helpers import consumed_positions, remaining_runs, worker_runs


def remaining_after(total, segments, seed, epoch):
    """`remaining_runs` one position at a time."""
    return remaining_runs(total, segments, seed, epoch).to_array()


def worker_positions(remaining, part, rank, role):
    """`worker_runs` of an array of positions, one position at a time."""
    positions, batches = worker_runs(Runs.from_positions(remaining), part, rank, role)
    return positions.to_array(), batches


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


def test_one_plan_gives_the_rank_its_batches_and_each_worker_its_pieces():
    counts = [5, 0, 40, 13, 22]
    part = Partition(3, 2, 8, drop_last=False, rule="pad", shuffle_buffer=4, shuffle_initial=2)
    for rank in range(3):
        plan = plan_epoch(counts, part, rank, seed=2, epoch=1)
        slots = [plan.worker(role) for role in range(2)]
        assert plan.batches == sum(slot.batches for slot in slots) == batches_for(27, part)
        assert plan.samples == sum(slot.samples for slot in slots) == 27
        assert plan.padded == 27 * 3 - sum(counts)
        read = sum(p.stop - p.start for slot in slots for p in slot.parts[0].pieces)
        assert read == plan.samples  # the pieces hold exactly the rank's share


def test_one_plain_source_is_planned_as_an_unnamed_mix_of_one():
    counts = np.array([5, 0, 40, 13, 22])
    part = Partition(2, 2, 8, drop_last=False, rule="pad", shuffle_buffer=4, shuffle_initial=2)
    earlier = Segment(Partition(3, 1, 4, False, "uneven", 8, 2), consumed=2)

    def read(sources):
        plan = plan_epoch(sources, part, 1, seed=5, epoch=2, segments=[earlier])
        slots = [plan.worker(role) for role in range(2)]
        return [[(p.shard, p.start, p.stop) for p in s.parts[0].pieces] for s in slots]

    plain = read(counts)
    assert plain == read(Mix(("",), (counts,), (int(counts.sum()),)))
    # A named source is drawn from its name too (`source_seed`): another order, the same
    # samples left after the segment's replay.
    named = read(Mix(("a",), (counts,), (int(counts.sum()),)))
    assert named != plain
    assert sum(b - a for slot in named for _, a, b in slot) == sum(
        b - a for slot in plain for _, a, b in slot
    )


def test_resampled_mode_is_a_branch_of_the_same_plan():
    part = Partition(3, 2, 8, drop_last=False, rule="pad")
    plans = [plan_epoch([5, 7], part, rank, 0, 0, draws=100) for rank in range(3)]
    assert {plan.batches for plan in plans} == {batches_for(34, part)}  # ceil(100 / 3)
    for plan in plans:
        slots = [plan.worker(role) for role in range(2)]
        assert all(slot.parts[0].pieces is None for slot in slots)  # drawn as the worker goes
        assert sum(slot.batches for slot in slots) == plan.batches
    # A segment read under another partition consumed 3 batches of 4 on each of 2 ranks.
    earlier = Segment(Partition(2, 1, 4, drop_last=False, rule="pad"), consumed=3)
    assert plan_epoch([5, 7], part, 0, 0, 0, [earlier], draws=100).total == 100 - 3 * 4 * 2


def test_a_partition_is_made_from_the_groups_and_refuses_what_splits_no_epoch():
    batch = Batching(size=32, drop_last=True, epoch_rule="drop")
    made = Partition.of(batch, Shuffle(buffer=64, initial=16), world_size=4, num_workers=2)
    assert made == Partition(4, 2, 32, True, "drop", shuffle_buffer=64, shuffle_initial=16)
    with pytest.raises(ValueError, match="resolve them first"):
        Partition.of(Batching(size=32), Shuffle(), 1, 1)  # drop_last, epoch_rule: None
    segment = Segment(made, consumed=9)
    assert Segment.from_ints(segment.to_ints()) == segment
    assert len(segment.to_ints()) == SEGMENT_INTS
    assert Segment.from_dict(segment.to_dict()) == segment
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        Segment.from_dict({**segment.to_dict(), "batch_size": 0})  # an edited loader state


def test_the_loader_plans_each_epoch_once_for_len_the_log_and_what_is_left(shard_dir, monkeypatch):
    planned = []

    def counted(*args, **kwargs):
        planned.append(tuple(args[5]) if len(args) > 5 else ())
        return plan_epoch(*args, **kwargs)

    monkeypatch.setattr(roles_module, "plan_epoch", counted)  # where loader and workers ask
    options = dict(workers=Workers(count=2, persistent=False))
    first = loader_for(shard_dir, rank=0, world_size=2, **options)
    assert planned == [()]  # the log line's plan
    assert len(first) == len(first) == first.batches_remaining() > 3
    assert planned == [()]  # ... which len() and batches_remaining() read
    epoch_keys(first, limit=3)
    state = first.state_dict()
    assert first.batches_remaining() == len(first) - 3 and len(planned) == 1
    # Resumed on one rank: the rest of the epoch is replayed once, whatever is asked.
    resumed = loader_for(shard_dir, **options)
    resumed.load_state_dict(state)
    left = resumed.batches_remaining()
    assert left == resumed.batches_remaining() and left < len(resumed)
    assert len(planned) == 3 and planned[2] == tuple(resumed.segments)
    assert len(epoch_keys(resumed)) == left
