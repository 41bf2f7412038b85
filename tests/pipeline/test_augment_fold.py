"""A policy's leading geometric ops folded into the fast crop (`pipeline.fast_transforms`).

The fold resamples the decoded image once where timm resamples twice (the crop, then the
op on it), so it is compared with our crop followed by the op (Pillow's within rounding,
`test_augment_ops`) by PSNR: the floor is the lowest value measured here (35.6 dB; medians
39.6 rotations, 43-44 shears and translations) less 2.6 dB, and below the worst measured
on crops of real photographs (33.8; benchmarks/recipe_loader.py's shards). The gap is the second
resampling's blur, which the fold does not add: a fractional translation blurs the whole
crop in two passes. The op of the wrong sign, or a crop box off by a few pixels, gives
far less (`test_a_fold_in_the_wrong_direction_fails_the_floor`). The fill is exact away
from its edge, where OpenCV's constant border blends it with the edge pixel over one
source pixel (Pillow's hard edge made soft, centred at the same place).
"""

from __future__ import annotations

import itertools
import random
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("simplejpeg")
cv2 = pytest.importorskip("cv2")

from pipeline import Augment, Batching  # noqa: E402
from pipeline.affine import compose  # noqa: E402
from pipeline.augment import build_augmenter, warp  # noqa: E402
from pipeline.augment.levels import OPS as NAMED_OPS  # noqa: E402
from pipeline.augment.levels import AffineOp, AffineRun, op_argument  # noqa: E402
from pipeline.fast_transforms import FastRandomResizedCrop  # noqa: E402
from pipeline.transforms import SampleRandom  # noqa: E402
from tests.oddimages import encode, noise_image, photo_jpeg  # noqa: E402
from tests.pillow_ops import psnr  # noqa: E402
from tests.pipeline.conftest import loader_for  # noqa: E402
from tests.pipeline.test_fast_transforms import marked_jpeg  # noqa: E402

FILL = (124, 116, 104)
FOLD_FLOOR = 33.0  # dB against the crop then the op (module docstring)
FOLDED = [
    AffineOp(kind, argument, resample, FILL)
    for (kind, argument), resample in itertools.product(
        [
            ("Rotate", 27.0),
            ("Rotate", -9.5),
            ("ShearX", 0.27),
            ("ShearY", -0.3),
            ("TranslateXRel", 0.405),
            ("TranslateYRel", -0.2),
            ("TranslateX", 33.3),
        ],
        ["bilinear", "bicubic"],
    )
]
IMAGES = [photo_jpeg(256, 341, seed=1), photo_jpeg(341, 256, seed=2), photo_jpeg(500, 375, 3)]


def two_passes(crop, data: bytes, seed: str, *ops: AffineOp) -> np.ndarray:
    """The crop, then each op on it (what timm does, with our Pillow-exact ops)."""
    pixels = crop(data, SampleRandom(seed))
    for op in ops:
        op(pixels)
    return pixels


def folded(crop, data: bytes, seed: str, *ops: AffineOp, **options) -> np.ndarray:
    """The crop with `ops` folded in (where it can)."""
    return crop(data, SampleRandom(seed), then=AffineRun(ops), **options)


def inside(op: AffineOp, size: int) -> np.ndarray:
    """Where Pillow's op samples the crop (True) rather than filling (False)."""
    low, high = warp.inside_spans(op.matrix(size, size), size, size)
    columns = np.arange(size)
    return (columns >= low[:, None]) & (columns < high[:, None])


@pytest.mark.parametrize("op", FOLDED, ids=lambda op: f"{op.kind}{op.argument}-{op.resample}")
def test_a_folded_op_is_the_op_on_the_crop_within_psnr(op):
    crop = FastRandomResizedCrop(size=112)
    sampled = inside(op, 112)
    ring = np.ones((5, 5), np.uint8)
    far_outside = ~cv2.dilate(sampled.astype(np.uint8), ring).astype(bool)
    for index, data in enumerate(IMAGES):
        for seed in (f"a{index}", f"b{index}", f"c{index}"):
            once = folded(crop, data, seed, op)
            reference = two_passes(crop, data, seed, op)
            assert psnr(once, reference) > FOLD_FLOOR, (op, seed)
            assert (once[far_outside] == FILL).all()
            assert (reference[far_outside] == FILL).all()


@pytest.mark.parametrize(
    "first,second",
    [
        (FOLDED[0], FOLDED[5]),  # rotate, then shear-y
        (FOLDED[8], FOLDED[2]),  # translate-x, then rotate
        (FOLDED[4], FOLDED[7]),  # shear-x, then shear-y
    ],
    ids=["rotate-shear", "translate-rotate", "shear-shear"],
)
def test_two_geometric_ops_fold_into_one_warp_with_both_fills(first, second):
    """The second op's own fill (where its point leaves the frame) is painted exactly, the
    first's is the crop's border: far from either edge, the fill is Pillow's."""
    crop = FastRandomResizedCrop(size=112)
    sampled = inside(second, 112) & _inside_through(first, second, 112)
    far_outside = ~cv2.dilate(sampled.astype(np.uint8), np.ones((5, 5), np.uint8)).astype(bool)
    assert far_outside.any() and sampled.any()
    for index, data in enumerate(IMAGES):
        for seed in (f"a{index}", f"b{index}"):
            once = folded(crop, data, seed, first, second)
            reference = two_passes(crop, data, seed, first, second)
            assert psnr(once, reference) > FOLD_FLOOR, seed
            assert (once[far_outside] == FILL).all() and (reference[far_outside] == FILL).all()
    assert (folded(crop, IMAGES[0], "x", first, second)[~inside(second, 112)] == FILL).all()


def _inside_through(first: AffineOp, second: AffineOp, size: int) -> np.ndarray:
    """Where the second op's point, read through the first, lands inside the crop."""
    both = compose([op.matrix(size, size) for op in (first, second)])
    low, high = warp.inside_spans(both, size, size)
    columns = np.arange(size)
    return (columns >= low[:, None]) & (columns < high[:, None])


def test_a_fold_in_the_wrong_direction_fails_the_floor():
    crop = FastRandomResizedCrop(size=112)
    for kind, argument in (("Rotate", 20.0), ("ShearX", 0.3), ("TranslateXRel", 0.2)):
        op = AffineOp(kind, argument, "bilinear", FILL)
        wrong = AffineOp(kind, -argument, "bilinear", FILL)
        assert psnr(folded(crop, IMAGES[0], "w", wrong), two_passes(crop, IMAGES[0], "w", op)) < 20


def test_a_fold_with_the_crop_box_off_fails_the_floor():
    """The same op on a box moved by 4 source pixels: far below the floor."""
    op = AffineOp("Rotate", 10.0, "bilinear", FILL)
    crop = FastRandomResizedCrop(size=112, scale=(0.3, 0.3))
    data = IMAGES[2]

    class Moved(FastRandomResizedCrop):
        def choose_crop(self, width, height, rng):
            (left, top, right, bottom), flip = super().choose_crop(width, height, rng)
            return (left + 4, top, right + 4, bottom), flip

    moved = Moved(size=112, scale=(0.3, 0.3))
    assert psnr(folded(moved, data, "m", op), two_passes(crop, data, "m", op)) < 29


def test_an_op_that_moves_nothing_leaves_the_crop_as_it_was():
    crop = FastRandomResizedCrop(size=96)
    for op in (
        AffineOp("Rotate", 0.0, "bicubic", FILL),
        AffineOp("Rotate", 360.0, "bilinear", FILL),
        AffineOp("ShearX", 0.0, "bilinear", FILL),
        AffineOp("TranslateYRel", 0.0, "bilinear", FILL),
    ):
        for seed in ("i", "j"):
            plain = crop(IMAGES[1], SampleRandom(seed))
            assert np.array_equal(folded(crop, IMAGES[1], seed, op, op), plain), op


@pytest.mark.parametrize(
    "crop,data",
    [
        # shrunk by more than AREA_SHRINK (no DCT scaling): box-averaged, not one warp
        (FastRandomResizedCrop(size=64, scale=(0.9, 1.0), draft=False), IMAGES[2]),
        (FastRandomResizedCrop(size=96, resample="nearest"), IMAGES[0]),
        (FastRandomResizedCrop(size=96, resample="bicubic"), IMAGES[0]),
        (FastRandomResizedCrop(size=96), encode(noise_image(200, 150), "PNG")),  # Pillow's
    ],
    ids=["averaged", "nearest", "bicubic", "pillow-fallback"],
)
def test_crops_that_are_not_one_bilinear_warp_run_the_op_after(crop, data):
    op = AffineOp("Rotate", 15.0, "bilinear", FILL)
    for seed in ("p", "q", "r"):
        second = AffineOp("ShearY", 0.2, "bicubic", FILL)
        once = folded(crop, data, seed, op, second)
        assert np.array_equal(once, two_passes(crop, data, seed, op, second))


def test_a_fold_writes_into_the_slot_and_flips_with_the_crop():
    crop = FastRandomResizedCrop(size=96, hflip=1.0)
    op = AffineOp("ShearX", 0.2, "bilinear", FILL)
    slot = np.zeros((96, 96, 3), np.uint8)
    assert folded(crop, IMAGES[0], "s", op, out=slot) is slot
    assert psnr(slot, two_passes(crop, IMAGES[0], "s", op)) > FOLD_FLOOR
    unflipped = FastRandomResizedCrop(size=96, hflip=0.0)
    assert psnr(slot, two_passes(unflipped, IMAGES[0], "s", op)) < 20


def test_a_folded_crop_of_a_band_is_the_folded_crop_of_the_whole_decode():
    """JPEGs with restart markers decode only the band under the box: the fold reads the
    box's region, whose pixels the band holds bit for bit, so the bytes are the same."""
    data = marked_jpeg(512, 384, seed=4)
    band = FastRandomResizedCrop(size=112)
    whole = FastRandomResizedCrop(size=112)
    object.__setattr__(whole, "band_decode", False)  # a ClassVar, set on this one crop
    for index, op in enumerate(FOLDED[::2]):
        seed = f"band{index}"
        ops = (op, FOLDED[-index - 1])
        once = folded(band, data, seed, *ops)
        assert np.array_equal(once, folded(whole, data, seed, *ops)), op


def train_images(shard_dir: Path) -> dict[str, bytes]:
    """Every train sample's JPEG bytes, by key, read from the tar shards."""
    images = {}
    for path in sorted(Path(shard_dir).rglob("*.tar")):
        with tarfile.open(path) as tar:
            for member in tar:
                if member.name.endswith(".jpg"):
                    images[member.name.rsplit(".", 2)[0]] = tar.extractfile(member).read()
    return images


def test_the_loader_folds_a_policys_first_geometric_op_into_the_crop(shard_dir):
    """Each delivered image is the fold of its first op (when geometric) and the rest after;
    at least one sample's first op was folded, and the fold shows in its pixels."""
    augment = Augment(auto_augment="rand-m9-n2-mstd0.5-inc1")
    batch = Batching(size=8, epoch_rule="uneven", drop_last=False)
    loader = loader_for(shard_dir, augment=augment, batch=batch)
    crop = FastRandomResizedCrop(size=32)
    augmenter = build_augmenter(augment, 32, "bilinear")  # the loader's crop filter
    sources = train_images(shard_dir)
    folds = 0
    for images, _, keys in loader:
        for key, image in zip(keys, images, strict=True):
            data = sources[key.rsplit("/", 1)[-1]] if key not in sources else sources[key]
            rng = SampleRandom(f"augment:11:0:{key}:0")
            then, rest = augmenter.leading_affine(augmenter.draw(rng))
            expected = crop(data, SampleRandom(f"aug:11:0:{key}:0"), then=then)
            augmenter(expected, rng, rest)
            assert torch.equal(image.permute(1, 2, 0), torch.from_numpy(expected)), key
            if then is not None and then.centre_matrix(32, 32) is not None:
                unfolded = two_passes(crop, data, f"aug:11:0:{key}:0", *then.ops)
                augmenter(unfolded, SampleRandom(f"augment:11:0:{key}:0"), rest)
                folds += not np.array_equal(unfolded, expected)
    assert folds >= 3


def test_draws_made_before_the_pixel_work_are_timms_interleaved_draws():
    """`draw`, then the drawn ops, gives the pixels of timm's order, where each op draws
    (probability, magnitude, sign, filter) and runs before the next op draws."""
    augmenter = build_augmenter(Augment(auto_augment="rand-m9-mstd0.5-inc1"), 64)
    policy = augmenter.policy
    image = FastRandomResizedCrop(size=64)(IMAGES[0], random.Random(0))
    for index in range(60):
        interleaved, rng = image.copy(), SampleRandom(f"d{index}")
        for op in policy.choose(rng):
            if rng.random() > op.prob:
                continue
            argument = op_argument(op.name, op.draw_magnitude(rng), op.hparams, rng)
            NAMED_OPS[op.name][1](argument, op.hparams, rng)(interleaved)
        drawn_first, rng = image.copy(), SampleRandom(f"d{index}")
        for op in augmenter.draw(rng):
            op(drawn_first)
        assert np.array_equal(interleaved, drawn_first), index


@pytest.mark.parametrize("width,height", [(1, 1), (1, 9), (9, 1), (16, 16), (3, 200)])
def test_folds_of_tiny_and_thin_jpegs_give_a_crop_and_never_raise(width, height):
    """The box's region may be a single pixel or row, enlarged many times: the warp still
    fills the slot. The fill's soft edge spans one source pixel, so a one-pixel image's
    crop is its colour blended with the fill, nothing else."""
    data = encode(noise_image(width, height, seed=width + height), "JPEG", quality=90)
    crop = FastRandomResizedCrop(size=32)
    for index, first in enumerate(FOLDED):
        second, seed = FOLDED[-1 - index], f"t{index}"
        once = folded(crop, data, seed, first, second)
        assert once.shape == (32, 32, 3) and once.dtype == np.uint8
        if width == height == 1:
            colour = crop(data, SampleRandom(seed))[0, 0].astype(int)
            low, high = np.minimum(colour, FILL), np.maximum(colour, FILL)
            assert ((once >= low - 1) & (once <= high + 1)).all()
            assert (once == FILL).all(-1).any()


def record_bands(monkeypatch) -> list[tuple]:
    """From now on, the (left, top, right, bottom) of each band asked of a JPEG."""
    from pipeline import fast_transforms

    asked: list[tuple] = []
    original = fast_transforms.crop_band

    def spy(data, left, top, right, bottom, scale):
        asked.append((left, top, right, bottom))
        return original(data, left, top, right, bottom, scale)

    monkeypatch.setattr(fast_transforms, "crop_band", spy)
    return asked


def test_a_shifted_crop_decodes_only_the_rows_it_reads(monkeypatch):
    """A shift by 40% of the side leaves 40% of the box unread: the band asked of the JPEG
    is that much shorter, and the crop the same bytes as from the whole decode."""
    asked = record_bands(monkeypatch)
    data = marked_jpeg(512, 384, seed=5)
    crop = FastRandomResizedCrop(size=112, scale=(0.5, 0.5), ratio=(1.0, 1.0))
    whole = FastRandomResizedCrop(size=112, scale=(0.5, 0.5), ratio=(1.0, 1.0))
    object.__setattr__(whole, "band_decode", False)
    for shift, kind in ((0.4, "TranslateYRel"), (-0.4, "TranslateYRel"), (0.4, "TranslateXRel")):
        op = AffineOp(kind, shift, "bilinear", FILL)
        crop(data, SampleRandom("s"))
        _, top, _, bottom = asked[-1]
        plain_rows, plain_columns = bottom - top, asked[-1][2] - asked[-1][0]
        once = folded(crop, data, "s", op)
        left, top, right, bottom = asked[-1]
        rows, columns = bottom - top, right - left
        if kind == "TranslateYRel":  # (the plain crop's band has a guard: a DCT-scaled box)
            assert rows <= 0.7 * plain_rows and 0.9 * plain_columns <= columns <= plain_columns
        else:
            assert columns <= 0.7 * plain_columns and 0.9 * plain_rows <= rows <= plain_rows
        assert np.array_equal(once, folded(whole, data, "s", op))
        assert psnr(once, two_passes(crop, data, "s", op)) > FOLD_FLOOR
    rotated = AffineOp("Rotate", 20.0, "bilinear", FILL)  # reads all of its box
    folded(crop, data, "s", rotated)
    assert 0.9 * plain_rows <= asked[-1][3] - asked[-1][1] <= plain_rows


@pytest.mark.parametrize("shift", [-500.0, 500.0])
def test_a_shift_past_the_whole_crop_is_all_fill_and_decodes_one_row(shift, monkeypatch):
    asked = record_bands(monkeypatch)
    crop = FastRandomResizedCrop(size=64)
    data = marked_jpeg(256, 192, seed=6)
    for kind in ("TranslateX", "TranslateY"):
        once = folded(crop, data, "far", AffineOp(kind, shift, "bilinear", FILL))
        assert (once == FILL).all()
        left, top, right, bottom = asked[-1]
        assert (right - left == 1) if kind == "TranslateX" else (bottom - top == 1)


def test_a_fold_of_a_jpeg_the_decoder_will_only_read_whole_uses_the_whole_decode(monkeypatch):
    """Where the DCT-scaled decode is refused, the image is decoded at full scale, and the
    region the fold reads is found again in those pixels: the crop shows the same part
    of the image as a crop without DCT scaling."""
    from pipeline import fast_transforms

    original = fast_transforms.decode_jpeg_scaled

    def refuse_scaled(data, width, height, scale, **options):
        return None if scale > 1 else original(data, width, height, scale, **options)

    monkeypatch.setattr(fast_transforms, "decode_jpeg_scaled", refuse_scaled)
    data = IMAGES[2]
    scaled = FastRandomResizedCrop(size=128, scale=(0.5, 0.7))  # a 2x DCT scale drawn
    full = FastRandomResizedCrop(size=128, scale=(0.5, 0.7), draft=False)
    for crop in (scaled, full):
        object.__setattr__(crop, "band_decode", False)
    for seed, op in itertools.product(("w1", "w2", "w3"), (FOLDED[6], FOLDED[9])):
        once = folded(scaled, data, seed, op)  # shifts: the region read is part of the box
        # the full-scale crop is box-averaged, the fold a bilinear warp shrinking ~3x:
        # measured 37.9-40.4 dB; the region of the 2x scale read at full scale, 13
        assert psnr(once, two_passes(full, data, seed, op)) > 30, (seed, op)
