"""CUDA-only checks: fp16 GradScaler order, pinned batches, bf16 + channels_last."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import Batching, Crop, Workers
from pipeline.loader import LoaderConfig, build_loader
from pipeline.prefetch import CudaPrefetcher
from tests.gpu import gpu
from tests.trainers.conftest import read_rows, train_main

pytestmark = [*gpu, pytest.mark.slow]


def test_fp16_unscales_before_clipping(train_shards, tmp_path, monkeypatch):
    calls: list[str] = []
    scaler = torch.amp.GradScaler
    for method in ("scale", "unscale_", "step", "update"):
        original = getattr(scaler, method)

        def recorded(self, *args, _name=method, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(scaler, method, recorded)
    clip = torch.nn.utils.clip_grad_norm_

    def recorded_clip(parameters, max_norm, *args, **kwargs):
        calls.append("clip")
        return clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recorded_clip)
    code = train_main(
        train_shards,
        tmp_path / "run",
        device="cuda",
        amp="fp16",
        clip_grad=1.0,
        accum_steps=2,
        max_steps=3,
        epochs=1,
    )
    assert code == 0
    per_step = [
        "scale",
        "scale",
        "unscale_",
        "clip",
        "step",
        "update",
    ]  # two micro-steps, then one step
    assert calls == per_step * 3
    assert all(math.isfinite(r["loss"]) for r in read_rows(tmp_path / "run", "train"))


def test_loader_pins_batches_and_prefetcher_normalizes_on_the_gpu(train_shards):
    loader = build_loader(
        LoaderConfig(
            source=str(train_shards),
            batch=Batching(size=8),
            crop=Crop(image_size=24),
            workers=Workers(count=1),
        )
    )
    images, labels = next(iter(loader))
    assert images.is_pinned() and images.dtype == torch.uint8
    prefetched = CudaPrefetcher(loader, torch.device("cuda"), channels_last=True)
    images, labels = next(iter(prefetched))
    assert images.is_cuda and images.dtype == torch.float32
    assert images.is_contiguous(memory_format=torch.channels_last)


def test_bf16_channels_last_run_records_gpu_memory(train_shards, tmp_path):
    run_dir = tmp_path / "run"
    code = train_main(
        train_shards, run_dir, device="cuda", amp="bf16", channels_last=True, max_steps=4, epochs=1
    )
    assert code == 0
    rows = read_rows(run_dir, "train")
    assert all(row["peak_mem_gb"] > 0 for row in rows)
    assert read_rows(run_dir, "end")[0]["verdict"]
