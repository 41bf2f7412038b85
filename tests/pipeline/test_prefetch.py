"""`CudaPrefetcher`: normalization values, layouts, pass-through, and the CUDA stream hand-over."""

from __future__ import annotations

import contextlib
import itertools
import warnings

import pytest
import torch

from pipeline.config import Batching, Workers
from pipeline.prefetch import IMAGENET_MEAN, IMAGENET_STD, CudaPrefetcher
from tests.gpu import gpu
from tests.pipeline.conftest import epoch_keys, loader_for

MEAN = torch.tensor(IMAGENET_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
STD = torch.tensor(IMAGENET_STD, dtype=torch.float64).view(1, 3, 1, 1)


def reference(images: torch.Tensor) -> torch.Tensor:
    """The textbook formula in float64."""
    return (images.double() / 255 - MEAN) / STD


def synthetic_batches(count: int = 3, batch: int = 4, size: int = 8) -> list[tuple]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for i in range(count):
        images = torch.randint(
            0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=generator
        )
        # Every pixel value appears, so the extremes 0 and 255 are checked too.
        images.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
        batches.append((images, torch.arange(batch) + 10 * i))
    return batches


def test_float32_values_match_the_formula():
    batches = synthetic_batches()
    out = list(CudaPrefetcher(batches, "cpu"))
    assert len(out) == len(batches)
    for (images, labels), (src_images, src_labels) in zip(out, batches, strict=True):
        assert images.dtype == torch.float32 and images.shape == src_images.shape
        assert images.is_contiguous()
        assert (images.double() - reference(src_images)).abs().max() < 1e-6
        assert torch.equal(labels, src_labels) and labels.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_the_rounded_float32_value(dtype):
    (src_images, _), *_ = synthetic_batches(count=1)
    (images, _), *_ = list(CudaPrefetcher([(src_images, torch.zeros(4))], "cpu", dtype=dtype))
    assert images.dtype == dtype
    expected = reference(src_images)
    # Round-to-nearest: relative error at most half an ulp, 2^-8 for bf16 (8 significant
    # bits) and 2^-11 for fp16 (11 bits).
    half_ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    error = (images.double() - expected).abs()
    assert (error <= expected.abs() * half_ulp + 1e-6).all()


def test_custom_mean_and_std():
    batch = (torch.full((1, 3, 2, 2), 255, dtype=torch.uint8), torch.zeros(1))
    prefetcher = CudaPrefetcher([batch], "cpu", mean=(0.0, 0.5, 1.0), std=(1.0, 0.5, 2.0))
    (images, _), *_ = list(prefetcher)
    assert images[0, :, 0, 0].tolist() == pytest.approx([1.0, 1.0, 0.0])


def test_float_input_is_not_modified_in_place():
    images = torch.full((1, 3, 2, 2), 255.0)
    (out, _), *_ = list(CudaPrefetcher([(images, torch.zeros(1))], "cpu"))
    assert torch.equal(images, torch.full((1, 3, 2, 2), 255.0))
    assert out is not images


def test_channels_last_output_keeps_values():
    batches = synthetic_batches(count=1)
    (plain, _), *_ = list(CudaPrefetcher(batches, "cpu"))
    (nhwc, _), *_ = list(CudaPrefetcher(batches, "cpu", channels_last=True))
    assert nhwc.is_contiguous(memory_format=torch.channels_last)
    assert not nhwc.is_contiguous()
    assert torch.equal(nhwc, plain)


def test_channels_last_input_comes_out_nchw_unless_asked():
    batches = synthetic_batches(count=1)
    nhwc_input = [
        (images.contiguous(memory_format=torch.channels_last), labels) for images, labels in batches
    ]
    (plain, _), *_ = list(CudaPrefetcher(batches, "cpu"))
    (out, _), *_ = list(CudaPrefetcher(nhwc_input, "cpu"))
    assert out.is_contiguous() and torch.equal(out, plain)


def test_real_loader_batches_and_keys_pass_through(shard_dir):
    raw = list(loader_for(shard_dir))
    prefetched = list(CudaPrefetcher(loader_for(shard_dir), "cpu"))
    assert len(prefetched) == len(raw) > 1
    for (images, labels, keys), (src_images, src_labels, src_keys) in zip(
        prefetched, raw, strict=True
    ):
        assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
        assert (images.double() - reference(src_images)).abs().max() < 1e-6
        assert torch.equal(labels, src_labels)
        assert keys == src_keys


def test_empty_loaders_yield_nothing(shard_dir):
    assert list(CudaPrefetcher([], "cpu")) == []
    # More samples per batch than the split has, and drop_last: an epoch of zero batches.
    empty = loader_for(shard_dir, batch=Batching(size=10_000, drop_last=True))
    prefetcher = CudaPrefetcher(empty, "cpu")
    assert len(prefetcher) == 0
    assert list(prefetcher) == []


def test_len_set_epoch_and_state_pass_through(shard_dir):
    loader = loader_for(shard_dir)
    prefetcher = CudaPrefetcher(loader, "cpu")
    assert prefetcher.loader is loader
    assert len(prefetcher) == len(loader)
    prefetcher.set_epoch(3)
    assert loader.epoch == 3
    taken = [keys for _, _, keys in itertools.islice(prefetcher, 2)]
    assert prefetcher.state_dict() == loader.state_dict()

    resumed = loader_for(shard_dir)
    resumed_prefetcher = CudaPrefetcher(resumed, "cpu")
    resumed_prefetcher.load_state_dict(prefetcher.state_dict())
    uninterrupted = loader_for(shard_dir)
    uninterrupted.set_epoch(3)
    full = epoch_keys(uninterrupted)
    assert taken == full[:2]
    assert [list(keys) for _, _, keys in resumed_prefetcher] == full[2:]


def test_state_with_a_batch_in_flight_redelivers_it(shard_dir):
    loader = loader_for(shard_dir)
    full = epoch_keys(loader_for(shard_dir))
    epoch_keys(loader, limit=3)
    state = loader.state_dict(in_flight=1)
    assert state["segments"][-1]["consumed"] == 2
    assert loader.state_dict()["segments"][-1]["consumed"] == 3
    resumed = loader_for(shard_dir)
    resumed.load_state_dict(state)
    assert epoch_keys(resumed) == full[2:]


def test_in_flight_cannot_exceed_the_batches_taken(shard_dir):
    with pytest.raises(ValueError, match="in_flight"):
        loader_for(shard_dir).state_dict(in_flight=1)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="floating"):
        CudaPrefetcher([], "cpu", dtype=torch.uint8)
    with pytest.raises(ValueError, match="one value per RGB channel"):
        CudaPrefetcher([], "cpu", mean=(0.5,))
    with pytest.raises(ValueError, match="positive"):
        CudaPrefetcher([], "cpu", std=(0.2, 0.0, 0.2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without CUDA")
def test_cuda_device_without_cuda_falls_back_to_the_cpu():
    prefetcher = CudaPrefetcher(synthetic_batches(count=1), "cuda")
    assert prefetcher.device == torch.device("cpu") and prefetcher.stream is None
    (images, _), *_ = list(prefetcher)
    assert images.device.type == "cpu"


class FakeStream:
    """Records the stream calls the prefetcher makes, so the hand-over order is testable on CPU."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits {other.name}")


@pytest.fixture
def fake_streams(monkeypatch):
    """A CPU prefetcher driven through its CUDA code path, with streams that record calls."""
    log: list[str] = []
    side, consumer = FakeStream("side", log), FakeStream("consumer", log)

    @contextlib.contextmanager
    def on_stream(stream):
        log.append(f"enter {stream.name}")
        yield
        log.append(f"exit {stream.name}")

    def record_stream(tensor, stream):
        log.append(f"record {tuple(tensor.shape)} on {stream.name}")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: consumer)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return side, log


def cuda_path(loader, side: FakeStream) -> CudaPrefetcher:
    prefetcher = CudaPrefetcher(loader, "cpu")
    prefetcher.stream = side  # type: ignore[assignment]
    return prefetcher


def test_hand_over_order_on_the_cuda_path(fake_streams):
    side, log = fake_streams
    prefetcher = cuda_path(synthetic_batches(count=3), side)
    with pytest.warns(UserWarning, match="pageable"):
        for i, _ in enumerate(prefetcher):
            log.append(f"consumer got {i}")
    launch = ["side waits consumer", "enter side", "exit side"]
    hand_over = [
        "consumer waits side",
        "record (4, 3, 8, 8) on consumer",
        "record (4,) on consumer",
    ]
    # One batch ahead: batch k+1 is queued before batch k is handed to the consumer.
    assert log == (
        launch
        + hand_over
        + launch
        + ["consumer got 0"]
        + hand_over
        + launch
        + ["consumer got 1"]
        + hand_over
        + ["consumer got 2"]
    )


def test_cuda_path_state_and_early_exit_do_not_lose_the_prefetched_batch(fake_streams, shard_dir):
    side, _ = fake_streams
    full = epoch_keys(loader_for(shard_dir))
    prefetcher = cuda_path(loader_for(shard_dir), side)
    seen = []
    with pytest.warns(UserWarning, match="pageable"):
        for _, _, keys in prefetcher:
            seen.append(keys)
            if len(seen) == 3:
                state = prefetcher.state_dict()  # the loader has delivered 4 batches
                break
    resumed = loader_for(shard_dir)
    resumed.load_state_dict(state)
    assert seen == full[:3]
    assert epoch_keys(resumed) == full[3:]
    # The abandoned iteration gave its prefetched batch back to the loader.
    assert [keys for _, _, keys in prefetcher] == full[3:]


def test_cuda_path_state_at_the_end_of_an_epoch_is_the_next_epoch(fake_streams, shard_dir):
    side, _ = fake_streams
    prefetcher = cuda_path(loader_for(shard_dir), side)
    with pytest.warns(UserWarning, match="pageable"):
        batches = sum(1 for _ in prefetcher)
    assert batches == len(prefetcher)
    state = prefetcher.state_dict()
    assert state["epoch"] == 1 and state["segments"][-1]["consumed"] == 0


def test_cuda_path_empty_loader_yields_nothing(fake_streams):
    side, log = fake_streams
    assert list(cuda_path([], side)) == []
    assert log == []


class TestCuda:
    """The side-stream path; skipped without CUDA."""

    pytestmark = gpu

    def test_stream_is_created_once(self, shard_dir, monkeypatch):
        prefetcher = CudaPrefetcher(
            loader_for(shard_dir, workers=Workers(count=0, pin_memory=True)), "cuda"
        )
        stream = prefetcher.stream
        assert isinstance(stream, torch.cuda.Stream)
        created = []
        real_stream = torch.cuda.Stream

        def counting_stream(*args, **kwargs):
            created.append(1)
            return real_stream(*args, **kwargs)

        monkeypatch.setattr(torch.cuda, "Stream", counting_stream)
        for _ in range(2):
            assert len(list(prefetcher)) == len(prefetcher) > 0
        assert prefetcher.stream is stream and created == []

    def test_matches_the_cpu_path(self, shard_dir):
        cpu = list(CudaPrefetcher(loader_for(shard_dir), "cpu", channels_last=True))
        cuda = list(
            CudaPrefetcher(
                loader_for(shard_dir, workers=Workers(count=0, pin_memory=True)),
                "cuda",
                channels_last=True,
            )
        )
        assert len(cuda) == len(cpu) > 1
        for (images, labels, keys), (cpu_images, cpu_labels, cpu_keys) in zip(
            cuda, cpu, strict=True
        ):
            assert images.device.type == "cuda" and labels.device.type == "cuda"
            assert images.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(images.cpu(), cpu_images, rtol=0, atol=1e-6)
            assert torch.equal(labels.cpu(), cpu_labels) and keys == cpu_keys

    def test_pinned_source_gives_no_warning_and_pageable_warns_once(self, shard_dir):
        pinned = loader_for(shard_dir, workers=Workers(count=0, pin_memory=True))
        images, _, _ = next(iter(pinned))
        assert images.is_pinned()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*pageable")
            list(
                CudaPrefetcher(
                    loader_for(shard_dir, workers=Workers(count=0, pin_memory=True)), "cuda"
                )
            )
        with pytest.warns(UserWarning, match="pageable") as caught:
            list(
                CudaPrefetcher(
                    loader_for(shard_dir, workers=Workers(count=0, pin_memory=False)), "cuda"
                )
            )
        assert len([w for w in caught if "pageable" in str(w.message)]) == 1

    def test_two_epochs_with_persistent_workers(self, shard_dir):
        loader = loader_for(shard_dir, workers=Workers(count=2, persistent=True, pin_memory=True))
        prefetcher = CudaPrefetcher(loader, "cuda", dtype=torch.bfloat16)
        epochs = []
        for _ in range(2):
            keys = []
            for images, labels, batch_keys in prefetcher:
                assert images.device.type == "cuda" and images.dtype == torch.bfloat16
                assert labels.device.type == "cuda" and int(labels.max()) < 4
                keys += batch_keys
            epochs.append(keys)
        assert len(epochs[0]) == len(epochs[1]) == len(loader) * 8
        assert epochs[0] != epochs[1]  # the epoch reached the persistent workers

    def test_empty_loader_yields_nothing(self):
        assert list(CudaPrefetcher([], "cuda")) == []

    def test_state_saved_mid_epoch_resumes_at_the_next_unseen_batch(self, shard_dir):
        full = epoch_keys(loader_for(shard_dir))
        prefetcher = CudaPrefetcher(
            loader_for(shard_dir, workers=Workers(count=0, pin_memory=True)), "cuda"
        )
        iterator = iter(prefetcher)
        seen = [next(iterator)[2] for _ in range(3)]
        state = prefetcher.state_dict()  # the loader is one batch ahead of `seen`
        resumed = loader_for(shard_dir)
        resumed.load_state_dict(state)
        assert seen == full[:3]
        assert epoch_keys(resumed) == full[3:]

    def test_breaking_out_gives_the_prefetched_batch_back(self, shard_dir):
        full = epoch_keys(loader_for(shard_dir))
        prefetcher = CudaPrefetcher(
            loader_for(shard_dir, workers=Workers(count=0, pin_memory=True)), "cuda"
        )
        first = []
        for _, _, keys in prefetcher:
            first.append(keys)
            if len(first) == 2:
                break
        rest = [keys for _, _, keys in prefetcher]
        assert first + rest == full
