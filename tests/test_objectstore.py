"""Shards in an S3-compatible store on localhost: the loader reads them, build-shards writes them.

A moto server stands in for S3 and a fault-injecting proxy in front of it
returns 503s, cuts bodies and stalls; nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import traceback
from collections import Counter

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

from pipeline.config import Batching, ReadOptions, Workers
from pipeline.loader import ShardLoader  # noqa: E402
from pipeline.stats import LoaderDataError  # noqa: E402
from preprocess.cli import main  # noqa: E402
from preprocess.job import run_build  # noqa: E402
from preprocess.ray_job import BuildError  # noqa: E402
from shards.parquet import ParquetShardWriter, iter_parquet_samples  # noqa: E402
from shards.storage import RetryPolicy, ShardReadError, open_stream  # noqa: E402
from shards.tar import iter_tar_samples  # noqa: E402
from tests.conftest import shard_key, shard_path, shard_url, small_build_config  # noqa: E402
from tests.objectstore import FaultProxy, MotoS3, isolate_aws_environment  # noqa: E402
from tests.pipeline.conftest import loader_for  # noqa: E402

pytestmark = pytest.mark.distributed

SHARDS_BUCKET = "shards-ro"
FAST = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, timeout=1.0)
SECRET = "SECRET-sh4rdp1pe-d0-n0t-l3ak-9f8e7d"
ACCESS_KEY = "AKIASHARDPIPETESTKEY"


@pytest.fixture(autouse=True)
def isolated_aws_env(monkeypatch, tmp_path):
    """No real AWS profile, credentials or metadata service is ever consulted."""
    isolate_aws_environment(monkeypatch, tmp_path)


@pytest.fixture(scope="session")
def moto_s3():
    with MotoS3() as server:
        yield server


@pytest.fixture(scope="session")
def s3_shards(moto_s3, built_shards):
    """The session's local shards uploaded to `s3://shards-ro/shards/`: read-only."""
    moto_s3.create_bucket(SHARDS_BUCKET)
    moto_s3.upload_dir(built_shards.output, SHARDS_BUCKET, "shards")
    return f"s3://{SHARDS_BUCKET}/shards"


@pytest.fixture
def proxy(moto_s3):
    with FaultProxy(moto_s3.endpoint) as running:
        yield running


@pytest.fixture
def bucket(moto_s3, request):
    """A fresh bucket per test, named after it."""
    name = "t-" + request.node.name.lower().replace("_", "-").replace("[", "-").strip("]-")[:50]
    moto_s3.create_bucket(name)
    return name


def epoch_keys(source, **overrides) -> tuple[list[str], ShardLoader]:
    """Keys of one full epoch, in delivery order (every sample once: `uneven`, no drop)."""
    loader = loader_for(
        source, batch=Batching(size=8, epoch_rule="uneven", drop_last=False), **overrides
    )
    keys = [k for _, _, batch in loader for k in batch]
    return keys, loader


def use_endpoint(monkeypatch, endpoint: str, *, generic: bool = False) -> None:
    """Credentials and endpoint through the client's standard environment variables."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL" if generic else "AWS_ENDPOINT_URL_S3", endpoint)
    # Writes rely on botocore's own retries: two quick tries keep failing tests short.
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")


# Loader ------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "workers"), [("tar", 0), ("parquet", 2)])
def test_loader_reads_the_manifest_and_shards_from_s3_like_the_local_copy(
    moto_s3, s3_shards, built_shards, fmt, workers
):
    local, _ = epoch_keys(str(built_shards.output), format=fmt, workers=Workers(count=workers))
    remote, loader = epoch_keys(
        f"{s3_shards}/manifest.json",
        format=fmt,
        workers=Workers(count=workers),
        io=ReadOptions(storage_options=moto_s3.storage_options()),
    )
    assert remote == local  # same samples, same order: the source does not matter
    assert len(remote) == len(set(remote)) == built_shards.manifest.splits["train"].samples
    assert loader.source.shards[0].url == shard_url(s3_shards, "train", 0, fmt)
    assert not loader.stats.skipped


def test_tar_shards_stream_in_ranged_reads_instead_of_a_whole_download(
    moto_s3, s3_shards, built_shards, proxy, monkeypatch
):
    import shards.storage.objectstore

    block = 8 * 2**10  # the real block (8 MiB) exceeds these small test shards
    monkeypatch.setattr(shards.storage.objectstore, "FSSPEC_SEQUENTIAL_CACHE", ("readahead", block))
    monkeypatch.setattr(shards.storage.objectstore, "FSSPEC_BUFFER_SIZE", block)
    url = shard_url(s3_shards, "train", 0)
    size = shard_path(built_shards.output, "train", 0).stat().st_size
    assert size > 8 * block
    options = moto_s3.storage_options(proxy.endpoint)
    with open_stream(url, FAST, storage_options=options) as stream:
        samples = iter_tar_samples(stream, url)
        next(samples)
        fetched_first = sum(span(r.range) for r in proxy.requests if r.method == "GET")
        rest = list(samples)
    ranges = [r.range for r in proxy.requests if r.method == "GET"]
    assert fetched_first < size / 4  # the first sample came before most of the shard
    assert len(rest) == built_shards.manifest.splits["train"].shards[0].samples - 1
    assert len(ranges) > 4 and all(r is not None for r in ranges)
    # Consecutive ranges tile the object: nothing fetched twice, nothing whole.
    bounds = [tuple(int(x) for x in r.removeprefix("bytes=").split("-")) for r in ranges]
    assert bounds[0][0] == 0 and bounds[-1][1] == size - 1
    assert all(b[0] == a[1] + 1 for a, b in zip(bounds, bounds[1:], strict=False))


def test_a_fetched_shard_takes_one_ranged_get_per_span(
    moto_s3, s3_shards, built_shards, proxy, monkeypatch, tmp_path
):
    """Each request to a store costs a first-byte delay and the store's CPU: a span is
    one GET of its bytes, not one GET per copy buffer."""
    from shards.storage import ranged

    span_bytes = 16 * 2**10
    monkeypatch.setattr(ranged, "MIN_SPAN", span_bytes)
    monkeypatch.setattr(ranged, "MAX_SPAN", span_bytes)
    monkeypatch.setattr(ranged, "COPY_CHUNK", 1024)  # a span is many copy buffers
    url = shard_url(s3_shards, "train", 0)
    local = shard_path(built_shards.output, "train", 0)
    size = local.stat().st_size
    assert size > 4 * span_bytes
    target = tmp_path / "fetched"
    with target.open("wb+") as file:
        got = ranged.fetch_into(
            url,
            file.fileno(),
            FAST,
            size=size,
            storage_options=moto_s3.storage_options(proxy.endpoint),
            connections=3,
        )
    assert got == size and target.read_bytes() == local.read_bytes()
    ranges = sorted(span(r.range) for r in proxy.requests if r.method == "GET")
    assert len(ranges) == -(-size // span_bytes)  # one GET per span, none repeated
    assert sum(ranges) == size


def test_parquet_fetches_only_the_footer_and_the_row_groups_it_reads(
    moto_s3, bucket, proxy, tmp_path
):
    path = tmp_path / "big.parquet"
    rng = random.Random(5)
    with open(path, "wb") as f:
        writer = ParquetShardWriter(f, "jpg", row_group_size=8)
        for i in range(64):  # random bytes: compression cannot shrink them
            sample = {"__key__": f"s{i:04d}", "jpg": rng.randbytes(40_000), "cls": b"0"}
            writer.write({**sample, "json": b"{}"})
        writer.close()
    size = path.stat().st_size
    moto_s3.client().upload_file(str(path), bucket, "big.parquet")
    url = f"s3://{bucket}/big.parquet"
    options = moto_s3.storage_options(proxy.endpoint)
    with open_stream(url, FAST, storage_options=options, random_access=True) as stream:
        keys = [s["__key__"] for s in iter_parquet_samples(stream, url, 40, 48)]
    assert keys == [f"s{i:04d}" for i in range(40, 48)]
    ranges = [r.range for r in proxy.requests if r.method == "GET"]
    assert ranges and all(r is not None for r in ranges)
    assert sum(span(r) for r in ranges) < size / 2
    assert min(int(r.removeprefix("bytes=").split("-")[0]) for r in ranges) > size / 2


def span(range_header: str | None) -> int:
    start, stop = range_header.removeprefix("bytes=").split("-")
    return int(stop) - int(start) + 1


# Faults ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_503s_cut_bodies_and_stalls_are_retried_and_the_epoch_is_exact(
    moto_s3, s3_shards, built_shards, proxy, fmt
):
    local, _ = epoch_keys(str(built_shards.output), format=fmt)
    faults = [
        proxy.fail(rf"/train-000000\.{fmt}$", times=2, status=503),
        proxy.fail(rf"/train-000003\.{fmt}$", times=1, status=500),
        proxy.cut(rf"/train-000001\.{fmt}$", times=2, after_bytes=700),
        proxy.cut(rf"/train-000004\.{fmt}$", times=1, after_bytes=100, reset=True),
        proxy.stall(rf"/train-000002\.{fmt}$", times=1, after_bytes=300),
        proxy.stall(rf"/train-000005\.{fmt}$", times=1, method="HEAD"),
    ]
    remote, loader = epoch_keys(
        f"{s3_shards}/manifest.json",
        format=fmt,
        io=ReadOptions(retry=FAST, storage_options=moto_s3.storage_options(proxy.endpoint)),
    )
    assert [f.injected for f in faults] == [f.times for f in faults]  # every fault happened
    assert Counter(remote) == Counter(local)  # every sample exactly once
    assert len(remote) == len(set(remote))
    assert not loader.stats.skipped and loader.stats.refilled == 0


def test_a_permanently_failing_shard_is_retried_then_skipped_counted_and_named(
    moto_s3, s3_shards, built_shards, proxy, caplog
):
    local, _ = epoch_keys(str(built_shards.output))
    proxy.fail(r"/train-000001\.tar$", times=10_000, status=503)
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        remote, loader = epoch_keys(
            f"{s3_shards}/manifest.json",
            io=ReadOptions(retry=FAST, storage_options=moto_s3.storage_options(proxy.endpoint)),
            max_skip_fraction=1.0,
        )
    lost = built_shards.manifest.splits["train"].shards[1].samples
    assert len(remote) == len(local)  # refilled: the batches keep their sizes
    assert sum(loader.stats.skipped.values()) == lost  # one reason: the shard was unreadable
    assert len(loader.stats.skipped) == 1
    assert loader.stats.refilled == lost
    assert not set(remote) - set(local)
    gets = proxy.count(r"/train-000001\.tar$")
    assert gets > 0 and gets % FAST.attempts == 0  # exactly the retry budget per piece
    message = f"cannot read shard {shard_url(s3_shards, 'train', 1)} ({FAST.attempts} attempt(s))"
    assert message in caplog.text


def test_past_the_retry_budget_the_error_names_the_url_and_the_last_failure(
    moto_s3, s3_shards, proxy
):
    url = shard_url(s3_shards, "train", 2)
    proxy.cut(r"/train-000002\.tar$", times=10_000, after_bytes=2000)
    options = moto_s3.storage_options(proxy.endpoint)
    with (
        pytest.raises(ShardReadError) as info,
        open_stream(url, FAST, storage_options=options) as f,
    ):
        f.read()
    assert info.value.url == url and info.value.attempts == FAST.attempts
    assert f"cannot read shard {url}" in str(info.value)
    assert "ClientPayloadError" in str(info.value)
    with pytest.raises(ShardReadError, match="check the URL and that the shard was uploaded"):
        open_stream(f"{s3_shards}/missing.tar", FAST, storage_options=options)


def test_with_every_shard_failing_the_loader_stops_with_a_clear_error(
    moto_s3, s3_shards, proxy, caplog
):
    proxy.fail(r"/train-\d+\.tar$", times=10_000, status=503)
    retry = RetryPolicy(attempts=2, base_delay=0.0, timeout=1.0)
    with (
        caplog.at_level(logging.WARNING, logger="pipeline"),
        pytest.raises(
            LoaderDataError, match="over its budget.*shard_unreadable.*preprocess verify"
        ),
    ):
        epoch_keys(
            f"{s3_shards}/manifest.json",
            io=ReadOptions(retry=retry, storage_options=moto_s3.storage_options(proxy.endpoint)),
        )
    # The first unreadable shard already exceeds the skip budget and stops the loader.
    any_train_shard = shard_url(s3_shards, "train", 0).removesuffix("00.tar")  # train-0000..
    assert f"cannot read shard {any_train_shard}" in caplog.text


def test_credentials_never_appear_in_logs_or_errors(moto_s3, s3_shards, proxy, caplog):
    options = moto_s3.storage_options(proxy.endpoint, key=ACCESS_KEY, secret=SECRET)
    errors = []
    with caplog.at_level(logging.DEBUG):
        keys, _ = epoch_keys(
            f"{s3_shards}/manifest.json", io=ReadOptions(retry=FAST, storage_options=options)
        )
        assert keys
        proxy.fail(r"/train-000003\.tar$", times=10_000, status=503)
        proxy.stall(r"/train-000004\.tar$", times=10_000)
        for url in (
            shard_url(s3_shards, "train", 3),
            shard_url(s3_shards, "train", 4),
            f"{s3_shards}/absent.tar",
        ):
            with (
                pytest.raises(ShardReadError) as info,
                open_stream(url, FAST, storage_options=options) as f,
            ):
                f.read()
            errors.append(info.value)
        proxy.release()
    assert caplog.records  # botocore, s3fs and fsspec debug logs were captured
    texts = [caplog.text]
    for error in errors:
        texts += [str(error), repr(error), "".join(traceback.format_exception(error))]
    assert all(SECRET not in text for text in texts)
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert all(ACCESS_KEY not in text for text in [warnings, *texts[1:]])


# build-shards to the object store -----------------------------------------------------


@pytest.fixture(scope="module")
def s3_build(moto_s3, sample_dir, tmp_path_factory):
    """`preprocess build-shards --output s3://...` run once; tests copy it before changing it."""
    patch = pytest.MonkeyPatch()
    try:
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            patch.delenv(name)
        empty = tmp_path_factory.mktemp("aws")
        patch.setenv("AWS_CONFIG_FILE", str(empty / "config"))
        patch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty / "credentials"))
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        use_endpoint(patch, moto_s3.endpoint, generic=True)
        moto_s3.create_bucket("build-ro")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = main(build_args(sample_dir, "s3://build-ro/out"))
    finally:
        patch.undo()
    assert code == 0
    assert "manifest: s3://build-ro/out/manifest.json" in printed.getvalue()
    return "build-ro", "out"


def build_args(sample_dir, output: str) -> list[str]:
    # The options of tests.conftest.small_build_config, through the command line.
    return [
        "build-shards",
        *("--input", str(sample_dir), "--output", output, "--image-size", "64"),
        *("--shard-size", "32", "--val-fraction", "0.2", "--seed", "3"),
        *("--row-group-size", "16", "--executor", "inline", "--no-progress"),
    ]


def local_files(directory) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def copy_prefix(moto_s3, source: tuple[str, str], bucket: str, prefix: str) -> None:
    client = moto_s3.client()
    for key in moto_s3.keys(source[0], source[1] + "/"):
        target = prefix + key[len(source[1]) :]
        client.copy_object(Bucket=bucket, Key=target, CopySource={"Bucket": source[0], "Key": key})


@pytest.mark.slow
def test_build_shards_writes_to_s3_and_the_loader_reads_the_result(
    moto_s3, s3_build, built_shards, capsys
):
    bucket, prefix = s3_build
    local = local_files(built_shards.output)
    stored = {k[len(prefix) + 1 :]: moto_s3.get(bucket, k) for k in moto_s3.keys(bucket, prefix)}
    assert sorted(stored) == sorted(local)  # the same files, and no temp or partial object
    for name, data in local.items():
        if not name.startswith("_build/"):  # markers also hold the objects' ETags
            assert stored[name] == data, name  # byte-identical shards, manifest, errors
    remote, _ = epoch_keys(
        f"s3://{bucket}/{prefix}/manifest.json",
        io=ReadOptions(storage_options=moto_s3.storage_options()),
    )
    local_keys, _ = epoch_keys(str(built_shards.output))
    assert remote == local_keys


@pytest.mark.slow
def test_resume_on_s3_rebuilds_only_missing_or_changed_shards_without_downloading(
    moto_s3, s3_build, built_shards, sample_dir, bucket, proxy, monkeypatch
):
    copy_prefix(moto_s3, s3_build, bucket, "out")
    # A crash before train-000002 was committed; train-000004.tar changed behind our back.
    for key in (
        shard_key("train", 2),
        shard_key("train", 2, "parquet"),
        "_build/train-000002.json",
    ):
        moto_s3.delete(bucket, f"out/{key}")
    moto_s3.delete(bucket, "out/manifest.json")
    original = moto_s3.get(bucket, f"out/{shard_key('train', 4)}")
    moto_s3.client().put_object(
        Bucket=bucket, Key=f"out/{shard_key('train', 4)}", Body=bytes(len(original))
    )
    use_endpoint(monkeypatch, proxy.endpoint)
    summary = run_build(small_build_config(sample_dir, f"s3://{bucket}/out"))
    assert (summary.shards_built, summary.shards_reused) == (2, shard_count(built_shards) - 2)
    assert str(summary.output / "manifest.json") == f"s3://{bucket}/out/manifest.json"
    # Kept shards were checked by size and ETag (HEAD), never downloaded; the changed
    # one was downloaded once to hash it, then rebuilt.
    downloads = Counter(r.path for r in proxy.requests if r.method == "GET" and r.range)
    assert set(downloads) == {f"/{bucket}/out/{shard_key('train', 4)}"}
    for name, data in local_files(built_shards.output).items():
        if not name.startswith("_build/"):
            assert moto_s3.get(bucket, f"out/{name}") == data, name


@pytest.mark.slow
def test_a_failed_upload_leaves_no_object_or_marker_and_the_rerun_completes(
    moto_s3, built_shards, sample_dir, bucket, proxy, monkeypatch
):
    use_endpoint(monkeypatch, proxy.endpoint)
    proxy.fail(r"/train-000003\.parquet$", times=10_000, status=503, method="PUT")
    output = f"s3://{bucket}/out"
    with pytest.raises(OSError):
        run_build(small_build_config(sample_dir, output))
    keys = {k.removeprefix("out/") for k in moto_s3.keys(bucket, "out/")}
    assert "manifest.json" not in keys and "_build/config.json" in keys
    assert (
        not {shard_key("train", 3), shard_key("train", 3, "parquet"), "_build/train-000003.json"}
        & keys
    )
    markers = {k[len("_build/") : -len(".json")] for k in keys if k.startswith("_build/")}
    markers.discard("config")
    committed = [marker.rsplit("-", 1) for marker in markers]
    for fmt in ("tar", "parquet"):  # every final-named object belongs to a committed shard
        expected = {shard_key(split, int(index), fmt) for split, index in committed}
        assert {k for k in keys if k.endswith(f".{fmt}")} == expected
    assert markers  # the build got somewhere before the failure
    proxy.clear()
    summary = run_build(small_build_config(sample_dir, output))
    assert summary.shards_reused == len(markers)
    assert summary.shards_built == shard_count(built_shards) - len(markers)
    for name, data in local_files(built_shards.output).items():
        if not name.startswith("_build/"):
            assert moto_s3.get(bucket, f"out/{name}") == data, name


def shard_count(summary) -> int:
    return sum(len(s.shards) for s in summary.manifest.splits.values())


def test_a_changed_config_or_a_foreign_prefix_is_refused_on_s3(
    moto_s3, s3_build, sample_dir, bucket, monkeypatch
):
    copy_prefix(moto_s3, s3_build, bucket, "out")
    use_endpoint(monkeypatch, moto_s3.endpoint)
    with pytest.raises(BuildError, match=r"shard_size: 32 -> 16") as info:
        run_build(small_build_config(sample_dir, f"s3://{bucket}/out", shard_size=16))
    assert f"s3://{bucket}/out holds a build" in str(info.value)
    moto_s3.client().put_object(Bucket=bucket, Key="other/precious.txt", Body=b"keep")
    for overwrite in (False, True):
        with pytest.raises(BuildError, match="build"):
            run_build(small_build_config(sample_dir, f"s3://{bucket}/other", overwrite=overwrite))
    assert moto_s3.get(bucket, "other/precious.txt") == b"keep"
