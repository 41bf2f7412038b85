"""Fields beyond image and class: captions, metadata, multi-label targets, weights, label-free shards.

The exactness, equal-batch, resume and refill checks of test_loader.py, run with extra
fields, plus shards written by webdataset's own `ShardWriter` (jpeg/png/webp + txt +
json, no cls) and the torch-free field helpers of `shards.sample`.
"""

from __future__ import annotations

import io
import itertools
import json
import pickle
import random
from collections import Counter
from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.config import Batching, Resampled, Workers
from shards.errors import UsageError
from shards.manifest import read_manifest
from shards.sample import (
    Field,
    SampleError,
    check_class_range,
    class_ranged_fields,
    collate_values,
    field_value,
    parse_json,
    resolve_fields,
)
from shards.tar import TarShardWriter, iter_tar_samples
from tests.pipeline.conftest import loader_for

NUM_TAGS = 6
TAGS = Field("tags", "multi_label", source="json", key="tags", num_classes=NUM_TAGS)
WEIGHT = Field("weight", "weight", source="json", key="weight")
EXTRA = ("image", "label", "txt", "json", TAGS, WEIGHT)


def tags_of(key: str) -> list[int]:
    """A sample's tags, a pure function of its key (0 to 3 of them)."""
    draw = random.Random(key)
    return sorted(draw.sample(range(NUM_TAGS), draw.randrange(4)))


def caption_of(key: str) -> str:
    return f"a photo of {key} – ünïcödé"


def weight_of(key: str) -> float:
    return float(len(key) % 5) / 2


def enrich(sample: dict) -> dict:
    """Our sample plus a caption and a metadata document with tags and a weight."""
    key = sample["__key__"]
    meta = json.loads(sample["json"])
    meta.update(tags=tags_of(key), weight=weight_of(key), label=int(sample["cls"]))
    return {
        "__key__": key,
        "jpg": sample["jpg"],
        "cls": sample["cls"],
        "txt": caption_of(key).encode("utf-8"),
        "json": json.dumps(meta).encode("utf-8"),
    }


def rewrite_tars(shard_dir, out, change=enrich) -> str:
    """The train tars re-written with `change` applied to each sample; a brace pattern."""
    out.mkdir(exist_ok=True)
    urls = read_manifest(shard_dir).shard_urls("train", "tar", str(shard_dir))
    for index, url in enumerate(urls):
        with open(url, "rb") as stream:
            samples = [change(s) for s in iter_tar_samples(stream, url)]
        with open(out / f"train-{index:06d}.tar", "wb") as file:
            writer = TarShardWriter(file)
            for sample in samples:
                if sample is not None:
                    writer.write(sample)
            writer.close()
    return str(out / f"train-{{000000..{len(urls) - 1:06d}}}.tar")


@pytest.fixture(scope="module")
def rich_shards(shard_dir, tmp_path_factory):
    return rewrite_tars(shard_dir, tmp_path_factory.mktemp("rich"))


@pytest.fixture(scope="module")
def rich_keys(shard_dir):
    urls = read_manifest(shard_dir).shard_urls("train", "tar", str(shard_dir))
    keys = []
    for url in urls:
        with open(url, "rb") as stream:
            keys += [s["__key__"] for s in iter_tar_samples(stream, url)]
    return keys


def field_batches(loader, limit=None):
    return list(itertools.islice(loader, limit))


def check_rows(batch) -> list[str]:
    """Every field of a batch belongs to the key in its row; returns the keys."""
    images, labels, texts, metas, tags, weights, keys = batch
    size = len(keys)
    assert images.dtype == torch.uint8 and images.shape == (size, 3, 32, 32)
    assert labels.dtype == torch.int64 and labels.shape == (size,)
    assert tags.dtype == torch.float32 and tags.shape == (size, NUM_TAGS)
    assert weights.dtype == torch.float32 and weights.shape == (size,)
    for row, key in enumerate(keys):
        assert texts[row] == caption_of(key)
        assert metas[row]["tags"] == tags_of(key) and isinstance(metas[row]["width"], int)
        assert torch.nonzero(tags[row]).flatten().tolist() == tags_of(key)
        assert weights[row].item() == weight_of(key)
        assert labels[row].item() == metas[row]["label"]
    return list(keys)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("workers", [0, 2])
def test_extra_fields_every_sample_exactly_once(rich_shards, rich_keys, world, workers):
    seen = Counter()
    for rank in range(world):
        loader = loader_for(
            rich_shards,
            fields=EXTRA,
            rank=rank,
            world_size=world,
            batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
            workers=Workers(count=workers, persistent=False),
        )
        for batch in loader:
            seen.update(check_rows(batch))
    assert seen == Counter(rich_keys)


def test_extra_fields_keep_the_order_and_pixels_of_image_and_label(rich_shards):
    plain = field_batches(loader_for(rich_shards, workers=Workers(count=2)))
    rich = field_batches(loader_for(rich_shards, workers=Workers(count=2), fields=EXTRA))
    assert [b[2] for b in plain] == [b[-1] for b in rich]
    for (images, labels, _), extra in zip(plain, rich, strict=True):
        assert torch.equal(images, extra[0]) and torch.equal(labels, extra[1])


def test_extra_fields_give_every_rank_the_same_batch_count(rich_shards):
    counts = []
    for rank in range(3):
        loader = loader_for(
            rich_shards,
            fields=EXTRA,
            rank=rank,
            world_size=3,
            batch=Batching(size=8, drop_last=True),
            workers=Workers(count=2, persistent=False),
        )
        batches = field_batches(loader)
        assert all(len(check_rows(b)) == 8 for b in batches) and len(batches) == len(loader)
        counts.append(len(batches))
    assert len(set(counts)) == 1


@pytest.mark.parametrize("workers,stop_after", [(0, 5), (2, 5), (3, 4)])
def test_extra_fields_resume_mid_epoch_with_the_identical_sequence(
    rich_shards, workers, stop_after
):
    options = dict(fields=EXTRA, workers=Workers(count=workers, persistent=False))
    full = [check_rows(b) for b in loader_for(rich_shards, **options)]
    interrupted = loader_for(rich_shards, **options)
    head = [check_rows(b) for b in field_batches(interrupted, stop_after)]
    resumed = loader_for(rich_shards, **options)
    resumed.load_state_dict(interrupted.state_dict())
    assert head + [check_rows(b) for b in resumed] == full


def spoiled(key: str) -> str | None:
    """What is wrong with a sample after `spoil`: a few in 23 get a bad field."""
    number = int.from_bytes(key.encode(), "big") % 23
    return {0: "bad_text", 1: "bad_json", 2: "bad_labels", 3: "bad_json"}.get(number)


def spoil(sample: dict) -> dict:
    """A bad caption, JSON document, tag list or nesting, per `spoiled`."""
    sample = enrich(sample)
    number = int.from_bytes(sample["__key__"].encode(), "big") % 23
    if number == 0:
        sample["txt"] = b"caption \xff\xfe not utf-8"
    elif number == 1:
        sample["json"] = b'{"tags": [1, 2'
    elif number == 2:
        sample["json"] = json.dumps({"tags": [NUM_TAGS], "weight": 1}).encode()
    elif number == 3:
        sample["json"] = b"[" * 40 + b"]" * 40
    return sample


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_fields_are_counted_skips_and_refilled(shard_dir, tmp_path, rich_keys, workers):
    pattern = rewrite_tars(shard_dir, tmp_path / "spoiled", spoil)
    loader = loader_for(
        pattern,
        fields=EXTRA,
        batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
        workers=Workers(count=workers),
        max_skip_fraction=0.5,
    )
    batches = field_batches(loader)
    keys = [k for batch in batches for k in check_rows(batch)]  # refills: fields aligned
    expected = Counter(spoiled(key) for key in rich_keys)
    del expected[None]
    assert sum(expected.values()) >= 4 and set(expected) == {"bad_text", "bad_json", "bad_labels"}
    assert loader.stats.skipped == dict(expected)
    assert loader.stats.refilled == sum(expected.values())
    # Every planned slot is filled: bad samples never, good ones once or as refills.
    assert len(keys) == len(rich_keys) and len(batches) == len(loader)
    assert {k for k in rich_keys if spoiled(k) is None} == set(keys)


def test_label_free_fields_read_shards_without_cls(shard_dir, tmp_path, rich_keys):
    def drop_cls(sample):
        sample = enrich(sample)
        del sample["cls"]
        return sample

    pattern = rewrite_tars(shard_dir, tmp_path / "nocls", drop_cls)
    loader = loader_for(
        pattern,
        fields=("image", "txt"),
        batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
    )
    keys = [k for images, texts, keys in loader for k in keys]
    assert sorted(keys) == sorted(rich_keys)
    # The default asks for a label: refused before any worker starts, not a skip per sample.
    with pytest.raises(UsageError, match="hold no class labels; .* fields=\\('image', 'txt'\\)"):
        loader_for(pattern)


# --- shards written by webdataset's own ShardWriter ---------------------------------------


def encoded_image(seed: int, fmt: str) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (40, 48, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def webdataset_shards(tmp_path_factory):
    """img2dataset-style shards from the real `webdataset.ShardWriter`: no cls anywhere."""
    wds = pytest.importorskip("webdataset")
    out = tmp_path_factory.mktemp("wds")
    kinds = ("jpeg", "png", "webp")
    keys = []
    with wds.ShardWriter(str(out / "part-%05d.tar"), maxcount=25, verbose=0) as writer:
        for index in range(70):
            key = f"{index:09d}"
            kind = kinds[index % 3]
            writer.write(
                {
                    "__key__": key,
                    kind: encoded_image(index, "JPEG" if kind == "jpeg" else kind.upper()),
                    "txt": f"caption {key}",
                    "json": {"key": key, "caption": f"caption {key}", "width": 48},
                }
            )
            keys.append(key)
    return str(out / "part-{00000..00002}.tar"), keys


@pytest.mark.parametrize("workers", [0, 2])
def test_webdataset_shardwriter_shards_stream_every_sample_once(webdataset_shards, workers):
    pattern, expected = webdataset_shards
    seen = Counter()
    for rank in range(2):
        loader = loader_for(
            pattern,
            fields=("image", "txt", "json"),
            rank=rank,
            world_size=2,
            batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
            workers=Workers(count=workers, persistent=False),
        )
        for images, texts, metas, keys in loader:
            assert images.shape[1:] == (3, 32, 32) and images.float().std() > 5
            assert texts == [f"caption {k}" for k in keys]
            assert [m["key"] for m in metas] == list(keys)
            seen.update(keys)
    assert seen == Counter(expected)
    assert loader.stats.skipped == {}


def test_a_label_member_is_read_when_there_is_no_cls(tmp_path):
    with open(tmp_path / "train-000000.tar", "wb") as file:
        writer = TarShardWriter(file)
        for index in range(12):
            writer.write(
                {
                    "__key__": f"s{index:03d}",
                    "jpeg": encoded_image(index, "JPEG"),
                    "label": str(index % 3).encode(),
                }
            )
        writer.close()
    loader = loader_for(str(tmp_path / "train-000000.tar"), train=False, batch=Batching(size=4))
    labels = [int(v) for _, labels, _ in loader for v in labels]
    assert labels == [i % 3 for i in range(12)]


# --- field transforms ---------------------------------------------------------------------


class CharTokenizer:
    """A toy tokenizer: code points, padded or cut to `length` (module level: picklable)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, text: str, rng: random.Random) -> torch.Tensor:
        if "bad" in text:
            raise SampleError("bad_caption", f"caption {text!r} is refused")
        ids = [ord(c) % 1000 for c in text[: self.length]]
        return torch.tensor(ids + [0] * (self.length - len(ids)), dtype=torch.int64)


def ragged(text: str, rng: random.Random) -> np.ndarray:
    return np.zeros(len(text), dtype=np.int64)


def broken(text: str, rng: random.Random) -> str:
    return text + 1  # a bug: TypeError


def test_a_field_transform_tokenizes_in_the_workers(rich_shards):
    tokens = Field("tokens", "text", source="txt", transform=CharTokenizer(16))
    loader = loader_for(rich_shards, fields=("image", tokens), workers=Workers(count=2))
    # What spawned workers receive: the settings, field transforms included, pickled.
    (_, copied) = pickle.loads(pickle.dumps(loader.settings)).fields
    assert copied.transform("ab", random.Random(0)).tolist()[:3] == [97, 98, 0]
    images, ids, keys = next(iter(loader))
    assert ids.dtype == torch.int64 and ids.shape == (len(keys), 16)
    for row, key in zip(ids.tolist(), keys, strict=True):
        assert row == [ord(c) % 1000 for c in caption_of(key)[:16]]


def test_a_field_transform_raising_sample_error_is_a_skip_and_others_propagate(shard_dir, tmp_path):
    def flag(sample):
        sample = enrich(sample)
        if sample["__key__"].endswith("3"):
            sample["txt"] = b"bad caption"
        return sample

    pattern = rewrite_tars(shard_dir, tmp_path / "flagged", flag)
    tokens = Field("tokens", "text", source="txt", transform=CharTokenizer(8))
    loader = loader_for(pattern, fields=(tokens,), max_skip_fraction=0.5)
    batches = list(loader)
    flagged = loader.stats.skipped.get("bad_caption", 0)
    assert flagged > 0 and all(len(keys) == 8 for _, keys in batches)
    assert all(not k.endswith("3") for _, keys in batches for k in keys)
    with pytest.raises(TypeError):
        list(loader_for(pattern, fields=(Field("t", "text", transform=broken),)))
    with pytest.raises(ValueError, match="fixed shape"):
        list(loader_for(pattern, fields=(Field("t", "text", transform=ragged),)))


# --- tar and Parquet ----------------------------------------------------------------------


def test_tar_and_parquet_give_the_same_json_documents(shard_dir):
    options = dict(
        split="val", train=False, batch=Batching(size=5), fields=("image", "label", "json")
    )
    tar = list(loader_for(shard_dir, format="tar", **options))
    parquet = list(loader_for(shard_dir, format="parquet", **options))
    assert [b[-1] for b in tar] == [b[-1] for b in parquet]
    for (a, la, ja, _), (b, lb, jb, _) in zip(tar, parquet, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb) and ja == jb
        assert all(isinstance(doc, dict) and "width" in doc for doc in ja)


# --- the torch-free helpers ---------------------------------------------------------------


def one(sample_fields: dict, field: Field):
    return field_value({"__key__": "k1", **sample_fields}, field)


@pytest.mark.parametrize(
    ("members", "field", "reason"),
    [
        ({"txt": b"\xc3\x28"}, Field("txt", "text"), "bad_text"),
        ({"txt": b"x" * 65}, Field("txt", "text", max_bytes=64), "bad_text"),
        ({}, Field("txt", "text"), "no_text"),
        ({"json": b"{'a': 1}"}, Field("json", "json"), "bad_json"),
        ({"json": b"[1, 2]"}, Field("json", "json"), "bad_json"),
        ({"json": b"[" * 100_000 + b"]" * 100_000}, Field("json", "json"), "bad_json"),
        ({"json": b'{"a": 1' + b"9" * 5000 + b"}"}, Field("json", "json"), "bad_json"),
        ({"json": b'{"t": [1, 7]}'}, Field("t", "multi_label", "json", "t", 7), "bad_labels"),
        ({"json": b'{"t": [true]}'}, Field("t", "multi_label", "json", "t", 7), "bad_labels"),
        ({"json": b'{"u": [1]}'}, Field("t", "multi_label", "json", "t", 7), "no_labels"),
        ({"labels": b'"1 2"'}, Field("t", "multi_label", num_classes=7), "bad_labels"),
        ({"json": b'{"w": NaN}'}, Field("w", "weight", "json", "w"), "bad_weight"),
        ({"json": b'{"w": -1}'}, Field("w", "weight", "json", "w"), "bad_weight"),
        ({"weight": b"1" + b"0" * 400}, Field("w", "weight"), "bad_weight"),
        # Each kind has its one bad_ reason, whatever made the value bad (the docs' table).
        ({"weight": b"nan"}, Field("w", "weight"), "bad_weight"),
        ({"weight": b"NaN"}, Field("w", "weight"), "bad_weight"),
        ({"weight": b""}, Field("w", "weight"), "bad_weight"),
        ({"weight": b"1" * 100}, Field("w", "weight", max_bytes=64), "bad_weight"),
        ({"labels": b"1 2"}, Field("t", "multi_label", num_classes=7), "bad_labels"),
        ({"labels": b"[1, 2"}, Field("t", "multi_label", num_classes=7), "bad_labels"),
        ({"labels": b"[1, 1e999]"}, Field("t", "multi_label", num_classes=7), "bad_labels"),
        (
            {"json": b'{"t": [1], "t": [2]}'},
            Field("t", "multi_label", "json", "t", 7),
            "bad_labels",
        ),
        ({"json": b'{"a": NaN}'}, Field("json", "json"), "bad_json"),
        ({"json": b'{"a": 1, "a": 1}'}, Field("json", "json"), "bad_json"),
        ({"json": b'{"a": "\\udc00"}'}, Field("json", "json"), "bad_json"),
        ({"txt": "\ud800"}, Field("txt", "text"), "bad_text"),
        ({"jpeg": b"x"}, Field("label", "label"), "no_label"),
    ],
)
def test_bad_field_values_are_sample_errors_naming_the_sample(members, field, reason):
    with pytest.raises(SampleError) as caught:
        one(members, field)
    assert caught.value.reason == reason and "k1" in caught.value.detail


def test_labels_past_the_manifests_classes_are_the_label_fields_skips():
    label = Field("label", "label")
    wide = Field("t", "multi_label", num_classes=10)
    narrow = Field("t", "multi_label", num_classes=3)
    fields = (Field("image", "image"), label, wide, narrow)
    # The narrow multi-label field is bounded by its own width already.
    assert class_ranged_fields(fields, 4) == {1, 2} and class_ranged_fields(fields, None) == set()
    check_class_range(label, 3, 4, "k1")
    check_class_range(wide, [0, 3], 4, "k1")
    check_class_range(wide, [], 4, "k1")
    for spec, value, reason in ((label, 4, "bad_label"), (wide, [1, 9], "bad_labels")):
        with pytest.raises(SampleError) as caught:
            check_class_range(spec, value, 4, "k1")
        assert caught.value.reason == reason and "4 classes the manifest names" in str(caught.value)


def test_good_field_values_and_their_collation():
    tags = Field("t", "multi_label", num_classes=4)
    assert one({"labels": b"[3, 1, 3]"}, tags) == [3, 1, 3]
    assert one({"weight": b"0.25"}, Field("w", "weight")) == 0.25
    assert one({"txt": "é".encode()}, Field("txt", "text")) == "é"
    assert one({"label": 4}, Field("label", "label")) == 4
    assert one({"png": b"p", "jpeg": b"j"}, Field("image", "image")) == b"p"
    hot = collate_values(tags, [[3, 1, 3], [], [0]])
    assert hot.dtype == np.float32 and hot.tolist() == [[0, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]
    nested = parse_json(b'{"a": {"b": [[1]]}}', "x")
    assert nested == {"a": {"b": [[1]]}}
    with pytest.raises(SampleError, match="deeper than 3"):
        parse_json(b'{"a": {"b": [[1]]}}', "x", max_depth=3)


@pytest.mark.parametrize(
    "fields",
    [
        (),
        ("image", "image"),
        ("caption",),
        (Field("a", "image"), Field("b", "image")),
    ],
)
def test_bad_field_lists_are_refused(fields):
    with pytest.raises(UsageError):
        resolve_fields(fields)


@pytest.mark.parametrize(
    "options",
    [
        dict(name="x", kind="tensor"),
        dict(name="x", kind="text", source="pkl"),
        dict(name="x", kind="text", source="pth"),
        dict(name="x", kind="json", source="__error__"),
        dict(name="x", kind="text", source="seg.png"),
        dict(name="x", kind="image", source="photo"),
        dict(name="x", kind="multi_label"),
        dict(name="x", kind="text", num_classes=3),
        dict(name="x", kind="text", key="a"),
        dict(name="x", kind="image", transform=partial(ragged)),
        dict(name="x", kind="text", max_bytes=0),
        dict(name="", kind="text"),
    ],
)
def test_bad_field_specs_are_refused(options):
    # A UsageError is a ValueError: callers catching that still do.
    with pytest.raises(UsageError):
        Field(**options)


def test_bad_fields_fail_before_any_shard_is_opened(tmp_path):
    with pytest.raises(UsageError, match="unknown field 'caption'"):
        loader_for(str(tmp_path / "missing-{000000..000003}.tar"), fields=("image", "caption"))


def test_parquet_written_by_hf_datasets_reads_image_and_label(tmp_path):
    datasets = pytest.importorskip("datasets")
    images = [{"bytes": encoded_image(i, "PNG"), "path": None} for i in range(12)]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])}
    )
    table = {"image": images, "label": [i % 3 for i in range(12)]}
    path = tmp_path / "train-000000.parquet"
    datasets.Dataset.from_dict(table, features=features).to_parquet(str(path))
    loader = loader_for(str(path), train=False, batch=Batching(size=4))
    labels = [int(v) for images, labels, _ in loader for v in labels]
    assert labels == [i % 3 for i in range(12)]
    label_free = loader_for(str(path), train=False, batch=Batching(size=4), fields=("image",))
    assert sum(len(keys) for _, keys in label_free) == 12


def test_class_balance_needs_a_label_field(shard_dir):
    with pytest.raises(ValueError, match="fields must hold 'label'"):
        loader_for(shard_dir, sampling=Resampled(balance=True), fields=("image", "json"))
    balanced = loader_for(
        shard_dir,
        batch=Batching(size=16),
        sampling=Resampled(balance=True),
        fields=("label", "json"),
    )
    labels, metas, keys = next(iter(balanced))
    assert len(metas) == len(keys) == 16 and labels.dtype == torch.int64
