"""`preprocess make-sample`: write a synthetic ImageFolder tree of photo-like images.

It feeds demos, tests and the scale benchmark of `build-shards`; shards, pipeline and trainers
never import it.
"""

from __future__ import annotations

import colorsys
import logging
import math
import multiprocessing
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from io import BytesIO
from pathlib import Path

import numpy as np
from PIL import Image

from preprocess.progress import progress_bar
from shards.errors import UsageError
from shards.storage.write import atomic_write_bytes

log = logging.getLogger(__name__)

MAX_CLASSES = 1000
TEXTURE_SIZE = 512  # power of two: wrapping a texture index is a bit mask
NOISE_SIZE = 2048  # larger than any image, so noise is a plain slice
VARIANTS = 6  # texture variants per family; each image picks one
FAMILIES = (
    "hstripes",
    "vstripes",
    "checker",
    "rings",
    "dots",
    "hatch",
    "waves",
    "bricks",
    "blobs",
    "grain",
)

# (kind, share). Plain RGB JPEG takes the rest. Each kind is something a real photo
# folder holds and the sharder must normalise: grey, EXIF-rotated, CMYK, alpha, palette.
KIND_SHARES = (
    ("jpeg_gray", 0.030),
    ("jpeg_exif", 0.020),
    ("jpeg_cmyk", 0.003),
    ("png_rgb", 0.010),
    ("png_rgba", 0.008),
    ("png_p", 0.007),
    ("webp", 0.010),
    ("bmp", 0.003),
    ("tiff", 0.003),
)
KINDS = ("jpeg", *(kind for kind, _ in KIND_SHARES))
EXTENSIONS = {"jpeg": "jpg", "png": "png", "webp": "webp", "bmp": "bmp", "tiff": "tiff"}

# Common web-photo sizes near 500x375, then a log-uniform tail (see `_draw_size`).
_COMMON_SIZES = ((500, 333), (333, 500), (500, 500), (500, 281), (400, 300), (640, 480))
_TAIL_ASPECTS = (4 / 3, 3 / 2, 1.0, 16 / 9, 5 / 4)
_ORIENTATIONS = (6, 6, 6, 8, 3)  # EXIF orientation tags, 6 (phone held upright) most often
# The transpose that stores an upright image so that `ImageOps.exif_transpose` restores it.
_STORE_TRANSPOSE = {
    3: Image.Transpose.ROTATE_180,
    6: Image.Transpose.ROTATE_90,
    8: Image.Transpose.ROTATE_270,
}
_CHUNK = 64  # images per worker task: small enough to balance, large enough to amortise IPC
_OUR_DIR = re.compile(r"^class_\d{3}$")
# Our images, and what a killed run leaves: `shards.storage.write` temporaries (and `.tmp` of older runs).
_OUR_FILE = re.compile(
    r"^(img_\d+\.(jpg|png|webp|bmp|tiff)(\.tmp)?"
    r"|\.img_\d+\.(jpg|png|webp|bmp|tiff)\.tmp-\d+-[0-9a-f]{8})$"
)


@dataclass(frozen=True)
class SampleSummary:
    """What `make_sample` wrote.

    Attributes:
        output: the root of the ImageFolder tree.
        count: number of images written.
        classes: class directory names, in label order (also sorted order).
        formats: images per kind (`jpeg`, `jpeg_gray`, `png_rgba`, ...), sorted by name.
        wall_s: wall-clock seconds, including worker start-up.
        images_per_s: `count / wall_s`.
        kept: the tree held this sample already and was kept (`make_sample`'s rerun).
    """

    output: Path
    count: int
    classes: list[str]
    formats: dict[str, int]
    wall_s: float
    images_per_s: float
    kept: bool = False

    def describe(self) -> str:
        """Return a short human-readable report, one fact per line."""
        shares = ", ".join(f"{k} {v} ({v / self.count:.1%})" for k, v in self.formats.items())
        if self.kept:
            return (
                f"kept {self.output}: it holds this sample already ({self.count} images in "
                f"{len(self.classes)} classes, the same seed); nothing drawn\nformats: {shares}"
            )
        return (
            f"wrote {self.count} images in {len(self.classes)} classes to {self.output}\n"
            f"formats: {shares}\n"
            f"time: {self.wall_s:.1f} s ({self.images_per_s:.0f} images/s)"
        )


@dataclass(frozen=True)
class _Bank:
    """Per-process precomputed data, a pure function of the seed."""

    textures: np.ndarray  # (len(FAMILIES) * VARIANTS, TEXTURE_SIZE, TEXTURE_SIZE) uint8
    noise: np.ndarray  # (NOISE_SIZE, NOISE_SIZE) int16


@dataclass(frozen=True)
class _Plan:
    """Everything image `index` needs, drawn from its own RNG."""

    index: int
    label: int
    kind: str
    width: int
    height: int
    texture: int
    offset: tuple[int, int]
    step: float
    ramp: tuple[float, float]
    noise_at: tuple[int, int] | None
    palette: np.ndarray  # (256, 3) uint8: level -> RGB
    quality: int
    orientation: int


def class_names(classes: int) -> list[str]:
    """Return the class directory names for `classes` classes, in label order.

    Zero-padded, so sorted order is label order (what ImageFolder relies on).
    """
    return [f"class_{k:03d}" for k in range(classes)]


def make_sample(
    output: str | Path,
    count: int,
    classes: int = 10,
    seed: int = 0,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> SampleSummary:
    """Write `count` synthetic photo-like images as `output/<class>/img_<index>.<ext>`.

    Image `i` has label `i % classes`. Each class has its own hue and texture family,
    varied per image (tint, scale, offset, gradient, noise), so a small CNN can learn
    the classes at 64-128 px. About 92% are RGB JPEGs; the rest are grey, EXIF-rotated
    or CMYK JPEGs, RGB/RGBA/palette PNGs, WEBP, BMP and TIFF (see `KIND_SHARES`).
    The first images cycle through every kind, so even a small sample has each.

    Output bytes depend only on `(count, classes, seed)`, never on `workers`. With
    more than one worker this starts a spawn pool, so a script that calls it needs the
    usual `if __name__ == "__main__":` guard.

    Args:
        output: directory to create or fill; must be empty or absent.
        count: number of images, at least 1.
        classes: number of classes, 1 to 1000.
        seed: non-negative seed.
        workers: worker processes; defaults to `os.cpu_count()`. 1 runs in-process.
        overwrite: replace an earlier make-sample tree at `output`. A directory that
            holds anything else is never deleted. A tree that already is this sample
            (every file name of `(count, classes, seed)`, and the first and last image
            byte for byte) is kept as it is: rerunning the command draws nothing.
        progress: a bar on a terminal, a line every 10 s in a log file.

    Returns:
        A `SampleSummary`.

    Raises:
        ValueError: on a bad argument, or an output directory that cannot be used.
    """
    _check_args(count, classes, seed, workers)
    start = time.perf_counter()
    names = class_names(classes)
    if overwrite and _is_this_sample(Path(output), count, classes, seed):
        kinds = Counter(_draw_plan(index, seed, classes).kind for index in range(count))
        wall = time.perf_counter() - start
        return SampleSummary(
            Path(output), count, names, dict(sorted(kinds.items())), wall, count / wall, True
        )
    root = _prepare_output(Path(output), overwrite)
    for name in names:
        (root / name).mkdir()
    chunks = [range(i, min(i + _CHUNK, count)) for i in range(0, count, _CHUNK)]
    writer = partial(_write_chunk, root=str(root), count=count, classes=classes, seed=seed)
    with progress_bar(count, progress, label="make-sample") as bar:
        formats = _run_chunks(writer, chunks, workers or os.cpu_count() or 1, count, bar)
    os.sync()  # the images were renamed into place unsynced (`durable=False`): flush once
    wall = time.perf_counter() - start
    return SampleSummary(
        output=root,
        count=count,
        classes=names,
        formats=dict(sorted(formats.items())),
        wall_s=wall,
        images_per_s=count / wall,
    )


def _sample_path(plan: _Plan, names: list[str], width: int) -> str:
    """`class_NNN/img_INDEX.EXT`: where image `plan.index` of a sample goes."""
    ext = EXTENSIONS[plan.kind.split("_")[0]]
    return os.path.join(names[plan.label], f"img_{plan.index:0{width}d}.{ext}")


def _is_this_sample(root: Path, count: int, classes: int, seed: int) -> bool:
    """Whether `root` holds exactly the sample `(count, classes, seed)` draws: its file
    names (a name says the image's index, class and kind), and its first and last
    image byte for byte (drawn again: under a second), so another seed is told apart."""
    if not root.is_dir():
        return False
    names, width = class_names(classes), max(7, len(str(count - 1)))
    plans = [_draw_plan(index, seed, classes) for index in range(count)]
    expected = {_sample_path(plan, names, width) for plan in plans}
    held = {
        os.path.join(entry.name, item.name)
        for entry in root.iterdir()
        if entry.is_dir()
        for item in entry.iterdir()
    }
    if held != expected or len(list(root.iterdir())) != len(names):
        return False
    bank = _get_bank(seed)
    for plan in {plans[0].index: plans[0], plans[-1].index: plans[-1]}.values():
        data = _encode(plan, _compose(plan, bank))
        if (root / _sample_path(plan, names, width)).read_bytes() != data:
            return False
    return True


def render_image(index: int, classes: int = 10, seed: int = 0) -> tuple[int, Image.Image]:
    """Return `(label, image)` for image `index` of a sample, upright and not encoded.

    The image is in the mode its file stores (RGB, L, RGBA, P or CMYK); an EXIF-rotated
    file holds these pixels turned, and `ImageOps.exif_transpose` turns them back.
    """
    if index < 0:
        raise UsageError(f"index must be non-negative, got {index}")
    _check_args(1, classes, seed, None)
    plan = _draw_plan(index, seed, classes)
    return plan.label, _compose(plan, _get_bank(seed))


def _check_args(count: int, classes: int, seed: int, workers: int | None) -> None:
    if count < 1:
        raise UsageError(f"count must be at least 1, got {count}")
    if not 1 <= classes <= MAX_CLASSES:
        raise UsageError(f"classes must be between 1 and {MAX_CLASSES}, got {classes}")
    if seed < 0:
        raise UsageError(f"seed must be non-negative, got {seed}")
    if workers is not None and workers < 1:
        raise UsageError(f"workers must be at least 1, got {workers}")


def _prepare_output(root: Path, overwrite: bool) -> Path:
    """Return `root` as an existing empty directory, clearing an old sample if allowed."""
    if root.exists() and not root.is_dir():
        raise UsageError(f"output {root} exists and is not a directory; choose another path")
    if root.is_dir() and any(root.iterdir()):
        if not overwrite:
            raise UsageError(
                f"output directory {root} is not empty; choose an empty or new directory, "
                "or pass overwrite=True (--overwrite) to replace an earlier sample there"
            )
        _remove_old_sample(root)
    root.mkdir(parents=True, exist_ok=True)
    return root


def _remove_old_sample(root: Path) -> None:
    """Delete a tree written by `make_sample`; refuse if it holds anything else."""
    dirs = list(root.iterdir())
    for entry in dirs:
        if entry.is_symlink() or not entry.is_dir() or not _OUR_DIR.match(entry.name):
            raise UsageError(
                f"{root} holds {entry.name!r}, not written by make-sample; "
                "refusing to delete it: choose an empty or new directory"
            )
        for item in entry.iterdir():
            if item.is_symlink() or not item.is_file() or not _OUR_FILE.match(item.name):
                raise UsageError(
                    f"{entry} holds {item.name!r}, not written by make-sample; "
                    "refusing to delete it: choose an empty or new directory"
                )
    for entry in dirs:
        shutil.rmtree(entry)


def _run_chunks(
    writer: Callable[[range], Counter], chunks: list[range], workers: int, count: int, bar=None
) -> Counter:
    """Run `writer` over all chunks, in-process or on a spawn pool; sum the kind counts."""
    if workers == 1 or len(chunks) == 1:
        return _tally(map(writer, chunks), count, bar)
    # spawn, not fork: the caller may hold threads (Ray, torch), and fork would copy them.
    context = multiprocessing.get_context("spawn")
    with context.Pool(min(workers, len(chunks))) as pool:
        return _tally(pool.imap_unordered(writer, chunks), count, bar)


def _tally(results: Iterable[Counter], count: int, bar=None) -> Counter:
    """Sum per-chunk kind counts, logging progress every 50,000 images (and each chunk
    to `bar`, a `preprocess.progress.progress_bar`)."""
    totals: Counter = Counter()
    for counts in results:
        before = totals.total()
        totals += counts
        if bar is not None:
            bar.update(counts.total())
        if totals.total() // 50_000 > before // 50_000:
            log.info("make-sample: %d of %d images written", totals.total(), count)
    return totals


def _write_chunk(indices: range, root: str, count: int, classes: int, seed: int) -> Counter:
    """Render, encode and write images `indices`; return how many of each kind."""
    bank = _get_bank(seed)
    names = class_names(classes)
    width = max(7, len(str(count - 1)))
    kinds: Counter = Counter()
    for index in indices:
        plan = _draw_plan(index, seed, classes)
        data = _encode(plan, _compose(plan, bank))
        path = os.path.join(root, _sample_path(plan, names, width))
        # Write then rename, so a killed run never leaves a truncated image behind;
        # `make_sample` syncs once at the end instead of twice an image.
        atomic_write_bytes(path, data, durable=False)
        kinds[plan.kind] += 1
    return kinds


_BANK: dict[int, _Bank] = {}


def _get_bank(seed: int) -> _Bank:
    """Return this process's bank for `seed`, building it on first use (about 0.6 s)."""
    if seed not in _BANK:
        _BANK.clear()  # one seed per process at a time: the bank is ~25 MB
        _BANK[seed] = _build_bank(seed)
    return _BANK[seed]


def _build_bank(seed: int) -> _Bank:
    rng = np.random.default_rng([seed, 0])
    unit = np.arange(TEXTURE_SIZE, dtype=np.float32) / TEXTURE_SIZE
    u, v = np.meshgrid(unit, unit)  # u runs along x (columns), v along y (rows)
    # A faint low-frequency field keeps patterns from looking machine-made; a few
    # fields, shifted differently per texture, look as good as one field each.
    organic = [_noise_field(rng, 0.0, 3.0) for _ in range(4)]
    textures = np.empty((len(FAMILIES) * VARIANTS, TEXTURE_SIZE, TEXTURE_SIZE), np.uint8)
    for t in range(len(textures)):
        family, variant = divmod(t, VARIANTS)
        pattern = _standardise(_PATTERNS[FAMILIES[family]](u, v, variant, rng))
        shift = tuple(int(x) for x in rng.integers(TEXTURE_SIZE, size=2))
        pattern += 0.35 * np.roll(organic[t % len(organic)], shift, axis=(0, 1))
        textures[t] = _to_levels(pattern)
    noise = rng.standard_normal((NOISE_SIZE, NOISE_SIZE), dtype=np.float32) * 5.0
    return _Bank(textures=textures, noise=noise.round().astype(np.int16))


def _standardise(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / (x.std() + 1e-6)


def _to_levels(x: np.ndarray) -> np.ndarray:
    """Map a field to uint8 levels 40..215, leaving head-room for gradient and noise."""
    z = np.clip(_standardise(x), -2.0, 2.0)
    return (127.5 + z * 43.75).astype(np.uint8)


def _noise_field(rng: np.random.Generator, centre: float, width: float) -> np.ndarray:
    """Return periodic noise whose spectrum is a Gaussian ring at `centre` cycles per tile."""
    # Random spectrum coefficients shaped by the ring, then one inverse FFT.
    fy = np.fft.fftfreq(TEXTURE_SIZE, 1 / TEXTURE_SIZE)[:, None]
    fx = np.fft.rfftfreq(TEXTURE_SIZE, 1 / TEXTURE_SIZE)[None, :]
    gain = np.exp(-(((np.hypot(fy, fx) - centre) / width) ** 2))
    shape = gain.shape
    spectrum = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) * gain
    field = np.fft.irfft2(spectrum, s=(TEXTURE_SIZE, TEXTURE_SIZE))
    return _standardise(field.astype(np.float32))


# Texture families. Every pattern is periodic on the tile (integer cycles per tile), so
# a crop may wrap around, and looks the same after a horizontal flip, so a flip keeps the class.
# Frequencies stay low (periods of 40-100 px) to survive resizing to 64 px.


def _hstripes(u: np.ndarray, v: np.ndarray, variant: int, rng: np.random.Generator) -> np.ndarray:
    sharp = 0.5 + 0.5 * variant
    return np.tanh(sharp * np.sin(2 * np.pi * (5 + variant) * v + rng.uniform(0, 6.3)))


def _vstripes(u: np.ndarray, v: np.ndarray, variant: int, rng: np.random.Generator) -> np.ndarray:
    return _hstripes(v, u, variant, rng)


def _checker(u: np.ndarray, v: np.ndarray, variant: int, rng: np.random.Generator) -> np.ndarray:
    n = 4 + variant
    return np.tanh(3.0 * np.sin(2 * np.pi * n * u) * np.sin(2 * np.pi * n * v))


def _rings(u: np.ndarray, v: np.ndarray, variant: int, rng: np.random.Generator) -> np.ndarray:
    cells = 1 + variant % 2  # ring centres per tile side
    du, dv = (u * cells) % 1.0 - 0.5, (v * cells) % 1.0 - 0.5
    radius = np.hypot(du, dv) * TEXTURE_SIZE / cells
    return np.cos(2 * np.pi * radius / (40 + 8 * variant))


def _dots(u: np.ndarray, v: np.ndarray, variant: int, rng: np.random.Generator) -> np.ndarray:
    n = 5 + variant
    radius = np.hypot((u * n) % 1.0 - 0.5, (v * n) % 1.0 - 0.5)
    return -np.tanh((radius - rng.uniform(0.2, 0.32)) * 25.0)


def _hatch(u: np.ndarray, v: np.ndarray, variant: int, rng: np.random.Generator) -> np.ndarray:
    n = 4 + variant  # the two diagonals swap under a flip, so the pattern is flip-invariant
    return np.maximum(
        _sharp_peaks(np.cos(np.pi * n * (u + v))), _sharp_peaks(np.cos(np.pi * n * (u - v)))
    )


def _sharp_peaks(x: np.ndarray) -> np.ndarray:
    """Return x**8 by squaring thrice (a float power is ten times slower)."""
    x = x * x
    x *= x
    x *= x
    return x


def _waves(u: np.ndarray, v: np.ndarray, variant: int, rng: np.random.Generator) -> np.ndarray:
    bend = 1.5 + 0.5 * variant
    return np.sin(2 * np.pi * (5 + variant) * u + bend * np.cos(2 * np.pi * 3 * v))


def _bricks(u: np.ndarray, v: np.ndarray, variant: int, rng: np.random.Generator) -> np.ndarray:
    rows, cols = 6 + 2 * (variant % 3), 3 + variant // 2
    row = np.floor(v * rows)
    fv = (v * rows) % 1.0
    fu = (u * cols + 0.5 * (row % 2)) % 1.0
    edge = np.minimum(np.minimum(fv, 1 - fv) / cols, np.minimum(fu, 1 - fu) / rows)
    return np.tanh(edge * rows * cols * 6.0)


def _blobs(u: np.ndarray, v: np.ndarray, variant: int, rng: np.random.Generator) -> np.ndarray:
    return np.tanh(2.0 * _noise_field(rng, 0.0, 4.0 + variant))


def _grain(u: np.ndarray, v: np.ndarray, variant: int, rng: np.random.Generator) -> np.ndarray:
    return _noise_field(rng, 9.0 + variant, 2.5)


_PATTERNS = {
    "hstripes": _hstripes,
    "vstripes": _vstripes,
    "checker": _checker,
    "rings": _rings,
    "dots": _dots,
    "hatch": _hatch,
    "waves": _waves,
    "bricks": _bricks,
    "blobs": _blobs,
    "grain": _grain,
}


def _draw_plan(index: int, seed: int, classes: int) -> _Plan:
    """Draw image `index`'s parameters from an RNG seeded by `(seed, index)` alone."""
    rng = np.random.default_rng([seed, 1, index])
    label = index % classes
    kind = _draw_kind(rng, index)
    width, height = _draw_size(rng)
    # Larger images sample the texture more finely, so the class pattern spans a
    # similar share of the frame at any size (what a resize to 64-128 px keeps).
    step = rng.uniform(0.75, 1.3) * math.sqrt(500 / max(width, height))
    family = label % len(FAMILIES)
    return _Plan(
        index=index,
        label=label,
        kind=kind,
        width=width,
        height=height,
        texture=family * VARIANTS + int(rng.integers(VARIANTS)),
        offset=(int(rng.integers(TEXTURE_SIZE)), int(rng.integers(TEXTURE_SIZE))),
        step=step,
        ramp=(rng.uniform(-40, 40), rng.uniform(-40, 40)),
        noise_at=_draw_noise(rng, width, height),
        palette=_draw_palette(rng, label, classes),
        quality=int(rng.integers(85, 93)),
        orientation=_ORIENTATIONS[int(rng.integers(len(_ORIENTATIONS)))],
    )


def _draw_kind(rng: np.random.Generator, index: int) -> str:
    draw = rng.random()  # drawn even when unused, so later draws never shift
    if index < len(KINDS):
        return KINDS[index]
    for kind, share in KIND_SHARES:
        if draw < share:
            return kind
        draw -= share
    return "jpeg"


def _draw_size(rng: np.random.Generator) -> tuple[int, int]:
    """Return (width, height): mostly 500x375 or 375x500, with a 200-1600 px tail."""
    draw = rng.random()
    if draw < 0.50:
        return 500, 375
    if draw < 0.68:
        return 375, 500
    if draw < 0.75:
        return _COMMON_SIZES[int(rng.integers(len(_COMMON_SIZES)))]
    long_side = int(math.exp(rng.uniform(math.log(200), math.log(1600))))
    short_side = max(1, round(long_side / _TAIL_ASPECTS[int(rng.integers(len(_TAIL_ASPECTS)))]))
    return (long_side, short_side) if rng.random() < 0.7 else (short_side, long_side)


def _draw_noise(rng: np.random.Generator, width: int, height: int) -> tuple[int, int] | None:
    y = int(rng.integers(NOISE_SIZE - height + 1))
    x = int(rng.integers(NOISE_SIZE - width + 1))
    return None if rng.random() < 0.15 else (y, x)  # some photos are clean


def _class_hue(label: int, classes: int) -> float:
    return label / classes


def _draw_palette(rng: np.random.Generator, label: int, classes: int) -> np.ndarray:
    """Return a 256-entry level -> RGB ramp around the class hue, jittered per image."""
    spacing = 1.0 / min(classes, 12)
    hue = _class_hue(label, classes) + rng.uniform(-0.3, 0.3) * spacing
    sat = rng.uniform(0.45, 0.95)
    shift = rng.uniform(-0.06, 0.06)  # shadows and highlights drift in hue, as in photos
    stops = (
        (hue - shift, 0.8, rng.uniform(0.06, 0.2)),
        (hue, sat, rng.uniform(0.5, 0.75)),
        (hue + shift, sat * 0.6, rng.uniform(0.82, 0.95)),
        (hue + 2 * shift, 0.15, 1.0),
    )
    stop_rgb = np.array([colorsys.hsv_to_rgb(h % 1.0, s, b) for h, s, b in stops])
    # Contrast and gamma per image: where the ramp is sampled, and how fast.
    levels = np.linspace(0.0, 1.0, 256)
    levels = np.clip(0.5 + (levels - 0.5) * rng.uniform(0.8, 1.4), 0.0, 1.0)
    levels **= rng.uniform(0.7, 1.4)
    at = (0.0, 0.4, 0.75, 1.0)
    rgb = np.stack([np.interp(levels, at, stop_rgb[:, c]) for c in range(3)], axis=1)
    return (rgb * 255.0 + 0.5).astype(np.uint8)


def _levels(plan: _Plan, bank: _Bank) -> np.ndarray:
    """Return the (height, width) uint8 level map: texture crop + gradient + noise."""
    mask = TEXTURE_SIZE - 1
    oy, ox = plan.offset
    # Strided integer indices: crop, scale (nearest) and wrap in one gather.
    rows = (oy + np.arange(plan.height) * plan.step).astype(np.intp) & mask
    cols = (ox + np.arange(plan.width) * plan.step).astype(np.intp) & mask
    texture = bank.textures[plan.texture].take(rows, axis=0).take(cols, axis=1)
    ramp_y = np.linspace(-plan.ramp[0], plan.ramp[0], plan.height).astype(np.int16)
    ramp_x = np.linspace(-plan.ramp[1], plan.ramp[1], plan.width).astype(np.int16)
    level = np.add.outer(ramp_y, ramp_x)  # int16: the sum may leave 0..255 before the clip
    if plan.noise_at is not None:
        y, x = plan.noise_at
        level += bank.noise[y : y + plan.height, x : x + plan.width]
    level += texture
    np.clip(level, 0, 255, out=level)
    return level.astype(np.uint8)


def _compose(plan: _Plan, bank: _Bank) -> Image.Image:
    """Return the upright image in the mode its kind stores (RGB, L, RGBA, P or CMYK)."""
    size = (plan.width, plan.height)
    indexed = Image.frombuffer("P", size, _levels(plan, bank), "raw", "P", 0, 1)
    indexed.putpalette(plan.palette.tobytes())
    if plan.kind == "png_p":
        return indexed
    if plan.kind == "jpeg_gray":
        return indexed.convert("L")
    image = indexed.convert("RGB")
    if plan.kind == "jpeg_cmyk":
        return image.convert("CMYK")
    if plan.kind == "png_rgba":
        image.putalpha(Image.frombytes("L", size, _vignette(plan.width, plan.height).tobytes()))
    return image


def _vignette(width: int, height: int) -> np.ndarray:
    """Return an alpha mask: opaque centre, fully transparent corners."""
    ay = 255.0 * (1.6 - 1.4 * np.abs(np.linspace(-1, 1, height)))
    ax = 255.0 * (1.6 - 1.4 * np.abs(np.linspace(-1, 1, width)))
    return np.clip(np.minimum.outer(ay, ax) - 255.0 * 0.6, 0, 255).astype(np.uint8)


def _encode(plan: _Plan, image: Image.Image) -> bytes:
    """Encode `image` in the format of `plan.kind`."""
    out = BytesIO()
    if plan.kind.startswith("jpeg"):
        options: dict = {"quality": plan.quality}
        if plan.kind == "jpeg_exif":
            # Store the pixels turned, with the tag that turns them back upright.
            image = image.transpose(_STORE_TRANSPOSE[plan.orientation])
            exif = Image.Exif()
            exif[0x0112] = plan.orientation
            options["exif"] = exif.tobytes()
        image.save(out, "JPEG", **options)
    elif plan.kind == "png_p" and plan.index % 2:
        image.save(out, "PNG", compress_level=1, transparency=0)  # adds a tRNS chunk
    elif plan.kind.startswith("png"):
        image.save(out, "PNG", compress_level=1)
    elif plan.kind == "webp":
        image.save(out, "WEBP", quality=plan.quality, method=2)
    elif plan.kind == "tiff":
        image.save(out, "TIFF", compression="tiff_lzw")
    else:
        image.save(out, "BMP")
    return out.getvalue()
