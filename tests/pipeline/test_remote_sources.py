"""Remote sources as a webdataset user names them (issue 31): tars without a manifest
over http, and a manifest's folder over s3 and http, read by the loader as a local one.

A real localhost HTTP server and a moto S3 server; nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import logging
import shutil
from collections import Counter

import pytest

from pipeline.config import Batching, Crop, Exact, LoaderConfig, ReadOptions, Resampled, Workers
from pipeline.loader import build_loader
from shards.errors import UsageError
from tests.httpserver import LocalHTTPServer
from tests.objectstore import MotoS3, isolate_aws_environment
from tests.test_foreign_shards import write_shardwriter_shards

BRACES = "shard-{000000..000002}.tar"  # 10 + 10 + 5 samples
LABELLED = ("image", "label")


@pytest.fixture(scope="module")
def served(tmp_path_factory, built_shards):
    """webdataset ShardWriter tars (no manifest) and one of our builds, over http."""
    root = tmp_path_factory.mktemp("www")
    write_shardwriter_shards(root / "wds")
    shutil.copytree(built_shards.output, root / "out")
    with LocalHTTPServer(root) as base:
        yield base


def text_loader(source, sampling=None, fields=("image", "txt"), **io):
    return build_loader(
        LoaderConfig(
            source=source,
            fields=fields,
            sampling=sampling or Exact(),
            batch=Batching(size=5, drop_last=False, epoch_rule="uneven"),
            crop=Crop(image_size=16),
            workers=Workers(count=0),
            io=ReadOptions(**io),
            with_keys=True,
        )
    )


def keys_of(loader) -> Counter:
    return Counter(key for *_, keys in loader for key in keys)


def test_resampled_remote_tars_without_a_manifest_need_no_counts(served):
    loader = text_loader(f"{served}/wds/{BRACES}", Resampled(epoch_samples=40))
    keys = keys_of(loader)
    assert sum(keys.values()) == 40
    assert set(keys) <= {f"{i:09d}" for i in range(25)} and len(keys) > 10
    batch = next(iter(loader))
    assert len(batch[1]) == 5 and batch[1][0].startswith("caption ")  # the txt field


def test_resampled_without_counts_asks_for_the_epoch_length(served):
    with pytest.raises(UsageError, match=r"Resampled\(epoch_samples=N\)"):
        text_loader(f"{served}/wds/{BRACES}", Resampled())


def test_exact_remote_tars_are_refused_in_one_line_or_counted_when_asked(served, caplog):
    with pytest.raises(UsageError) as refused:
        text_loader(f"{served}/wds/{BRACES}")
    message = str(refused.value)
    assert "\n" not in message and "count_remote_shards=True" in message
    assert f"preprocess index {served}/wds" in message and "epoch_samples" in message
    caplog.set_level(logging.INFO, logger="pipeline")
    loader = text_loader(f"{served}/wds/{BRACES}", count_remote_shards=True)
    assert keys_of(loader) == Counter({f"{i:09d}": 1 for i in range(25)})
    assert "3 shards without a manifest: counted by reading them" in caplog.text


def test_a_manifest_folder_over_http_reads_as_the_local_one(served, built_shards):
    local = keys_of(text_loader(str(built_shards.output), fields=LABELLED))
    for source in (f"{served}/out/", f"{served}/out"):
        assert keys_of(text_loader(source, fields=LABELLED)) == local


def test_a_manifest_folder_over_s3_reads_as_the_local_one(
    monkeypatch, tmp_path, built_shards, served
):
    isolate_aws_environment(monkeypatch, tmp_path)
    with MotoS3() as s3:
        s3.create_bucket("data")
        s3.upload_dir(built_shards.output, "data", "shards")
        options = {"storage_options": s3.storage_options()}
        local = keys_of(text_loader(str(built_shards.output), fields=LABELLED))
        for source in ("s3://data/shards", "s3://data/shards/"):
            assert keys_of(text_loader(source, fields=LABELLED, **options)) == local
