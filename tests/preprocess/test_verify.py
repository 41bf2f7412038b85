"""`preprocess verify` judges samples exactly as the loader does."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from pipeline.config import Batching, Crop, Workers
from pipeline.loader import LoaderConfig, build_loader
from preprocess.cli import main
from preprocess.verify import VerifyError, verify_directory
from shards.tar import TarShardWriter, iter_tar_samples
from tests.conftest import shard_key


def eps_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buffer, "EPS")
    return buffer.getvalue()


PSD_BYTES = b"8BPS\x00\x01" + bytes(6) + b"\x00\x03" + (8).to_bytes(4, "big") * 2 + bytes(64)


def replace_images(directory: Path, name: str, images: dict[int, object]) -> None:
    """Put other bytes in some `.jpg` members and make the manifest agree with the file."""
    path = directory / name
    with open(path, "rb") as stream:
        samples = list(iter_tar_samples(stream, str(path)))
    buffer = io.BytesIO()
    writer = TarShardWriter(buffer)
    for index, sample in enumerate(samples):
        sample = {k: v for k, v in sample.items() if k != "__url__"}
        if index in images:
            new = images[index]
            sample["jpg"] = new(sample["jpg"]) if callable(new) else new
        writer.write(sample)
    writer.close()
    path.write_bytes(buffer.getvalue())
    manifest = directory / "manifest.json"
    document = json.loads(manifest.read_text())
    for shard in document["splits"]["train"]["shards"]:
        file = shard["files"]["tar"]
        if file["name"] == name:
            file["bytes"] = len(buffer.getvalue())
            file["sha256"] = hashlib.sha256(buffer.getvalue()).hexdigest()
            shard["files"] = {"tar": file}
    for split in document["splits"].values():
        for shard in split["shards"]:
            shard["files"] = {"tar": shard["files"]["tar"]}
    document["formats"] = ["tar"]
    manifest.write_text(json.dumps(document))


def cut_in_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def loader_skips(directory: Path) -> dict[str, int]:
    """What one exactly-once epoch of the loader skips, by reason."""
    config = LoaderConfig(
        source=str(directory),
        batch=Batching(size=8),
        crop=Crop(image_size=32),
        workers=Workers(count=0),
        max_skip_fraction=1.0,
        train=False,
    )
    loader = build_loader(config)
    list(loader)
    return loader.stats.skipped


@pytest.fixture
def tar_only(built_shards, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(built_shards.output, out)
    return out


def test_verify_fails_on_what_the_loader_skips_and_counts_it_the_same(tar_only, capsys):
    replace_images(tar_only, shard_key("train", 0), {0: eps_bytes(), 3: PSD_BYTES, 5: cut_in_half})
    with pytest.raises(VerifyError) as raised:
        verify_directory(tar_only)
    message = str(raised.value)
    assert "3 of" in message and "unidentified: 2" in message and "truncated: 1" in message
    assert "train-000000.tar" in message

    assert loader_skips(tar_only) == {"unidentified": 2, "truncated": 1}
    assert main(["verify", str(tar_only)]) == 1
    assert "would be skipped by the loader" in capsys.readouterr().err


def replace_labels(directory: Path, name: str, labels: dict[int, bytes]) -> None:
    """Put other bytes in some `.cls` members (the manifest resealed to match)."""
    path = directory / name
    with open(path, "rb") as stream:
        samples = list(iter_tar_samples(stream, str(path)))
    originals = {index: sample["jpg"] for index, sample in enumerate(samples)}
    for index, label in labels.items():
        samples[index]["cls"] = label
    buffer = io.BytesIO()
    writer = TarShardWriter(buffer)
    for sample in samples:
        writer.write({k: v for k, v in sample.items() if k != "__url__"})
    writer.close()
    path.write_bytes(buffer.getvalue())
    replace_images(directory, name, {index: originals[index] for index in labels})


def test_a_label_past_the_manifests_classes_fails_verify_as_the_loader_skips_it(tar_only):
    classes = len(json.loads((tar_only / "manifest.json").read_text())["classes"])
    replace_labels(tar_only, shard_key("train", 0), {1: str(classes).encode()})
    with pytest.raises(VerifyError, match=r"1 of \d+ samples .*\(bad_label: 1\)"):
        verify_directory(tar_only)
    assert loader_skips(tar_only) == {"bad_label": 1}


def test_verify_passes_a_good_dataset_the_loader_reads_without_skips(tar_only):
    report = verify_directory(tar_only)
    assert report.samples > 0 and not report.skipped


def test_verify_reports_a_count_that_disagrees_with_the_shard(tar_only):
    manifest = tar_only / "manifest.json"
    document = json.loads(manifest.read_text())
    split = document["splits"]["train"]
    split["shards"][1]["samples"] -= 2
    split["samples"] -= 2
    document["written"] -= 2
    document["inputs"] -= 2
    split["shards"][1]["class_counts"] = []
    split["class_counts"] = []
    manifest.write_text(json.dumps(document))
    with pytest.raises(VerifyError, match="train-000001.tar: shard_long"):
        verify_directory(tar_only)
