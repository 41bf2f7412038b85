"""The reader's contract check of a Parquet shard's schema: which columns it reads, and how.

`check_schema` runs before any row is read and gives a `ParquetLayout`; a schema
that breaks the contract is a `ShardError` (`schema`) naming the column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

from shards.errors import ShardError
from shards.parquet.schema import HF_METADATA_KEY, LABEL_COLUMNS, METADATA_KEY
from shards.parquet.stream import REBUILD
from shards.sample import IMAGE_FIELDS, mapped_members

# Optional columns read when requested: a shard without them yields samples without them.
TEXT_FIELDS = ("json", "txt")
# Optional typed columns, yielded as the JSON bytes of their tar members (`[0, 3]`, `0.5`):
# `labels` a list of integers, `weight` a number; a JSON string column of either reads too.
JSON_VALUE_FIELDS = ("labels", "weight")
OPTIONAL_FIELDS = TEXT_FIELDS + JSON_VALUE_FIELDS


@dataclass(frozen=True)
class ParquetLayout:
    """What a reader takes from a shard whose schema passed `check_schema`.

    Attributes:
        image_field: the image column (one of `IMAGE_FIELDS`).
        columns: the columns to read, also the names they are yielded under;
            `__key__` first when the shard has one.
        image_struct: the image column is HF's `{bytes, path}` struct: only its
            `bytes` leaf is read, never `path`.
        classes: `(label column, class count)` for each label column read whose
            classes the file's metadata names (`metadata_classes`).
        mapped: the columns read beyond the contract's own, because a `Field` names
            them (`caption`); yielded as a tar member of that name would hold them.
    """

    image_field: str
    columns: tuple[str, ...]
    image_struct: bool = False
    classes: tuple[tuple[str, int], ...] = ()
    mapped: tuple[str, ...] = ()

    @property
    def has_key(self) -> bool:
        return self.columns[:1] == ("__key__",)

    @property
    def read_paths(self) -> list[str]:
        """The column paths handed to pyarrow: the struct's `bytes` leaf alone."""
        return [
            f"{name}.bytes" if self.image_struct and name == self.image_field else name
            for name in self.columns
        ]


def check_schema(schema: pa.Schema, url: str, fields: frozenset[str]) -> ParquetLayout:
    """Check a shard's schema against the contract before any row is read.

    The contract: `__key__` a string when present (a shard without one, as HF
    datasets writes, gets keys made from its file name and row index), exactly
    one image column (one of `IMAGE_FIELDS`) holding binary or HF's Image struct
    (a binary `bytes` field; its `path` is never read), the label columns
    (`cls`, HF's `label`) that `fields` asks for integers, at least one of them
    present when any is asked for, `json`/`txt` strings, `labels` a list of
    integers and `weight` a number (either also a JSON string) when present and
    asked for. Any other column `fields` names (a `shards.sample.Field` mapping it,
    checked by `mapped_members`) is read when present and a string, binary, a number
    or a list of integers. Columns nothing asks for are ignored.

    Raises:
        ShardError: `schema`, naming the missing or mistyped column.
    """
    columns = []
    if schema.get_all_field_indices("__key__"):
        _expect(schema, url, "__key__", "string", (pa.types.is_string, pa.types.is_large_string))
        columns.append("__key__")
    images = [name for name in IMAGE_FIELDS if schema.get_all_field_indices(name)]
    if len(images) != 1:
        found = f"columns {images}" if images else "none"
        raise ShardError(
            "schema",
            url,
            f"needs exactly one image column of {IMAGE_FIELDS}, found {found}; {REBUILD}",
        )
    image_field = images[0]
    image_struct = _check_image_column(schema, url, image_field)
    if image_field in fields:
        columns.append(image_field)
    labels = _label_columns(schema, url, fields)
    columns += labels
    for name in OPTIONAL_FIELDS:
        if name in fields and schema.get_all_field_indices(name):
            wanted, checks = _OPTIONAL_TYPES.get(name, ("string", STRING_TYPES))
            _expect(schema, url, name, wanted, checks)
            columns.append(name)
    mapped = [name for name in sorted(mapped_members(fields)) if schema.get_all_field_indices(name)]
    for name in mapped:
        _expect(schema, url, name, _MAPPED_TYPES, _MAPPED_CHECKS)
    named = metadata_classes(schema.metadata)
    classes = tuple((name, named[name]) for name in labels if name in named)
    return ParquetLayout(image_field, (*columns, *mapped), image_struct, classes, tuple(mapped))


def metadata_classes(metadata: dict[bytes, bytes] | None) -> dict[str, int]:
    """`{label column: class count}` for the label columns whose classes a file names.

    Our `shardpipe` document names them (`class_names`, for its `label_field`, or
    only their count, `num_classes`, past `CLASS_NAMES_IN_SHARD_BYTES`), and HF
    datasets' `huggingface` features do for a `ClassLabel` column (`names` or
    `num_classes`). A document that is not what those writers write names nothing:
    the file is read, its labels are not range-checked here.
    """
    metadata = metadata or {}
    found: dict[str, int] = {}
    ours = _json_document(metadata.get(METADATA_KEY))
    if isinstance(ours, dict) and ours.get("label_field") in LABEL_COLUMNS:
        names, count = ours.get("class_names"), ours.get("num_classes")
        if isinstance(names, list):
            found[ours["label_field"]] = len(names)
        elif type(count) is int and count >= 0:
            found[ours["label_field"]] = count
    hf = _json_document(metadata.get(HF_METADATA_KEY))
    info = hf.get("info") if isinstance(hf, dict) else None
    features = info.get("features") if isinstance(info, dict) else None
    for name in LABEL_COLUMNS:
        feature = features.get(name) if isinstance(features, dict) else None
        if name in found or not isinstance(feature, dict) or feature.get("_type") != "ClassLabel":
            continue
        names, count = feature.get("names"), feature.get("num_classes")
        if isinstance(names, list):
            found[name] = len(names)
        elif type(count) is int and count >= 0:
            found[name] = count
    return found


def _json_document(raw: bytes | None) -> object:
    """A metadata value parsed as JSON; None when absent or not JSON."""
    if raw is None:
        return None
    try:
        return json.loads(raw)
    # ValueError: not UTF-8 or not JSON; RecursionError: nested past the parser's stack.
    except (ValueError, RecursionError):
        return None


def _is_integer_list(kind: pa.DataType) -> bool:
    listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    return listed and pa.types.is_integer(kind.value_type)


def is_number(kind: pa.DataType) -> bool:
    return pa.types.is_floating(kind) or pa.types.is_integer(kind)


STRING_TYPES = (pa.types.is_string, pa.types.is_large_string)
_OPTIONAL_TYPES = {
    "labels": ("a list of integers (or a JSON string)", (_is_integer_list, *STRING_TYPES)),
    "weight": ("a number (or a JSON string)", (is_number, *STRING_TYPES)),
}


_BINARY = (pa.types.is_binary, pa.types.is_large_binary)
BYTES_TYPES = (*STRING_TYPES, *_BINARY)
_MAPPED_TYPES = "a string, binary, a number or a list of integers"
_MAPPED_CHECKS = (*BYTES_TYPES, is_number, _is_integer_list)
_IMAGE_TYPES = "binary or a struct with a binary 'bytes' field (HF's Image)"


def _check_image_column(schema: pa.Schema, url: str, name: str) -> bool:
    """Whether the image column is a struct (checked: its `bytes` is binary); else binary."""
    _expect(schema, url, name, _IMAGE_TYPES, (*_BINARY, pa.types.is_struct))
    kind = schema.field(name).type
    if not pa.types.is_struct(kind):
        return False
    indices = kind.get_all_field_indices("bytes")
    if len(indices) == 1 and any(check(kind.field(indices[0]).type) for check in _BINARY):
        return True
    raise ShardError(
        "schema",
        url,
        f"image column {name!r} is {kind}, not {_IMAGE_TYPES}; write the image bytes into "
        "a 'bytes' field, or rebuild the shard with `preprocess build-shards`",
    )


def _label_columns(schema: pa.Schema, url: str, fields: frozenset[str]) -> list[str]:
    """The label columns to read: those asked for that the shard has, each an integer."""
    asked = [name for name in LABEL_COLUMNS if name in fields]
    present = [name for name in asked if schema.get_all_field_indices(name)]
    if asked and not present:
        wanted = " or ".join(repr(name) for name in asked)
        raise ShardError(
            "schema",
            url,
            f"has no label column {wanted} (the shard contract needs an integer label); "
            f"{REBUILD}, or leave the label out of the fields read",
        )
    for name in present:
        _expect(schema, url, name, "an integer", (pa.types.is_integer,))
    return present


def _expect(schema: pa.Schema, url: str, name: str, wanted: str, checks: tuple) -> None:
    indices = schema.get_all_field_indices(name)
    if not indices:
        problem = f"has no {name!r} column"
    elif len(indices) > 1:
        problem = f"has {len(indices)} columns named {name!r}"
    elif not any(check(schema.field(indices[0]).type) for check in checks):
        problem = f"column {name!r} is {schema.field(indices[0]).type}, not {wanted}"
    else:
        return
    raise ShardError(
        "schema", url, f"{problem} (the shard contract needs {name!r} {wanted}); {REBUILD}"
    )
