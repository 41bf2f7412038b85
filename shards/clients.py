"""Index files other tools read beside the manifest: timm's `_info.json`, wids indexes
and open_clip's `sizes.json`.

All are made from the manifest alone (its per-shard counts, sizes and names), so
`preprocess build-shards` writes them right after the manifest and `preprocess
index` rewrites them for an existing output without opening a shard. They describe
the tar shards, the format these tools read; names are relative to the output
directory. The same manifest gives the same bytes.

* `_info.json` (timm's `ReaderWds`): `splits.<name>` with `name`, `num_samples`,
  `filenames` (one entry per shard, joined to timm's `root`) and `shard_lengths`,
  plus `num_classes` and `classes`. A `val` split is listed as `validation` too,
  timm's default name for it, so `--val-split` need not be given.
* `<split>.wids.json` (wids' `ShardListDataset`): `wids_version` 1 and a
  `shardlist` of `{url, nsamples, filesize}`, URLs relative to the index file.
* `sizes.json` (open_clip's `get_dataset_size`, so `--train-num-samples` need not be
  given): `{shard base name: samples}` for every split's tar shards, written in the
  directory that holds them (`tar/`, or the output itself in the flat layout), since
  open_clip opens `sizes.json` beside the first shard of `--train-data` and looks each
  shard up by its base name. None goes into `parquet/`: pyarrow and polars open that
  directory by its path and refuse a file in it that is not Parquet.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from pathlib import Path
from typing import Any

from shards.formats import TAR
from shards.manifest import Manifest
from shards.storage.write import OutputStore, atomic_write_bytes

INFO_NAME = "_info.json"
WIDS_SUFFIX = ".wids.json"
CLIENT_FORMAT = TAR.name  # the format timm, wids and open_clip read
TIMM_VALIDATION = "validation"  # timm's default `--val-split`
SIZES_NAME = "sizes.json"  # the name open_clip looks for beside the shards
_PLAIN_SPLIT = re.compile(r"[A-Za-z0-9_-]{1,64}").fullmatch


def wids_index_name(split: str) -> str:
    """`train.wids.json`; a split name that is not a plain word is hashed."""
    if _PLAIN_SPLIT(split):
        return f"{split}{WIDS_SUFFIX}"
    return f"split-{hashlib.sha256(split.encode('utf-8')).hexdigest()[:16]}{WIDS_SUFFIX}"


def is_client_file(name: str) -> bool:
    """True for names this module writes (what `--overwrite` clears with a build)."""
    directory, _, base = name.rpartition("/")
    if base == SIZES_NAME:
        return directory in ("", CLIENT_FORMAT)  # flat, or the by_format tar directory
    return name == INFO_NAME or (not directory and name.endswith(WIDS_SUFFIX))


def timm_info(manifest: Manifest) -> dict[str, Any] | None:
    """timm's `_info.json` for the manifest's tar shards; None without tar shards."""
    if CLIENT_FORMAT not in manifest.formats:
        return None
    splits = {}
    for name in sorted(manifest.splits):
        table = manifest.shard_table(name, CLIENT_FORMAT)
        splits[name] = {
            "name": name,
            "num_samples": manifest.splits[name].samples,
            "filenames": table.names(CLIENT_FORMAT),
            "shard_lengths": table.samples.tolist(),
        }
    if "val" in splits and TIMM_VALIDATION not in splits:
        splits[TIMM_VALIDATION] = {**splits["val"], "name": TIMM_VALIDATION}
    return {
        "name": "shardpipe",
        "num_classes": len(manifest.classes),
        "classes": list(manifest.classes),
        "splits": splits,
    }


def wids_index(manifest: Manifest, split: str) -> dict[str, Any] | None:
    """The wids index of one split's tar shards; None without tar shards or shards."""
    if CLIENT_FORMAT not in manifest.formats:
        return None
    table = manifest.shard_table(split, CLIENT_FORMAT)
    if not len(table):
        return None  # wids refuses an index without shards
    files = table.file_columns(CLIENT_FORMAT)
    shardlist = [
        {"url": name, "nsamples": int(samples), "filesize": int(size)}
        for name, samples, size in zip(
            table.names(CLIENT_FORMAT), table.samples, files.sizes, strict=True
        )
    ]
    return {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "name": split,
        "shardlist": shardlist,
    }


def open_clip_sizes(manifest: Manifest) -> dict[str, dict[str, int]]:
    """open_clip's size files: `{path of a sizes.json: {shard base name: samples}}`.

    One file per directory holding tar shards, listing the shards of every split there
    (so `--train-data` and `--val-data` both find their counts); empty without tar shards.
    Base names cannot collide within a directory, as each shard's name is unique.
    """
    if CLIENT_FORMAT not in manifest.formats:
        return {}
    by_directory: dict[str, dict[str, int]] = {}
    for split in sorted(manifest.splits):
        table = manifest.shard_table(split, CLIENT_FORMAT)
        for name, samples in zip(table.names(CLIENT_FORMAT), table.samples, strict=True):
            directory, _, base = name.rpartition("/")
            by_directory.setdefault(directory, {})[base] = int(samples)
    return {
        posixpath.join(directory, SIZES_NAME): dict(sorted(sizes.items()))
        for directory, sizes in sorted(by_directory.items())
    }


def client_files(manifest: Manifest) -> list[tuple[str, bytes]]:
    """`(name, bytes)` of every client file for `manifest`, deterministic."""
    files = []
    info = timm_info(manifest)
    if info is not None:
        files.append((INFO_NAME, _encode(info)))
    for split in sorted(manifest.splits):
        index = wids_index(manifest, split)
        if index is not None:
            files.append((wids_index_name(split), _encode(index)))
    for name, sizes in open_clip_sizes(manifest).items():
        files.append((name, _encode(sizes)))
    return files


def write_client_files(target: str | Path | OutputStore, manifest: Manifest) -> list[str]:
    """Write the client files into a directory or an `OutputStore`, atomically; their names."""
    files = client_files(manifest)
    for name, data in files:
        if isinstance(target, OutputStore):
            target.write_bytes_atomic(name, data)
        else:
            path = Path(target) / name
            path.parent.mkdir(parents=True, exist_ok=True)  # `tar/` of an index-only copy
            atomic_write_bytes(path, data)
    return [name for name, _ in files]


def _encode(document: dict[str, Any]) -> bytes:
    return (json.dumps(document, indent=1) + "\n").encode("utf-8")
