"""The trainer's side of the data: loaders per split, the train/val overlap check, key lookup.

Train reads with drop_last and the `pad` epoch rule (equal batch counts on
every rank); evaluation reads every sample exactly once across ranks (the
loader's `uneven` rule, no drop_last). Keys are listed from the shards
themselves through the format registry: tar headers (seeking over the data) or
the Parquet key column.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from pipeline.checksum import open_shard
from pipeline.config import Batching, Mixing, Resampled, Source, default_source_name
from pipeline.loader import LoaderConfig, ShardLoader, resolve_config_source
from pipeline.mixing import ResolvedMix
from pipeline.sources import ResolvedSource, ShardSpec, is_manifest_source
from shards.errors import DataError, ShardpipeError, UsageError
from shards.formats import FORMATS
from shards.manifest import MANIFEST_NAME, SplitNotFoundError
from shards.redact import redact_url
from shards.sample import MULTI_LABEL_MEMBER, Field, LabelField, MissingFieldError
from shards.storage import DEFAULT_RETRY, url_scheme
from shards.storage.patterns import expand_urls
from trainers.config import TrainConfig
from trainers.distributed import DistInfo
from trainers.recipe import progressive_resize

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

    @property
    def target_classes(self) -> int | None:
        """The width of multi-hot targets (multi-label); None for single-label."""
        return target_classes(self.train.config)


def loader_config(
    config: TrainConfig, info: DistInfo, split: str, train: bool, **extra
) -> LoaderConfig:
    """One split's loader: the run's loader options as given, and what only the run knows
    (the split's source, the per-device batch size, the seed, the rank, the device)."""
    source = (
        train_source(config) if train or config.data.val_shards is None else config.data.val_shards
    )
    options = config.loader
    if options.workers.pin_memory is None:
        # Page-locked batches only where they go to a GPU, whatever the machine has.
        workers = replace(options.workers, pin_memory=info.device.type == "cuda")
        options = replace(options, workers=workers)
    if not train and options.workers.placement == "ray":
        # Evaluation reads with the --workers local workers: a second set of actors
        # would hold as many of the cluster's CPUs again for the whole run, idle
        # between evaluations, for a split read once per epoch.
        options = replace(options, workers=replace(options.workers, placement="local"))
    if train:
        extra = {**recipe_settings(config), **extra}
        options = replace(
            options, crop=replace(options.crop, progressive=progressive_resize(config))
        )
    return LoaderConfig(
        source=source,
        split=split,
        train=train,
        # The loader's layout (channels-last) is free either way; CudaPrefetcher gives the
        # model the layout --channels-last asks for.
        batch=Batching(
            size=config.schedule.batch_size, aug_repeats=config.recipe.aug_repeats if train else 1
        ),
        **train_sampling(config, train),
        seed=config.run.seed,
        rank=info.rank,
        world_size=info.world_size,
        **options.options,
        **extra,
    )


def train_sampling(config: TrainConfig, train: bool) -> dict[str, Any]:
    """How the train split's samples are drawn: `--resampled` draws `--train-epoch-samples`
    with replacement; otherwise each sample once an epoch, a mix sharing that many out."""
    if train and config.data.resampled:
        return {"sampling": Resampled(epoch_samples=config.data.train_epoch_samples)}
    return {"mixing": Mixing(epoch_samples=config.data.train_epoch_samples)}


def recipe_settings(config: TrainConfig) -> dict[str, Any]:
    """The train loader's share of the recipe: the workers' `Augment`, when one is asked for."""
    augment = config.recipe.augment()
    return {} if augment is None else {"augment": augment}


def train_source(config: TrainConfig) -> str | list[Source]:
    """`--train-shards` as the loader takes it: one dataset, or a mix of `Source`s.

    A mix's datasets share each epoch by `--train-weights`, else each gives its own size
    (open_clip's `A::B` without upsampling factors). Names come from the datasets
    (`.../web/manifest.json` -> `web`) unless given (`web=s3://bucket/web`); two alike
    get their position appended (`out1`, `out2`), so keys and stats tell them apart.
    """
    named = [named_source(part) for part in config.data.train_sources]
    parts = [part for _, part in named]
    if len(parts) == 1 and config.data.train_weights is None:
        return parts[0]
    names = [given or default_source_name(part) for given, part in named]
    names = [
        f"{n}{i + 1}" if names.count(n) > 1 and not named[i][0] else n for i, n in enumerate(names)
    ]
    weights = config.data.train_weights or (None,) * len(parts)
    return [
        Source(
            part,
            weight=weight,
            repeat=None if weight else 1,
            split=config.data.train_split,
            name=name,
        )
        for part, weight, name in zip(parts, weights, names, strict=True)
    ]


_NAMED_SOURCE = re.compile(r"^([A-Za-z0-9_.-]+)=(.+)$")


def named_source(part: str) -> tuple[str | None, str]:
    """`web=s3://bucket/web` -> `("web", "s3://bucket/web")`: a mix's dataset named on the
    command line; `(None, part)` for a part without a name (a URL's `=` comes after its
    `:` or `/`, which a name cannot hold; a local path that exists is taken as it is)."""
    match = _NAMED_SOURCE.match(part)
    if match is None or os.path.exists(part):
        return None, part
    return match.group(1), match.group(2)


def check_sources(config: TrainConfig) -> None:
    """Local `--train-shards` / `--val-shards` that do not exist, found before any loader is built.

    Raises:
        DataError: naming the flag, the path, and what to pass instead.
    """
    for source in config.data.train_sources:
        check_source("--train-shards", named_source(source)[1])
    if config.data.val_shards is not None:
        check_source("--val-shards", config.data.val_shards)


def check_source(flag: str, source: str | None) -> None:
    """One source: a dataset directory needs its manifest; shard paths must exist.

    Remote sources are left to the loader (asking costs a request, with retries).
    Some shard files of a pattern missing is the loader's call (it leaves them
    out, with a warning); all of them missing is a typo.
    """
    if not source or url_scheme(source) not in ("", "file"):
        return
    try:
        paths = expand_urls(source)
    except UsageError as error:
        raise DataError(f"{flag} {redact_url(source)}: {error}") from error
    if len(paths) == 1 and os.path.isdir(paths[0]):
        if not os.path.exists(os.path.join(paths[0], MANIFEST_NAME)) and not holds_shards(paths[0]):
            raise DataError(
                f"{flag} {source}: this directory holds no {MANIFEST_NAME} and no shard files; "
                f"pass the output directory of `preprocess build-shards`, a {MANIFEST_NAME}, "
                "or shard files"
            )
        return
    if any(os.path.exists(path) for path in paths):
        return
    if len(paths) == 1:
        raise DataError(
            f"{flag} {paths[0]} does not exist; pass a dataset directory, its {MANIFEST_NAME}, "
            "or shard files (a brace pattern such as train-{000000..000009}.tar)"
        )
    raise DataError(
        f"{flag} {source}: none of its {len(paths)} shard files exist (the first would be "
        f"{paths[0]}); check the directory and the brace range"
    )


def holds_shards(directory: str) -> bool:
    """Whether `directory` holds shard files (img2dataset's, webdataset's): the loader
    reads such a folder without a manifest, counting its shards."""
    suffixes = tuple(fmt.suffix for fmt in FORMATS.values())
    return any(name.endswith(suffixes) for name in os.listdir(directory))


def build_loaders(config: TrainConfig, info: DistInfo) -> Loaders:
    """Train loader (with keys, for the non-finite report and traces) and the val loader.

    Raises:
        DataError: the source cannot be read as configured (a malformed manifest, an
            unknown split or format, shards that cannot be counted), one line naming it.
    """
    if not config.data.train_shards:
        raise DataError("--train-shards is required: a manifest.json, its directory, or shard URLs")
    settings = loader_config(config, info, config.data.train_split, True, with_keys=True)
    train = build_split_loader(settings, "--train-shards", config)
    return Loaders(train, build_val_loader(config, info, target_classes(train.config)))


def batch_fields(config: TrainConfig, num_classes: int | None) -> tuple[str | Field, ...]:
    """What each batch carries before the keys: the images and the targets.

    Single-label: int64 class ids (`cls`, then `label`, unless --label-field names one).
    Multi-label: a float32 multi-hot `[B, num_classes]` from the `labels` member (a JSON
    list of class ids) or the --label-field given.
    """
    if config.data.task == "single-label":
        if config.data.label_field is None:
            return ("image", "label")  # the loader's default, exactly
        return ("image", Field("label", "label", source=config.data.label_field))
    field = LabelField.parse(config.data.label_field or MULTI_LABEL_MEMBER)
    return ("image", Field("labels", "multi_label", field.member, field.key, num_classes))


def target_classes(settings: LoaderConfig) -> int | None:
    """The multi-hot width of a loader's targets; None for single-label."""
    return next((f.num_classes for f in settings.fields if isinstance(f, Field)), None)


def multi_label_classes(config: TrainConfig, source: ResolvedSource) -> int:
    """Multi-label targets need their width before the loader is built: flag, else manifest."""
    if config.model.num_classes is not None:
        return config.model.num_classes
    if source.classes:
        return len(source.classes)
    raise DataError(
        f"--train-shards {redact_url(os.fspath(config.data.train_shards))}: no class list (no "
        "manifest.json beside the shards names the classes); pass --num-classes N"
    )


def check_task_fits(config: TrainConfig, source: ResolvedSource, where) -> None:
    """One clear error when the manifest says the data holds other targets than `--task`."""
    name = redact_url(os.fspath(where)) if isinstance(where, (str, os.PathLike)) else "the shards"
    if source.label_mode == "none":
        raise DataError(
            f"{name}: the dataset has no class labels (built with --label none); train needs "
            "labelled data (for image-text pairs see docs/examples/contrastive.py)"
        )
    if source.label_mode == "multi" and config.data.task != "multi-label":
        raise DataError(
            f"{name}: the dataset is multi-label (built with --label multi): "
            "pass --task multi-label"
        )


def open_split(
    settings: LoaderConfig, config: TrainConfig, num_classes: int | None = None
) -> ShardLoader:
    """Resolve the source and build its loader, with the fields `config` trains on.

    Raises what resolving a source raises (see `SOURCE_ERRORS`).
    """
    source = resolve_config_source(settings)
    check_task_fits(config, source, settings.source)
    if config.data.task == "multi-label" and num_classes is None:
        num_classes = multi_label_classes(config, source)
    return ShardLoader(replace(settings, fields=batch_fields(config, num_classes)), source)


def build_val_loader(
    config: TrainConfig, info: DistInfo, num_classes: int | None = None
) -> ShardLoader | None:
    """From --val-shards, else the train manifest's val split when it has one, else None."""
    settings = loader_config(
        config, info, config.data.val_split, False, with_keys=config.run.debug_trace
    )
    if config.data.val_shards is not None:
        return build_split_loader(settings, "--val-shards", config, num_classes)
    if len(config.data.train_sources) > 1 or not is_manifest_source(config.data.train_shards):
        log.warning("no --val-shards given: training without evaluation")
        return None
    try:
        return open_split(settings, config, num_classes)
    except SplitNotFoundError:
        log.warning(
            "the train manifest has no %r split: training without evaluation", config.data.val_split
        )
        return None
    except SOURCE_ERRORS as error:
        raise source_error("--train-shards", settings, error) from error


# What resolving a source raises for data it cannot use (see `resolve_source`): our
# errors, I/O errors, and the loader's refusals that are still plain `ValueError`s (a
# source without labels or counts). Anything else (a bare `KeyError`, `TypeError`) is a
# bug and propagates with its traceback.
SOURCE_ERRORS = (ShardpipeError, OSError)


def build_split_loader(
    settings: LoaderConfig, flag: str, config: TrainConfig, num_classes: int | None = None
) -> ShardLoader:
    """`open_split`, its data-source errors turned into one-line `DataError`s."""
    try:
        return open_split(settings, config, num_classes)
    except SOURCE_ERRORS as error:
        raise source_error(flag, settings, error) from error


def source_error(flag: str, settings: LoaderConfig, error: Exception) -> DataError:
    text = " ".join(str(error).split())  # one line, whatever the cause wrapped
    if isinstance(error, MissingFieldError) and error.field.kind in ("label", "multi_label"):
        text = missing_label_hint(error)
    source = settings.source
    if isinstance(source, (str, os.PathLike)):
        source = redact_url(os.fspath(source))
    else:  # a mix: its datasets, redacted
        source = "::".join(redact_url(os.fspath(item.source)) for item in source)
    return DataError(f"{flag} {source} (split {settings.split!r}): {text}")


def missing_label_hint(error: MissingFieldError) -> str:
    """What `train` says of shards whose samples hold no label member: in flags, since
    the loader's `Field(...)` hint cannot be given on the command line."""
    wanted = " or ".join(error.field.source)
    return (
        f"the samples hold {', '.join(error.members) or 'no members'} and no {wanted}: train "
        "fits a class per sample; name the member that holds it with --label-field MEMBER "
        "(or json:KEY), or build labelled shards (preprocess build-shards --input LIST.csv "
        "with path,label); for image-text pairs see docs/examples/contrastive.py"
    )


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


def locate_source_keys(
    source: ResolvedSource | ResolvedMix, keys: Iterable[str]
) -> dict[str, list[str]]:
    """`locate_keys` over each source; a named source's keys are `"{name}/{key}"`."""
    keys = list(keys)
    found: dict[str, list[str]] = {}
    for name, part in zip(source.names, source.parts, strict=True):
        prefix = f"{name}/" if name else ""
        own = [key[len(prefix) :] for key in keys if key.startswith(prefix)]
        for url, hits in locate_keys(part.shards, own).items():
            found[url] = [prefix + key for key in hits]
    return found


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
