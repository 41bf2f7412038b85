"""Shards we did not build: webdataset `ShardWriter`, img2dataset and HF `to_parquet` output.

The loader, `preprocess verify`, `info` and `index` take them as a directory without our
manifest, a glob or a brace pattern; `preprocess index` saves a manifest beside them, after
which exact epochs, equal batches per rank and resume work as on our own shards.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import tarfile
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.config import Batching, LoaderConfig, ReadOptions, Workers
from pipeline.loader import build_loader
from pipeline.sources import resolve_source
from preprocess.cli import main as preprocess_main
from shards.errors import UsageError
from shards.manifest import read_manifest
from shards.storage.write import file_sha256
from tests.pipeline.conftest import epoch_keys, loader_for

SHARDWRITER_SAMPLES = 25  # 10 + 10 + 5 in three shards
TEXT_FIELDS = ("image", "txt")


def jpeg_bytes(seed: int, size: tuple[int, int] = (24, 28)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG")
    return buffer.getvalue()


def write_shardwriter_shards(folder, count: int = SHARDWRITER_SAMPLES, corrupt: int | None = None):
    """webdataset's own `ShardWriter`: `shard-000000.tar`, ... of 10 samples each."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "shard-%06d.tar"), maxcount=10, verbose=0) as sink:
        for i in range(count):
            image = b"not a jpeg at all" if i == corrupt else jpeg_bytes(i)
            sink.write(
                {
                    "__key__": f"{i:09d}",
                    "jpg": image,
                    "txt": f"caption {i}",
                    "json": json.dumps({"i": i}).encode(),
                }
            )
    return folder


@pytest.fixture(scope="module")
def shardwriter_dir(tmp_path_factory):
    return write_shardwriter_shards(tmp_path_factory.mktemp("wds") / "shards")


def add_member(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def img2dataset_dir(tmp_path_factory):
    """img2dataset's webdataset layout: `00000.tar` of `000000000.jpg/.txt/.json`, with a
    `00000.parquet` of its download status and a `00000_stats.json` beside each."""
    folder = tmp_path_factory.mktemp("img2dataset") / "out"
    folder.mkdir()
    for shard in range(2):
        rows = []
        with tarfile.open(folder / f"{shard:05d}.tar", "w", format=tarfile.GNU_FORMAT) as archive:
            for i in range(6):
                key = f"{shard:05d}{i:04d}"
                meta = {"key": key, "caption": f"a photo {key}", "url": f"http://x/{key}.jpg"}
                add_member(archive, f"{key}.jpg", jpeg_bytes(shard * 100 + i))
                add_member(archive, f"{key}.txt", meta["caption"].encode())
                add_member(archive, f"{key}.json", json.dumps(meta).encode())
                rows.append(
                    {**meta, "status": "success", "error_message": None, "width": 28, "height": 24}
                )
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{shard:05d}.parquet")
        (folder / f"{shard:05d}_stats.json").write_text(json.dumps({"count": 6}))
    return folder


def shard_keys(folder, pattern: str = "*.tar") -> list[str]:
    """Every sample key of the tar shards in `folder`, read with the standard library."""
    keys = []
    for path in sorted(folder.glob(pattern)):
        with tarfile.open(path) as archive:
            names = [m.name.split(".", 1)[0] for m in archive.getmembers()]
        keys += list(dict.fromkeys(names))
    return keys


def foreign_loader(source, **overrides):
    options = dict(fields=TEXT_FIELDS, batch=Batching(size=8, epoch_rule="uneven", drop_last=False))
    return loader_for(source, **{**options, **overrides})


def test_loader_reads_a_shardwriter_folder_exactly_once_and_says_so_once(tmp_path, caplog):
    shardwriter_dir = write_shardwriter_shards(tmp_path / "fresh")  # not yet told of
    expected = Counter(shard_keys(shardwriter_dir))
    assert sum(expected.values()) == SHARDWRITER_SAMPLES
    seen = Counter()
    with caplog.at_level(logging.INFO, logger="pipeline"):
        for rank in range(2):
            loader = foreign_loader(
                shardwriter_dir, rank=rank, world_size=2, workers=Workers(count=2)
            )
            for keys in epoch_keys(loader):
                seen.update(keys)
    assert seen == expected
    notes = [r.getMessage() for r in caplog.records if "without a manifest" in r.getMessage()]
    assert len(notes) == 1  # once a process: not per rank's loader, nor per worker
    assert "3 shards without a manifest: counted by reading them" in notes[0]
    assert f"preprocess index {shardwriter_dir}" in notes[0]
    assert not any("cannot be counted" in r.getMessage() for r in caplog.records)


def test_a_glob_and_the_folder_name_the_same_shards(shardwriter_dir):
    folder = resolve_source(str(shardwriter_dir), "train")
    for pattern in ("*.tar", "**/*.tar", "shard-00000?.tar"):
        globbed = resolve_source(str(shardwriter_dir / pattern), "train")
        assert [s.url for s in globbed.shards] == [s.url for s in folder.shards]
    assert folder.counts.tolist() == [10, 10, 5]
    with pytest.raises(UsageError, match="no file matches"):
        resolve_source(str(shardwriter_dir / "*.parquet"), "train")


def test_mixed_formats_are_refused_naming_both_and_format_chooses(img2dataset_dir, tmp_path):
    """img2dataset's status Parquet beside its tars (with `_stats.json`) is no shard: the
    folder is its tars. Tar and Parquet shards side by side otherwise are refused."""
    assert resolve_source(str(img2dataset_dir), "train").shards.fmt == "tar"
    mixed = shutil.copytree(img2dataset_dir, tmp_path / "mixed")
    for stats in mixed.glob("*_stats.json"):
        stats.unlink()
    with pytest.raises(UsageError) as refusal:
        resolve_source(str(mixed), "train")
    line = str(refusal.value)
    assert "\n" not in line and "2 parquet, 2 tar" in line
    assert "format='parquet' or format='tar'" in line
    tars = resolve_source(str(img2dataset_dir), "train", "tar")
    assert tars.total_samples == 12 and tars.shards.fmt == "tar"
    keys = Counter(
        k for keys in epoch_keys(foreign_loader(img2dataset_dir, format="tar")) for k in keys
    )
    assert keys == Counter(shard_keys(img2dataset_dir))


def test_a_brace_range_with_missing_shards_is_refused_in_one_line(shardwriter_dir, caplog):
    pattern = str(shardwriter_dir / "shard-{000000..000006}.tar")
    with pytest.raises(UsageError) as refusal:
        resolve_source(pattern, "train")
    line = str(refusal.value)
    assert "\n" not in line and "4 of the 7 shards named do not exist" in line
    assert "shard-000003.tar" in line and "and 1 more" in line
    assert "allow_missing_shards=True" in line and "--allow-missing-shards" in line
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        found = resolve_source(pattern, "train", allow_missing=True)
    assert found.total_samples == SHARDWRITER_SAMPLES
    assert sum("do not exist" in r.getMessage() for r in caplog.records) == 1
    # The loader's setting says the same.
    with pytest.raises(UsageError, match="4 of the 7 shards named do not exist"):
        build_loader(LoaderConfig(pattern, fields=("image", "txt"), workers=Workers(count=0)))
    loader = build_loader(
        LoaderConfig(
            pattern,
            fields=("image", "txt"),
            workers=Workers(count=0),
            io=ReadOptions(allow_missing_shards=True),
        )
    )
    assert loader.source.total_samples == SHARDWRITER_SAMPLES


def test_verify_and_info_report_what_the_shards_hold(shardwriter_dir, capsys):
    assert preprocess_main(["verify", str(shardwriter_dir)]) == 0
    out = capsys.readouterr().out
    assert "3 tar shards without a manifest, 25 samples" in out
    assert "members: jpg 25, json 25, txt 25 of 25 samples; decode failures: none" in out
    assert preprocess_main(["info", str(shardwriter_dir / "shard-000000.tar")]) == 0
    captured = capsys.readouterr()
    assert "samples: 10 (10 to 10 a shard)" in captured.out
    assert "no classes (label-free)" in captured.out
    assert "UTF-8" not in captured.out + captured.err
    assert "did not finish" not in captured.out + captured.err


def test_verify_counts_decode_failures_in_shards_we_did_not_build(tmp_path, capsys):
    folder = write_shardwriter_shards(tmp_path / "bad", count=12, corrupt=4)
    assert preprocess_main(["verify", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "FAILED: 1 of 12 samples in 2 tar shards would be skipped" in err
    assert "shard-000000.tar sample 000000004" in err and "did not finish" not in err


def test_hf_parquet_is_read_as_it_is(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    images = [{"bytes": jpeg_bytes(i), "path": None} for i in range(9)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict({"image": images, "label": list(range(9))}, features)
    (tmp_path / "hf").mkdir()
    dataset.to_parquet(str(tmp_path / "hf" / "train-00000.parquet"))
    assert preprocess_main(["verify", str(tmp_path / "hf")]) == 0
    assert "9 samples; members: image 9, label 9 of 9 samples" in capsys.readouterr().out
    assert resolve_source(str(tmp_path / "hf"), "train").total_samples == 9


def test_index_saves_a_manifest_then_ranks_get_equal_batches_and_resume_works(
    shardwriter_dir, tmp_path, capsys, caplog
):
    folder = tmp_path / "indexed"
    shutil.copytree(shardwriter_dir, folder)
    assert preprocess_main(["index", str(folder)]) == 0
    assert "3 tar shards, 25 samples; wrote" in capsys.readouterr().out
    manifest = read_manifest(folder)
    table = manifest.splits["train"].shards
    assert table.samples.tolist() == [10, 10, 5]
    assert table.names("tar") == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    files = table.file_columns("tar")
    assert files.sha256(2) == file_sha256(folder / "shard-000002.tar")
    assert manifest.fields["label"] == "none" and manifest.classes == []
    assert (folder / "_info.json").exists()
    assert preprocess_main(["verify", str(folder)]) == 0  # the manifest's checksums hold
    assert "OK: 3 shards, 3 files, 25 samples" in capsys.readouterr().out
    assert preprocess_main(["info", str(folder)]) == 0
    info = capsys.readouterr().out
    assert "no classes (label-free)" in info and "indexed by `preprocess index`" in info

    with caplog.at_level(logging.INFO, logger="pipeline"):
        counts = [
            len(epoch_keys(loader_for(folder, fields=TEXT_FIELDS, rank=r, world_size=3)))
            for r in range(3)
        ]
    assert len(set(counts)) == 1 and counts[0] > 0  # the pad rule: the same count per rank
    assert not any("without a manifest" in r.getMessage() for r in caplog.records)

    full = epoch_keys(foreign_loader(folder, workers=Workers(count=2, persistent=False)))
    interrupted = foreign_loader(folder, workers=Workers(count=2, persistent=False))
    head = epoch_keys(interrupted, limit=2)
    resumed = foreign_loader(folder, workers=Workers(count=2, persistent=False))
    resumed.load_state_dict(interrupted.state_dict())
    assert head + epoch_keys(resumed) == full
    assert Counter(k for keys in full for k in keys) == Counter(shard_keys(folder))


def test_index_refuses_a_manifest_away_from_the_shards(shardwriter_dir, tmp_path, capsys):
    assert preprocess_main(["index", str(shardwriter_dir), "--output", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "relative to its own folder" in err and str(shardwriter_dir) in err
    assert not (tmp_path / "manifest.json").exists()


def test_verify_and_info_expand_a_quoted_brace_pattern(shardwriter_dir, capsys):
    pattern = str(shardwriter_dir / "shard-{000000..000002}.tar")
    assert preprocess_main(["verify", pattern]) == 0
    assert "3 tar shards without a manifest, 25 samples" in capsys.readouterr().out
    assert preprocess_main(["info", str(shardwriter_dir / "shard-{000000..000001}.tar")]) == 0
    assert "samples: 20" in capsys.readouterr().out
    half = str(shardwriter_dir / "shard-{000000..000004}.tar")
    assert preprocess_main(["verify", half]) == 1
    err = capsys.readouterr().err
    assert (
        "2 of the 5 shards" in err and "do not exist" in err and len(err.strip().splitlines()) == 1
    )


def test_verify_info_and_index_read_parquet_without_a_class_column(tmp_path, capsys):
    """img2dataset's Parquet has no `cls`/`label` column: a survey must not ask for one."""
    from tests.pipeline.test_field_mapping import write_img2dataset_parquet

    folder = tmp_path / "i2d"
    folder.mkdir()
    write_img2dataset_parquet(folder / "00000.parquet")
    assert preprocess_main(["info", str(folder)]) == 0
    assert "no classes (label-free)" in capsys.readouterr().out
    assert preprocess_main(["index", str(folder)]) == 0
    assert "1 parquet shards" in capsys.readouterr().out
    # The failed downloads (null jpg cells) are what the loader would skip: verify says so.
    assert preprocess_main(["verify", str(folder)]) == 1
    assert "null_cell" in capsys.readouterr().err


def test_a_uint64_label_past_int64_costs_its_row_alone_in_the_loader_and_verify(tmp_path, capsys):
    """Issue 29: the shard was refused whole as bad_data, its good rows lost with it."""
    folder = tmp_path / "u64"
    folder.mkdir()
    labels = pa.array([1, 2, 2**64 - 1, 0, 3, 1], pa.uint64())
    table = pa.table({"image": [jpeg_bytes(i) for i in range(6)], "label": labels})
    features = {
        "image": {"_type": "Image"},
        "label": {"_type": "ClassLabel", "names": list("abcd")},
    }
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    pq.write_table(table.replace_schema_metadata(metadata), folder / "train.parquet")
    loader = foreign_loader(folder, fields=("image", "label"))
    delivered = [key for keys in epoch_keys(loader) for key in keys]
    # The skipped row's slot is refilled with a repeat, as for any skip.
    assert sorted({key[-1] for key in delivered}) == ["0", "1", "3", "4", "5"]
    assert loader.stats.workers[0]["skipped"] == {"bad_label": 1}
    assert loader.stats.workers[0]["bad_shards"] == {}
    assert preprocess_main(["verify", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "1 of 6 samples" in err and "(bad_label: 1)" in err and "18446744073709551615" in err


def test_a_parquet_file_repeating_keys_is_read_row_by_row_and_counted(tmp_path, capsys):
    """Issue 29: `k1, k1, k2, k2, k1, k3` lost 5 of its 6 rows as `non_adjacent_key`."""
    folder = tmp_path / "repeats"
    folder.mkdir()
    keys = ["k1", "k1", "k2", "k2", "k1", "k3"]
    images = [jpeg_bytes(i) for i in range(6)]
    table = pa.table({"__key__": keys, "image": images, "txt": [f"row {i}" for i in range(6)]})
    pq.write_table(table, folder / "a.parquet")
    assert preprocess_main(["verify", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "6 samples" in out and "3 rows repeat the key of an earlier row" in out
    assert "a.parquet" in out
    assert preprocess_main(["index", str(folder)]) == 0
    assert "3 rows repeat the key of an earlier row" in capsys.readouterr().out
    assert read_manifest(folder).config["indexed"]["repeated_keys"] == 3
    loader = foreign_loader(folder, batch=Batching(size=6, epoch_rule="uneven", drop_last=False))
    delivered = [key for keys in epoch_keys(loader) for key in keys]
    wanted = ["k1", "k1-000000001", "k2", "k2-000000003", "k1-000000004", "k3"]
    assert sorted(delivered) == sorted(wanted)
    assert loader.stats.workers[0]["skipped"] == {} and loader.stats.workers[0]["bad_shards"] == {}
