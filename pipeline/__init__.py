"""The streaming loader: shard URLs or a manifest in, uint8 image batches out.

`from pipeline import LoaderConfig, build_loader`. The names are imported
lazily so that `pipeline.urls` and friends stay importable without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LoaderConfig", "build_loader", "ShardLoader", "CudaPrefetcher"]


def __getattr__(name: str) -> Any:
    if name in ("LoaderConfig", "build_loader", "ShardLoader"):
        from pipeline import loader

        return getattr(loader, name)
    if name == "CudaPrefetcher":
        from pipeline.prefetch import CudaPrefetcher

        return CudaPrefetcher
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
