"""Restart markers in the JPEGs `build-shards` writes: one per MCU row, pixels unchanged.

Real builds of a real sample, through `main([...])`, with both backends and both shard
formats; the markers are read from the files' own bytes. The loader splices the rows between
markers into a smaller JPEG, so every row must start at a marker.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from preprocess.cli import main
from preprocess.sample import make_sample
from shards.manifest import read_manifest
from shards.parquet import iter_parquet_samples
from shards.tar import iter_tar_samples

# 160 px: the shorter side spans 10 MCU rows, so the marker numbers wrap (RST7, then RST0).
BUILD = [
    "build-shards",
    "--image-size",
    "160",
    "--shard-size",
    "12",
    "--val-fraction",
    "0.2",
    "--executor",
    "inline",
    "--no-progress",
]
FORMATS = ("tar", "parquet")
SOF_BASELINE, SOF_PROGRESSIVE, DRI, SOS, EOI = 0xC0, 0xC2, 0xDD, 0xDA, 0xD9


@dataclass(frozen=True)
class JpegLayout:
    """What a JPEG's own markers say about its frame and restart intervals."""

    sof: int  # the frame marker: baseline, progressive, ...
    width: int
    height: int
    mcu: tuple[int, int]  # MCU width and height in pixels
    interval: int | None  # MCUs per restart interval (DRI), None without a DRI segment
    restarts: list[int]  # n of each RSTn marker in the entropy-coded data, in order


def jpeg_layout(data: bytes) -> JpegLayout:
    """Walk the header segments to the scan, then the scan's markers to EOI."""
    pos, sof, interval = 2, None, None
    while True:
        assert data[pos] == 0xFF, f"no marker at byte {pos}"
        marker, length = data[pos + 1], int.from_bytes(data[pos + 2 : pos + 4], "big")
        body = data[pos + 4 : pos + 2 + length]
        if 0xC0 <= marker <= 0xC3:
            sof = (marker, body)
        elif marker == DRI:
            interval = int.from_bytes(body[:2], "big")
        pos += 2 + length
        if marker == SOS:
            break
    marker, frame = sof
    height, width = int.from_bytes(frame[1:3], "big"), int.from_bytes(frame[3:5], "big")
    factors = [frame[7 + 3 * c] for c in range(frame[5])]
    mcu = (8 * max(f >> 4 for f in factors), 8 * max(f & 15 for f in factors))
    restarts = []
    while True:  # in the scan, 0xFF 0x00 is a stuffed 0xFF byte and 0xFF 0xD0-0xD7 is RSTn
        pos = data.index(b"\xff", pos)
        code = data[pos + 1]
        if code == EOI:
            break
        if 0xD0 <= code <= 0xD7:
            restarts.append(code - 0xD0)
        pos += 1 if code == 0xFF else 2
    return JpegLayout(marker, width, height, mcu, interval, restarts)


def decoded(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(BytesIO(data)).convert("RGB"))


def images_by_key(output: Path, fmt: str) -> dict[str, bytes]:
    """Every sample's stored image, by key, read from the shards of one format."""
    manifest = read_manifest(output)
    reader = iter_tar_samples if fmt == "tar" else iter_parquet_samples
    images = {}
    for split in manifest.splits:
        for url in manifest.shard_urls(split, fmt, str(output)):
            with open(url, "rb") as stream:
                images.update((s["__key__"], s[manifest.image_field]) for s in reader(stream, url))
    return images


def all_files(directory: Path) -> dict[str, bytes]:
    """What a build wrote; its plan (`_build/plan/`, made by every rerun) left out."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.relative_to(directory).as_posix().startswith("_build/plan/")
    }


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    """40 real images: plain JPEGs and the odd kinds the fast backend hands to Pillow."""
    root = tmp_path_factory.mktemp("restart_sample") / "images"
    make_sample(root, 40, classes=2, seed=5, workers=1)
    return root


def build_args(sample: Path, output: Path, *flags: str) -> list[str]:
    return [*BUILD, "--input", str(sample), "--output", str(output), *flags]


@pytest.fixture(scope="module")
def builds(sample, tmp_path_factory) -> dict[str, Path]:
    """Outputs of builds that differ in backend, restart markers and encoding."""
    variants = {
        "fast": ["--backend", "fast"],
        "fast-plain": ["--backend", "fast", "--no-jpeg-restarts"],
        "fast-png": ["--backend", "fast", "--encode", "png"],
        "pillow": ["--backend", "pillow"],
        "pillow-plain": ["--backend", "pillow", "--no-jpeg-restarts"],
    }
    outputs = {}
    for name, flags in variants.items():
        outputs[name] = tmp_path_factory.mktemp("restart_builds") / name
        assert main(build_args(sample, outputs[name], *flags)) == 0, name
    return outputs


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["fast", "pillow"])
def test_every_mcu_row_starts_at_a_restart_marker(builds, backend, fmt):
    images = images_by_key(builds[backend], fmt)
    assert len(images) >= 30
    wrapped = 0
    for key, data in images.items():
        layout = jpeg_layout(data)
        assert layout.sof == SOF_BASELINE, key  # not progressive
        assert layout.mcu == (16, 16), key  # 4:2:0 RGB: no grey outputs are ever written
        assert layout.interval == math.ceil(layout.width / 16), key  # one MCU row
        rows = math.ceil(layout.height / 16)
        assert layout.restarts == [n % 8 for n in range(rows - 1)], key
        wrapped += rows - 1 > 8
    assert wrapped  # some images are tall enough for RST7 to be followed by RST0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("build", ["fast-plain", "pillow-plain"])
def test_no_jpeg_restarts_writes_files_without_markers(builds, build, fmt):
    for key, data in images_by_key(builds[build], fmt).items():
        layout = jpeg_layout(data)
        assert layout.interval is None and layout.restarts == [], key


@pytest.mark.parametrize("fmt", FORMATS)
def test_markers_leave_the_pillow_backends_pixels_as_they_were(builds, fmt):
    with_markers = images_by_key(builds["pillow"], fmt)
    without = images_by_key(builds["pillow-plain"], fmt)
    assert with_markers.keys() == without.keys()
    for key, data in with_markers.items():
        assert data != without[key], key  # the markers are there ...
        assert np.array_equal(decoded(data), decoded(without[key])), key  # ... and change nothing


@pytest.mark.parametrize("fmt", FORMATS)
def test_fast_backend_writes_pillows_bytes_for_its_pixels(builds, fmt):
    # The fast backend's resized pixels, stored losslessly by the PNG build, encoded by
    # Pillow: with markers the bytes are the fast build's own (the same quality, 4:2:0,
    # accurate DCT, baseline, standard tables); without them the pixels are the same.
    stored = images_by_key(builds["fast"], fmt)
    lossless = images_by_key(builds["fast-png"], fmt)
    assert stored.keys() == lossless.keys()
    for key, data in stored.items():
        pixels = Image.open(BytesIO(lossless[key])).convert("RGB")
        encodings = {}
        for rows in (1, 0):
            buffer = BytesIO()
            pixels.save(buffer, "JPEG", quality=90, optimize=False, restart_marker_rows=rows)
            encodings[rows] = buffer.getvalue()
        assert data == encodings[1], key
        assert np.array_equal(decoded(data), decoded(encodings[0])), key


def test_build_without_the_option_resumes_only_with_no_jpeg_restarts(
    sample, builds, tmp_path, capsys
):
    # A build made before restart markers existed has no `jpeg_restarts` in its records,
    # which is what --no-jpeg-restarts writes.
    old = tmp_path / "old"
    shutil.copytree(builds["fast-plain"], old)
    record = json.loads((old / "_build" / "config.json").read_text())
    assert "jpeg_restarts" not in record["config"]["image"]
    assert "jpeg_restarts" not in json.loads((old / "manifest.json").read_text())["config"]["image"]
    before = all_files(old)
    capsys.readouterr()

    assert main(build_args(sample, old, "--backend", "fast")) == 1  # default: markers
    err = capsys.readouterr().err
    change = next(line for line in err.splitlines() if "jpeg_restarts" in line)
    assert "image.jpeg_restarts: False -> True" in change and "--no-jpeg-restarts" in change
    assert "Traceback" not in err
    assert all_files(old) == before  # refused before writing a shard or a record

    shard = next((old / "tar").glob("train-*.tar"))
    shard.unlink()
    (old / "parquet" / shard.name.replace(".tar", ".parquet")).unlink()
    (old / "manifest.json").unlink()
    assert main(build_args(sample, old, "--backend", "fast", "--no-jpeg-restarts")) == 0
    assert all_files(old) == before  # rebuilt byte for byte, still without markers


def test_build_with_markers_refuses_to_resume_without_them(sample, builds, tmp_path, capsys):
    new = tmp_path / "new"
    shutil.copytree(builds["pillow"], new)
    record = json.loads((new / "_build" / "config.json").read_text())
    assert record["config"]["image"]["jpeg_restarts"] is True
    capsys.readouterr()
    assert main(build_args(sample, new, "--backend", "pillow", "--no-jpeg-restarts")) == 1
    change = next(line for line in capsys.readouterr().err.splitlines() if "jpeg_restarts" in line)
    assert "True -> False" in change and "without --no-jpeg-restarts" in change


def test_restart_markers_are_not_recorded_for_other_encodings(builds):
    # PNG and WebP builds are untouched by the option, so their records stay as they were
    # and builds started before it still resume.
    record = json.loads((builds["fast-png"] / "_build" / "config.json").read_text())
    assert "jpeg_restarts" not in record["config"]["image"]


def test_help_shows_the_flag(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["build-shards", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "--jpeg-restarts, --no-jpeg-restarts" in out and "restart marker" in out
