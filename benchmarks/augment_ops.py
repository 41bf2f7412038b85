"""Each augmentation op at 224 px in one process: our uint8 op against the Pillow call timm makes.

For every op of timm's RandAugment, AutoAugment and AugMix lists, at one magnitude
(`--magnitude`, default 9, the sign timm's level function keeps), times `pipeline.augment`'s
op on a 224x224x3 uint8 crop (refilled from the decoded image before each call, a copy of
~5 us that timm does not pay) and timm's Pillow call on the decoded PIL image (it returns a
new image). Both run in the same rounds, the ops in a rotating order and the two sides
alternating first, on CPU time, OpenCV on one thread as in the loader's workers. Prints a
markdown table: microseconds an image each way, the median over rounds of Pillow / ours
with its spread ((max - min) / median), and the fidelity: `exact` (every byte equal) or
the PSNR in dB against Pillow. Then whole recipes (ours only): the policies (geometric
ops bilinear, as behind the loader's default bilinear crop), DeiT's worker recipe with
random erasing, and erasing alone, also as a multiple of a reference op (cv2.resize)
timed in the same rounds; and last, a geometric op folded into the fast crop against
the op run after it.

    python benchmarks/augment_ops.py [--rounds 7] [--calls 200] [--magnitude 9]
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import statistics
import sys
import time
from io import BytesIO
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import markdown_table, spread  # noqa: E402

from pipeline.augment import Augment, build_augmenter  # noqa: E402
from pipeline.augment.levels import OPS, Hparams, op_argument  # noqa: E402
from pipeline.augment.policies import AUGMIX_OPS, RAND_INCREASING_OPS, RAND_OPS  # noqa: E402
from pipeline.transforms import SampleRandom  # noqa: E402
from tests.oddimages import photo_jpeg  # noqa: E402
from tests.pillow_ops import FixedSign, psnr, timm_pillow_op  # noqa: E402

SIZE = 224
RESAMPLE = "bilinear"
EXTRA_OPS = ("PosterizeOriginal", "TranslateX", "TranslateY", "Desaturate", "GaussianBlur")
POLICIES = ("rand-m9-mstd0.5-inc1", "original", "augmix-m5-w3-d2", "trivialaugment", "3a")
# whole recipes as `Augment` keywords: the policies above, DeiT's worker recipe, erasing
RECIPES = {policy: {"auto_augment": policy} for policy in POLICIES} | {
    "rand-m9-mstd0.5-inc1 + re 0.25": {"auto_augment": "rand-m9-mstd0.5-inc1", "re_prob": 0.25},
    "erasing (re_prob 1, pixel)": {"re_prob": 1.0, "re_mode": "pixel"},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of every op both ways")
    parser.add_argument("--calls", type=int, default=200, help="calls per op, side and round")
    parser.add_argument("--magnitude", type=float, default=9.0, help="timm magnitude, 0-10")
    args = parser.parse_args(argv)
    cv2.setNumThreads(1)
    image = np.asarray(Image.open(BytesIO(photo_jpeg(SIZE, SIZE, seed=1))).convert("RGB"))
    hparams = Hparams(translate_const=int(SIZE * 0.45), fill=(124, 116, 104), resample=(RESAMPLE,))
    names = list(dict.fromkeys((*RAND_OPS, *RAND_INCREASING_OPS, *AUGMIX_OPS, *EXTRA_OPS)))
    arguments = {name: op_argument(name, args.magnitude, hparams, FixedSign(0.0)) for name in names}
    cases = {}
    for name in names:
        cases[(name, "ours")] = functools.partial(run_ours, name, arguments[name], hparams, image)
        cases[(name, "pillow")] = functools.partial(
            run_pillow, name, arguments[name], Image.fromarray(image), hparams.fill
        )
    times = time_rounds(cases, names, args.rounds, args.calls)
    rows = []
    for name in names:
        ours, theirs = times[(name, "ours")], times[(name, "pillow")]
        ratios = [p / o for p, o in zip(theirs, ours, strict=True)]
        rows.append(
            [
                name,
                _argument_text(arguments[name]),
                f"{statistics.median(ours):.0f}",
                f"{statistics.median(theirs):.0f}",
                f"{statistics.median(ratios):.2f}x",
                f"{spread(ratios):.0%}",
                fidelity(name, arguments[name], hparams, image),
            ]
        )
    print(
        f"{SIZE}x{SIZE} photo-like JPEG, magnitude {args.magnitude:g}, {RESAMPLE}, "
        f"{args.rounds} rounds x {args.calls} calls, CPU time, medians"
    )
    header = ["op", "argument", "ours us", "Pillow us", "Pillow / ours", "spread", "fidelity"]
    print(markdown_table(header, rows))
    print()
    print(policy_table(image, args.rounds, args.calls))
    print()
    print(fold_table(args.rounds, args.calls, hparams.fill))
    return 0


def run_ours(name: str, argument, hparams: Hparams, image: np.ndarray, calls: int) -> None:
    pixels, op, rng = np.empty_like(image), OPS[name][1], random.Random(0)
    for _ in range(calls):
        np.copyto(pixels, image)
        op(argument, hparams, rng)(pixels)


def run_pillow(name: str, argument, img: Image.Image, fill, calls: int) -> None:
    for _ in range(calls):
        timm_pillow_op(name, argument, img, RESAMPLE, fill)


def time_rounds(cases: dict, names: list[str], rounds: int, calls: int) -> dict:
    """Microseconds a call per case and round: ops in rotating order, sides alternating."""
    times: dict = {key: [] for key in cases}
    for round_index in range(rounds):
        shift = round_index % len(names)
        sides = ("ours", "pillow") if round_index % 2 == 0 else ("pillow", "ours")
        for name in names[shift:] + names[:shift]:
            for side in sides:
                started = time.process_time()
                cases[(name, side)](calls)
                times[(name, side)].append((time.process_time() - started) / calls * 1e6)
    return times


def fidelity(name: str, argument, hparams: Hparams, image: np.ndarray) -> str:
    """`exact`, or the PSNR of our pixels against Pillow's."""
    pixels = image.copy()
    OPS[name][1](argument, hparams, random.Random(0))(pixels)
    img = Image.fromarray(image)
    reference = np.asarray(timm_pillow_op(name, argument, img, RESAMPLE, hparams.fill))
    value = psnr(pixels, reference)
    return "exact" if math.isinf(value) else f"{value:.1f} dB"


def policy_table(image: np.ndarray, rounds: int, calls: int) -> str:
    """Whole recipes as the loader runs them (ours only): microseconds an image, and as a
    multiple of a fixed reference op timed in the same rounds (cv2.resize of the crop to
    half size), a figure that survives a loaded host."""
    rows = []
    for name, keywords in RECIPES.items():
        augmenter = build_augmenter(Augment(**keywords), SIZE, RESAMPLE)  # the loader's crop
        pixels, spent, ratios = np.empty_like(image), [], []
        for round_index in range(rounds):
            started = time.process_time()
            for call in range(calls):
                np.copyto(pixels, image)
                augmenter(pixels, SampleRandom(f"{round_index}/{call}"))
            spent.append((time.process_time() - started) / calls * 1e6)
            ratios.append(spent[-1] / reference_us(image, calls))
        rows.append(
            [
                name,
                f"{statistics.median(spent):.0f}",
                f"{statistics.median(ratios):.1f}x",
                f"{spread(spent):.0%}",
            ]
        )
    header = ["recipe (ours, per image)", "us", "/ reference op", "spread"]
    return markdown_table(header, rows)


FOLDS = (("Rotate", 27.0), ("ShearX", 0.27), ("TranslateXRel", 0.405))


def fold_table(rounds: int, calls: int, fill) -> str:
    """A geometric op folded into the fast crop (one warp of the decoded JPEG) against the
    crop then the op: CPU us a crop over the plain crop, decode included, on 341 x 256
    photo-like JPEGs (the recipe benchmark's shard size), kinds in rotating order."""
    from pipeline.augment.levels import AffineOp, AffineRun
    from pipeline.fast_transforms import FastRandomResizedCrop

    crop = FastRandomResizedCrop(size=SIZE)
    images = [photo_jpeg(341, 256, seed=seed) for seed in range(8)]
    slot = np.empty((SIZE, SIZE, 3), np.uint8)

    def timed(run) -> float:
        started = time.process_time()
        for call in range(calls):
            run(images[call % len(images)], SampleRandom(f"fold/{call}"))
        return (time.process_time() - started) / calls * 1e6

    results: dict = {}
    for round_index in range(rounds):
        shift = round_index % len(FOLDS)
        for kind, argument in FOLDS[shift:] + FOLDS[:shift]:
            op = AffineOp(kind, argument, RESAMPLE, fill)
            plain = timed(lambda data, rng: crop(data, rng, out=slot))
            folded = timed(
                lambda data, rng, op=op: crop(data, rng, out=slot, then=AffineRun((op,)))
            )
            after = timed(lambda data, rng, op=op: op(crop(data, rng, out=slot)))
            results.setdefault(kind, []).append((folded - plain, after - plain))
    rows = []
    for kind, _ in FOLDS:
        folded = statistics.median(f for f, _ in results[kind])
        after = statistics.median(a for _, a in results[kind])
        rows.append([kind, f"{folded:+.0f}", f"{after:+.0f}", f"{after - folded:.0f}"])
    header = ["op on a 224 crop", "folded: us over the crop", "run after", "us saved"]
    return markdown_table(header, rows)


def reference_us(image: np.ndarray, calls: int) -> float:
    """Microseconds of CPU for one cv2.resize of `image` to half its side (INTER_LINEAR)."""
    size = (image.shape[1] // 2, image.shape[0] // 2)
    started = time.process_time()
    for _ in range(calls):
        cv2.resize(image, size, interpolation=cv2.INTER_LINEAR)
    return (time.process_time() - started) / calls * 1e6


def _argument_text(argument) -> str:
    if argument is None:
        return "-"
    return f"{argument:g}" if isinstance(argument, float) else str(argument)


if __name__ == "__main__":
    sys.exit(main())
