"""`preprocess verify`, `info` and `index` on every store: a moto S3 server and a real
localhost HTTP server, read through the storage layer as the loader reads them.

Sources as users give them: a dataset we built (its manifest), shards another tool wrote
(their prefix, a glob where the store can list, a brace pattern, one file). Credentials and
the endpoint come from the client's standard environment, as on a real machine.
"""

from __future__ import annotations

import re
import shlex
import shutil

import pytest

from preprocess.cli import main as preprocess_main
from tests.httpserver import LocalHTTPServer
from tests.objectstore import MotoS3, isolate_aws_environment
from tests.test_foreign_shards import write_shardwriter_shards

BRACES = "shard-{000000..000002}.tar"


@pytest.fixture(scope="module")
def moto_s3():
    with MotoS3() as server:
        yield server


@pytest.fixture(scope="module")
def foreign_dir(tmp_path_factory):
    """webdataset ShardWriter shards: 25 samples in 3 tars, no manifest."""
    return write_shardwriter_shards(tmp_path_factory.mktemp("wds") / "shards")


@pytest.fixture
def s3_env(monkeypatch, tmp_path, moto_s3):
    isolate_aws_environment(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_s3.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.endpoint)
    return moto_s3


@pytest.fixture
def bucket(s3_env, request):
    name = "rc-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    s3_env.create_bucket(name)
    return name


def run(capsys, *argv: str) -> tuple[int, str]:
    code = preprocess_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_verify_info_index_on_s3_shards_another_tool_wrote(s3_env, bucket, foreign_dir, capsys):
    s3_env.upload_dir(foreign_dir, bucket, "wds")
    prefix = f"s3://{bucket}/wds"
    for source in (prefix, f"{prefix}/", f"{prefix}/*.tar", f"{prefix}/{BRACES}"):
        code, out = run(capsys, "verify", source)
        assert code == 0, out
        assert "3 tar shards without a manifest, 25 samples" in out
        assert f"preprocess index {prefix}" in out  # a hint that works, pasted
    code, out = run(capsys, "info", f"{prefix}/shard-000001.tar")
    assert code == 0 and "1 tar shards" in out and "samples: 10" in out, out
    code, out = run(capsys, "index", prefix)
    assert code == 0 and f"wrote {prefix}/manifest.json" in out, out
    assert "wds/manifest.json" in s3_env.keys(bucket, "wds/")
    # The manifest written to the store it read is what the next look finds.
    code, out = run(capsys, "verify", prefix)
    assert code == 0 and "verify: OK: 3 shards, 3 files, 25 samples" in out, out
    code, out = run(capsys, "info", prefix)
    assert code == 0 and "indexed by `preprocess index`" in out, out
    code, out = run(capsys, "index", prefix)  # ours now: the client files are rewritten
    assert code == 0 and "index: wrote" in out, out


def test_verify_and_info_on_a_built_dataset_in_s3_find_a_replaced_shard(
    s3_env, bucket, built_shards, capsys
):
    s3_env.upload_dir(built_shards.output, bucket, "out")
    code, out = run(capsys, "verify", f"s3://{bucket}/out")
    assert code == 0 and "verify: OK:" in out, out
    code, out = run(capsys, "info", f"s3://{bucket}/out/manifest.json")
    assert code == 0 and "split train:" in out, out
    key = next(k for k in s3_env.keys(bucket, "out/") if k.endswith(".tar"))
    s3_env.client().put_object(Bucket=bucket, Key=key, Body=b"replaced")
    code, out = run(capsys, "verify", f"s3://{bucket}/out/")
    assert code == 1 and "manifest says" in out, out


def test_verify_info_index_over_http(tmp_path, foreign_dir, built_shards, capsys, monkeypatch):
    root = tmp_path / "www"
    shutil.copytree(foreign_dir, root / "wds")
    shutil.copytree(built_shards.output, root / "out")
    monkeypatch.chdir(tmp_path)
    with LocalHTTPServer(root) as base:
        code, out = run(capsys, "verify", f"{base}/wds/{BRACES}")
        assert code == 0 and "3 tar shards without a manifest, 25 samples" in out, out
        # The printed hint is a command that works as pasted (a web server is read-only).
        hint = re.search(r"run `preprocess (index [^`]+)`", out).group(1)
        code, out = run(capsys, *shlex.split(hint))
        assert code == 0 and (tmp_path / "wds-index" / "manifest.json").is_file(), out
        code, out = run(capsys, "info", f"{base}/wds/{BRACES}")
        assert code == 0 and "samples: 25 (5 to 10 a shard)" in out, out
        code, out = run(capsys, "verify", f"{base}/wds/")
        assert code == 1 and "cannot be listed" in out and "{00000..00009}" in out, out
        # A web server cannot be written: the manifest goes where it is told, to be copied.
        code, out = run(capsys, "index", f"{base}/wds/{BRACES}", "--output", str(tmp_path / "m"))
        assert code == 0 and f"copy it (and the files beside it) to {base}/wds" in out, out
        shutil.copy(tmp_path / "m" / "manifest.json", root / "wds" / "manifest.json")
        code, out = run(capsys, "verify", f"{base}/wds/")
        assert code == 0 and "verify: OK: 3 shards, 3 files, 25 samples" in out, out
        code, out = run(capsys, "verify", f"{base}/out/")
        assert code == 0 and "verify: OK:" in out, out
        code, out = run(capsys, "info", f"{base}/out")
        assert code == 0 and "split train:" in out, out
        code, out = run(capsys, "index", f"{base}/out")
        assert code == 1 and "cannot write to http://" in out, out
