"""Tests for `preprocess make-sample`: real files, determinism, learnable classes, safe output."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from preprocess.sample import KINDS, class_names, make_sample, render_image

COUNT = 120
CLASSES = 10
SEED = 3
FORMAT_OF_EXTENSION = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP", "bmp": "BMP", "tiff": "TIFF"}


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """One sample written in-process, shared by the read-only tests."""
    root = tmp_path_factory.mktemp("sample") / "images"
    summary = make_sample(root, COUNT, classes=CLASSES, seed=SEED, workers=1)
    return summary


def files_of(root: Path) -> dict[str, bytes]:
    """Map each file's path relative to `root` to its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def orientation_of(path: Path) -> int | None:
    with Image.open(path) as image:
        return image.getexif().get(0x0112)


def long_side_of(path: Path) -> int:
    with Image.open(path) as image:
        return max(image.size)


def upright(path: Path) -> Image.Image:
    with Image.open(path) as image:
        return ImageOps.exif_transpose(image).convert("RGB")


def test_tree_is_an_image_folder_with_each_index_once(sample):
    names = class_names(CLASSES)
    assert sorted(p.name for p in sample.output.iterdir()) == names
    files = sorted(sample.output.rglob("img_*"))
    assert len(files) == COUNT
    indices = sorted(int(p.name[4:].split(".")[0]) for p in files)
    assert indices == list(range(COUNT))
    for path in files:
        index = int(path.name[4:].split(".")[0])
        assert path.parent.name == names[index % CLASSES]
        assert path.name == f"img_{index:07d}.{path.suffix[1:]}"


def test_summary_counts_match_the_files(sample):
    assert sample.count == COUNT
    assert sample.classes == class_names(CLASSES)
    assert sum(sample.formats.values()) == COUNT
    assert set(sample.formats) == set(KINDS)  # the first images cycle through every kind
    assert sample.images_per_s > 0
    assert "120 images" in sample.describe()


def test_every_file_decodes_as_the_format_its_extension_names(sample):
    for path in sample.output.rglob("img_*"):
        with Image.open(path) as image:
            assert image.format == FORMAT_OF_EXTENSION[path.suffix[1:]], path
            image.load()


def test_odd_modes_and_orientation_are_present(sample):
    seen = set()
    for path in sample.output.rglob("img_*"):
        with Image.open(path) as image:
            orientation = image.getexif().get(0x0112)
            seen.add((image.format, image.mode, orientation in (3, 6, 8)))
    for wanted in [
        ("JPEG", "RGB", False),
        ("JPEG", "L", False),
        ("JPEG", "CMYK", False),
        ("JPEG", "RGB", True),
        ("PNG", "RGB", False),
        ("PNG", "RGBA", False),
        ("PNG", "P", False),
        ("WEBP", "RGB", False),
        ("BMP", "RGB", False),
        ("TIFF", "RGB", False),
    ]:
        assert wanted in seen


def test_exif_transpose_turns_rotated_jpegs_upright(sample):
    rotated = [
        p
        for p in sample.output.rglob("img_*.jpg")
        if Image.open(p).getexif().get(0x0112) in (3, 6, 8)
    ]
    assert rotated
    for path in rotated:
        index = int(path.name[4:].split(".")[0])
        expected = np.asarray(render_image(index, CLASSES, SEED)[1].convert("RGB"), np.int16)
        with Image.open(path) as stored:
            assert stored.size != expected.shape[1::-1] or stored.getexif()[0x0112] == 3
            raw = np.asarray(stored.convert("RGB"), np.int16)
        restored = np.asarray(upright(path), np.int16)
        assert restored.shape == expected.shape
        assert np.abs(restored - expected).mean() < 6  # JPEG loss only
        if raw.shape == expected.shape:  # orientation 3: same size, turned 180 degrees
            assert np.abs(raw - expected).mean() > 15


def test_sizes_are_photo_like(sample):
    long_sides = [long_side_of(p) for p in sample.output.rglob("img_*")]
    assert all(200 <= side <= 1600 for side in long_sides)
    assert 450 <= statistics.median(long_sides) <= 550
    assert len(set(long_sides)) > 3  # a tail, not one size


def test_images_are_not_flat(sample):
    for path in sample.output.rglob("img_*"):
        pixels = np.asarray(upright(path).convert("L"), np.float32)
        assert pixels.std() > 8, path
        # Not one smooth blob either: neighbouring pixels differ (texture and noise).
        detail = np.abs(np.diff(pixels, axis=0)).mean() + np.abs(np.diff(pixels, axis=1)).mean()
        assert detail > 1.0, path


def test_classes_are_separable_by_a_trivial_classifier(sample):
    features, labels, indices = [], [], []
    for index, name in enumerate(sample.classes):
        for path in sorted((sample.output / name).iterdir()):
            small = upright(path).resize((16, 16), Image.Resampling.BILINEAR)
            features.append(np.asarray(small, np.float32).reshape(-1, 3).mean(axis=0))
            labels.append(index)
            indices.append(int(path.name[4:].split(".")[0]))
    features, labels, indices = np.array(features), np.array(labels), np.array(indices)
    # Split by round, not by index parity: with 10 classes, parity would split by class.
    train = (indices // CLASSES) % 2 == 0
    test = ~train
    centroids = np.stack([features[train & (labels == k)].mean(axis=0) for k in range(CLASSES)])
    distances = ((features[test][:, None, :] - centroids[None]) ** 2).sum(axis=2)
    accuracy = (distances.argmin(axis=1) == labels[test]).mean()
    assert accuracy > 3 / CLASSES  # well above the 1/10 of guessing


def test_same_arguments_write_identical_bytes(sample, tmp_path):
    again = make_sample(tmp_path / "again", COUNT, classes=CLASSES, seed=SEED, workers=1)
    assert files_of(again.output) == files_of(sample.output)


def test_worker_count_does_not_change_the_bytes(sample, tmp_path):
    pooled = make_sample(tmp_path / "pooled", COUNT, classes=CLASSES, seed=SEED, workers=2)
    assert pooled.formats == sample.formats
    assert files_of(pooled.output) == files_of(sample.output)


def test_another_seed_gives_other_images(tmp_path):
    first = files_of(make_sample(tmp_path / "a", 10, classes=3, seed=1, workers=1).output)
    second = files_of(make_sample(tmp_path / "b", 10, classes=3, seed=2, workers=1).output)
    assert first.keys() == second.keys()  # the first 10 images cycle through the kinds
    assert all(first[name] != second[name] for name in first)


def test_a_prefix_of_a_larger_sample_is_the_same_images(sample, tmp_path):
    """Image i depends on (seed, i) alone, not on how many images are written."""
    small = files_of(
        make_sample(tmp_path / "small", 15, classes=CLASSES, seed=SEED, workers=1).output
    )
    full = files_of(sample.output)
    assert all(small[name] == full[name] for name in small)


def test_non_empty_output_is_refused_and_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty.*overwrite"):
        make_sample(tmp_path, 5, workers=1)
    with pytest.raises(ValueError, match="not written by make-sample"):
        make_sample(tmp_path, 5, workers=1, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_overwrite_replaces_an_earlier_sample(tmp_path):
    make_sample(tmp_path / "out", 20, classes=4, workers=1)
    summary = make_sample(tmp_path / "out", 6, classes=2, workers=1, overwrite=True)
    assert sorted(p.name for p in summary.output.iterdir()) == ["class_000", "class_001"]
    assert len(list(summary.output.rglob("img_*"))) == 6


def test_overwrite_removes_what_a_killed_run_left(tmp_path):
    """A run killed mid-image leaves a `shards.storage.write` temporary: --overwrite takes it as ours."""
    first = make_sample(tmp_path / "out", 4, classes=1, workers=1)
    image = next(first.output.rglob("img_*"))
    (image.parent / f".{image.name}.tmp-123-0a1b2c3d").write_bytes(b"partial")
    (image.parent / "img_9.jpg.tmp").write_bytes(b"partial, an older run")
    summary = make_sample(tmp_path / "out", 3, classes=1, workers=1, overwrite=True)
    assert sorted(p.name for p in (summary.output / "class_000").iterdir()) == [
        "img_0000000.jpg",
        "img_0000001.jpg",
        "img_0000002.jpg",
    ]
    (summary.output / "class_000" / ".img_0.jpg.tmp-x").write_bytes(b"not one of ours")
    with pytest.raises(ValueError, match="not written by make-sample"):
        make_sample(tmp_path / "out", 3, classes=1, workers=1, overwrite=True)


def test_output_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        make_sample(target, 5, workers=1)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"count": 0}, "count"),
        ({"classes": 0}, "classes"),
        ({"classes": 1001}, "classes"),
        ({"seed": -1}, "seed"),
        ({"workers": 0}, "workers"),
    ],
)
def test_bad_arguments_are_refused_before_writing(tmp_path, arguments, message):
    options = {"count": 5, **arguments}
    with pytest.raises(ValueError, match=message):
        make_sample(tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_class_names_sort_in_label_order():
    names = class_names(1000)
    assert names == sorted(names)
    assert len(set(names)) == 1000
