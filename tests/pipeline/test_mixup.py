"""`MixupCutmix`: soft targets, box areas, modes, multi-label, determinism, and the prefetcher option."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pipeline import MixupCutmix
from pipeline.prefetch import CudaPrefetcher
from shards.errors import UsageError
from tests.gpu import gpu
from tests.pipeline.conftest import loader_for

CLASSES = 10
MODES = ("batch", "pair", "elem")


def constant_batch(size: int = 8, side: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Image i is filled with the value i + 1 and labelled class i: every pixel tells whose it is."""
    images = torch.arange(1, size + 1, dtype=torch.float32).view(size, 1, 1, 1)
    return images.expand(size, 3, side, side).clone(), torch.arange(size)


def partner_share(mixed: torch.Tensor, size: int) -> torch.Tensor:
    """Share of each image's pixels that now hold its partner's value (`size - i`)."""
    partner = torch.arange(size, 0, -1, dtype=torch.float32).view(size, 1, 1, 1)
    return (mixed == partner).float().mean(dim=(1, 2, 3))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "alphas", [(0.8, 0.0), (0.0, 1.0), (0.8, 1.0)], ids=["mixup", "cutmix", "both"]
)
def test_targets_are_soft_rows_that_sum_to_one(mode, alphas):
    mix = MixupCutmix(
        mixup_alpha=alphas[0],
        cutmix_alpha=alphas[1],
        mode=mode,
        label_smoothing=0.1,
        num_classes=CLASSES,
    )
    for _ in range(5):
        images, labels = constant_batch()
        out, targets = mix(images, labels)
        assert out is images and targets.dtype == torch.float32
        assert targets.shape == (8, CLASSES)
        torch.testing.assert_close(targets.sum(dim=1), torch.ones(8))
        assert (targets >= 0.1 / CLASSES - 1e-7).all()  # smoothing leaves every class its floor


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("minmax", [None, (0.2, 0.8)])
def test_cutmix_target_share_is_the_pasted_box_area(mode, minmax):
    """The lambda is corrected to the clipped box: the partner's target weight is exactly the
    share of the image its pixels cover."""
    mix = MixupCutmix(
        mixup_alpha=0.0,
        cutmix_alpha=1.0,
        cutmix_minmax=minmax,
        mode=mode,
        label_smoothing=0.0,
        num_classes=CLASSES,
    )
    clipped = 0
    for _ in range(20):
        images, labels = constant_batch(size=8, side=15)
        draw = mix.draw(8, 15, 15)  # the draw the call below makes: the position is unchanged
        out, targets = mix(images, labels)
        share = partner_share(out, 8)
        partner_weight = targets[torch.arange(8), torch.arange(7, -1, -1)]
        torch.testing.assert_close(partner_weight, share, atol=1e-6, rtol=0)
        boxes = draw.boxes
        clipped += int(
            (
                (boxes[:, 0] == 0) | (boxes[:, 1] == 15) | (boxes[:, 2] == 0) | (boxes[:, 3] == 15)
            ).sum()
        )
    assert clipped > 0  # boxes at the border were among them: the correction was exercised


@pytest.mark.parametrize("mode", MODES)
def test_mixup_pixels_and_targets_share_one_lambda(mode):
    mix = MixupCutmix(
        mixup_alpha=0.8, cutmix_alpha=0.0, mode=mode, label_smoothing=0.0, num_classes=CLASSES
    )
    images, labels = constant_batch()
    out, targets = mix(images, labels)
    own = targets[torch.arange(8), labels]
    expected = own * (labels + 1) + (1 - own) * (
        8 - labels
    )  # lam * own value + (1 - lam) * partner's
    torch.testing.assert_close(out[:, 0, 0, 0], expected.float())
    assert (out == out[:, :, :1, :1]).all()  # a blend is uniform over the image


def test_the_modes_share_draws_as_documented():
    def lambdas(mode: str) -> np.ndarray:
        mix = MixupCutmix(mixup_alpha=1.0, mode=mode, label_smoothing=0.0, num_classes=CLASSES)
        _, targets = mix(*constant_batch())
        return targets[torch.arange(8), torch.arange(8)].numpy()

    batch, pair, elem = lambdas("batch"), lambdas("pair"), lambdas("elem")
    assert np.allclose(batch, batch[0])  # one draw for all
    assert np.allclose(pair, pair[::-1]) and len(np.unique(pair.round(6))) == 4  # one per pair
    assert len(np.unique(elem.round(6))) == 8  # one per element


def reference_mix(
    images: torch.Tensor, lam: np.ndarray, cutmix: np.ndarray, boxes: np.ndarray
) -> torch.Tensor:
    """timm's per-element loop (`_mix_elem`), written plainly."""
    source, out = images.clone(), images.clone()
    size = len(images)
    for i in range(size):
        j = size - 1 - i
        if lam[i] == 1.0:
            continue
        if cutmix[i]:
            yl, yh, xl, xh = boxes[i]
            out[i, :, yl:yh, xl:xh] = source[j, :, yl:yh, xl:xh]
        else:
            out[i] = source[i] * lam[i] + source[j] * (1 - lam[i])
    return out


@pytest.mark.parametrize("mode", MODES)
def test_the_vectorised_mix_equals_the_per_element_loop(mode):
    mix = MixupCutmix(
        mixup_alpha=0.8, cutmix_alpha=1.0, prob=0.8, mode=mode, num_classes=CLASSES, seed=3
    )
    generator = torch.Generator().manual_seed(0)
    for step in range(10):
        images = torch.randn(8, 3, 12, 10, generator=generator)
        mix.set_position(0, step)
        draw = mix.draw(8, 12, 10)
        expected = reference_mix(images, draw.lam, draw.cutmix, draw.boxes)
        out, _ = mix(images, torch.arange(8))
        torch.testing.assert_close(out, expected)


def test_draws_come_from_seed_rank_epoch_and_step():
    def run(mix: MixupCutmix, epoch: int, steps: int) -> list[torch.Tensor]:
        mix.set_epoch(epoch)
        return [mix(*constant_batch())[1] for _ in range(steps)]

    settings = dict(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=CLASSES, seed=7)
    first = run(MixupCutmix(**settings), epoch=2, steps=6)
    again = run(MixupCutmix(**settings), epoch=2, steps=6)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    resumed = MixupCutmix(**settings)
    resumed.set_position(2, 4)  # a run resumed after 4 batches of epoch 2
    assert torch.equal(resumed(*constant_batch())[1], first[4])
    assert resumed.step == 5
    assert len({tuple(t[0].tolist()) for t in first}) == 6  # each step draws afresh
    others = [
        run(MixupCutmix(**settings), epoch=3, steps=6),
        run(MixupCutmix(**{**settings, "seed": 8}), epoch=2, steps=6),
        run(MixupCutmix(**settings, rank=1), epoch=2, steps=6),
    ]
    for other in others:
        assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize("mode", MODES)
def test_multi_hot_targets_are_smoothed_and_mixed(mode):
    mix = MixupCutmix(
        mixup_alpha=0.8, cutmix_alpha=1.0, mode=mode, label_smoothing=0.2, num_classes=CLASSES
    )
    images, _ = constant_batch()
    hot = torch.zeros(8, CLASSES)
    for i in range(8):
        hot[i, [i, (i + 3) % CLASSES]] = 1.0
    lam_source = MixupCutmix(
        mixup_alpha=0.8, cutmix_alpha=1.0, mode=mode, label_smoothing=0.0, num_classes=CLASSES
    )
    _, single = lam_source(constant_batch()[0], torch.arange(8))  # the same draw, class ids
    lam = single[torch.arange(8), torch.arange(8)].unsqueeze(1)
    _, targets = mix(images, hot)
    smoothed = hot * 0.8 + 0.2 / CLASSES
    torch.testing.assert_close(targets, smoothed * lam + smoothed.flip(0) * (1 - lam))
    torch.testing.assert_close(targets.sum(dim=1), smoothed.sum(dim=1))


def test_prob_zero_leaves_images_and_gives_smoothed_one_hot():
    mix = MixupCutmix(
        mixup_alpha=1.0, cutmix_alpha=1.0, prob=0.0, label_smoothing=0.1, num_classes=4
    )
    images, labels = constant_batch(size=4)
    before = images.clone()
    out, targets = mix(images, labels)
    assert torch.equal(out, before)
    torch.testing.assert_close(targets, torch.eye(4) * 0.9 + 0.025)


def test_odd_batches_mix_in_batch_mode_only():
    images, labels = constant_batch(size=7)
    _, targets = MixupCutmix(num_classes=CLASSES)(images, labels)
    torch.testing.assert_close(targets.sum(dim=1), torch.ones(7))
    for mode in ("pair", "elem"):
        with pytest.raises(UsageError, match=f"mode='{mode}'. needs an even batch, got 7"):
            MixupCutmix(mode=mode, num_classes=CLASSES)(*constant_batch(size=7))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(mixup_alpha=0.0), "nothing to mix"),
        (dict(mixup_alpha=-1.0), "mixup_alpha must be a number of at least 0"),
        (dict(cutmix_minmax=(0.8, 0.2)), "cutmix_minmax must be .min, max., 0 < min"),
        (dict(cutmix_minmax=0.5), "cutmix_minmax must be .min, max. or None, got 0.5"),
        (dict(prob=1.5), "prob must be a number in"),
        (dict(mode="pairs"), "mode 'pairs' is not one of batch, pair, elem"),
        (dict(label_smoothing=1.0), "label_smoothing must be a number in"),
        (dict(num_classes=0), "num_classes must be at least 1"),
    ],
)
def test_bad_settings_are_one_line_errors(settings, message):
    with pytest.raises(UsageError, match=message) as caught:
        MixupCutmix(**{"num_classes": CLASSES, **settings})
    assert "\n" not in str(caught.value) and "MixupCutmix." in str(caught.value)


def test_bad_batches_are_one_line_errors():
    mix = MixupCutmix(num_classes=CLASSES)
    with pytest.raises(
        UsageError, match="images must be a float .B, C, H, W. tensor, got torch.uint8"
    ):
        mix(torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.arange(4))
    with pytest.raises(UsageError, match="labels must be a tensor of 4 rows"):
        mix(torch.zeros(4, 3, 8, 8), torch.arange(3))
    with pytest.raises(UsageError, match="class ids .B. or multi-hot .B, 10."):
        mix(torch.zeros(4, 3, 8, 8), torch.zeros(4, 3))


def test_the_minmax_box_forces_cutmix_as_timm_does():
    mix = MixupCutmix(
        mixup_alpha=0.0, cutmix_alpha=0.0, cutmix_minmax=(0.4, 0.6), num_classes=CLASSES
    )
    assert mix.cutmix_alpha == 1.0
    draw = mix.draw(4, 20, 20)
    heights, widths = draw.boxes[:, 1] - draw.boxes[:, 0], draw.boxes[:, 3] - draw.boxes[:, 2]
    assert ((heights >= 8) & (heights < 12) & (widths >= 8) & (widths < 12)).all()


# --- the CudaPrefetcher option ---------------------------------------------------------


def uint8_batches(count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8, generator=generator),
            torch.arange(6) % 4,
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefetcher_mixes_after_normalising_then_casts(dtype):
    batches = uint8_batches()
    settings = dict(mixup_alpha=0.8, cutmix_alpha=1.0, mode="elem", num_classes=4, seed=2)
    mixed = list(CudaPrefetcher(batches, "cpu", dtype=dtype, mix=MixupCutmix(**settings)))
    plain = list(CudaPrefetcher(batches, "cpu"))
    by_hand = MixupCutmix(**settings)
    for (images, targets), (normalised, labels) in zip(mixed, plain, strict=True):
        want_images, want_targets = by_hand(normalised, labels)
        assert images.dtype == dtype and targets.shape == (6, 4)
        torch.testing.assert_close(images, want_images.to(dtype))
        torch.testing.assert_close(targets, want_targets)


class EpochBatches(list):
    """A list of batches with the `set_epoch` a loader has."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def test_prefetcher_set_epoch_resets_the_mix():
    mix = MixupCutmix(num_classes=4)
    prefetcher = CudaPrefetcher(EpochBatches(uint8_batches()), "cpu", mix=mix)
    list(prefetcher)
    assert (mix.epoch, mix.step) == (0, 3)
    prefetcher.set_epoch(4)
    assert (mix.epoch, mix.step) == (4, 0) and prefetcher.loader.epoch == 4


def test_prefetcher_mixes_a_resumed_epoch_as_the_whole_one(shard_dir):
    """The mix follows the loader's position: a run stopped after 2 batches and resumed from
    the loader's state mixes the remaining batches exactly as the uninterrupted run."""

    def prefetcher(loader):
        mix = MixupCutmix(mixup_alpha=0.8, cutmix_alpha=1.0, mode="pair", num_classes=8, seed=5)
        return CudaPrefetcher(loader, "cpu", mix=mix)

    whole = [(images, targets) for images, targets, _ in prefetcher(loader_for(shard_dir))]
    first = loader_for(shard_dir)
    stopped = prefetcher(first)
    list(itertools.islice(stopped, 2))
    state = stopped.state_dict()
    second = loader_for(shard_dir)
    resumed = prefetcher(second)
    resumed.load_state_dict(state)
    rest = [(images, targets) for images, targets, _ in resumed]
    assert len(rest) == len(whole) - 2
    for (images, targets), (want_images, want_targets) in zip(rest, whole[2:], strict=True):
        assert torch.equal(images, want_images) and torch.equal(targets, want_targets)


@pytest.mark.parametrize("mode", [pytest.param(mode, marks=gpu) for mode in MODES])
def test_mixing_on_cuda_equals_the_cpu(mode):
    """The same draws give the same pixels and targets on the GPU (through the prefetcher's
    side stream) as on the CPU."""
    batches = uint8_batches()
    settings = dict(mixup_alpha=0.8, cutmix_alpha=1.0, mode=mode, num_classes=4, seed=9)
    on_cpu = list(CudaPrefetcher(batches, "cpu", mix=MixupCutmix(**settings)))
    pinned = [(images.pin_memory(), labels.pin_memory()) for images, labels in batches]
    on_gpu = list(CudaPrefetcher(pinned, "cuda", mix=MixupCutmix(**settings)))
    for (images, targets), (want_images, want_targets) in zip(on_gpu, on_cpu, strict=True):
        assert images.is_cuda and targets.is_cuda
        torch.testing.assert_close(images.cpu(), want_images, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(targets.cpu(), want_targets)
