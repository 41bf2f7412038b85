"""The streaming loader: shard URLs or a manifest in, uint8 image batches out.

`from pipeline import LoaderConfig, build_loader`. The names are imported
lazily so that `pipeline.config`, `pipeline.sources` and friends stay importable
without torch.
"""

from __future__ import annotations

from typing import Any

# The settings groups of `LoaderConfig` (pipeline.config, no torch).
CONFIG_NAMES = (
    "LoaderConfig",
    "LoaderOptions",
    "Batching",
    "Exact",
    "Resampled",
    "Mixing",
    "Source",
    "Shuffle",
    "Crop",
    "ProgressiveResize",
    "Augment",
    "Workers",
    "ReadOptions",
)
__all__ = [*CONFIG_NAMES, "build_loader", "ShardLoader", "CudaPrefetcher", "MixupCutmix"]


def __getattr__(name: str) -> Any:
    if name in CONFIG_NAMES:
        from pipeline import config

        return getattr(config, name)
    if name in ("build_loader", "ShardLoader"):
        from pipeline import loader

        return getattr(loader, name)
    if name == "CudaPrefetcher":
        from pipeline.prefetch import CudaPrefetcher

        return CudaPrefetcher
    if name == "MixupCutmix":
        from pipeline.mixup import MixupCutmix

        return MixupCutmix
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
