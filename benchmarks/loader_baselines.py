"""Stock baselines for the loader benchmark, needing only the standard library, numpy, Pillow, torch.

Holds the epoch timer and the torchvision-like Pillow crop that every contender of
`loader_throughput.py` shares, and runs MosaicML streaming, LitData and NVIDIA DALI (CPU
operators) from their own venv (they pin other versions than the project), as a subprocess of
`loader_throughput.py`:

    PEER_PYTHON benchmarks/loader_baselines.py convert mds --workdir DIR
    PEER_PYTHON benchmarks/loader_baselines.py run mds --workdir DIR [--seed 0] [--warmup 3]
    PEER_PYTHON benchmarks/loader_baselines.py run dali --workdir DIR --shards DIR/shards512

`run` prints one JSON `Measurement` line.
"""

from __future__ import annotations

import argparse
import gc
import importlib.machinery
import io
import json
import math
import os
import resource
import shutil
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
PEERS = ("mds", "litdata", "dali")
# DALI's shuffle buffer, in samples: ours holds 2,000 (500 before the first batch), stock
# webdataset 1,000; DALI fills all of it before the first batch.
DALI_INITIAL_FILL = 2000
DALI_READER = "Reader"
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


def peer_dir(workdir: Path, shard_dir: Path, peer: str) -> Path:
    """Where a peer's conversion of `shard_dir` is cached (DIR/mds for DIR/shards, as before)."""
    return workdir / (peer if shard_dir == workdir / "shards" else f"{peer}-{shard_dir.name}")


def is_current(out: Path, shard_dir: Path) -> bool:
    """A conversion exists and is newer than every shard (rebuilt shards are converted again)."""
    index = out / "index.json"
    tars = train_tars(shard_dir)
    return index.exists() and all(tar.stat().st_mtime <= index.stat().st_mtime for tar in tars)


def convert_mds(workdir: Path, shard_dir: Path) -> Path:
    """Write the shards' JPEGs as an MDS dataset (bytes column, no compression)."""
    streaming = import_streaming()
    out = peer_dir(workdir, shard_dir, "mds")
    if not is_current(out, shard_dir):
        shutil.rmtree(out, ignore_errors=True)
        with streaming.MDSWriter(out=str(out), columns={"jpg": "bytes", "cls": "int"}) as writer:
            for jpg, label in iter_tar_dir(shard_dir):
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


def convert_litdata(workdir: Path, shard_dir: Path) -> Path:
    """Write the shards' JPEGs as a LitData optimized dataset (raw bytes, 64 MB chunks)."""
    import litdata

    out = peer_dir(workdir, shard_dir, "litdata")
    if not is_current(out, shard_dir):
        shutil.rmtree(out, ignore_errors=True)
        inputs = [str(p) for p in train_tars(shard_dir)]
        litdata.optimize(
            fn=litdata_samples,
            inputs=inputs,
            output_dir=str(out),
            chunk_bytes="64MB",
            num_workers=2,
            verbose=False,
        )
    return out


def run_mds(workdir: Path, seed: int, warmup: int, workers: int, shard_dir: Path) -> Measurement:
    streaming = import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    cpu_before = cpu_seconds()
    started = time.perf_counter()
    base = streaming.StreamingDataset(
        local=str(peer_dir(workdir, shard_dir, "mds")),
        shuffle=True,
        shuffle_seed=seed,
        batch_size=BATCH_SIZE,
    )
    loader = DataLoader(
        DecodedStream(base), batch_size=BATCH_SIZE, num_workers=workers, drop_last=True
    )
    measurement = time_epoch(loader, f"MosaicML streaming {streaming.__version__}", warmup, started)
    del loader, base
    return with_cpu(measurement, cpu_before)


def run_litdata(
    workdir: Path, seed: int, warmup: int, workers: int, shard_dir: Path
) -> Measurement:
    import litdata

    cpu_before = cpu_seconds()
    started = time.perf_counter()
    dataset = litdata.StreamingDataset(
        str(peer_dir(workdir, shard_dir, "litdata")),
        shuffle=True,
        drop_last=True,
        seed=seed,
        transform=DecodeSample(),
    )
    loader = litdata.StreamingDataLoader(
        dataset, batch_size=BATCH_SIZE, num_workers=workers, drop_last=True
    )
    measurement = time_epoch(loader, f"LitData {litdata.__version__}", warmup, started)
    del loader, dataset
    return with_cpu(measurement, cpu_before)


def dali_index_paths(workdir: Path, shard_dir: Path) -> list[Path]:
    """Where DALI's index of each train tar shard lives: cached in the workdir, per build."""
    index_dir = workdir / "dali-index" / shard_dir.name
    return [index_dir / f"{tar.stem}.idx" for tar in train_tars(shard_dir)]


def convert_dali(workdir: Path, shard_dir: Path) -> Path:
    """Index the tar shards with DALI's `wds2idx`, so the timed run does not scan them.

    An index older than its shard is rewritten (the shards were rebuilt); each is written
    under a temporary name and renamed, so an interrupted conversion leaves none half-done.
    """
    from wds2idx import IndexCreator

    tars = train_tars(shard_dir)
    if not tars:
        raise SystemExit(f"no train-*.tar shards in {shard_dir}: build them with build-shards")
    for tar, index in zip(tars, dali_index_paths(workdir, shard_dir), strict=True):
        if index.exists() and index.stat().st_mtime >= tar.stat().st_mtime:
            continue
        index.parent.mkdir(parents=True, exist_ok=True)
        partial = index.with_suffix(".idx.partial")
        with IndexCreator(str(tar), str(partial), verbose=False) as creator:
            creator.create_index()
        os.replace(partial, index)
    return index.parent


def build_dali_pipeline(tars: list[Path], indexes: list[Path], seed: int, threads: int):
    """DALI's documented webdataset + random-crop-decode recipe on CPU operators only.

    torchvision's RandomResizedCrop parameters (area 0.08-1, aspect 3/4-4/3, 10 attempts),
    resized to 224x224 bilinear with DALI's default antialiasing, a coin-flip mirror; the
    output is DALI's own NHWC uint8 (ours hands out NCHW: on a GPU either is one permute).
    `device_id=None`: no GPU is needed or touched.
    """
    from nvidia.dali import fn, pipeline, types

    pipe = pipeline.Pipeline(batch_size=BATCH_SIZE, num_threads=threads, device_id=None, seed=seed)
    with pipe:
        jpegs, labels = fn.readers.webdataset(
            paths=[str(p) for p in tars],
            index_paths=[str(p) for p in indexes],
            ext=["jpg", "cls"],
            missing_component_behavior="error",
            random_shuffle=True,
            initial_fill=DALI_INITIAL_FILL,
            name=DALI_READER,
        )
        images = fn.decoders.image_random_crop(
            jpegs,
            device="cpu",
            output_type=types.RGB,
            random_area=[0.08, 1.0],
            random_aspect_ratio=[3 / 4, 4 / 3],
            num_attempts=10,
        )
        images = fn.resize(images, size=[CROP_SIZE, CROP_SIZE], interp_type=types.INTERP_LINEAR)
        images = fn.flip(images, horizontal=fn.random.coin_flip(probability=0.5))
        pipe.set_outputs(images, labels)
    pipe.build()
    return pipe


def iter_dali_batches(pipe, batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`batches` (NHWC uint8 images, labels) torch batches from `pipe.run()`.

    `as_array` copies the images out of DALI's buffers, which the next `run` reuses. The
    `cls` members are ASCII digits, so DALI hands out their bytes and we parse them here
    (ragged, which rules out `DALIGenericIterator`'s dense copy).
    """
    for _ in range(batches):
        images, labels = pipe.run()
        labels = torch.tensor([int(np.asarray(label).tobytes()) for label in labels])
        yield torch.from_numpy(images.as_array()), labels


def run_dali(workdir: Path, seed: int, warmup: int, workers: int, shard_dir: Path) -> Measurement:
    """One DALI epoch: its reader's epoch size, less the last partial batch (drop_last)."""
    import nvidia.dali

    tars, indexes = train_tars(shard_dir), dali_index_paths(workdir, shard_dir)
    if not all(index.exists() for index in indexes):
        raise SystemExit(f"no DALI index for {shard_dir}: run `convert dali` first")
    cpu_before = cpu_seconds()
    started = time.perf_counter()
    # DALI's threads play the part of the other contenders' worker processes.
    pipe = build_dali_pipeline(tars, indexes, seed, threads=workers)
    batches = pipe.epoch_size(DALI_READER) // BATCH_SIZE
    name = f"NVIDIA DALI {nvidia.dali.__version__} (CPU)"
    measurement = time_epoch(iter_dali_batches(pipe, batches), name, warmup, started)
    del pipe
    return with_cpu(measurement, cpu_before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("convert", "run"))
    parser.add_argument("peer", choices=PEERS)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="worker processes (DALI: threads)")
    parser.add_argument(
        "--shards", type=Path, help="the build the peer reads (default WORKDIR/shards)"
    )
    args = parser.parse_args(argv)
    shard_dir = args.shards or args.workdir / "shards"
    if args.action == "convert":
        convert = {"mds": convert_mds, "litdata": convert_litdata, "dali": convert_dali}
        out = convert[args.peer](args.workdir, shard_dir)
        print(json.dumps({"converted": str(out)}))
        return 0
    run = {"mds": run_mds, "litdata": run_litdata, "dali": run_dali}[args.peer]
    result = run(args.workdir, args.seed, args.warmup, args.workers, shard_dir)
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
