"""Tampered loader states: every state is either a possible point of this epoch for this
dataset, which resumes exactly, or one clear `LoaderStateError` naming the field.

The table holds the malformed states (wrong types, missing or extra keys, bad nesting)
and the out-of-range values issue 29 found loading silently; the fuzz mutates a real
state's fields at random (seeded) and holds every outcome to the same two answers.
"""

from __future__ import annotations

import copy
import random
from collections import Counter

import pytest

from pipeline import Batching, Source, Workers
from pipeline.plan import LoaderStateError
from tests.pipeline.conftest import epoch_keys, loader_for

DROP = object()  # a table value: remove the key
EXACT = dict(
    batch=Batching(size=8, epoch_rule="uneven", drop_last=False)
)  # every sample of the epoch delivered


def loader_at(shard_dir, stop_after=2, **options):
    """A loader that delivered `stop_after` batches, and its state."""
    loader = loader_for(shard_dir, **EXACT, **options)
    epoch_keys(loader, limit=stop_after)
    return loader, loader.state_dict()


def edited(state, path, value):
    """`state` with the item at `path` (keys and list indices) set to `value`, or removed."""
    state = copy.deepcopy(state)
    *parents, last = path
    target = state
    for step in parents:
        target = target[step]
    if value is DROP:
        del target[last]
    else:
        target[last] = value
    return state


SEGMENT = ("segments", 0)

# (path, value, the field the message must name): each state is malformed.
MALFORMED = [
    ((("version",), DROP, "version")),
    ((("epoch",), DROP, "epoch")),
    ((("seed",), DROP, "seed")),
    ((("total_samples",), DROP, "total_samples")),
    ((("segments",), DROP, "segments")),
    ((("extra",), 1, "extra")),
    ((("version",), "1", "version")),
    ((("version",), 1.0, "version")),
    ((("version",), True, "version")),
    ((("version",), None, "version")),
    ((("epoch",), 0.0, "epoch")),
    ((("epoch",), "0", "epoch")),
    ((("epoch",), None, "epoch")),
    ((("seed",), "11", "seed")),
    ((("seed",), 11.0, "seed")),
    ((("seed",), None, "seed")),
    ((("total_samples",), "48", "total_samples")),
    ((("total_samples",), None, "total_samples")),
    ((("segments",), None, "segments")),
    ((("segments",), {}, "segments")),
    ((("segments",), "segments", "segments")),
    ((("segments",), [], "segments")),
    ((SEGMENT, None, "segments[0]")),
    ((SEGMENT, 5, "segments[0]")),
    ((SEGMENT, [1, 1, 8, False, "uneven", 64, 16, 2], "segments[0]")),
    (((*SEGMENT, "consumed"), DROP, "segments[0].consumed")),
    (((*SEGMENT, "world_size"), DROP, "segments[0].world_size")),
    (((*SEGMENT, "extra"), 0, "segments[0].extra")),
    (((*SEGMENT, "drop_last"), "yes", "segments[0].drop_last")),
    (((*SEGMENT, "drop_last"), 1, "segments[0].drop_last")),
    (((*SEGMENT, "rule"), "shuffle", "segments[0].rule")),
    (((*SEGMENT, "rule"), None, "segments[0].rule")),
    (((*SEGMENT, "consumed"), 2.0, "segments[0].consumed")),
    (((*SEGMENT, "consumed"), "2", "segments[0].consumed")),
    (((*SEGMENT, "consumed"), None, "segments[0].consumed")),
    (((*SEGMENT, "batch_size"), 8.0, "segments[0].batch_size")),
    (((*SEGMENT, "world_size"), "1", "segments[0].world_size")),
    (((*SEGMENT, "num_workers"), None, "segments[0].num_workers")),
    (((*SEGMENT, "shuffle_buffer"), True, "segments[0].shuffle_buffer")),
]

# Well-formed values that describe no point of this epoch.
OUT_OF_RANGE = [
    ((*SEGMENT, "consumed"), -1, "segments[0].consumed"),
    ((*SEGMENT, "consumed"), -(10**6), "segments[0].consumed"),
    ((*SEGMENT, "consumed"), 2**63, "segments[0].consumed"),
    ((*SEGMENT, "consumed"), 2**70, "segments[0].consumed"),
    ((*SEGMENT, "consumed"), True, "segments[0].consumed"),
    ((*SEGMENT, "consumed"), 10**6, "segments[0].consumed"),
    ((*SEGMENT, "consumed"), 26, "segments[0].consumed"),  # one past this rank's 25 batches
    ((*SEGMENT, "batch_size"), 10**9, "segments[0].consumed"),  # 2 batches of one
    ((*SEGMENT, "batch_size"), 0, "segments[0].batch_size"),
    ((*SEGMENT, "batch_size"), -8, "segments[0].batch_size"),
    ((*SEGMENT, "world_size"), 0, "segments[0].world_size"),
    ((*SEGMENT, "world_size"), 10**5, "segments[0].world_size"),
    ((*SEGMENT, "num_workers"), 0, "segments[0].num_workers"),
    ((*SEGMENT, "num_workers"), 2**63, "segments[0].num_workers"),
    ((*SEGMENT, "shuffle_buffer"), 0, "segments[0].shuffle_buffer"),
    ((*SEGMENT, "shuffle_initial"), -1, "segments[0].shuffle_initial"),
    (("epoch",), -1, "epoch"),
    (("epoch",), 2**63, "epoch"),
    (("epoch",), 2**70, "epoch"),
    (("epoch",), True, "epoch"),
    (("version",), 2, "version"),
    (("seed",), 12, "seed"),
    (("total_samples",), 195, "total_samples"),
    (("total_samples",), True, "total_samples"),
]


def assert_refused(loader, state, field):
    before = (loader.epoch, list(loader.segments), loader.consumed)
    with pytest.raises(LoaderStateError) as caught:
        loader.load_state_dict(state)
    message = str(caught.value)
    assert message.startswith("loader state") and "\n" not in message
    assert field in message
    assert (loader.epoch, list(loader.segments), loader.consumed) == before  # left as it was


def test_the_session_split_is_what_the_table_assumes(shard_dir):
    loader, state = loader_at(shard_dir)
    assert state["total_samples"] == 194 and len(loader) == 25  # batches of 8
    assert state["segments"][0]["consumed"] == 2


@pytest.mark.parametrize("path,value,field", MALFORMED + OUT_OF_RANGE)
def test_a_tampered_state_is_one_clear_error_naming_the_field(shard_dir, path, value, field):
    _, state = loader_at(shard_dir)
    assert_refused(loader_for(shard_dir, **EXACT), edited(state, path, value), field)


@pytest.mark.parametrize("state", [None, [], "state", 5, b"\x00"])
def test_a_state_that_is_not_a_dict_is_refused(shard_dir, state):
    assert_refused(loader_for(shard_dir, **EXACT), state, "not a dict")


def test_too_many_segments_are_refused(shard_dir):
    _, state = loader_at(shard_dir)
    state["segments"] = state["segments"] * 9
    assert_refused(loader_for(shard_dir, **EXACT), state, "segments")


def test_a_segment_past_what_remains_after_the_earlier_ones_is_refused(shard_dir):
    """Two ranks read 13 batches each (all 194 samples), then one more on one rank."""
    _, state = loader_at(shard_dir)
    both = dict(state["segments"][0], world_size=2, consumed=13)
    state["segments"] = [both, dict(both, world_size=1, consumed=1)]
    loader = loader_for(
        shard_dir, workers=Workers(count=2), **EXACT
    )  # another partition: both replayed
    assert_refused(loader, state, "segments[1].consumed")


@pytest.mark.parametrize("world,workers", [(10**5, 10**3), (10**5, 1), (2**62, 2**62)])
def test_a_segment_whose_replay_walks_more_slots_than_the_epoch_is_refused(
    shard_dir, world, workers
):
    _, state = loader_at(shard_dir)
    state["segments"][0].update(world_size=world, num_workers=workers, consumed=1)
    assert_refused(loader_for(shard_dir, **EXACT), state, "segments[0].world_size")


def test_a_segment_of_a_billion_workers_replays_only_the_slots_that_read(shard_dir):
    """One batch read under 10^9 workers: only slot 0 read, so the replay walks that slot,
    never a list of every slot, and the rest of the epoch is the other 186 samples once."""
    full = Counter(k for b in epoch_keys(loader_for(shard_dir, **EXACT)) for k in b)
    _, state = loader_at(shard_dir, stop_after=1)
    state["segments"][0]["num_workers"] = 10**9
    resumed = loader_for(shard_dir, **EXACT)
    resumed.load_state_dict(state)
    rest = Counter(k for b in epoch_keys(resumed) for k in b)
    assert sum(rest.values()) == len(rest) == 194 - 8 and not rest - full


def test_a_segment_that_read_nothing_costs_nothing_whatever_its_world(shard_dir):
    """A segment of 2**62 ranks that consumed no batch replays nothing: it loads at once."""
    full = Counter(k for b in epoch_keys(loader_for(shard_dir, **EXACT)) for k in b)
    head, state = loader_at(shard_dir)
    state["segments"].insert(0, dict(state["segments"][0], world_size=2**62, consumed=0))
    resumed = loader_for(shard_dir, **EXACT)
    resumed.load_state_dict(state)
    rest = Counter(k for b in epoch_keys(resumed) for k in b)
    assert sum(rest.values()) == len(rest) == 194 - 16 and not rest - full


def mixed_options(shard_dir):
    sources = [
        Source(shard_dir, name="tr", repeat=1.5),
        Source(shard_dir, split="val", name="va", samples=30),
    ]
    return dict(source=sources, workers=Workers(count=0))


@pytest.mark.parametrize(
    "path,value,field",
    [
        (("sources",), DROP, "sources"),
        (("sources",), None, "sources"),
        (("sources", 0), "tr", "sources"),
        (("sources", 0, 3), True, "sources"),  # unit 1 spelled True
        (("sources", 1, 2), 31, "sources"),
        ((*SEGMENT, "consumed"), 10**6, "segments[0].consumed"),
        ((*SEGMENT, "world_size"), 10**5, "segments[0].world_size"),
    ],
)
def test_a_tampered_mix_state_is_one_clear_error(shard_dir, path, value, field):
    options = mixed_options(shard_dir)
    _, state = loader_at(shard_dir, **options)
    assert_refused(loader_for(shard_dir, **EXACT, **options), edited(state, path, value), field)


def test_a_mix_state_on_a_single_source_loader_names_the_extra_key(shard_dir):
    _, state = loader_at(shard_dir, **mixed_options(shard_dir))
    state["total_samples"] = 48
    assert_refused(loader_for(shard_dir, **EXACT), state, "sources")


MUTATIONS = [
    DROP,
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    3,
    4,
    5,
    7,
    8,
    12,
    16,
    24,
    25,
    64,
    "drop",
    10**6,
    2**63,
    -(2**70),
    0.5,
    2.0,
    "1",
    "uneven",
    "pad",
    [],
    {},
]


def leaves(state, prefix=()):
    """Every path to a key or item of `state`, containers included."""
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for key, value in items:
        yield (*prefix, key)
        if isinstance(value, dict | list):
            yield from leaves(value, (*prefix, key))


@pytest.mark.parametrize("mixed", [False, True], ids=["one-source", "mix"])
def test_fuzzed_states_resume_exactly_or_are_refused_in_one_line(shard_dir, mixed):
    """300 seeded mutations of a real state (one or two fields each): every outcome is a
    load whose epoch delivers exactly what the edited state says is left, or the error."""
    options = dict(**EXACT, **(mixed_options(shard_dir) if mixed else {}))
    _, state = loader_at(shard_dir, **(mixed_options(shard_dir) if mixed else {}))
    loader = loader_for(shard_dir, **options)
    full = Counter(k for b in epoch_keys(loader_for(shard_dir, **options)) for k in b)
    saved = loader_for(shard_dir, **options)
    saved.load_state_dict(state)
    reference = Counter(k for b in epoch_keys(saved) for k in b)
    paths = list(leaves(state))
    inner = [path for path in paths if path[0] == "segments" and len(path) == 3]
    rng = random.Random(29)
    outcomes = Counter()
    for _ in range(300):
        tampered = state
        for _ in range(rng.randint(1, 2)):
            path = rng.choice(inner if rng.random() < 0.7 else paths)
            try:
                tampered = edited(tampered, path, rng.choice(MUTATIONS))
            except (KeyError, IndexError, TypeError):
                continue  # an earlier mutation removed or replaced this path's parent
        try:
            loader.load_state_dict(tampered)
        except LoaderStateError as error:
            assert str(error).startswith("loader state") and "\n" not in str(error)
            outcomes["refused"] += 1
            continue
        outcomes["loaded"] += 1
        if loader.epoch != 0:
            continue  # a later epoch of the same data: resumes at its start
        outcomes["resumed"] += 1
        used, skipped = loader.epoch_plan().used, loader.consumed * 8  # batches of 8
        planned = used - min(skipped, used)
        rest = Counter(k for b in epoch_keys(loader) for k in b)
        assert not rest - full  # nothing from outside the epoch, nothing twice
        assert sum(rest.values()) == planned and loader.epoch == 1
        if tampered == state:  # a mutation that changed nothing resumes as the saved state
            assert rest == reference
        loader.set_epoch(0)
    assert outcomes["refused"] > 100 and outcomes["resumed"] > 20
