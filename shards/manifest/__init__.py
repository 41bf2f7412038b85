"""`manifest.json`: the contract between `preprocess build-shards` and the loader.

Written last and atomically, so a dataset without a manifest is incomplete by
definition. It lists, per split and format, every shard with its sample count,
byte size and sha256, plus the class names, the build config and the skip
histogram. The loader uses the counts to give every rank equal batch counts.

In memory a split's shards are a `ShardTable`: numpy columns (counts, sizes, raw
sha256 digests, sparse per-shard class counts), with file names derived from
`shard_name` unless the manifest says otherwise, and a `ShardInfo` made only when
one shard is looked at: ~90 bytes a shard in two formats, plus 12 a non-zero class
count, where one `ShardInfo` per shard took ~1.5 KB.

On disk (version 2) a split of at most `INLINE_MAX_SHARDS` shards keeps its shard
list inline in `manifest.json`, exactly as version 1 did; a larger split's list goes
to a Parquet side file `_shards-<split>.parquet` beside it, referenced from the
manifest by name, row count, byte size and sha256, and written before it (the
manifest stays the commit point). Why two layouts rather than one: a small
dataset's manifest stays one self-contained file that can be read, diffed, edited
and copied with a text editor, `curl` or `jq`, and every hostile-input check of
version 1 keeps applying to it unchanged; past a few thousand shards JSON costs
~20 us and ~2.5 KB of transient objects a shard to parse (300k shards: 5.5 s and
800 MiB), where a side table loads 10^6 shards in 0.6 s (the loader's one split and
format in 0.15 s and ~160 MiB). Both layouts end in the same `ShardTable` and the
same checks, so what a reader trusts does not depend on the layout. The leading `_`
keeps `pyarrow.dataset` and polars from taking the side file for a data file.
`write_manifest` (or `Manifest.to_files`) writes this layout; `Manifest.to_json`
gives the whole manifest as one inline document, whatever its size.

Version 3 names its `layout`: `flat` (every shard beside the manifest, as in
versions 1 and 2) or `by_format` (`tar/train-000000.tar`, `parquet/...`: one
directory per format, so each holds one kind of file and pyarrow, polars, duckdb
and HF datasets open it by its path). A shard name may carry at most that one
directory, its own format's name; derived names follow the layout.

Reading one is strict, because a manifest may come from anywhere (a bucket, a web
server, a hand edit): every field is type-checked, every count cross-checked, and
every shard name must be a plain file beside the manifest or in its format's
directory (never `..`, an absolute path or a URL); a side file must match
its recorded size and sha256 before it is parsed, and its columns get the same
checks as inline shards. Whatever the bytes, the only error is a `ManifestError`
that names the file and the field.

The package, bottom up: `names` (file names, layouts, versions, caps), `errors`
(`ManifestError`), `table` (`ShardTable`, `ShardInfo`, `SplitInfo`), `parse` (strict
JSON), `mapped` (local side tables, memory-mapped), `state` (what one read has learnt),
`fields`, `inline` and `side_tables` (the checks of those parts), `read` (the document),
`model` (`Manifest`) and `files` (`read_manifest`, `write_manifest`).
"""

from shards.manifest.errors import (
    FormatNotBuiltError,
    ManifestError,
    ManifestNotFoundError,
    SplitNotFoundError,
)
from shards.manifest.fields import LABEL_MODES, fields_entry
from shards.manifest.files import manifest_base, manifest_url, read_manifest, write_manifest
from shards.manifest.mapped import SideTableReader, TableReader
from shards.manifest.model import Manifest
from shards.manifest.names import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INLINE_MAX_SHARDS,
    LAYOUT_BY_FORMAT,
    LAYOUT_FLAT,
    LAYOUTS,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MIN_TABLE_ROW_BYTES,
    format_dir,
    parse_shard_name,
    shard_name,
    shard_pattern,
    table_name,
)
from shards.manifest.side_tables import encode_table
from shards.manifest.table import (
    ClassCounts,
    FileColumns,
    FileInfo,
    ShardInfo,
    ShardTable,
    SplitInfo,
)

__all__ = [
    "ClassCounts",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FileColumns",
    "FileInfo",
    "FormatNotBuiltError",
    "INLINE_MAX_SHARDS",
    "LABEL_MODES",
    "LAYOUTS",
    "LAYOUT_BY_FORMAT",
    "LAYOUT_FLAT",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "MIN_TABLE_ROW_BYTES",
    "Manifest",
    "ManifestError",
    "ManifestNotFoundError",
    "ShardInfo",
    "ShardTable",
    "SplitInfo",
    "SplitNotFoundError",
    "SideTableReader",
    "TableReader",
    "encode_table",
    "fields_entry",
    "format_dir",
    "parse_shard_name",
    "manifest_base",
    "manifest_url",
    "read_manifest",
    "shard_name",
    "shard_pattern",
    "table_name",
    "write_manifest",
]
