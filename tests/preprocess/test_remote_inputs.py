"""Build inputs on an http(s) server or in S3 read through `shards.storage`, as shards are.

A real localhost HTTP server and a moto S3 store behind a fault-injecting proxy: a
server that fails the first requests is retried and the build loses nothing; one that
stalls is ended by the deadline as a counted skip naming the URL, never a hang.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

import preprocess.images
from preprocess.images import read_source
from preprocess.job import run_build
from preprocess.listing import InputError
from preprocess.ray_job import BuildError
from preprocess.sources import stream_sources
from shards.sample import SampleError
from shards.storage import RetryPolicy
from tests.conftest import small_build_config
from tests.httpserver import LocalHTTPServer

FAST = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02, timeout=0.5, deadline=2.0)
IMAGES = 12


@pytest.fixture(autouse=True)
def fast_input_retry(monkeypatch):
    """Inline builds read in this process: a short budget keeps stalls short."""
    monkeypatch.setattr(preprocess.images, "INPUT_RETRY", FAST)


@pytest.fixture
def served(sample_dir, tmp_path):
    """`IMAGES` sample images under one directory with a `list.csv` naming them."""
    root = tmp_path / "www"
    files = sorted(sample_dir.rglob("*.jpg"))[:IMAGES]
    rows = []
    for path in files:
        rel = path.relative_to(sample_dir).as_posix()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, root / rel)
        rows.append(f"{rel},{path.parent.name}")
    (root / "list.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    return root, [row.split(",")[0] for row in rows]


def build_from(url, tmp_path, name="out", **overrides):
    options = {"val_fraction": 0.0, "max_skip_fraction": 1.0, **overrides}
    return run_build(small_build_config(url, tmp_path / name, **options)), tmp_path / name


def skips(output) -> dict[str, dict]:
    lines = (output / "errors.jsonl").read_text().splitlines()
    return {entry["path"]: entry for entry in map(json.loads, lines)}


def test_a_list_file_on_an_http_server_builds_like_the_local_list(served, tmp_path):
    root, rels = served
    local, local_out = build_from(root / "list.csv", tmp_path, "local")
    server = LocalHTTPServer(root)
    server.fail(f"/{rels[3]}", count=2, status=503)  # fails twice, then serves
    server.fail("/list.csv", count=1, status=502)
    with server as base:
        remote, remote_out = build_from(f"{base}/list.csv", tmp_path, "remote")
    assert remote.manifest.written == local.manifest.written == IMAGES
    assert not remote.manifest.skipped
    assert server.count(f"/{rels[3]}") == 3 and server.count("/list.csv") == 2
    for shard in sorted(local_out.rglob("*.tar")):
        assert (remote_out / shard.relative_to(local_out)).read_bytes() == shard.read_bytes()


def test_a_remote_list_takes_absolute_urls_beside_relative_rows(served, tmp_path):
    """A list on the server naming half its images by absolute URL (another host name for
    the server) and half relative to itself builds them all; an absolute URL with a
    scheme no store serves is refused naming its row."""
    root, rels = served
    with LocalHTTPServer(root) as base:
        other = base.replace("127.0.0.1", "localhost")
        rows = [f"{other}/{rel}," if i % 2 else f"{rel}," for i, rel in enumerate(rels)]
        rows = [row + rel.split("/")[0] for row, rel in zip(rows, rels, strict=True)]
        (root / "mixed.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
        built, out = build_from(f"{base}/mixed.csv", tmp_path, "mixed")
        assert built.manifest.written == IMAGES and not built.manifest.skipped
        (root / "bad.csv").write_text(f"path,label\nftp://h/{rels[0]},a\n")
        with pytest.raises(InputError, match=r"bad.csv line 2.*scheme not allowed: 'ftp'"):
            build_from(f"{base}/bad.csv", tmp_path, "bad")


def test_a_stalled_image_is_a_counted_skip_at_the_deadline_never_a_hang(served, tmp_path):
    root, rels = served
    server = LocalHTTPServer(root)
    server.stall(f"/{rels[5]}", after_bytes=None, times=100)  # hangs before the headers
    server.drip(f"/{rels[6]}", interval=0.05, times=100)  # no read stalls; the whole crawls
    (root / rels[7]).unlink()  # a 404: missing, as a local file would be
    started = time.monotonic()
    with server as base:
        summary, out = build_from(f"{base}/list.csv", tmp_path)
    assert time.monotonic() - started < 30  # the server would hang each request 30 s
    assert summary.manifest.skipped == {"io_error": 2, "missing": 1}
    assert summary.manifest.written == IMAGES - 3
    stalled, dripped, missing = (skips(out)[rels[i]] for i in (5, 6, 7))
    assert f"{base}/{rels[5]}: TimeoutError" in stalled["detail"]
    assert "3 attempt(s)" in stalled["detail"]
    assert f"{base}/{rels[6]}: deadline of 2 s" in dripped["detail"]
    assert f"{base}/{rels[7]}: HTTP 404" in missing["detail"]


def test_remote_input_errors_name_the_url_redacted(tmp_path):
    secret = "t0ken-d0-n0t-l3ak"
    with LocalHTTPServer(tmp_path) as base, pytest.raises(SampleError) as missing:
        read_source(f"{base}/absent.jpg?X-Amz-Signature={secret}", 1000)
    assert missing.value.reason == "missing"
    assert "X-Amz-Signature=REDACTED" in str(missing.value) and secret not in str(missing.value)


def test_an_http_tree_is_refused_with_what_to_pass_instead(tmp_path):
    with LocalHTTPServer(tmp_path) as base, pytest.raises(InputError, match="cannot be listed"):
        list(stream_sources(f"{base}/images")[1])


def test_a_file_url_input_is_the_local_tree(sample_dir, tmp_path):
    listing, items = stream_sources(sample_dir.as_uri())
    assert len(list(items)) == 240 and listing.root == str(sample_dir)


# Credentials never enter the output (issue 29) -------------------------------------------
SECRETS = ("alice", "hunter2pw", "SIGSECRET", "TOKSECRET", "LISTSECRET")


def output_text(output) -> list[tuple[str, str]]:
    """(where, text) of every byte the build left in `output`: each file raw, each tar
    member, and every Parquet value and metadata entry decoded (pages may be compressed)."""
    import io
    import tarfile

    import pyarrow.parquet as pq

    found = []
    for path in sorted(p for p in output.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found.append((str(path), data.decode("latin-1")))
        if path.suffix == ".tar":
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                for member in tar.getmembers():
                    text = tar.extractfile(member).read().decode("latin-1")
                    found.append((f"{path}:{member.name}", member.name + text))
        if path.suffix == ".parquet":
            parquet = pq.ParquetFile(path)
            metadata = parquet.schema_arrow.metadata or {}
            found.append((f"{path}:meta", repr(metadata)))
            table = parquet.read()
            for name in table.column_names:
                found.append((f"{path}:{name}", repr(table.column(name).to_pylist())))
    return found


def secrets_in_output(output, *extra: str) -> list[str]:
    texts = output_text(output) + [("log", text) for text in extra]
    return [f"{secret} in {where}" for where, text in texts for secret in SECRETS if secret in text]


def test_credentials_in_input_urls_never_reach_the_output(served, tmp_path, caplog):
    """Rows naming two hosts by URL with Basic auth and signed queries, some failing;
    then a list that is itself behind credentials, its rows relative to it."""
    root, rels = served
    (root / rels[2]).unlink()  # a 404
    server = LocalHTTPServer(root)
    server.fail(f"/{rels[4]}", count=100, status=503)  # past the retries: io_error
    caplog.set_level("DEBUG")
    with server as base:
        port = base.rsplit(":", 1)[1]
        hosts = [
            f"http://alice:hunter2pw@127.0.0.1:{port}",
            f"http://alice:hunter2pw@localhost:{port}",
        ]
        query = "?X-Amz-Signature=SIGSECRET&X-Amz-Credential=AKIA%2Falice&part=1;token=TOKSECRET"
        rows = [f"{hosts[i % 2]}/{rel}{query},{rel.split('/')[0]}" for i, rel in enumerate(rels)]
        (tmp_path / "urls.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
        summary, out = build_from(tmp_path / "urls.csv", tmp_path, "absolute",
                                  formats=("tar", "parquet"))  # fmt: skip
        # Relative rows of a list behind credentials are read with the list's.
        listed, listed_out = build_from(f"{hosts[0]}/list.csv?token=LISTSECRET", tmp_path,
                                        "listed", formats=("tar", "parquet"))  # fmt: skip
    for built in (summary, listed):
        assert built.manifest.skipped == {"missing": 1, "io_error": 1}
        assert built.manifest.written == IMAGES - 2
    assert secrets_in_output(out, caplog.text) == [], "\n".join(secrets_in_output(out, caplog.text))
    assert secrets_in_output(listed_out, caplog.text) == []
    # Still recorded, redacted: where each sample came from and which inputs failed.
    failed = {
        entry["path"] for entry in map(json.loads, (out / "errors.jsonl").read_text().splitlines())
    }
    name = rels[2].rsplit("/", 1)[-1]
    assert any(f"127.0.0.1:{port}/" in path and f"{name}?X-Amz-Signature=REDACTED" in path
               for path in failed)  # fmt: skip
    assert any("token=REDACTED" in path for path in failed)


def test_a_refused_build_leaves_no_credentials_behind(served, tmp_path):
    """Over its skip budget the build is refused: its plan, which names the inputs as
    listed, goes with it as it does after a finished build."""
    root, rels = served
    (root / rels[2]).unlink()
    with LocalHTTPServer(root) as base:
        signed = base.replace("http://", "http://alice:hunter2pw@")
        rows = [f"{signed}/{rel}?X-Amz-Signature=SIGSECRET,{rel.split('/')[0]}" for rel in rels]
        (tmp_path / "urls.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
        with pytest.raises(BuildError, match="skipped"):
            build_from(tmp_path / "urls.csv", tmp_path, max_skip_fraction=0.0)
    assert (tmp_path / "out" / "errors.jsonl").exists()  # what it did write is kept
    assert secrets_in_output(tmp_path / "out") == []


# S3 (moto) --------------------------------------------------------------------------


@pytest.fixture
def s3_inputs(sample_dir, monkeypatch, tmp_path):
    """The sample tree in `s3://inputs/images`, read through a fault proxy via the environment."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from tests.objectstore import FaultProxy, MotoS3, isolate_aws_environment

    isolate_aws_environment(monkeypatch, tmp_path)
    with MotoS3() as s3, FaultProxy(s3.endpoint) as proxy:
        s3.create_bucket("inputs")
        s3.upload_dir(sample_dir, "inputs", "images")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        yield s3, proxy


def test_s3_inputs_survive_503s_and_a_stalled_image_is_a_counted_skip(
    s3_inputs, built_shards, tmp_path
):
    s3, proxy = s3_inputs
    image_fault = proxy.fail(r"/inputs/images/class_000/.*\.jpg$", times=2, status=503)
    listing_fault = proxy.fail(r"/inputs/?$", times=1, status=503)  # a listing call
    summary, out = build_from("s3://inputs/images", tmp_path, val_fraction=0.2)  # as built
    assert image_fault.injected == 2 and listing_fault.injected == 1
    assert summary.manifest.inputs == built_shards.manifest.inputs
    assert not summary.manifest.skipped
    for shard in sorted(built_shards.output.rglob("*.tar")):
        assert (out / shard.relative_to(built_shards.output)).read_bytes() == shard.read_bytes()
    stalled = (
        "class_001/"
        + sorted(key.rsplit("/", 1)[1] for key in s3.keys("inputs", "images/class_001/"))[0]
    )
    proxy.clear()
    proxy.stall(rf"/inputs/images/{stalled}$", times=100)
    started = time.monotonic()
    summary, out = build_from("s3://inputs/images", tmp_path, "stalled")
    assert time.monotonic() - started < 60
    assert summary.manifest.skipped == {"io_error": 1}
    assert f"s3://inputs/images/{stalled}" in skips(out)[stalled]["detail"]


def test_s3_listing_takes_storage_options(s3_inputs, sample_dir):
    s3, proxy = s3_inputs
    listing, items = stream_sources(
        "s3://inputs/images", storage_options=s3.storage_options(proxy.endpoint)
    )
    assert len(list(items)) == len(list(sample_dir.rglob("*.*")))


@pytest.fixture
def s3_without_environment(sample_dir, monkeypatch, tmp_path):
    """The sample tree in `s3://inputs/images` and a bucket `outputs`, and no `AWS_*`
    endpoint or credentials at all: only `storage_options` can reach them."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from tests.objectstore import FaultProxy, MotoS3, isolate_aws_environment

    isolate_aws_environment(monkeypatch, tmp_path)
    with MotoS3() as s3, FaultProxy(s3.endpoint) as proxy:
        s3.create_bucket("inputs")
        s3.create_bucket("outputs")
        s3.upload_dir(sample_dir, "inputs", "images")
        yield s3, proxy


def test_a_build_reads_and_writes_s3_with_its_storage_options_alone(
    s3_without_environment, built_shards, tmp_path
):
    s3, proxy = s3_without_environment
    # Through the proxy: its 503s show the images themselves were read with these options.
    images = proxy.fail(r"/inputs/images/class_000/.*\.jpg$", times=2, status=503)
    options = s3.storage_options(proxy.endpoint)
    config = small_build_config(
        "s3://inputs/images", "s3://outputs/shards", storage_options=options
    )
    summary = run_build(config)
    assert images.injected == 2
    assert not summary.manifest.skipped
    assert summary.manifest.inputs == built_shards.manifest.inputs
    for shard in sorted(built_shards.output.rglob("*.tar")):
        key = "shards/" + shard.relative_to(built_shards.output).as_posix()
        assert s3.get("outputs", key) == shard.read_bytes()
    # The options hold the credentials: nothing the build wrote names them.
    for key in s3.keys("outputs", "shards/"):
        if key.endswith((".json", ".jsonl")):
            text = s3.get("outputs", key).decode()
            assert s3.secret_key not in text and "storage_options" not in text, key
