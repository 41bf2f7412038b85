"""`train --train-shards` names a manifest's folder on a store as it names a local one
(issue 31): over http and s3, the train split and the val split beside it are read."""

from __future__ import annotations

import json

from tests.httpserver import LocalHTTPServer
from tests.objectstore import MotoS3, isolate_aws_environment
from tests.trainers.conftest import train_main


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_reads_a_manifest_folder_over_http(train_shards, tmp_path):
    with LocalHTTPServer(train_shards) as base:
        assert train_main(f"{base}/", tmp_path / "run", epochs=1) == 0
    assert any("val_loss" in row or "val_top1" in row for row in metrics(tmp_path / "run"))


def test_train_reads_a_manifest_folder_over_s3(train_shards, tmp_path, monkeypatch):
    isolate_aws_environment(monkeypatch, tmp_path)
    with MotoS3() as s3:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
        s3.create_bucket("data")
        s3.upload_dir(train_shards, "data", "shards")
        assert train_main("s3://data/shards", tmp_path / "run", epochs=1) == 0
    assert any("val_loss" in row or "val_top1" in row for row in metrics(tmp_path / "run"))


def test_train_draws_remote_tars_without_a_manifest_with_resampled(train_shards, tmp_path):
    """webdataset's everyday case (issue 31): tars on a web server, no manifest, no counts.
    `--resampled` draws `--train-epoch-samples` an epoch; without it the one-line refusal
    names the ways on."""
    served = tmp_path / "served"
    served.mkdir()
    shards = sorted((train_shards / "tar").glob("train-*.tar"))
    for shard in shards:
        (served / shard.name).write_bytes(shard.read_bytes())
    last = len(shards) - 1
    with LocalHTTPServer(served) as base:
        pattern = f"{base}/train-{{000000..{last:06d}}}.tar"
        flags = {"format": "tar", "num_classes": 4, "epochs": 1, "val_shards": None}
        run = tmp_path / "run"
        assert train_main(pattern, run, resampled=True, train_epoch_samples=96, **flags) == 0
        assert train_main(pattern, tmp_path / "exact", **flags) == 1
    steps = [row for row in metrics(run) if row.get("kind") == "train"]
    assert steps and max(row["step"] for row in steps) == 96 // 16  # 96 drawn, batches of 16
