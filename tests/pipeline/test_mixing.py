"""Weighted sources on real shards: exact quotas, per-batch shares, resume, keys, classes."""

from __future__ import annotations

import itertools
import json
import shutil
from collections import Counter

import numpy as np
import pytest

from pipeline import Batching, Mixing, Source, Workers
from pipeline.epoch import Mix, SourceEpoch, interleave_counts, plan_epoch
from pipeline.mixing import source_quotas
from pipeline.plan import Partition
from pipeline.positions import EpochLayout, Runs
from preprocess.job import run_build
from shards.errors import UsageError
from shards.manifest import read_manifest
from tests.conftest import small_build_config
from tests.pipeline.conftest import epoch_keys, loader_for
from tests.pipeline.test_loader import split_keys

EXACT = dict(
    batch=Batching(size=8, epoch_rule="uneven", drop_last=False)
)  # every planned sample delivered


def mix_of(shard_dir, train, val, **extra):
    """The session dataset's train and val splits as two sources of a mix."""
    return [
        Source(shard_dir, name="tr", **train, **extra),
        Source(shard_dir, split="val", name="va", **val, **extra),
    ]


def keys_of(batches):
    return [key for keys in batches for key in keys]


@pytest.fixture(scope="module")
def two_class_dir(sample_dir, tmp_path_factory):
    """A second dataset holding only the session sample's last two classes (ids 0, 1)."""
    root = tmp_path_factory.mktemp("two_class")
    images = root / "images"
    for name in sorted(p.name for p in sample_dir.iterdir())[2:]:
        (images / name).mkdir(parents=True)
        for path in sorted((sample_dir / name).iterdir())[:8]:
            shutil.copy(path, images / name / path.name)
    run_build(small_build_config(images, root / "out", val_fraction=0.0, shard_size=5))
    return root / "out"


def test_a_source_takes_exactly_one_share_and_a_valid_name():
    with pytest.raises(UsageError, match="exactly one of weight, samples or repeat"):
        Source("data/a")
    with pytest.raises(UsageError, match="exactly one of weight, samples or repeat"):
        Source("data/a", weight=1, repeat=2)
    with pytest.raises(UsageError, match="Source.samples must be an integer"):
        Source("data/a", samples=0)
    with pytest.raises(UsageError, match="Source.name must be letters"):
        Source("data/a", weight=1, name="a/b")
    assert Source("s3://big/manifest.json", weight=0.7).label == "big"
    assert Source("data/curated", weight=0.3).label == "curated"
    assert Source("s3://b/web/tar/train-{000..009}.tar", repeat=1).label == "web"
    assert "secret" not in repr(Source("https://u:secret@host/d/manifest.json", weight=1))


def test_quotas_are_exact_and_sum_to_the_epoch():
    sources = [Source("a", weight=0.7), Source("b", weight=0.2), Source("c", weight=0.1)]
    assert source_quotas(sources, [100, 50, 7], None) == (110, 31, 16)  # 157 shared out
    assert sum(source_quotas(sources, [1, 1, 1], 1001)) == 1001
    assert source_quotas([Source("a", samples=5), Source("b", repeat=2.5)], [9, 3], None) == (
        5,
        8,
    )
    with pytest.raises(UsageError, match="give every source of a mix a weight, or none"):
        source_quotas([Source("a", weight=1), Source("b", samples=3)], [5, 5], None)
    with pytest.raises(UsageError, match="named alike"):
        source_quotas([Source("x/a", weight=1), Source("y/a", weight=1)], [5, 5], None)
    with pytest.raises(UsageError, match="get no sample"):
        source_quotas([Source("a", weight=1000), Source("b", weight=1)], [5, 5], None)


@pytest.mark.parametrize("sizes", [(700, 300), (13, 987), (5, 5)])
def test_two_sources_hold_their_rounded_share_in_every_stretch(sizes):
    counts = interleave_counts(np.arange(sum(sizes) + 1), sizes)
    assert counts[:, -1].tolist() == list(sizes)
    for length in (7, 16, 100):
        window = counts[:, length:] - counts[:, :-length]
        share = np.array(sizes) * length / sum(sizes)
        assert (window >= np.floor(share)[:, None]).all()
        assert (window <= np.ceil(share)[:, None]).all()


def test_the_mixed_plan_shares_out_every_quota_over_ranks_and_workers():
    mix = Mix(("a", "b"), (np.array([7, 9, 5]), np.array([4, 6])), (50, 13))
    for world, workers in ((1, 1), (2, 3), (3, 2)):
        part = Partition(world, workers, 4, False, "uneven")
        per_source = Counter()
        for rank in range(world):
            plan = plan_epoch(mix, part, rank, 1, 2, ())
            for role in range(workers):
                for slot in plan.worker(role).parts:
                    per_source[slot.name] += sum(p.stop - p.start for p in slot.pieces)
        assert per_source == {"a": 50, "b": 13}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("seed,epoch", [(11, 0), (3, 4)])
def test_each_source_gives_exactly_its_quota_every_sample_floor_or_ceil_times(
    shard_dir, world, seed, epoch
):
    sources = mix_of(shard_dir, dict(repeat=1.5), dict(samples=20))
    train, val = split_keys(shard_dir, "train"), split_keys(shard_dir, "val")
    delivered = Counter()
    for rank in range(world):
        loader = loader_for(
            shard_dir, source=sources, seed=seed, rank=rank, world_size=world, **EXACT
        )
        loader.set_epoch(epoch)
        delivered.update(keys_of(epoch_keys(loader)))
    per_source = Counter(key.split("/")[0] for key in delivered.elements())
    assert per_source == {"tr": len(train) * 3 // 2, "va": 20}
    assert {delivered[f"tr/{key}"] for key in train} == {1, 2}  # 1.5 passes: once or twice
    assert set(delivered) <= {f"tr/{k}" for k in train} | {f"va/{k}" for k in val}
    assert max(delivered[f"va/{key}"] for key in val) == 1  # a subset: none twice


def test_an_under_sampled_source_shows_all_of_itself_over_epochs(shard_dir):
    val = split_keys(shard_dir, "val")
    quota = len(val) // 4
    sources = mix_of(shard_dir, dict(samples=8), dict(samples=quota))
    loader = loader_for(shard_dir, source=sources, **EXACT)
    epochs = -(-len(val) // quota)
    subsets = [
        [k for k in keys_of(epoch_keys(loader)) if k.startswith("va/")] for _ in range(epochs)
    ]
    assert all(len(set(subset)) == len(subset) == quota for subset in subsets)
    assert len(set().union(*subsets[:-1])) == quota * (epochs - 1)  # a new part each epoch
    assert len(set().union(*subsets)) == len(val)  # and all of it within ceil(size / quota)


def test_every_batch_holds_each_sources_rounded_share(shard_dir):
    sources = mix_of(
        shard_dir,
        dict(weight=0.7),
        dict(weight=0.3),
    )
    loader = loader_for(
        shard_dir,
        source=sources,
        mixing=Mixing(epoch_samples=160),
        batch=Batching(size=10),
        workers=Workers(count=2),
    )
    batches = epoch_keys(loader)
    assert len(batches) == 16
    assert {sum(k.startswith("va/") for k in keys) for keys in batches} == {3}
    assert loader.stats.summary()["sources"]["va"]["samples"] == 48


def test_single_source_batches_hold_one_source(shard_dir):
    sources = mix_of(shard_dir, dict(samples=64), dict(samples=32))
    loader = loader_for(shard_dir, source=sources, mixing=Mixing(batches="single"))
    batches = epoch_keys(loader)
    assert all(len({k.split("/")[0] for k in keys}) == 1 for keys in batches)
    assert Counter(keys[0].split("/")[0] for keys in batches) == {"tr": 8, "va": 4}


def test_order_is_deterministic_and_changes_every_epoch(shard_dir):
    sources = mix_of(shard_dir, dict(weight=2), dict(weight=1))
    first, again = (loader_for(shard_dir, source=sources) for _ in range(2))
    epoch0 = epoch_keys(first)
    assert epoch0 == epoch_keys(again)
    assert epoch_keys(first) != epoch0


@pytest.mark.parametrize("workers,stop_after", [(0, 5), (2, 3)])
def test_mid_epoch_resume_continues_the_identical_sequence(shard_dir, workers, stop_after):
    sources = mix_of(shard_dir, dict(repeat=1.25), dict(repeat=0.5))
    options = dict(source=sources, workers=Workers(count=workers, persistent=False))
    full = epoch_keys(loader_for(shard_dir, **options))
    interrupted = loader_for(shard_dir, **options)
    head = epoch_keys(interrupted, limit=stop_after)
    resumed = loader_for(shard_dir, **options)
    resumed.load_state_dict(interrupted.state_dict())
    assert head + epoch_keys(resumed) == full


def test_resume_on_another_world_size_gives_the_identical_remaining_multiset(shard_dir):
    sources = mix_of(shard_dir, dict(repeat=1.5), dict(samples=30))
    options = dict(source=sources, workers=Workers(count=2, persistent=False), **EXACT)
    full, consumed, states = Counter(), Counter(), []
    for rank in range(2):
        full.update(keys_of(epoch_keys(loader_for(shard_dir, rank=rank, world_size=2, **options))))
        loader = loader_for(shard_dir, rank=rank, world_size=2, **options)
        consumed.update(keys_of(epoch_keys(loader, limit=3)))
        states.append(loader.state_dict())
    assert states[0] == states[1]
    rests = []
    for _ in range(2):  # restarted twice on 3 ranks: the same remaining sequence each time
        rest = []
        for rank in range(3):
            loader = loader_for(shard_dir, rank=rank, world_size=3, **options)
            loader.load_state_dict(states[0])
            rest.append(epoch_keys(loader))
        rests.append(rest)
    assert rests[0] == rests[1]
    assert consumed + Counter(k for rank in rests[0] for k in keys_of(rank)) == full


def test_a_state_of_another_mix_is_refused(shard_dir):
    state = loader_for(shard_dir, source=mix_of(shard_dir, dict(weight=1), dict(weight=1)))
    other = loader_for(shard_dir, source=mix_of(shard_dir, dict(weight=2), dict(weight=1)))
    with pytest.raises(ValueError, match="another mix of sources"):
        other.load_state_dict(state.state_dict())


def test_classes_are_unified_by_name_across_sources(shard_dir, two_class_dir):
    sources = [
        Source(shard_dir, samples=40, name="four"),
        Source(two_class_dir, repeat=1, name="two"),
    ]
    loader = loader_for(shard_dir, source=sources, **EXACT)
    classes = read_manifest(shard_dir).classes
    assert loader.source.classes == classes
    names = {}  # key -> class name, from each dataset's own shards
    for name, directory in (("four", shard_dir), ("two", two_class_dir)):
        manifest = read_manifest(directory)
        probe = loader_for(directory, train=False, **EXACT)
        for _, labels, keys in probe:
            for label, key in zip(labels.tolist(), keys, strict=True):
                names[f"{name}/{key}"] = manifest.classes[label]
    seen = Counter()
    for _, labels, keys in loader:
        for label, key in zip(labels.tolist(), keys, strict=True):
            assert classes[label] == names[key]
            seen[key.split("/")[0]] += 1
    assert seen["two"] == len(split_keys(two_class_dir, "train"))


@pytest.fixture(scope="module")
def label_free_dir(sample_dir, tmp_path_factory):
    """Image-text pairs built with `--label none`: no class labels at all."""
    root = tmp_path_factory.mktemp("label_free")
    rows = []
    for index, path in enumerate(sorted(sample_dir.glob("*/*.jpg"))[:12]):
        shutil.copy(path, root / f"{index:03d}.jpg")
        rows.append(json.dumps({"path": f"{index:03d}.jpg", "text": f"picture {index}"}))
    (root / "pairs.jsonl").write_text("\n".join(rows) + "\n")
    config = small_build_config(
        root / "pairs.jsonl", root / "out", label="none", fields=("text:txt",), val_fraction=0.0
    )
    run_build(config)
    return root / "out"


def test_a_label_asked_of_a_label_free_source_is_one_clear_error(shard_dir, label_free_dir):
    sources = [Source(shard_dir, weight=1, name="labelled"), Source(label_free_dir, weight=1)]
    with pytest.raises(UsageError, match="source 'out': .* has no class labels"):
        loader_for(shard_dir, source=sources)
    loader = loader_for(shard_dir, source=sources, fields=("image",), **EXACT)
    keys = [k for _, batch in loader for k in batch]
    half = (len(split_keys(shard_dir, "train")) + len(split_keys(label_free_dir, "train"))) // 2
    assert Counter(k.split("/")[0] for k in keys) == {"labelled": half, "out": half}


def test_a_bad_shard_is_counted_against_its_own_source(shard_copy):
    target = sorted((shard_copy / "tar").glob("train-*.tar"))[0]
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    sources = mix_of(shard_copy, dict(repeat=1), dict(repeat=1))
    loader = loader_for(shard_copy, source=sources, max_skip_fraction=0.5, **EXACT)
    keys = keys_of(epoch_keys(loader))
    stats = loader.stats.summary()["sources"]
    assert stats["tr"]["skipped"] == sum(loader.stats.skipped.values()) > 0
    assert stats["va"]["skipped"] == 0
    # The lost samples' places are refilled from recent good ones, counted where they came from.
    assert (
        stats["tr"]["samples"] + stats["va"]["samples"] == len(keys) == loader.source.total_samples
    )
    assert stats["va"]["samples"] >= len(split_keys(shard_copy, "val"))
    assert stats["tr"]["samples"] == sum(k.startswith("tr/") for k in keys)


def test_sources_of_different_formats_mix(shard_dir):
    sources = [
        Source(shard_dir, samples=40, format="parquet", name="pq"),
        Source(shard_dir, split="val", samples=24, format="tar", name="tar"),
    ]
    keys = keys_of(epoch_keys(loader_for(shard_dir, source=sources, **EXACT)))
    assert Counter(k.split("/")[0] for k in keys) == {"pq": 40, "tar": 24}
    assert {k.split("/", 1)[1] for k in keys if k.startswith("pq/")} <= set(
        split_keys(shard_dir, "train")
    )


def planning_calls(monkeypatch, quota):
    """Shard orders built to plan a worker of a mix whose source `a` (24 samples in 3
    shards) gives `quota` samples, and to list its fetch plan; then those its first 50
    pieces cost (whole passes are laid out as they are read)."""
    built = Counter()
    original = EpochLayout.build

    def counted(*args, **kwargs):
        built["layouts"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(EpochLayout, "build", staticmethod(counted))
    mix = Mix(("a", "b"), (np.array([8, 0, 8, 8]), np.array([5, 5])), (quota, 10))
    slot = plan_epoch(mix, Partition(1, 2, 8, False, "uneven", 64, 16), 0, 3, 1, ()).worker(0)
    part = slot.parts[0]
    built["ahead"] = len(list(part.pieces.ahead()))
    planned = built["layouts"]
    assert len(list(itertools.islice(part.pieces, 50))) == 50
    assert built["layouts"] - planned <= 50 // 3 + 2  # one a pass read, 3 pieces a pass
    return planned, built["ahead"]


def test_an_over_sampled_source_plans_whole_passes_as_a_count(monkeypatch):
    """Whole passes are k passes and a remainder, laid out as the stream reaches them:
    planning work does not grow with the quota (before: one layout per pass, 35 s to the
    first batch at 10^6 samples of 24)."""
    layouts, ahead = planning_calls(monkeypatch, 10**5)
    assert planning_calls(monkeypatch, 10**7) == planning_calls(monkeypatch, 10**12)
    assert max(layouts, planning_calls(monkeypatch, 10**3)[0]) <= 8 and ahead <= 2 * 3


def reference_places(epoch, positions):
    """(shard, offset, pass) of each quota position, one at a time from the layouts."""
    key = f"{epoch.seed}:{epoch.name}"
    out, full = [], epoch.passes * epoch.size
    for q in positions:
        if q < full:
            repeat, at = divmod(q, epoch.size)
            name = epoch.epoch if repeat == 0 else f"{epoch.epoch}.{repeat}"
            layout = EpochLayout.build(epoch.counts, key, name)
        else:
            repeat, at = epoch.passes, (epoch.offset + q - full) % epoch.size
            layout = EpochLayout.build(epoch.counts, key, "rest")
        piece = layout.pieces(Runs.span(at, at + 1))[0]
        out.append((piece.shard, piece.start, repeat))
    return out


@pytest.mark.parametrize("quota", [7, 10, 23, 47, 60])
def test_lazy_passes_place_every_quota_position_as_the_layouts_do(quota):
    epoch = SourceEpoch("a", np.array([3, 0, 5, 2]), quota, seed=4, epoch=3)
    cuts = sorted({0, quota} | {c for c in (4, 7, 20, 31, 33, 41) if c < quota})
    runs = Runs(cuts[:-1:2], cuts[1::2])  # every other stretch, across pass boundaries
    got = [
        (p.shard, offset, repeat)
        for p, repeat, _ in epoch.pieces(runs).iter_copies()
        for offset in range(p.start, p.stop)
    ]
    assert got == reference_places(epoch, runs.to_array().tolist())


@pytest.mark.parametrize(
    "sources,epoch_samples,named",
    [
        ([Source("a", samples=2**63), Source("b", samples=5)], None, "'a': samples"),
        ([Source("a", samples=5), Source("b", repeat=1e300)], None, "'b': repeat"),
        ([Source("a", weight=1), Source("b", weight=2)], 2**60, "Mixing.epoch_samples"),
        ([Source("a", samples=2**52 + 1), Source("b", samples=2**52)], None, "sum to"),
    ],
)
def test_a_quota_past_what_a_mix_can_plan_is_one_line(sources, epoch_samples, named):
    with pytest.raises(UsageError) as caught:
        source_quotas(sources, [24, 10], epoch_samples)
    assert named in str(caught.value) and "2**53" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_interleave_is_exact_past_int64_products():
    """Two sources of 4 and 3 billion: `points x size` passes 2**63; counts stay exact."""
    sizes = [4 * 10**9, 3 * 10**9]
    points = np.array([0, 1, 10**9, 7 * 10**9 - 1, 7 * 10**9])
    counts = interleave_counts(points, sizes)
    assert counts.sum(axis=0).tolist() == points.tolist()
    exact = [(p * sizes[0] + 7 * 10**9 // 2) // (7 * 10**9) for p in points.tolist()]
    assert counts[0].tolist() == exact


@pytest.mark.parametrize(
    "train,val,mixing,quotas",
    [
        (dict(repeat=1), dict(samples=10**7), Mixing(), (194, 10**7)),
        (dict(repeat=1), dict(repeat=1e6), Mixing(), (194, 46 * 10**6)),
        (dict(weight=1), dict(weight=3), Mixing(epoch_samples=10**12), (25 * 10**10, 75 * 10**10)),
    ],
    ids=["samples", "repeat", "epoch_samples"],
)
def test_a_source_read_a_million_times_its_size_gives_a_first_batch(
    shard_dir, train, val, mixing, quotas
):
    """Before: O(quota / size) planning per worker, minutes (or hours) to the first batch."""
    sources = mix_of(shard_dir, train, val)
    loader = loader_for(shard_dir, source=sources, mixing=mixing, workers=Workers(count=2), **EXACT)
    assert loader.source.quotas == quotas and len(loader) == -(-sum(quotas) // 8)
    images, labels, keys = next(iter(loader))
    assert len(keys) == 8 and images.shape[0] == 8
    assert {key.split("/")[0] for key in keys} <= {"tr", "va"}
