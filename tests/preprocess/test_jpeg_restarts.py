"""Restart markers in the JPEGs `build-shards` writes: an interval of
`restart_interval(width)` MCUs (one per MCU row under 24 MCUs; columns in narrow rows too
with --jpeg-restarts columns-all; one per MCU row everywhere with --jpeg-restarts rows;
none with --jpeg-restarts none), pixels unchanged; the switches of older versions still
mean those layouts, and builds they started resume byte for byte.

Real builds of a real sample, through `main([...])`, with both backends and both shard
formats; the markers are read from the files' own bytes. The loader splices the intervals
between markers into a smaller JPEG, so every row, and every interval within it, must start
at a marker.
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

from preprocess import images as preprocess_images
from preprocess.cli import main
from preprocess.images import ImageConfig
from preprocess.sample import make_sample
from shards.image.bands import restart_interval
from shards.image.policy import load_fast_backends
from shards.manifest import read_manifest
from shards.parquet import iter_parquet_samples
from shards.tar import iter_tar_samples

# 176 px: the shorter side spans 11 MCU rows, so even row markers wrap (RST7, then RST0).
# The sample's rows are all under 24 MCUs, so a default build keeps one interval per row;
# with --jpeg-restarts columns-all its widths have intervals of 4 MCUs (313 px: 20 MCUs),
# 5 (235 px), 7 (220 px) and a whole row (176 and 264 px: 11 and 17 MCUs, no divisor in
# 4..8).
BUILD = [
    "build-shards",
    "--image-size",
    "176",
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
        "fast-rows": ["--backend", "fast", "--jpeg-restarts", "rows"],
        "fast-narrow": ["--backend", "fast", "--jpeg-restarts", "columns-all"],
        "fast-plain": ["--backend", "fast", "--jpeg-restarts", "none"],
        "fast-png": ["--backend", "fast", "--encode", "png"],
        "pillow": ["--backend", "pillow"],
        "pillow-rows": ["--backend", "pillow", "--jpeg-restarts", "rows"],
        "pillow-narrow": ["--backend", "pillow", "--jpeg-restarts", "columns-all"],
        "pillow-plain": ["--backend", "pillow", "--jpeg-restarts", "none"],
    }
    outputs = {}
    for name, flags in variants.items():
        outputs[name] = tmp_path_factory.mktemp("restart_builds") / name
        assert main(build_args(sample, outputs[name], *flags)) == 0, name
    return outputs


def check_intervals(images: dict[str, bytes], interval_of) -> set[int | str]:
    """Assert every image's DRI is `interval_of(width)` MCUs and RST0..7 start each interval.

    Returns the intervals seen, a whole row's as "row".
    """
    assert len(images) >= 30
    seen, wrapped = set(), 0
    for key, data in images.items():
        layout = jpeg_layout(data)
        assert layout.sof == SOF_BASELINE, key  # not progressive
        assert layout.mcu == (16, 16), key  # 4:2:0 RGB: no grey outputs are ever written
        row_mcus = math.ceil(layout.width / 16)
        assert layout.interval == interval_of(layout.width), key
        assert row_mcus % layout.interval == 0, key  # every row starts a new interval
        intervals = math.ceil(layout.height / 16) * row_mcus // layout.interval
        assert layout.restarts == [n % 8 for n in range(intervals - 1)], key
        seen.add("row" if layout.interval == row_mcus else layout.interval)
        wrapped += intervals - 1 > 8
    assert wrapped  # some images have enough intervals for RST7 to be followed by RST0
    return seen


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["fast", "pillow"])
def test_every_restart_interval_of_a_default_build_starts_at_a_marker(builds, backend, fmt):
    seen = check_intervals(images_by_key(builds[backend], fmt), restart_interval)
    assert seen == {"row"}  # every row of the sample is under 24 MCUs


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["fast", "pillow"])
def test_columns_all_cuts_narrow_rows_into_columns(builds, backend, fmt):
    images = images_by_key(builds[f"{backend}-narrow"], fmt)
    seen = check_intervals(images, lambda width: restart_interval(width, 16, min_mcus=0))
    # 4 MCUs where the row allows it, other divisors, and a whole row where none fits.
    assert seen == {4, 5, 7, "row"}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["fast", "pillow"])
def test_rows_writes_one_interval_per_mcu_row(builds, backend, fmt):
    seen = check_intervals(
        images_by_key(builds[f"{backend}-rows"], fmt), lambda width: math.ceil(width / 16)
    )
    assert seen == {"row"}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("build", ["fast-plain", "pillow-plain"])
def test_none_writes_files_without_markers(builds, build, fmt):
    for key, data in images_by_key(builds[build], fmt).items():
        layout = jpeg_layout(data)
        assert layout.interval is None and layout.restarts == [], key


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("build", ["pillow", "pillow-rows"])
def test_markers_leave_the_pillow_backends_pixels_as_they_were(builds, build, fmt):
    with_markers = images_by_key(builds[build], fmt)
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
    # Column intervals are Pillow's `restart_marker_blocks`, rows its `restart_marker_rows`.
    stored = images_by_key(builds["fast"], fmt)
    by_rows = images_by_key(builds["fast-rows"], fmt)
    lossless = images_by_key(builds["fast-png"], fmt)
    assert stored.keys() == by_rows.keys() == lossless.keys()
    for key, data in stored.items():
        pixels = Image.open(BytesIO(lossless[key])).convert("RGB")
        columns = pillow_jpeg(pixels, restart_marker_blocks=restart_interval(pixels.width))
        assert data == columns, key
        assert by_rows[key] == pillow_jpeg(pixels, restart_marker_rows=1), key
        assert np.array_equal(decoded(data), decoded(pillow_jpeg(pixels))), key


def pillow_jpeg(image: Image.Image, **restarts: int) -> bytes:
    buffer = BytesIO()
    image.save(buffer, "JPEG", quality=90, optimize=False, **restarts)
    return buffer.getvalue()


# 4 (32 MCUs) and 5 (25 MCUs) MCUs an interval, a whole row (22, 27 and 43 MCUs, no divisor
# in 4..8), and narrow rows (16 and 7 MCUs, a one-MCU row): whole unless columns-all.
@pytest.mark.parametrize("width", [512, 341, 400, 430, 688, 256, 100, 9])
@pytest.mark.parametrize("layout", ["columns", "columns-all", "rows"])
def test_both_encoders_write_the_same_bytes_for_the_same_pixels(width, layout):
    # Widths the sample build does not reach, through the two encoders themselves.
    pixels = np.random.default_rng(width).integers(0, 256, (40, width, 3), dtype=np.uint8)
    config = ImageConfig(backend="pillow", jpeg_restarts=layout)
    simplejpeg, cv2 = load_fast_backends()
    ours = preprocess_images._encode_jpeg_array(simplejpeg, cv2, pixels, config)
    assert ours == preprocess_images._encode(Image.fromarray(pixels), config)
    intervals = {
        "columns": restart_interval(width),
        "columns-all": restart_interval(width, 16, min_mcus=0),
        "rows": math.ceil(width / 16),
    }
    assert jpeg_layout(ours).interval == intervals[layout]


# The switches of versions before `--jpeg-restarts` took a layout, alone and combined (each
# can only make the layout older, in any order), and the bare flag: the same bytes.
OLD_SPELLINGS = [
    ("fast", ["--jpeg-restarts"]),
    ("fast", ["--jpeg-restart-columns", "--jpeg-restart-narrow-rows"]),
    ("fast-rows", ["--no-jpeg-restart-columns"]),
    ("fast-rows", ["--no-jpeg-restart-columns", "--no-jpeg-restart-narrow-rows"]),
    ("fast-narrow", ["--no-jpeg-restart-narrow-rows"]),
    ("fast-plain", ["--no-jpeg-restarts"]),
    ("fast-plain", ["--no-jpeg-restarts", "--no-jpeg-restart-columns"]),
    ("fast-plain", ["--no-jpeg-restart-columns", "--no-jpeg-restarts"]),
]


@pytest.mark.parametrize(("build", "flags"), OLD_SPELLINGS)
def test_old_restart_switches_write_the_layout_they_name(sample, builds, tmp_path, build, flags):
    out = tmp_path / "old-spelling"
    assert main(build_args(sample, out, "--backend", "fast", *flags)) == 0
    assert all_files(out) == all_files(builds[build])


def test_build_without_markers_resumes_only_with_jpeg_restarts_none(
    sample, builds, tmp_path, capsys
):
    # A build made before restart markers existed has no `jpeg_restarts` in its records,
    # which is what --jpeg-restarts none writes (and the older --no-jpeg-restarts).
    old = tmp_path / "old"
    shutil.copytree(builds["fast-plain"], old)
    record = json.loads((old / "_build" / "config.json").read_text())
    assert "jpeg_restarts" not in record["config"]["image"]
    assert "jpeg_restarts" not in json.loads((old / "manifest.json").read_text())["config"]["image"]
    # --jpeg-restarts none resumes it: one line, naming that flag.
    change = "image.jpeg_restarts: 'none' -> 'columns'"
    assert_refused_then_resumed(sample, old, capsys, change, "--jpeg-restarts none")
    # The older switch still resumes it too.
    assert_refused_then_resumed(
        sample, old, capsys, change, "--jpeg-restarts none", ["--no-jpeg-restarts"]
    )


def assert_refused_then_resumed(
    sample, old, capsys, change: str, flag: str, resume: list[str] | None = None
) -> None:
    """The default rerun of `old` is refused with exactly one `jpeg_restarts` line holding
    `change` and naming `flag`, writing nothing; with `resume` (default: `flag`) it rebuilds
    byte for byte."""
    before = all_files(old)
    capsys.readouterr()
    assert main(build_args(sample, old, "--backend", "fast")) == 1
    err = capsys.readouterr().err
    changes = [line for line in err.splitlines() if "jpeg_restart" in line]
    assert len(changes) == 1, err
    assert change in changes[0] and f"rerun with {flag} to resume it" in changes[0]
    assert "Traceback" not in err
    assert all_files(old) == before  # refused before writing a shard or a record

    shard = next((old / "tar").glob("train-*.tar"))
    shard.unlink()
    (old / "parquet" / shard.name.replace(".tar", ".parquet")).unlink()
    (old / "manifest.json").unlink()
    assert main(build_args(sample, old, "--backend", "fast", *(resume or flag.split()))) == 0
    assert all_files(old) == before  # rebuilt byte for byte, as it was started


def test_build_with_markers_refuses_to_resume_without_them(sample, builds, tmp_path, capsys):
    new = tmp_path / "new"
    shutil.copytree(builds["pillow"], new)
    record = json.loads((new / "_build" / "config.json").read_text())
    assert record["config"]["image"]["jpeg_restarts"] is True
    capsys.readouterr()
    assert main(build_args(sample, new, "--backend", "pillow", "--no-jpeg-restarts")) == 1
    err = capsys.readouterr().err
    changes = [line for line in err.splitlines() if "jpeg_restart" in line]
    assert len(changes) == 1, err
    assert "'columns' -> 'none'" in changes[0]
    assert "rerun with --jpeg-restarts columns to resume it" in changes[0]


@pytest.mark.parametrize(
    ("build", "layout", "field", "under", "resume"),
    [
        ("fast-rows", "rows", "jpeg_restart_columns", "jpeg_restarts", None),
        ("fast-rows", "rows", "jpeg_restart_columns", "jpeg_restarts", "--no-jpeg-restart-columns"),
        ("fast-narrow", "columns-all", "jpeg_restart_narrow_rows", "jpeg_restart_columns", None),
        (
            "fast-narrow",
            "columns-all",
            "jpeg_restart_narrow_rows",
            "jpeg_restart_columns",
            "--no-jpeg-restart-narrow-rows",
        ),
    ],
)
def test_build_made_before_an_interval_switch_resumes_only_with_its_layout(
    sample, builds, tmp_path, capsys, build, layout, field, under, resume
):
    # A build made before the switch existed (one interval per row; column intervals in
    # narrow rows too) has no `field` in its records, which is what its layout writes.
    old = tmp_path / "old"
    shutil.copytree(builds[build], old)
    for record in (old / "_build" / "config.json", old / "manifest.json"):
        image = json.loads(record.read_text())["config"]["image"]
        assert image[under] is True and field not in image
    flag = f"--jpeg-restarts {layout}"
    change = f"image.jpeg_restarts: {layout!r} -> 'columns'"
    assert_refused_then_resumed(sample, old, capsys, change, flag, resume and [resume])


@pytest.mark.parametrize(
    ("layout", "flags"),
    [
        ("rows", ["--jpeg-restarts", "rows"]),
        ("rows", ["--no-jpeg-restart-columns"]),
        ("columns-all", ["--jpeg-restarts", "columns-all"]),
        ("columns-all", ["--no-jpeg-restart-narrow-rows"]),
    ],
)
def test_default_build_refuses_to_resume_with_an_older_layout(
    sample, builds, tmp_path, capsys, layout, flags
):
    record = json.loads((builds["fast"] / "_build" / "config.json").read_text())
    assert record["config"]["image"]["jpeg_restart_narrow_rows"] is True
    new = tmp_path / "new"
    shutil.copytree(builds["fast"], new)
    before = all_files(new)
    capsys.readouterr()
    assert main(build_args(sample, new, "--backend", "fast", *flags)) == 1
    err = capsys.readouterr().err
    changes = [line for line in err.splitlines() if "jpeg_restart" in line]
    assert len(changes) == 1, err
    assert f"image.jpeg_restarts: 'columns' -> {layout!r}" in changes[0]
    assert "rerun with --jpeg-restarts columns to resume it" in changes[0]
    assert all_files(new) == before


@pytest.mark.parametrize(
    ("build", "flags", "ignored"),
    [
        ("fast-plain", ["--jpeg-restarts", "none"], "jpeg_restart_columns"),
        ("fast-rows", ["--jpeg-restarts", "rows"], "jpeg_restart_narrow_rows"),
    ],
)
def test_an_older_layout_records_nothing_of_the_newer_ones(
    sample, builds, tmp_path, build, flags, ignored
):
    # Without markers there are no intervals, and with one interval per row everywhere no
    # narrow rows to keep whole: a build made before them resumes with its layout.
    record = json.loads((builds[build] / "_build" / "config.json").read_text())
    assert ignored not in record["config"]["image"]
    resumed = tmp_path / "resumed"
    shutil.copytree(builds[build], resumed)
    before = all_files(resumed)
    assert main(build_args(sample, resumed, "--backend", "fast", *flags)) == 0
    assert all_files(resumed) == before


def test_restart_markers_are_not_recorded_for_other_encodings(builds):
    # PNG and WebP builds are untouched by the layout, so their records stay as they were
    # and builds started before it still resume.
    record = json.loads((builds["fast-png"] / "_build" / "config.json").read_text())
    assert "jpeg_restarts" not in record["config"]["image"]
    assert "jpeg_restart_columns" not in record["config"]["image"]
    assert "jpeg_restart_narrow_rows" not in record["config"]["image"]


def test_help_shows_the_layout_choice_and_what_the_old_switches_mean(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["build-shards", "--help"])
    assert stop.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--jpeg-restarts [{columns,columns-all,rows,none}]" in out and "restart markers" in out
    # The old switches are not listed as flags of their own, only explained.
    assert "--no-jpeg-restart-columns, " not in out and "[--no-jpeg-restarts]" not in out
    assert "--no-jpeg-restarts, --no-jpeg-restart-columns and --no-jpeg-restart-narrow-rows" in out
