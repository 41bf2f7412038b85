"""Stock baselines for the loader benchmark, needing only the standard library, numpy, Pillow, torch.

Holds the epoch timer and the torchvision-like Pillow crop that every contender of
`loader_throughput.py` shares, and runs MosaicML streaming and LitData from their own venv
(they pin other versions than the project), as a subprocess of `loader_throughput.py`:

    PEER_PYTHON benchmarks/loader_baselines.py convert mds --workdir DIR
    PEER_PYTHON benchmarks/loader_baselines.py run mds --workdir DIR [--seed 0] [--warmup 3]

`run` prints one JSON `Measurement` line.
"""

from __future__ import annotations

import argparse
import gc
import importlib.machinery
import io
import json
import math
import resource
import statistics
import sys
import tarfile
import time
import types
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, IterableDataset

BATCH_SIZE = 256
CROP_SIZE = 224
PEERS = ("mds", "litdata")
# torchvision's ImageFolder IMG_EXTENSIONS.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class Measurement:
    """One epoch of one contender.

    Attributes:
        name: contender label.
        images: images timed (after the warm-up batches).
        seconds: wall time over which `images` arrived.
        first_batch_s: from constructing the loader to the first batch (None for plain loops).
        wait_ms_median, wait_ms_p95: time the consumer blocked per batch after warm-up.
        batches: batches in the epoch, warm-up included.
        epoch_images: images in the epoch, warm-up included.
        cpu_s: CPU seconds (user + system) of the process tree from constructing the loader
            to its workers' exit: a cost that other jobs on a shared machine barely change.
    """

    name: str
    images: int
    seconds: float
    first_batch_s: float | None = None
    wait_ms_median: float | None = None
    wait_ms_p95: float | None = None
    batches: int = 0
    epoch_images: int = 0
    cpu_s: float | None = None

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    @property
    def images_per_cpu_s(self) -> float | None:
        return self.epoch_images / self.cpu_s if self.cpu_s else None


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its children that have exited."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def with_cpu(measurement: Measurement, cpu_before: float) -> Measurement:
    """Add the CPU time since `cpu_before`; call after dropping the last loader reference.

    DataLoader workers are joined (and so counted in RUSAGE_CHILDREN) when their iterator
    is collected, which `gc.collect` forces.
    """
    gc.collect()
    measurement.cpu_s = cpu_seconds() - cpu_before
    return measurement


def time_epoch(batches: Iterable, name: str, warmup: int, started: float) -> Measurement:
    """Consume one epoch of `(images, labels, ...)` batches and time it.

    Throughput counts only batches after the first `warmup`, from the moment the last
    warm-up batch arrived: worker start-up and shuffle-buffer fill are in `first_batch_s`.
    """
    iterator = iter(batches)
    waits: list[float] = []
    first_batch_s = None
    count = images = epoch_images = 0
    warm_at = None
    while True:
        before = time.perf_counter()
        batch = next(iterator, None)
        now = time.perf_counter()
        if batch is None:
            break
        count += 1
        epoch_images += len(batch[1])
        if first_batch_s is None:
            first_batch_s = now - started
        if count == warmup:
            warm_at = now
        elif count > warmup:
            images += len(batch[1])
            waits.append(now - before)
    if warm_at is None or not waits:
        raise RuntimeError(f"{name}: only {count} batches, fewer than warm-up {warmup} + 1")
    return Measurement(
        name=name,
        images=images,
        seconds=now - warm_at,
        first_batch_s=first_batch_s,
        wait_ms_median=1000 * statistics.median(waits),
        wait_ms_p95=1000 * float(np.percentile(waits, 95)),
        batches=count,
        epoch_images=epoch_images,
    )


class PilRandomResizedCrop:
    """torchvision's RandomResizedCrop(224) + RandomHorizontalFlip + PILToTensor, in plain Pillow.

    Written out because torchvision's wheel does not load beside our CPU torch. Same
    steps and same torch RNG calls as torchvision 0.2x with a PIL input: `get_params`,
    `img.crop(box).resize(size, BILINEAR)`, a flip on `torch.rand(1) < 0.5`, then
    `torch.as_tensor(np.array(img, copy=True)).permute(2, 0, 1)`: `pil_to_tensor` returns
    the permuted view, without a `.contiguous()` copy (the collate's `torch.stack` makes
    the one contiguous batch), so the peers run what their users run.
    """

    def __init__(self, size: int = CROP_SIZE) -> None:
        self.size = size
        self.scale = (0.08, 1.0)
        self.log_ratio = (math.log(3 / 4), math.log(4 / 3))

    def get_params(self, width: int, height: int) -> tuple[int, int, int, int]:
        area = width * height
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(*self.scale).item()
            aspect = math.exp(torch.empty(1).uniform_(*self.log_ratio).item())
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,)).item())
                left = int(torch.randint(0, width - w + 1, size=(1,)).item())
                return top, left, h, w
        ratio = width / height
        w, h = width, height
        if ratio < 3 / 4:
            h = int(round(w / (3 / 4)))
        elif ratio > 4 / 3:
            w = int(round(h * (4 / 3)))
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, image: Image.Image) -> torch.Tensor:
        top, left, h, w = self.get_params(*image.size)
        image = image.crop((left, top, left + w, top + h))
        image = image.resize((self.size, self.size), Image.Resampling.BILINEAR)
        if torch.rand(1) < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        array = np.array(image, copy=True)
        return torch.as_tensor(array).permute(2, 0, 1)  # a view, as PILToTensor returns


def train_tars(shard_dir: Path) -> list[Path]:
    """The train tar shards of a build in either layout: `tar/` (the default) or flat.

    Globbed rather than read from the manifest: the peers' venv has no shardpipe.
    """
    directory = shard_dir / "tar" if (shard_dir / "tar").is_dir() else shard_dir
    return sorted(directory.glob("train-*.tar"))


def iter_tar_dir(shard_dir: Path) -> Iterator[tuple[bytes, int]]:
    """(jpg bytes, label) of every sample of the train tar shards, with stdlib tarfile."""
    for path in train_tars(shard_dir):
        fields: dict[str, dict[str, bytes]] = {}
        with tarfile.open(path) as archive:
            for member in archive:
                if not member.isfile():
                    continue
                key, _, ext = member.name.partition(".")
                fields.setdefault(key, {})[ext] = archive.extractfile(member).read()
        for sample in fields.values():
            yield sample["jpg"], int(sample["cls"])


class NaiveImageFolder(Dataset):
    """torchvision's ImageFolder in a few lines: `root/<class>/<file>`, Pillow, RGB, transform."""

    def __init__(self, root: Path, transform) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [
            (path, label)
            for label, name in enumerate(classes)
            for path in sorted((root / name).iterdir())
            if path.suffix.lower() in IMAGE_EXTENSIONS
        ]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[index]
        with open(path, "rb") as file:  # torchvision's pil_loader
            image = Image.open(file).convert("RGB")
        return self.transform(image), label


class DecodedStream(IterableDataset):
    """Decode + crop the `{"jpg": bytes, "cls": int}` samples of MosaicML's StreamingDataset.

    Its own `__iter__` runs inside each worker and does its partitioning and shuffling;
    we only add the same Pillow decode and crop as the stock webdataset baseline.
    """

    def __init__(self, base: IterableDataset) -> None:
        super().__init__()
        self.base = base
        self.crop = PilRandomResizedCrop()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        for sample in self.base:
            yield self.crop(decode_pil(sample["jpg"])), int(sample["cls"])


class DecodeSample:
    """LitData's `transform=`: the same decode and crop for one `{"jpg", "cls"}` sample."""

    def __init__(self) -> None:
        self.crop = PilRandomResizedCrop()

    def __call__(self, sample: dict) -> tuple[torch.Tensor, int]:
        return self.crop(decode_pil(sample["jpg"])), int(sample["cls"])


def decode_pil(data: bytes) -> Image.Image:
    """What `webdataset.decode("pil")` and torchvision's `pil_loader` do: open, load, RGB."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB")


def import_streaming() -> types.ModuleType:
    """Import MosaicML streaming, whose `__init__` imports torchvision for its vision datasets.

    The PyPI torchvision wheel needs a CUDA torch; with our CPU torch it fails to load. We
    stub the two names `streaming.vision` imports (never used by MDS reading) instead.
    """
    try:
        import streaming
    except (ImportError, RuntimeError):
        for name, attrs in (
            ("torchvision", {}),
            ("torchvision.datasets", {"VisionDataset": object}),
            ("torchvision.transforms", {}),
            ("torchvision.transforms.functional", {"to_tensor": None}),
        ):
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.__dict__.update(attrs)
            sys.modules[name] = module
        for name in [m for m in sys.modules if m.startswith("streaming")]:
            del sys.modules[name]
        import streaming
    return streaming


def convert_mds(workdir: Path) -> Path:
    """Write the 256-px shard JPEGs as an MDS dataset (bytes column, no compression)."""
    streaming = import_streaming()
    out = workdir / "mds"
    if not (out / "index.json").exists():
        with streaming.MDSWriter(out=str(out), columns={"jpg": "bytes", "cls": "int"}) as writer:
            for jpg, label in iter_tar_dir(workdir / "shards"):
                writer.write({"jpg": jpg, "cls": label})
    return out


def litdata_samples(tar_path: str) -> Iterator[dict]:
    """LitData `optimize` function: one input (a tar shard) -> its samples."""
    fields: dict[str, dict[str, bytes]] = {}
    with tarfile.open(tar_path) as archive:
        for member in archive:
            if member.isfile():
                key, _, ext = member.name.partition(".")
                fields.setdefault(key, {})[ext] = archive.extractfile(member).read()
    for sample in fields.values():
        yield {"jpg": sample["jpg"], "cls": int(sample["cls"])}


def convert_litdata(workdir: Path) -> Path:
    """Write the 256-px shard JPEGs as a LitData optimized dataset (raw bytes, 64 MB chunks)."""
    import litdata

    out = workdir / "litdata"
    if not (out / "index.json").exists():
        inputs = [str(p) for p in train_tars(workdir / "shards")]
        litdata.optimize(
            fn=litdata_samples,
            inputs=inputs,
            output_dir=str(out),
            chunk_bytes="64MB",
            num_workers=2,
            verbose=False,
        )
    return out


def run_mds(workdir: Path, seed: int, warmup: int, workers: int) -> Measurement:
    streaming = import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    cpu_before = cpu_seconds()
    started = time.perf_counter()
    base = streaming.StreamingDataset(
        local=str(workdir / "mds"), shuffle=True, shuffle_seed=seed, batch_size=BATCH_SIZE
    )
    loader = DataLoader(
        DecodedStream(base), batch_size=BATCH_SIZE, num_workers=workers, drop_last=True
    )
    measurement = time_epoch(loader, f"MosaicML streaming {streaming.__version__}", warmup, started)
    del loader, base
    return with_cpu(measurement, cpu_before)


def run_litdata(workdir: Path, seed: int, warmup: int, workers: int) -> Measurement:
    import litdata

    cpu_before = cpu_seconds()
    started = time.perf_counter()
    dataset = litdata.StreamingDataset(
        str(workdir / "litdata"), shuffle=True, drop_last=True, seed=seed, transform=DecodeSample()
    )
    loader = litdata.StreamingDataLoader(
        dataset, batch_size=BATCH_SIZE, num_workers=workers, drop_last=True
    )
    measurement = time_epoch(loader, f"LitData {litdata.__version__}", warmup, started)
    del loader, dataset
    return with_cpu(measurement, cpu_before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("convert", "run"))
    parser.add_argument("peer", choices=PEERS)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.action == "convert":
        out = {"mds": convert_mds, "litdata": convert_litdata}[args.peer](args.workdir)
        print(json.dumps({"converted": str(out)}))
        return 0
    run = {"mds": run_mds, "litdata": run_litdata}[args.peer]
    result = run(args.workdir, args.seed, args.warmup, args.workers)
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
