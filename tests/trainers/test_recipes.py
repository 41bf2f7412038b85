"""The training recipe flags (timm's names): parsing, what each builds, the loss, and a run."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from pipeline.augment import Augment
from pipeline.config import ProgressiveResize
from pipeline.mixup import MixupCutmix
from pipeline.prefetch import CudaPrefetcher
from tests.trainers.conftest import TRAIN_CLASSES, base_args, read_rows
from trainers.config import TrainConfig, parse_command_line
from trainers.data import loader_config
from trainers.distributed import DistInfo
from trainers.recipe import (
    SoftTargetCrossEntropy,
    build_criterion,
    build_mix,
    progressive_resize,
    recipe_line,
)
from trainers.train import main

DEIT = [
    "--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--mixup", "0.8", "--cutmix", "1.0",
    "--smoothing", "0.1",
]  # fmt: skip
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def parse(*flags: str) -> TrainConfig:
    return parse_command_line(["--train-shards", "data", *flags])[1]


def test_timm_flags_set_the_recipe():
    config = parse(
        *DEIT,
        *["--color-jitter", "0.3", "--remode", "rand", "--recount", "2", "--aug-repeats", "3"],
        *["--mixup-prob", "0.9", "--mixup-switch-prob", "0.4", "--mixup-mode", "pair"],
        *["--progressive-start", "160", "--progressive-end", "192", "--epochs", "16"],
        *["--progressive-first-epoch", "2", "--progressive-last-epoch", "12"],
    )
    recipe = config.recipe
    assert (recipe.auto_augment, recipe.re_prob, recipe.re_mode, recipe.re_count) == (
        "rand-m9-mstd0.5-inc1",
        0.25,
        "rand",
        2,
    )
    assert (recipe.mixup, recipe.cutmix, recipe.mixup_prob, recipe.mixup_switch_prob) == (
        0.8,
        1.0,
        0.9,
        0.4,
    )
    assert recipe.mixup_mode == "pair" and recipe.aug_repeats == 3 and recipe.color_jitter == 0.3
    assert config.recipe.label_smoothing == 0.1
    assert progressive_resize(config) == ProgressiveResize(
        start=160, end=192, first_epoch=2, last_epoch=12, step=32
    )
    assert recipe.augment() == Augment(
        auto_augment="rand-m9-mstd0.5-inc1",
        color_jitter=0.3,
        re_prob=0.25,
        re_mode="rand",
        re_count=2,
    )


def test_a_config_file_takes_the_same_names(tmp_path):
    path = tmp_path / "deit.toml"
    path.write_text(
        'aa = "rand-m9-mstd0.5-inc1"\nreprob = 0.25\nmixup = 0.8\ncutmix = 1.0\n'
        'smoothing = 0.1\naug-repeats = 3\nmixup-mode = "elem"\ncutmix-minmax = [0.2, 0.8]\n'
        "progressive-start = 160\nprogressive-end = 192\n"
    )
    from_file = parse("--config", str(path))
    flags = parse(
        *DEIT,
        *["--aug-repeats", "3", "--mixup-mode", "elem", "--cutmix-minmax", "0.2,0.8"],
        *["--progressive-start", "160", "--progressive-end", "192"],
    )
    assert from_file == flags
    assert TrainConfig.from_dict(flags.to_dict()) == flags  # what checkpoints store


def test_the_old_label_smoothing_spelling_still_works(tmp_path):
    assert parse("--label-smoothing", "0.2").recipe.label_smoothing == 0.2
    assert parse("--label-smoothing=0.3").recipe.label_smoothing == 0.3
    path = tmp_path / "old.toml"
    path.write_text("label-smoothing = 0.1\n")
    assert parse("--config", str(path)).recipe.label_smoothing == 0.1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--aa", "rand-x9"], "--aa 'rand-x9': section 'x9'"),
        (["--reprob", "1.5"], "--reprob must be a number in .0, 1."),
        (["--remode", "noise"], "invalid choice: 'noise'"),
        (["--recount", "0"], "--recount must be at least 1"),
        (["--mixup", "-0.1"], "--mixup must be at least 0"),
        (["--cutmix-minmax", "0.8,0.2"], "--cutmix-minmax must be min,max"),
        (["--mixup-mode", "pair", "--mixup", "1", "--batch-size", "15"], "must be even, got 15"),
        (["--progressive-start", "160"], "--progressive-start and progressive_end go together"),
        (["--progressive-last-epoch", "3"], "--progressive-last-epoch needs progressive_start"),
        (["--progressive-start", "16", "--progressive-end", "24"], "--progressive-start must be at least 32"),
        (["--aug-repeats", "2", "--train-shards", "other"], "--aug-repeats repeats the samples of one"),
    ],
)  # fmt: skip
def test_bad_recipe_flags_are_one_usage_line(flags, message, capsys):
    with pytest.raises(SystemExit) as caught:
        parse(*flags)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_the_loss_follows_the_recipe():
    assert type(build_criterion(parse())) is nn.CrossEntropyLoss
    smoothing = build_criterion(parse("--smoothing", "0.1"))
    assert isinstance(smoothing, nn.CrossEntropyLoss) and smoothing.label_smoothing == 0.1
    assert isinstance(build_criterion(parse("--mixup", "0.2")), SoftTargetCrossEntropy)
    assert isinstance(build_criterion(parse("--cutmix-minmax", "0.2,0.8")), SoftTargetCrossEntropy)
    multi = parse("--task", "multi-label", "--mixup", "0.2")
    assert isinstance(build_criterion(multi), nn.BCEWithLogitsLoss)


def test_soft_target_cross_entropy_is_smoothed_cross_entropy_on_smoothed_one_hots():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=generator)
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    soft = torch.nn.functional.one_hot(labels, 5).float() * 0.9 + 0.1 / 5
    torch.testing.assert_close(
        SoftTargetCrossEntropy()(logits, soft),
        nn.CrossEntropyLoss(label_smoothing=0.1)(logits, labels),
    )


def test_the_mix_is_built_from_the_flags_and_seeded_per_rank():
    config = parse(*DEIT, "--mixup-mode", "elem", "--seed", "4")
    mix = build_mix(config, num_classes=7, rank=2)
    assert isinstance(mix, MixupCutmix)
    assert (mix.mixup_alpha, mix.cutmix_alpha, mix.mode, mix.label_smoothing) == (
        0.8,
        1.0,
        "elem",
        0.1,
    )
    assert (mix.num_classes, mix.seed, mix.rank) == (7, 4, 2)
    assert build_mix(parse("--smoothing", "0.1"), num_classes=7, rank=0) is None


def test_only_the_train_loader_gets_the_recipe():
    flags = ["--progressive-start", "32", "--progressive-end", "64", "--aug-repeats", "3"]
    config = parse(*DEIT, *flags)
    train = loader_config(config, CPU, "train", train=True)
    val = loader_config(config, CPU, "val", train=False)
    assert train.augment == config.recipe.augment() and train.augment is not None
    assert train.batch.aug_repeats == 3 and train.crop.progressive == progressive_resize(config)
    assert not val.augment.enabled  # an eval loader given an enabled one would refuse it
    assert val.batch.aug_repeats == 1 and val.crop.progressive is None
    plain = loader_config(parse(), CPU, "train", train=True)
    assert not plain.augment.enabled and plain.crop.progressive is None
    assert plain.batch.aug_repeats == 1


def test_the_recipe_line_says_what_the_run_trains_with():
    assert recipe_line(parse()) == (
        "recipe: random-resized crop + flip; loss: cross-entropy; eval: plain center crop"
    )
    line = recipe_line(
        parse(
            *DEIT,
            *["--aug-repeats", "3", "--epochs", "4", "--progressive-start", "160"],
            *["--progressive-end", "224", "--progressive-step", "32"],
        )
    )
    assert line == (
        "recipe: random-resized crop + flip, policy rand-m9-mstd0.5-inc1, random erasing 0.25 "
        "(pixel, 1 boxes), 3 augmented repeats of each sample, progressive resizing "
        "160 192 192 224 px by epoch, mixup 0.8 / cutmix 1 (prob 1, switch 0.5, per batch); "
        "loss: soft-target cross-entropy, smoothing 0.1; eval: plain center crop"
    )


def test_a_cpu_run_with_deit_flags_learns(train_shards, tmp_path, capsys):
    """DeiT's recipe on the tests' 4-class sample: val accuracy well above chance (0.25)."""
    run = tmp_path / "deit"
    assert main(base_args(train_shards, run, epochs=3, workers=2) + DEIT) == 0
    evals = read_rows(run, "eval")
    assert evals[-1]["val_accuracy"] > 2.5 / TRAIN_CLASSES
    assert (
        "recipe: random-resized crop + flip, policy rand-m9-mstd0.5-inc1" in capsys.readouterr().err
    )
    train_losses = [row["loss"] for row in read_rows(run, "train")]
    assert min(train_losses) > 0.3  # soft targets: the loss cannot fall to a hard-label's near 0


def test_the_loader_scan_times_the_batch_mix_too(train_shards, tmp_path, monkeypatch):
    """`scan-throughput --scan-source loader` feeds its steps as training does: mixed."""
    import trainers.probe

    mixes = []

    class Recording(CudaPrefetcher):
        def __init__(self, *args, mix=None, **kwargs):
            mixes.append(mix)
            super().__init__(*args, mix=mix, **kwargs)

    monkeypatch.setattr(trainers.probe, "CudaPrefetcher", Recording)
    args = ["scan-throughput", "--model", "cnn", "--image-size", "24", "--device", "cpu"]
    args += ["--scan-steps", "1", "--scan-warmup", "0", "--scan-batch-sizes", "8"]
    args += ["--scan-source", "loader", "--train-shards", str(train_shards), "--workers", "0"]
    assert main([*args, "--run-dir", str(tmp_path / "scan"), "--mixup", "0.8"]) == 0
    assert len(mixes) == 1 and isinstance(mixes[0], MixupCutmix) and mixes[0].mixup_alpha == 0.8
