"""The manifest format's names and constants: file names, layouts, versions and size caps.

The bottom of `shards.manifest`: the one place shard and side-table names are made and
parsed, and the limits the reader holds a manifest to (each with why it is that size).
"""

from __future__ import annotations

import hashlib
import re

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "shardpipe-manifest"
FORMAT_VERSION = 3  # 2: a split's shard list may live in a side table; 3: `layout`
READ_VERSIONS = (1, 2, 3)
# A flat manifest is written as version 2, byte for byte what earlier builds wrote, so
# readers from before version 3 keep reading flat outputs; only `by_format` needs 3.
FLAT_VERSION = 2
# Where a build puts its shards: `flat` beside the manifest (versions 1 and 2, and
# version 3 when asked), or `by_format`, one directory per format (`tar/`, `parquet/`),
# which pyarrow, polars, duckdb and HF datasets open by its path with no glob.
LAYOUT_FLAT = "flat"
LAYOUT_BY_FORMAT = "by_format"
LAYOUTS = (LAYOUT_FLAT, LAYOUT_BY_FORMAT)

# Why these caps: `to_json` writes ~470 bytes per shard in two formats plus ~10 per
# class count, so 256 MiB holds ~500k shards inline: LAION-5B at 10k samples a shard.
# Parsing that takes seconds and a few GiB; anything larger is not a manifest we wrote.
MAX_MANIFEST_BYTES = 256 * 2**20
# One shard file is one build task's output, read front to back by one worker; ours are
# 0.1-10 GB. 1 TiB is 100x that and keeps the counts derived from it (`bytes //
# min_sample_bytes`) small enough to plan an epoch with.
MAX_FILE_BYTES = 2**40
# `config` is the only free-form part; the build writes it two levels deep. The cap
# keeps `to_json` (which recurses) and every reader of it far from the recursion limit.
MAX_CONFIG_DEPTH = 32
MAX_NAME_CHARS = 255  # NAME_MAX of common file systems
# A split above this many shards gets a side table (see the module docstring): at 2k
# shards the inline list is ~1 MB of JSON and ~50 ms to parse, still pleasant to read.
INLINE_MAX_SHARDS = 2048
# A side table is ~90 bytes a shard in two formats (sha256 does not compress) plus its
# class counts; 4 GiB is 10x a 10M-shard table, 2**26 shards 1,000x LAION-5B's.
MAX_TABLE_BYTES = 4 * 2**30
MAX_TABLE_ROWS = 2**26
# The fewest bytes one shard takes in a side table, per format: its sha256, 32 random
# bytes that `encode_table` stores plainly (no compression, no dictionary) and that no
# codec shrinks. So a table of `rows` shards in F formats is at least `rows * 32 * F`
# bytes, and a table claiming more rows than `bytes // (32 * F)` was not written by us:
# it is refused before it is read, whatever its columns compress to and whether or not
# the digests are read (2**26 zero rows in 1.7 MB would cost ~4 GiB to load).
MIN_TABLE_ROW_BYTES = 32
TABLE_PREFIX = "_shards-"
TABLE_SUFFIX = ".parquet"
PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}").fullmatch


def format_dir(fmt: str, layout: str = LAYOUT_FLAT) -> str:
    """The directory (with its `/`) that `layout` puts format `fmt`'s shards in: `tar/` or ``."""
    return f"{fmt}/" if layout == LAYOUT_BY_FORMAT else ""


def shard_name(split: str, index: int, fmt: str, layout: str = LAYOUT_FLAT) -> str:
    """`train-000012.tar` (or `tar/train-000012.tar`): the one place shard names are made.

    The name is relative to the manifest's directory.
    """
    return f"{format_dir(fmt, layout)}{split}-{index:06d}.{fmt}"


def shard_pattern(split: str, count: int, fmt: str, layout: str = LAYOUT_FLAT) -> str:
    """Brace pattern covering `count` shards, e.g. `train-{000000..000127}.tar`."""
    if count == 1:
        return shard_name(split, 0, fmt, layout)
    return f"{format_dir(fmt, layout)}{split}-{{{0:06d}..{count - 1:06d}}}.{fmt}"


def parse_shard_name(name: str, layout: str = LAYOUT_FLAT) -> tuple[str, int, str] | None:
    """`(split, index, fmt)` when `name` is `shard_name(split, index, fmt, layout)`, else None."""
    stem, dot, fmt = name.rpartition(".")
    stem = stem.removeprefix(format_dir(fmt, layout))
    split, dash, digits = stem.rpartition("-")
    if not (dot and dash and digits.isascii() and digits.isdigit()):
        return None
    index = int(digits)
    return (split, index, fmt) if shard_name(split, index, fmt, layout) == name else None


def table_name(split: str) -> str:
    """`_shards-train.parquet`: the side file of a split's shard table."""
    if PLAIN_KEY(split):
        return f"{TABLE_PREFIX}{split}{TABLE_SUFFIX}"
    return f"{TABLE_PREFIX}{hashlib.sha256(split.encode('utf-8')).hexdigest()[:16]}{TABLE_SUFFIX}"
