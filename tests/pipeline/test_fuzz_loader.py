"""Fuzzed shards inside a real loader: the good shards beside a mutant are never hurt.

Each case puts one mutant of a real shard (tests/shards/test_fuzz.py's mutator)
between good shards of the session dataset, declared in a manifest that still
describes the original, and reads one epoch. Invariants: the epoch has its planned
length, every key of the good shards is delivered, the only repeats are the
counted refills, and the damage shows up as counted skips, never an exception.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter

import pytest

from pipeline.config import Batching, Workers
from shards.tar import iter_tar_samples
from tests.pipeline.conftest import epoch_keys, loader_for
from tests.shards.test_fuzz import mutate_tar

CASES = 60


def keys_of(path) -> list[str]:
    with open(path, "rb") as stream:
        return [s["__key__"] for s in iter_tar_samples(stream, str(path), fields=frozenset())]


@pytest.mark.timeout(300)
def test_good_shards_beside_a_mutant_are_delivered_whole(shard_dir, tmp_path):
    document = json.loads((shard_dir / "manifest.json").read_text())
    shards = document["splits"]["train"]["shards"]
    names = [s["files"]["tar"]["name"] for s in shards]
    planned = sum(s["samples"] for s in shards)
    outcomes: Counter = Counter()
    for case in range(CASES):
        rng = random.Random(f"loader-fuzz:{case}")
        work = tmp_path / f"case{case}"
        shutil.copytree(shard_dir, work)
        victim = rng.randrange(len(names))
        good = Counter(k for i, n in enumerate(names) if i != victim for k in keys_of(work / n))
        target = work / names[victim]
        target.write_bytes(mutate_tar(rng, target.read_bytes()))
        loader = loader_for(
            work,
            batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
            workers=Workers(count=rng.choice([0, 2])),
            max_skip_fraction=1.0,
        )
        keys = Counter(k for batch in epoch_keys(loader) for k in batch)
        stats = loader.stats
        assert sum(keys.values()) == planned, f"case {case}: the epoch changed length"
        assert all(keys[k] >= 1 for k in good), f"case {case}: a good shard lost samples"
        assert sum(keys.values()) - len(keys) == stats.refilled, f"case {case}: uncounted repeats"
        lost = sum(stats.skipped.values())
        assert lost == stats.refilled, f"case {case}: refills do not match skips"
        outcomes.update(stats.bad_shards or {"clean": 1})
        shutil.rmtree(work)
    assert outcomes["clean"] < CASES / 2  # the mutants did damage, and it was counted
