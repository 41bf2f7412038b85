"""The trainer's side of the data: loaders per split, the train/val overlap check, key lookup.

Train reads with drop_last and the `pad` epoch rule (equal batch counts on
every rank); evaluation reads every sample exactly once across ranks (the
loader's `uneven` rule, no drop_last). Keys are listed from the shards
themselves through the format registry: tar headers (seeking over the data) or
the Parquet key column.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pipeline.checksum import open_shard
from pipeline.loader import LoaderConfig, ShardLoader, build_loader
from pipeline.opener import DEFAULT_RETRY
from pipeline.sources import ShardSpec, is_manifest_source
from shards.redact import redact_url
from trainers.config import TrainConfig
from trainers.distributed import DistInfo

log = logging.getLogger("trainers")
MAX_EXAMPLES = 5


@dataclass
class Loaders:
    """The run's loaders; `val` is None when there is no validation split."""

    train: ShardLoader
    val: ShardLoader | None

    @property
    def classes(self) -> list[str] | None:
        return self.train.source.classes


def loader_config(
    config: TrainConfig, info: DistInfo, split: str, train: bool, **extra
) -> LoaderConfig:
    source = config.train_shards if train or config.val_shards is None else config.val_shards
    return LoaderConfig(
        source=source,
        split=split,
        format=config.format,
        batch_size=config.batch_size,
        image_size=config.image_size,
        train=train,
        num_workers=config.workers,
        seed=config.seed,
        rank=info.rank,
        world_size=info.world_size,
        shuffle_buffer=config.shuffle_buffer,
        shuffle_initial=config.shuffle_initial,
        # The loader's layout is free either way; CudaPrefetcher gives the model its format.
        channels_last=True,
        pin_memory=info.device.type == "cuda",
        **extra,
    )


def build_loaders(config: TrainConfig, info: DistInfo) -> Loaders:
    """Train loader (with keys, for the non-finite report and traces) and the val loader."""
    if not config.train_shards:
        raise ValueError(
            "--train-shards is required: a manifest.json, its directory, or shard URLs"
        )
    train = build_loader(loader_config(config, info, config.train_split, True, with_keys=True))
    return Loaders(train, build_val_loader(config, info))


def build_val_loader(config: TrainConfig, info: DistInfo) -> ShardLoader | None:
    """From --val-shards, else the train manifest's val split when it has one, else None."""
    keys = config.debug_trace
    if config.val_shards is not None:
        return build_loader(loader_config(config, info, config.val_split, False, with_keys=keys))
    if not is_manifest_source(config.train_shards):
        log.warning("no --val-shards given: training without evaluation")
        return None
    try:
        return build_loader(loader_config(config, info, config.val_split, False, with_keys=keys))
    except KeyError:
        log.warning(
            "the train manifest has no %r split: training without evaluation", config.val_split
        )
        return None


def iter_shard_keys(spec: ShardSpec) -> Iterator[str]:
    """Sample keys of one shard, in order, without reading image data where possible."""
    with open_shard(spec, DEFAULT_RETRY, None) as stream:
        for sample in spec.format.iter_samples(stream, spec.url, fields=frozenset()):
            yield sample["__key__"]


def overlap_error(train: list[ShardSpec], val: list[ShardSpec], mode: str) -> str | None:
    """Why train and val overlap (shared shard files or sample keys), or None.

    Holds only the val keys in memory (the smaller split) and streams train keys.
    """
    if mode == "off":
        return None
    shared_urls = {s.url for s in train} & {s.url for s in val}
    if shared_urls:
        names = sorted(redact_url(u) for u in shared_urls)[:MAX_EXAMPLES]
        return f"train and val read the same shard files: {names}"
    if mode == "urls":
        return None
    started = time.perf_counter()
    val_keys = {key for spec in val for key in iter_shard_keys(spec)}
    shared: list[tuple[str, str]] = []
    count = train_keys = 0
    for spec in train:
        for key in iter_shard_keys(spec):
            train_keys += 1
            if key in val_keys:
                count += 1
                if len(shared) < MAX_EXAMPLES:
                    shared.append((key, redact_url(spec.url)))
    log.info(
        "overlap check: %d train and %d val keys compared in %.1f s, %d shared",
        train_keys,
        len(val_keys),
        time.perf_counter() - started,
        count,
    )
    if count:
        return (
            f"{count} samples are in both train and val (e.g. {shared}); rebuild the splits "
            "or pass --overlap-check off if this is intended"
        )
    return None


def locate_keys(specs: Iterable[ShardSpec], keys: Iterable[str]) -> dict[str, list[str]]:
    """Which shard URL holds each of `keys` (a scan of shard keys; used only on failure)."""
    wanted = set(keys)
    found: dict[str, list[str]] = {}
    for spec in specs:
        if not wanted:
            break
        for key in iter_shard_keys(spec):
            if key in wanted:
                wanted.discard(key)
                found.setdefault(redact_url(spec.url), []).append(key)
    return found
