"""Repeated augmentation (`Batching.aug_repeats`, DeiT's RASampler) in the epoch plan:
k copies of each selected sample, repeat numbers 0..k-1, the epoch's usual length,
copies spread over ranks, exact through a resume on the same or another world size."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections import Counter, defaultdict

import numpy as np
import pytest

from pipeline import Batching, Crop, LoaderConfig, Resampled, Source, Workers
from pipeline.epoch import Mix, plan_epoch
from pipeline.plan import Partition, Segment, shuffle_buffer
from pipeline.transforms import SampleRandom
from shards.errors import UsageError
from tests.pipeline.conftest import epoch_keys, loader_for
from tests.pipeline.plan_helpers import worker_rng

COUNTS = [32, 32, 17, 32, 5, 29, 32, 11]  # 190 samples, uneven shards
SEED, EPOCH = 11, 3


def part_of(world, workers, k, rule="pad", drop_last=True):
    return Partition(world, workers, 8, drop_last, rule, 16, 4, k)


def iter_copies(worker_plan):
    """A worker's copies in read order: `(shard, sample, repeat)`."""
    for piece, first, copies in worker_plan.parts[0].pieces.iter_copies():
        for sample in range(piece.start, piece.stop):
            for repeat in range(first, first + copies):
                yield piece.shard, sample, repeat


def deliveries(part, rank, segments=(), counts=COUNTS):
    """Rank `rank`'s batches in the DataLoader's order (batch j from worker j % workers):
    each batch a list of `(shard, sample, repeat)`, replayed from the plan on integers."""
    plan = plan_epoch(counts, part, rank, SEED, EPOCH, segments)
    per_role = []
    for role in range(part.num_workers):
        worker = plan.worker(role)
        rng = worker_rng(SEED, EPOCH, worker.shuffle_rank, role)
        order = list(shuffle_buffer(iter_copies(worker), 16, 4, rng))
        per_role.append([order[i : i + 8] for i in range(0, worker.samples, 8)])
    batches = []
    for step in range(plan.batches):
        batches.append(per_role[step % part.num_workers][step // part.num_workers])
    return batches


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("rule,drop_last", [("pad", True), ("pad", False), ("drop", True)])
def test_each_selected_sample_gets_k_copies_at_the_plain_epoch_length(
    k, world, workers, rule, drop_last
):
    copies = defaultdict(list)
    delivered = 0
    for rank in range(world):
        plan = plan_epoch(COUNTS, part_of(world, workers, k, rule, drop_last), rank, SEED, EPOCH)
        plain = plan_epoch(COUNTS, part_of(world, workers, 1, rule, drop_last), rank, SEED, EPOCH)
        assert (plan.batches, plan.used) == (plain.batches, plain.used)  # the epoch's length
        for role in range(workers):
            worker = plan.worker(role)
            rows = list(iter_copies(worker))
            assert len(rows) == worker.samples
            delivered += min(len(rows), worker.batches * 8)
            for shard, sample, repeat in rows:
                copies[(shard, sample)].append(repeat)
    repeats = plan.repeats
    assert delivered == repeats.total == world * plain.used
    assert len(copies) == repeats.selected == -(-repeats.total // k)
    counts = sorted(len(c) for c in copies.values())
    assert counts[1:] == [k] * (len(counts) - 1)  # only the last selected one may have fewer
    assert counts[0] == repeats.total - k * (repeats.selected - 1)
    assert all(sorted(c) == list(range(len(c))) for c in copies.values())


def selected_stream(k, epoch, world=1):
    """The samples an epoch selects, as stream places `(shard, sample)`."""
    plan = plan_epoch(COUNTS, part_of(world, 1, k), 0, SEED, epoch)
    return {(shard, sample) for shard, sample, _ in iter_copies(plan.worker(0))}


def test_the_selection_is_the_epochs_stream_head_and_changes_each_epoch():
    plain = plan_epoch(COUNTS, part_of(1, 1, 1), 0, SEED, EPOCH).worker(0).parts[0].pieces
    head = [(p.shard, s) for p in plain for s in range(p.start, p.stop)][:62]
    assert selected_stream(3, EPOCH) == set(head)  # 184 copies (23 batches) of the first 62
    seen = [selected_stream(3, epoch) for epoch in range(12)]
    assert len({frozenset(s) for s in seen}) == 12
    assert len(set().union(*seen)) == sum(COUNTS)  # every sample within 12 epochs here


@pytest.mark.parametrize("k,world", [(2, 2), (3, 3), (3, 6), (2, 4)])
def test_copies_reach_k_ranks_at_the_same_step_when_k_divides_the_world(k, world):
    where = defaultdict(list)
    for rank in range(world):
        for step, batch in enumerate(deliveries(part_of(world, 2, k), rank)):
            for slot, (shard, sample, repeat) in enumerate(batch):
                where[(shard, sample)].append((rank, step, slot, repeat))
    for places in where.values():
        assert sorted(p[3] for p in places) == list(range(k))
        assert len({p[0] for p in places}) == k  # k ranks
        assert len({p[1:3] for p in places}) == 1  # the same step and slot of the batch


def test_with_eight_ranks_and_three_copies_six_ranks_align_and_two_read_alone():
    counts = [64] * 40
    where = defaultdict(list)
    for rank in range(8):
        for step, batch in enumerate(deliveries(part_of(8, 2, 3), rank, counts=counts)):
            for shard, sample, repeat in batch:
                where[(shard, sample)].append((rank, step, repeat))
    spread = [p for p in where.values() if len({r for r, _, _ in p}) == 3]
    rest = [p for p in where.values() if p not in spread]
    assert all(len({s for _, s, _ in p}) == 1 for p in spread)  # one step
    assert {r for p in spread for r, _, _ in p} == set(range(6))
    assert len(spread) == 6 * 320 // 3  # six ranks of 320 copies: 640 samples
    assert {r for p in rest for r, _, _ in p} == {6, 7}
    # Ranks 6 and 7 read their samples alone (640 copies: one sample straddles them).
    assert sum(len({r for r, _, _ in p}) > 1 for p in rest) == 1


def test_a_plan_resumed_on_another_world_size_delivers_the_rest_exactly():
    before = part_of(2, 2, 3, drop_last=False)
    full = Counter(row for rank in range(2) for b in deliveries(before, rank) for row in b)
    head = Counter(row for rank in range(2) for b in deliveries(before, rank)[:3] for row in b)
    segments = (Segment(before, 3),)
    after = part_of(1, 3, 3, drop_last=False)
    rest = Counter(row for b in deliveries(after, 0, segments) for row in b)
    assert head + rest == full and max((head + rest).values()) == 1


def test_a_resume_that_changes_aug_repeats_mid_epoch_is_refused():
    with pytest.raises(UsageError, match="started with Batching.aug_repeats=3"):
        plan_epoch(COUNTS, part_of(1, 2, 2), 0, SEED, EPOCH, (Segment(part_of(2, 2, 3), 2),))


def test_a_mix_and_resampled_mode_refuse_aug_repeats(shard_dir):
    with pytest.raises(UsageError, match="aug_repeats=3 is refused for a mix"):
        LoaderConfig(
            source=[Source(str(shard_dir), repeat=1)], batch=Batching(size=8, aug_repeats=3)
        )
    mix = Mix(("a", "b"), (np.array([8, 8]), np.array([4])), (16, 4))
    with pytest.raises(
        UsageError, match="aug_repeats=3 re-read one source, and this epoch mixes a, b"
    ):
        plan_epoch(mix, part_of(1, 1, 3), 0, SEED, EPOCH)
    with pytest.raises(UsageError, match="aug_repeats=3 needs the exact epoch"):
        plan_epoch(COUNTS, part_of(1, 1, 3), 0, SEED, EPOCH, draws=100)
    with pytest.raises(UsageError, match="aug_repeats=2 needs the exact epoch"):
        LoaderConfig(source=str(shard_dir), batch=Batching(aug_repeats=2), sampling=Resampled(100))
    with pytest.raises(UsageError, match="Batching.aug_repeats must be at least 1, got 0"):
        Batching(aug_repeats=0)


# The plan of these partitions with aug_repeats=1, recorded before repeats existed.
PLAIN_PLAN_SHA256 = "a0b9e69acc7091bdf832149b5472ed3ed4e1db0149530ecb71340957d6180147"


def test_aug_repeats_1_leaves_the_plan_and_its_state_as_they_were():
    out = []
    shapes = [
        (1, 1, "pad", True),
        (2, 2, "pad", True),
        (3, 2, "drop", False),
        (2, 3, "uneven", False),
    ]
    for world, workers, rule, drop_last in shapes:
        part = Partition(world, workers, 8, drop_last, rule, 16, 4)
        for rank in range(world):
            for segments in [(), (Segment(Partition(2, 2, 8, True, "pad", 16, 4), 3),)]:
                plan = plan_epoch(COUNTS, part, rank, SEED, 1, segments)
                out.append([plan.batches, plan.padded, plan.total])
                for role in range(workers):
                    worker = plan.worker(role)
                    pieces = [(p.shard, p.start, p.stop) for p in worker.parts[0].pieces]
                    out.append([worker.samples, worker.batches, pieces])
        out.append(Segment(part, 2).to_dict())
    assert hashlib.sha256(json.dumps(out).encode()).hexdigest() == PLAIN_PLAN_SHA256
    assert list(Segment(part_of(1, 1, 1), 0).to_dict()) == [
        "world_size", "num_workers", "batch_size", "drop_last", "rule", "shuffle_buffer",
        "shuffle_initial", "consumed",
    ]  # fmt: skip


# --- the loader on real shards ---------------------------------------------------------


class RepeatTag:
    """An image transform whose pixels are its first random draws: they tell which
    `SampleRandom` (seed, epoch, key, repeat) the decode used."""

    def __call__(self, value, rng):
        return np.frombuffer(rng.getrandbits(96).to_bytes(12, "little"), np.uint8).reshape(2, 2, 3)


def tag(key, repeat, epoch=0, seed=SEED):
    """The pixels `RepeatTag` makes for copy `repeat` of `key`."""
    rng = SampleRandom(f"aug:{seed}:{epoch}:{key}:{repeat}")
    return rng.getrandbits(96).to_bytes(12, "little")


def tagged(loader, limit=None):
    """`(key, pixels)` of each sample, batch by batch."""
    batches = []
    for images, _, keys in itertools.islice(loader, limit):
        pixels = images.permute(0, 2, 3, 1).contiguous().numpy()
        batches.append([(k, pixels[i].tobytes()) for i, k in enumerate(keys)])
    return batches


TAG = RepeatTag()


def repeated(shard_dir, k=3, drop_last=None, transform=TAG, **overrides):
    """`loader_for`'s loader with `aug_repeats=k`, images tagged by their draws."""
    batch = Batching(size=8, drop_last=drop_last, aug_repeats=k)
    return loader_for(
        shard_dir, batch=batch, crop=Crop(image_size=32, transform=transform), **overrides
    )


def check_copies(rows, k=3, epoch=0):
    """Each key's copies carry repeat numbers 0..n-1, each once; returns copies per key."""
    per_key = defaultdict(set)
    for key, pixels in rows:
        per_key[key].add(pixels)
    for key, seen in per_key.items():
        assert seen == {tag(key, r, epoch) for r in range(len(seen))}, key
    assert len(rows) == sum(len(s) for s in per_key.values())  # no copy twice
    return Counter({key: len(seen) for key, seen in per_key.items()})


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_delivers_k_copies_with_repeats_0_to_k_minus_1(shard_dir, world, workers):
    rows, lengths = [], set()
    for rank in range(world):
        options = dict(
            rank=rank, world_size=world, workers=Workers(count=workers, persistent=False)
        )
        loader = repeated(shard_dir, **options)
        plain = loader_for(shard_dir, **options)
        batches = tagged(loader)
        assert len(batches) == len(loader) == len(plain)  # the epoch keeps its length
        lengths.add(sum(map(len, batches)))
        rows += [row for batch in batches for row in batch]
    assert lengths == {192 // world}  # 194 samples: 24 batches of 8 over the ranks
    counts = check_copies(rows)
    assert set(counts.values()) == {3} and len(counts) == 64


def test_the_copies_of_a_sample_are_cropped_differently(shard_dir):
    loader = repeated(shard_dir, transform=None)
    crops = defaultdict(set)
    for images, _, keys in loader:
        for image, key in zip(images, keys, strict=True):
            crops[key].add(image.numpy().tobytes())
    assert len(crops) == 64 and all(len(c) == 3 for c in crops.values())


def test_a_mid_epoch_resume_continues_the_identical_copies(shard_dir):
    full = tagged(repeated(shard_dir, workers=Workers(count=2, persistent=False)))
    interrupted = repeated(shard_dir, workers=Workers(count=2, persistent=False))
    head = tagged(interrupted, limit=5)
    state = interrupted.state_dict()
    assert state["segments"][0]["aug_repeats"] == 3
    resumed = repeated(shard_dir, workers=Workers(count=2, persistent=False))
    resumed.load_state_dict(state)
    assert head + tagged(resumed) == full


def test_a_resume_from_two_ranks_on_one_loses_and_doubles_no_copy(shard_dir):
    options = dict(drop_last=False)
    full, head, states = [], [], []
    for rank in range(2):
        two = dict(rank=rank, world_size=2, workers=Workers(count=2, persistent=False), **options)
        full += [row for batch in tagged(repeated(shard_dir, **two)) for row in batch]
        loader = repeated(shard_dir, **two)
        head += [row for batch in tagged(loader, limit=3) for row in batch]
        states.append(loader.state_dict())
    assert states[0] == states[1]
    single = repeated(shard_dir, workers=Workers(count=1, persistent=False), **options)
    single.load_state_dict(states[0])
    rest = [row for batch in tagged(single) for row in batch]
    assert Counter(head + rest) == Counter(full) and len(set(full)) == len(full) == 194
    counts = check_copies(head + rest)
    assert sorted(counts.values()) == [2] + [3] * 64  # 194 copies: the last sample gets 2


def test_each_epoch_selects_other_samples(shard_dir):
    loader = repeated(shard_dir)
    first = {k for keys in epoch_keys(loader) for k in keys}
    loader.set_epoch(1)
    second = check_copies([row for batch in tagged(loader) for row in batch], epoch=1)
    assert len(first) == len(second) == 64 and set(second) != first


def test_the_loader_says_what_an_epoch_reads(shard_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pipeline"):
        repeated(shard_dir, world_size=2, rank=1)
    assert (
        "aug_repeats 3: each epoch reads 64 of the 194 samples, 3 times each (192 copies "
        "over 2 ranks, the epoch's plain length)"
    ) in caplog.messages


def test_evaluation_reads_each_sample_once_whatever_aug_repeats_says(shard_dir):
    evaluation = repeated(shard_dir, transform=None, train=False)
    assert epoch_keys(evaluation) == epoch_keys(loader_for(shard_dir, train=False))


# One loader epoch's key order with aug_repeats=1 (batch 8, 2 workers, seed 11), recorded
# before repeats existed.
PLAIN_KEYS_SHA256 = "40ef847e736b865db96f512e1b5bd0d7efe2cd5eb7d19ca5c8abcb6c7580813a"


def test_aug_repeats_1_leaves_the_loaders_order_and_state_as_they_were(shard_dir):
    loader = repeated(shard_dir, k=1, transform=None, workers=Workers(count=2, persistent=False))
    keys = epoch_keys(loader)
    assert hashlib.sha256(json.dumps(keys).encode()).hexdigest() == PLAIN_KEYS_SHA256
    assert list(loader.state_dict()["segments"][0]) == [
        "world_size", "num_workers", "batch_size", "drop_last", "rule", "shuffle_buffer",
        "shuffle_initial", "consumed",
    ]  # fmt: skip
