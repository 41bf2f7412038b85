"""`inspect_shuffle` and `pipeline inspect-shuffle`: the real delivery order, and mixing scores."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline import Resampled, cli
from pipeline.config import Batching, Crop, Shuffle, Workers
from pipeline.loader import LoaderConfig
from pipeline.shuffle_quality import (
    LabelReadError,
    batch_tv,
    delivery_order,
    inspect_shuffle,
    position_ks,
    read_labels,
    read_shard_labels,
    same_class_rate,
)
from pipeline.sources import ShardSpec, resolve_source
from shards.storage import RetryPolicy
from shards.tar import TarShardWriter, iter_tar_samples
from tests.pipeline.conftest import loader_for

SORTED_SHARDS = 8
SORTED_PER_SHARD = 24


@pytest.fixture(scope="module")
def sorted_shards(tmp_path_factory) -> str:
    """8 tar shards, each holding one class only (4 classes): the worst case for a stream."""
    root = tmp_path_factory.mktemp("sorted")
    for shard in range(SORTED_SHARDS):
        label = shard % 4
        encoded = io.BytesIO()
        Image.new("RGB", (16, 16), (60 * label, 90, 200 - 40 * label)).save(encoded, "JPEG")
        with open(root / f"sorted-{shard:06d}.tar", "wb") as stream:
            writer = TarShardWriter(stream)
            for i in range(SORTED_PER_SHARD):
                sample = {"__key__": f"s{shard}_{i:03d}", "jpg": encoded.getvalue()}
                writer.write({**sample, "cls": str(label).encode()})
            writer.close()
    return str(root / f"sorted-{{000000..{SORTED_SHARDS - 1:06d}}}.tar")


def sorted_config(source: str, **overrides) -> LoaderConfig:
    options = dict(
        source=source,
        batch=Batching(size=8),
        crop=Crop(image_size=16),
        workers=Workers(count=0),
        seed=11,
        shuffle=Shuffle(buffer=1, initial=1),
    )
    options.update(overrides)
    return LoaderConfig(**options)


def tar_keys(loader) -> list[list[str]]:
    """Keys of every shard of the loader's split, read from its tar shards."""
    keys = []
    for spec in loader.source.shards:
        with open(spec.url, "rb") as stream:
            keys.append([s["__key__"] for s in iter_tar_samples(stream, spec.url)])
    return keys


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (2, 2), (5, 0)])
def test_delivery_order_is_what_the_loader_yields(shard_dir, world, workers):
    loaders = [
        loader_for(shard_dir, rank=rank, world_size=world, workers=Workers(count=workers))
        for rank in range(world)
    ]
    report = inspect_shuffle(loaders[0].config, epochs=2, trials=2, search_buffer=False)
    keys_by_shard = tar_keys(loaders[0])
    for rank, loader in enumerate(loaders):
        for epoch in range(2):
            batches = list(loader)
            labels = np.concatenate([b[1].numpy() for b in batches])
            keys = [key for b in batches for key in b[2]]
            order = report.orders[epoch][rank]
            same = delivery_order(loader, epoch)
            assert np.array_equal(same.shards, order.shards)
            assert np.array_equal(same.offsets, order.offsets)
            assert np.array_equal(report.labels[epoch][rank], labels)
            assert order.batch_sizes == [len(b[1]) for b in batches]
            expected = [
                keys_by_shard[s][o] for s, o in zip(order.shards, order.offsets, strict=True)
            ]
            assert expected == keys
    assert report.samples == sum(len(x) for x in report.labels[0])


def test_class_sorted_shards_with_a_buffer_of_one_score_clearly_worse(sorted_shards):
    bad = inspect_shuffle(sorted_config(sorted_shards), epochs=2)
    good = inspect_shuffle(
        sorted_config(sorted_shards, shuffle=Shuffle(buffer=512, initial=512)), epochs=2
    )
    assert not bad.within_ideal
    assert min(bad.excess.values()) > 1.0  # every metric more than twice the ideal
    assert good.within_ideal
    assert max(good.excess.values()) < 0.3
    assert bad.stream.same_class_rate > 0.9  # 24-sample runs of one class
    assert bad.verdict.startswith("buffer too small: raise --shuffle-buffer to ~")
    size, initial = bad.suggested_buffer
    assert (
        inspect_shuffle(
            sorted_config(sorted_shards, shuffle=Shuffle(buffer=size, initial=initial)), epochs=1
        ).excess["batch_tv"]
        < bad.excess["batch_tv"]
    )


def test_a_buffer_cannot_mix_what_each_worker_never_sees(sorted_shards):
    # Two workers: each batch comes from one worker, whose run holds 4 of the 8 shards.
    report = inspect_shuffle(
        sorted_config(
            sorted_shards, shuffle=Shuffle(buffer=512, initial=512), workers=Workers(count=2)
        )
    )
    assert not report.within_ideal and report.suggested_buffer is None
    assert "no shuffle buffer fixes it" in report.verdict


def test_sample_shuffled_build_mixes_near_ideal(shard_dir):
    report = inspect_shuffle(loader_for(shard_dir, workers=Workers(count=2)).config, epochs=2)
    assert report.within_ideal
    assert max(report.excess.values()) < 0.3
    assert report.verdict.startswith("mixing is within")
    assert report.classes == 4


def test_deterministic_and_seeded(shard_dir):
    config = loader_for(shard_dir).config
    first, second = inspect_shuffle(config), inspect_shuffle(config)
    assert np.array_equal(first.labels[0][0], second.labels[0][0])
    assert first.stream == second.stream and first.ideal == second.ideal
    other = inspect_shuffle(replace(config, seed=12))
    assert not np.array_equal(first.labels[0][0], other.labels[0][0])


def test_no_image_is_opened(sorted_shards, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("inspect_shuffle opened an image")

    monkeypatch.setattr(Image, "open", refuse)
    report = inspect_shuffle(sorted_config(sorted_shards), search_buffer=False)
    assert report.samples == SORTED_SHARDS * SORTED_PER_SHARD


def test_tar_and_parquet_labels_agree(shard_dir):
    retry = RetryPolicy()
    tar = resolve_source(str(shard_dir), "train", "tar")
    parquet = resolve_source(str(shard_dir), "train", "parquet")
    tar_labels = read_labels(tar.shards, retry, None, threads=2)
    parquet_labels = read_labels(parquet.shards, retry, None, threads=2)
    assert len(tar_labels) == len(parquet_labels) > 1
    for a, b in zip(tar_labels, parquet_labels, strict=True):
        assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)


def test_a_count_unlike_the_manifest_is_an_error(sorted_shards):
    url = sorted_shards.replace("{000000..000007}", "000000")
    with pytest.raises(
        LabelReadError, match="shard_short: the archive ends after 24 samples, 25 expected"
    ):
        read_shard_labels(ShardSpec(url, "tar", 25), RetryPolicy())
    with pytest.raises(LabelReadError, match="shard_long"):
        read_shard_labels(ShardSpec(url, "tar", 23), RetryPolicy())


def test_resampled_mode_is_refused(sorted_shards):
    with pytest.raises(ValueError, match="exact epochs"):
        inspect_shuffle(sorted_config(sorted_shards, sampling=Resampled()))


def test_statistics_on_known_streams():
    sorted_stream, alternating = np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1])
    assert same_class_rate(sorted_stream) == pytest.approx(2 / 3)
    assert same_class_rate(alternating) == 0.0
    half = np.array([0.5, 0.5])
    assert batch_tv(sorted_stream, [2, 2], half) == pytest.approx(0.5)
    assert batch_tv(alternating, [2, 2], half) == 0.0
    # Class 0 at quantiles 1/8 and 3/8: its ECDF is 1 at 3/8, where uniform is 3/8.
    assert position_ks(sorted_stream, 2) == pytest.approx(0.625)
    assert position_ks(alternating, 2) == pytest.approx(0.375)


def test_cli_prints_the_table_and_verdict(sorted_shards, capsys):
    code = cli.main(
        ["inspect-shuffle", sorted_shards, "--batch-size", "8", "--workers", "0"]
        + ["--shuffle-buffer", "1", "--shuffle-initial", "1", "--epochs", "2", "--seed", "11"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "same class as previous sample" in out and "192 samples/epoch" in out
    assert "verdict: buffer too small: raise --shuffle-buffer to ~" in out


def test_cli_json_and_errors(shard_dir, capsys):
    args = ["inspect-shuffle", str(shard_dir), "--batch-size", "8", "--workers", "1", "--json"]
    assert cli.main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["within_ideal"] is True and summary["classes"] == 4
    assert set(summary["excess"]) == {"same_class_rate", "batch_tv", "position_ks"}
    # A missing manifest is one of our errors (`ManifestNotFoundError`): one line, exit 1.
    assert cli.main(["inspect-shuffle", str(shard_dir / "missing.json")]) == 1
    err = capsys.readouterr().err
    assert "inspect-shuffle: error: no manifest at" in err and "Traceback" not in err


def test_installed_console_script(shard_dir):
    script = shutil.which("pipeline", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the `pipeline` console script is not installed (pip install -e .)")
    result = subprocess.run(
        [script, "inspect-shuffle", str(shard_dir), "--batch-size", "8", "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "verdict: mixing is within" in result.stdout


@pytest.fixture(scope="module")
def sorted_multilabel_shards(tmp_path_factory) -> str:
    """8 tar shards of multi-label samples: all hold class 0, each shard one more class of 4.

    Every other sample also holds class 5 (spread evenly), and one per shard no label: the
    rarest label of a sample is its shard's class, so the stream is sorted by it.
    """
    root = tmp_path_factory.mktemp("sorted-multi")
    encoded = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 90, 200)).save(encoded, "JPEG")
    for shard in range(SORTED_SHARDS):
        with open(root / f"multi-{shard:06d}.tar", "wb") as stream:
            writer = TarShardWriter(stream)
            for i in range(SORTED_PER_SHARD):
                labels = [] if i == 0 else [0, 1 + shard % 4] + ([5] if i % 2 == 0 else [])
                meta = {"tags": labels}
                writer.write(
                    {
                        "__key__": f"m{shard}_{i:03d}",
                        "jpg": encoded.getvalue(),
                        "labels": json.dumps(labels).encode(),
                        "json": json.dumps(meta).encode(),
                    }
                )
            writer.close()
    return str(root / f"multi-{{000000..{SORTED_SHARDS - 1:06d}}}.tar")


def test_multilabel_streams_are_measured_by_their_rarest_label(sorted_multilabel_shards):
    config = sorted_config(sorted_multilabel_shards, fields=("image",))
    bad = inspect_shuffle(config, epochs=2, label_field="labels")
    good = inspect_shuffle(
        replace(config, shuffle=Shuffle(buffer=512, initial=512)), epochs=2, label_field="labels"
    )
    assert bad.label_field == "labels" and bad.to_dict()["label_field"] == "labels"
    # Labels 0..5 exist; class 6 is "no label"; 0 and 5 are never any sample's rarest.
    assert bad.classes == 7
    delivered = np.concatenate(bad.labels[0])
    assert set(np.unique(delivered).tolist()) == {1, 2, 3, 4, 6}
    assert np.bincount(delivered, minlength=7)[6] == SORTED_SHARDS  # one unlabelled per shard
    assert not bad.within_ideal and bad.stream.same_class_rate > 0.8
    assert good.within_ideal
    by_key = inspect_shuffle(config, epochs=1, label_field="json:tags", search_buffer=False)
    assert np.array_equal(by_key.labels[0][0], bad.labels[0][0])


def test_cli_label_field(sorted_multilabel_shards, capsys):
    args = ["inspect-shuffle", sorted_multilabel_shards, "--batch-size", "8", "--workers", "0"]
    assert cli.main([*args, "--label-field", "labels", "--no-search"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("labels from labels (multi-label: each sample as its rarest label)")
    assert "192 samples/epoch, 7 classes" in out
    with pytest.raises(SystemExit) as stop:
        cli.main([*args, "--label-field", "tags"])
    assert stop.value.code == 2
    assert "--label-field 'tags'" in capsys.readouterr().err
    # The default reads cls, which these shards do not have: one clear error.
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "cannot read the labels of" in err and "--label-field" in err


def test_rarest_labels_of_known_sets():
    from pipeline.shuffle_quality import rarest_labels

    # Counts over both shards: 0 x3, 1 x2, 2 x1.
    first = (np.array([0, 1, 0, 2]), np.array([2, 0, 2]))  # {0,1}, {}, {0,2}
    second = (np.array([0, 1]), np.array([2]))  # {0,1}
    assert [r.tolist() for r in rarest_labels([first, second])] == [[1, 3, 2], [1]]
