"""The loader against shards and manifests that lie, leak or were tampered with.

Each case ends in a counted skip or one clear error that names the shard or the
manifest; never a hang, a crash of a bug type, or an epoch that silently changes.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.config import Batching, Crop, ReadOptions, Workers
from pipeline.loader import LoaderConfig, build_loader
from pipeline.sources import is_manifest_source, manifest_base
from pipeline.stats import LoaderDataError
from shards.manifest import ManifestError, read_manifest, write_manifest
from shards.storage import RetryPolicy
from shards.tar import BLOCK, header_checksum, member_header
from tests.conftest import shard_files, shard_path, shard_url
from tests.httpserver import LocalHTTPServer
from tests.pipeline.conftest import epoch_keys, loader_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def shards(shard_copy):
    return shard_copy


def edit_manifest(directory: Path, change) -> None:
    path = directory / "manifest.json"
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def full_epoch(source, **overrides):
    options = dict(
        batch=Batching(size=8, epoch_rule="uneven", drop_last=False), max_skip_fraction=1.0
    )
    options.update(overrides)
    loader = loader_for(source, **options)
    return loader, [k for batch in epoch_keys(loader) for k in batch]


def manifest_keys(directory: Path, fmt: str = "tar") -> Counter:
    return Counter(full_epoch(directory, format=fmt)[1])


def train_shard(document: dict, index: int) -> dict:
    return document["splits"]["train"]["shards"][index]


def declare_count(document: dict, index: int, samples: int) -> None:
    """Change one shard's count and keep the manifest self-consistent (a plausible lie)."""
    split = document["splits"]["train"]
    shard = split["shards"][index]
    for total in (split, document):
        total["samples" if total is split else "written"] += samples - shard["samples"]
    document["inputs"] += samples - shard["samples"]
    shard["samples"] = samples
    shard["class_counts"] = []
    split["class_counts"] = []


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_a_count_larger_than_the_shard_is_shard_short_for_both_formats(shards, fmt):
    reference = manifest_keys(shards, fmt)
    real = json.loads((shards / "manifest.json").read_text())
    real_count = train_shard(real, 0)["samples"]
    edit_manifest(shards, lambda d: declare_count(d, 0, real_count + 5))
    loader, keys = full_epoch(shards, format=fmt)
    assert loader.stats.bad_shards == {"shard_short": 1}
    assert loader.stats.skipped == {"shard_short": 5}
    # The epoch keeps the manifest's length, and the 5 missing are refills, counted as such.
    assert len(keys) == sum(reference.values()) + 5
    assert loader.stats.refilled == 5
    assert set(keys) == set(reference)


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_a_count_smaller_than_the_shard_is_shard_long_and_extra_samples_stay_unread(shards, fmt):
    reference = manifest_keys(shards, fmt)
    real = json.loads((shards / "manifest.json").read_text())
    real_count = train_shard(real, 0)["samples"]
    edit_manifest(shards, lambda d: declare_count(d, 0, real_count - 3))
    loader, keys = full_epoch(shards, format=fmt)
    assert loader.stats.bad_shards == {"shard_long": 1}
    assert not loader.stats.skipped and not loader.stats.refilled
    assert len(keys) == sum(reference.values()) - 3
    assert max(Counter(keys).values()) == 1


@pytest.mark.parametrize(
    "count",
    [-1, 10**10, "12", 12.5, True, None],
    ids=["neg", "huge", "str", "float", "bool", "null"],
)
def test_nonsense_counts_are_one_manifest_error_naming_the_field(shards, count):
    def change(document):
        train_shard(document, 0)["samples"] = count

    edit_manifest(shards, change)
    with pytest.raises(ManifestError, match=r"manifest\.json.*samples"):
        loader_for(shards)


@pytest.mark.parametrize(
    "name", ["../outside/secret.tar", "../../../../etc/hostname", "/etc/passwd", "s3://b/x.tar"]
)
def test_shard_names_cannot_escape_the_manifest_directory(shards, tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.tar").write_bytes(shard_path(shards, "train", 0).read_bytes())

    def change(document):
        train_shard(document, 1)["files"]["tar"]["name"] = name

    edit_manifest(shards, change)
    with pytest.raises(ManifestError, match="name"):
        loader_for(shards)


def test_a_tampered_shard_is_read_as_good_unless_checksums_are_verified(shards):
    reference = manifest_keys(shards)
    target = shard_path(shards, "train", 2)
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01  # one flipped bit in the archive's end padding: every sample still reads
    target.write_bytes(bytes(data))
    loader, keys = full_epoch(shards)
    assert not loader.stats.bad_shards
    loader, keys = full_epoch(shards, io=ReadOptions(checksums=True))
    assert loader.stats.bad_shards == {"checksum": 1}
    planned = json.loads((shards / "manifest.json").read_text())
    lost = train_shard(planned, 2)["samples"]
    assert loader.stats.skipped == {"checksum": lost}
    assert len(keys) == sum(reference.values())


def test_checksums_in_a_side_table_are_read_when_verifying_and_catch_a_tampered_shard(shards):
    # The loader leaves a side table's sha256 column unread unless it verifies.
    write_manifest(shards, read_manifest(shards), inline_max_shards=0)
    assert "table" in json.loads((shards / "manifest.json").read_text())["splits"]["train"]
    target = shard_path(shards, "train", 1)
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01
    target.write_bytes(bytes(data))
    loader, _ = full_epoch(shards)
    assert not loader.stats.bad_shards and loader.source.shards.digests is None
    loader, _ = full_epoch(shards, io=ReadOptions(checksums=True))
    assert loader.stats.bad_shards == {"checksum": 1}


def test_verify_checksums_passes_good_shards_over_http(shard_dir):
    reference = manifest_keys(shard_dir)
    with LocalHTTPServer(shard_dir) as base:
        loader, keys = full_epoch(
            f"{base}/manifest.json", workers=Workers(count=2), io=ReadOptions(checksums=True)
        )
    assert Counter(keys) == reference
    assert not loader.stats.bad_shards


def tar_with_member(name: bytes, data: bytes) -> bytes:
    header = bytearray(member_header("x" * len(name), len(data)))
    header[: len(name)] = name
    header[148:156] = b"%06o\0 " % header_checksum(bytes(header))
    return bytes(header) + data + bytes(-len(data) % BLOCK)


def test_a_non_utf8_member_name_is_one_counted_skip_also_in_workers(shards):
    reference = manifest_keys(shards)
    target = shard_path(shards, "train", 0)
    original = target.read_bytes()
    first = tar_with_member(b"caf\xe9.cls", b"1")
    target.write_bytes(first + original)

    def change(document):
        declare_count(document, 0, train_shard(document, 0)["samples"] + 1)
        train_shard(document, 0)["files"]["tar"]["bytes"] = len(first) + len(original)
        train_shard(document, 0)["files"]["tar"]["sha256"] = "0" * 64

    edit_manifest(shards, change)
    loader, keys = full_epoch(shards, workers=Workers(count=2))
    assert loader.stats.skipped == {"bad_name": 1} and loader.stats.refilled == 1
    assert set(keys) == set(reference) and len(keys) == sum(reference.values()) + 1


def write_parquet(path: Path, table: pa.Table) -> None:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    path.write_bytes(buffer.getvalue())


@pytest.mark.parametrize(
    "table",
    [
        pa.table({"__key__": [1], "jpg": [b"x"], "cls": [1]}),
        pa.table({"__key__": ["a"], "jpg": ["text"], "cls": [1]}),
    ],
    ids=["key-not-string", "image-as-string"],
)
def test_parquet_shards_off_contract_are_a_shard_error_not_a_crash(tmp_path, shard_dir, table):
    good = shard_files(shard_dir, "parquet", "train")[:2]
    for path in good:
        shutil.copy(path, tmp_path / path.name)
    write_parquet(tmp_path / "train-999999.parquet", table)
    loader, keys = full_epoch(str(tmp_path / "train-{000000,000001,999999}.parquet"))
    # Counting reads the schema too, so the shard is left out before the epoch, named.
    ((url, reason),) = loader.source.unreadable
    assert url.endswith("train-999999.parquet") and ": schema:" in reason
    assert sorted(keys) == sorted(
        k for p in good for k in pq.read_table(p, columns=["__key__"])["__key__"].to_pylist()
    )


def test_a_parquet_shard_without_labels_counts_but_is_a_named_schema_error_when_labels_are_read(
    tmp_path, shard_dir
):
    # Label-free shards are valid (image-text pairs), so counting accepts them; a loader
    # that asks for labels meets one `schema` error naming the shard, not a crash.
    good = shard_files(shard_dir, "parquet", "train")[:2]
    for path in good:
        shutil.copy(path, tmp_path / path.name)
    write_parquet(tmp_path / "train-999999.parquet", pa.table({"__key__": ["a"], "jpg": [b"x"]}))
    loader, keys = full_epoch(str(tmp_path / "train-{000000,000001,999999}.parquet"))
    assert not loader.source.unreadable and loader.stats.bad_shards == {"schema": 1}
    assert any("train-999999.parquet" in example for example in loader.stats.bad_shard_examples)
    expected = [
        k for p in good for k in pq.read_table(p, columns=["__key__"])["__key__"].to_pylist()
    ]
    # The lost planned sample is refilled from the good shards: the epoch keeps its length.
    assert set(keys) == set(expected) and len(keys) == len(expected) + 1


def test_a_corrupt_shard_without_manifest_is_left_out_and_named(tmp_path, shard_dir, caplog):
    for path in shard_files(shard_dir, "tar", "train")[:3]:
        shutil.copy(path, tmp_path / path.name)
    (tmp_path / "train-000001.tar").write_bytes(b"<html>404</html>" * 64)
    pattern = str(tmp_path / "train-{000000..000002}.tar")
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        loader, keys = full_epoch(pattern)
    assert [u for u, _ in loader.source.unreadable] == [str(tmp_path / "train-000001.tar")]
    assert "train-000001.tar" in caplog.text
    assert max(Counter(keys).values()) == 1 and len(loader.source.shards) == 2


def test_every_shard_corrupt_without_manifest_is_one_clear_error(tmp_path):
    for index in range(2):
        (tmp_path / f"train-00000{index}.tar").write_bytes(b"garbage" * 100)
    with pytest.raises(ValueError, match="none of the 2 shards could be read"):
        loader_for(str(tmp_path / "train-{000000..000001}.tar"))


def test_credentials_never_reach_logs_records_keys_or_stats(shards, caplog):
    shard_path(shards, "train", 1).write_bytes(b"garbage" * 200)  # a bad shard to report
    with LocalHTTPServer(shards) as base:
        secret_base = base.replace("http://", "http://alice:hunter2@")
        with caplog.at_level(logging.DEBUG):
            loader = build_loader(
                LoaderConfig(
                    source=f"{secret_base}/manifest.json?X-Amz-Signature=sig0123456789",
                    batch=Batching(size=8),
                    crop=Crop(image_size=32),
                    workers=Workers(count=0),
                    with_keys=True,
                    max_skip_fraction=1.0,
                )
            )
            batches = list(loader)
    texts = [
        caplog.text,
        repr(loader.source.shards[:3]),
        json.dumps(loader.stats.summary(), default=str),
        repr(loader.config),
    ]
    assert batches and loader.stats.bad_shards
    for text in texts:
        assert "hunter2" not in text and "sig0123456789" not in text
    assert "***@" in caplog.text


def test_a_presigned_manifest_url_is_recognised(shard_dir):
    url = "https://bucket.example/data/manifest.json?X-Amz-Signature=abc&X-Amz-Expires=60"
    assert is_manifest_source(url)
    assert manifest_base(url) == "https://bucket.example/data"
    reference = manifest_keys(shard_dir)
    with LocalHTTPServer(shard_dir) as base:
        loader, keys = full_epoch(f"{base}/manifest.json?X-Amz-Signature=abc")
    assert Counter(keys) == reference


def test_a_bad_shard_past_the_budget_names_the_shard(shards):
    shard_path(shards, "train", 3).write_bytes(b"\0" * 100 + b"junk" * 300)
    with pytest.raises(LoaderDataError, match="train-000003.tar"):
        full_epoch(shards, max_skip_fraction=0.0)


@pytest.mark.timeout(30)
def test_a_fifo_under_a_shard_name_is_refused_not_waited_on(shards):
    reference = manifest_keys(shards)
    target = shard_path(shards, "train", 1)
    planned = json.loads((shards / "manifest.json").read_text())
    target.unlink()
    os.mkfifo(target)
    loader, keys = full_epoch(shards)
    assert loader.stats.bad_shards == {"shard_unreadable": 1}
    assert loader.stats.skipped == {"shard_unreadable": train_shard(planned, 1)["samples"]}
    assert len(keys) == sum(reference.values())


@pytest.mark.timeout(60)
def test_a_crawling_server_costs_one_named_shard_in_workers(shard_dir):
    """Not "DataLoader timed out" naming nothing: the shard's deadline ends it, named."""
    reference = manifest_keys(shard_dir)
    planned = json.loads((shard_dir / "manifest.json").read_text())
    server = LocalHTTPServer(shard_dir)
    server.drip(shard_url("", "train", 1), interval=0.05, times=10)
    with server as base:
        loader, keys = full_epoch(
            f"{base}/manifest.json",
            workers=Workers(count=2),
            io=ReadOptions(
                retry=RetryPolicy(attempts=2, base_delay=0.01, timeout=1.0, deadline=2.0)
            ),
        )
    assert loader.stats.bad_shards == {"shard_unreadable": 1}
    assert loader.stats.skipped == {"shard_unreadable": train_shard(planned, 1)["samples"]}
    assert len(keys) == sum(reference.values())
    (example,) = loader.stats.bad_shard_examples
    assert "train-000001.tar" in example and "deadline" in example


@pytest.mark.timeout(60)
def test_an_endless_server_is_read_only_up_to_the_manifests_bytes(shard_dir):
    reference = manifest_keys(shard_dir)
    server = LocalHTTPServer(shard_dir)
    server.endless(shard_url("", "train", 1), times=10)
    with server as base:
        loader, keys = full_epoch(f"{base}/manifest.json", workers=Workers(count=2))
    assert Counter(keys) == reference and not loader.stats.bad_shards


def test_errors_of_url_checks_and_manifest_parsing_hide_credentials(shard_copy):
    from shards.storage import validate_url

    for url in ("file://alice:hunter2@remote/x.tar", "file://alice:hunter2@localhost/x.tar?q"):
        with pytest.raises(ValueError) as refused:
            validate_url(url)
        assert "hunter2" not in str(refused.value)
    (shard_copy / "manifest.json").write_text('{"format": "shardpipe-manifest", "version": 1')
    with LocalHTTPServer(shard_copy) as base:
        secret = base.replace("http://", "http://alice:hunter2@")
        with pytest.raises(ManifestError) as malformed:
            loader_for(f"{secret}/manifest.json?X-Amz-Signature=sig0123456789")
    assert "manifest.json" in str(malformed.value)
    assert "hunter2" not in str(malformed.value) and "sig0123456789" not in str(malformed.value)


def relabel_first_sample(path: Path, value: bytes) -> str:
    """Give the first sample of a tar shard the class id `value` (same length: the
    shard keeps its byte count); returns the sample's key."""
    data = bytearray(path.read_bytes())
    offset = 0
    while True:
        name = bytes(data[offset : offset + 100]).split(b"\0", 1)[0]
        size = int(bytes(data[offset + 124 : offset + 136]).strip(b"\0 "), 8)
        if name.endswith(b".cls"):
            assert size == len(value)
            data[offset + BLOCK : offset + BLOCK + size] = value
            path.write_bytes(bytes(data))
            return name[: -len(b".cls")].decode()
        offset += BLOCK + size + (-size % BLOCK)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_label_outside_the_manifests_classes_is_a_counted_bad_label(shards, workers):
    classes = read_manifest(shards).classes
    reference = manifest_keys(shards)
    key = relabel_first_sample(shard_path(shards, "train", 0), str(len(classes)).encode())
    loader, keys = full_epoch(shards, workers=Workers(count=workers))
    assert loader.stats.skipped == {"bad_label": 1} and loader.stats.refilled == 1
    assert key not in keys and set(keys) == set(reference) - {key}
    labels = [int(v) for _, labels, _ in loader_for(shards, train=False) for v in labels]
    assert max(labels) < len(classes)


def small_jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (24, 32, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG")
    return buffer.getvalue()


def test_a_webdataset_shard_with_dotted_keys_counts_them_as_dotted_key_skips(tmp_path, caplog):
    wds = pytest.importorskip("webdataset")
    keys = ["s0", "s1.a", "s2", "s3.b.c", "s4", "s5.d", "s6"]
    path = tmp_path / "part-00000.tar"
    with wds.TarWriter(str(path)) as writer:
        for index, key in enumerate(keys):
            writer.write({"__key__": key, "jpg": small_jpeg(index), "cls": index % 2})
    loader, delivered = full_epoch(
        str(path), train=False, batch=Batching(size=2, epoch_rule="uneven", drop_last=False)
    )
    # 7 written: 4 delivered, 3 counted (they used to vanish: 7 written, 3 delivered).
    assert loader.stats.skipped == {"dotted_key": 3}
    assert sorted(set(delivered)) == ["s0", "s2", "s4", "s6"]
    # Eval is exactly once: the 3 skips are never refilled with repeats, the batches come short.
    assert len(delivered) == 4 and loader.stats.unfilled == 3 and not loader.stats.refilled
    assert "must not contain dots" in caplog.text
