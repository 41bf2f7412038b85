"""The recipe flags (`TrainConfig.recipe`, timm's names) turned into what runs them.

The train loader's settings (`Augment`, repeated augmentation, progressive resizing), the
batch mix (`MixupCutmix`) and the loss that takes its soft targets, and the one line of
the startup log that says what the run trains with. Evaluation gets none of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import ProgressiveResize
from pipeline.mixup import MixupCutmix
from trainers.config import Recipe, TrainConfig


class SoftTargetCrossEntropy(nn.Module):
    """Cross-entropy against soft targets `[B, C]` (rows of class probabilities), the mean
    over the batch: `-sum(target * log_softmax(logits))` per sample, as timm's."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()


def build_criterion(config: TrainConfig) -> nn.Module:
    """The training loss: BCE per class (multi-label, hard or mixed targets alike), soft-target
    cross-entropy when batches are mixed (the smoothing is in the targets), else
    cross-entropy with `--smoothing` (the same loss as soft targets of smoothed one-hots)."""
    if config.data.task == "multi-label":
        return nn.BCEWithLogitsLoss()  # mean over samples x classes; takes soft targets too
    if config.recipe.mixes:
        return SoftTargetCrossEntropy()
    return nn.CrossEntropyLoss(label_smoothing=config.recipe.label_smoothing)


def build_mix(config: TrainConfig, num_classes: int, rank: int) -> MixupCutmix | None:
    """The batch mix of `--mixup`/`--cutmix`, drawn from (seed, rank, epoch, batch)."""
    recipe = config.recipe
    if not recipe.mixes:
        return None
    return MixupCutmix(
        mixup_alpha=recipe.mixup,
        cutmix_alpha=recipe.cutmix,
        cutmix_minmax=recipe.cutmix_minmax,
        prob=recipe.mixup_prob,
        switch_prob=recipe.mixup_switch_prob,
        mode=recipe.mixup_mode,
        label_smoothing=config.recipe.label_smoothing,
        num_classes=num_classes,
        seed=config.run.seed,
        rank=rank,
    )


def progressive_resize(config: TrainConfig) -> ProgressiveResize | None:
    """The train crops' side by epoch; the ramp ends at the last epoch unless told."""
    recipe = config.recipe
    if not recipe.progressive:
        return None
    last = recipe.progressive_last_epoch
    return ProgressiveResize(
        start=recipe.progressive_start,
        end=recipe.progressive_end,
        first_epoch=recipe.progressive_first_epoch,
        last_epoch=max(config.schedule.epochs - 1, recipe.progressive_first_epoch)
        if last is None
        else last,
        step=recipe.progressive_step,
    )


def recipe_line(config: TrainConfig) -> str:
    """What the run trains with beyond crop + flip, and the loss, in one log line."""
    recipe, parts = config.recipe, []
    if recipe.auto_augment is not None:
        parts.append(f"policy {recipe.auto_augment}")
    if recipe.color_jitter:
        parts.append(f"colour jitter {recipe.color_jitter:g}")
    if recipe.re_prob:
        parts.append(
            f"random erasing {recipe.re_prob:g} ({recipe.re_mode}, {recipe.re_count} boxes)"
        )
    if recipe.aug_repeats > 1:
        parts.append(f"{recipe.aug_repeats} augmented repeats of each sample")
    schedule = progressive_resize(config)
    if schedule is not None:
        sides = [schedule.size_at(epoch) for epoch in range(config.schedule.epochs)]
        parts.append(f"progressive resizing {' '.join(map(str, sides))} px by epoch")
    if recipe.mixes:
        parts.append(mix_text(recipe))
    crops = "random-resized crop + flip" + "".join(f", {part}" for part in parts)
    return f"recipe: {crops}; loss: {loss_text(config)}; eval: plain center crop"


def mix_text(recipe: Recipe) -> str:
    kinds = []
    if recipe.mixup:
        kinds.append(f"mixup {recipe.mixup:g}")
    if recipe.cutmix_minmax is not None:
        kinds.append(f"cutmix boxes {recipe.cutmix_minmax[0]:g}-{recipe.cutmix_minmax[1]:g}")
    elif recipe.cutmix:
        kinds.append(f"cutmix {recipe.cutmix:g}")
    switch = f", switch {recipe.mixup_switch_prob:g}" if len(kinds) == 2 else ""
    return f"{' / '.join(kinds)} (prob {recipe.mixup_prob:g}{switch}, per {recipe.mixup_mode})"


def loss_text(config: TrainConfig) -> str:
    smoothing = (
        f", smoothing {config.recipe.label_smoothing:g}" if config.recipe.label_smoothing else ""
    )
    if config.data.task == "multi-label":
        mixed = " on mixed multi-hot targets" if config.recipe.mixes else ""
        return f"BCE per class{mixed}"
    if config.recipe.mixes:
        return f"soft-target cross-entropy{smoothing}"
    return f"cross-entropy{smoothing}"
