"""The Parquet shard's columns and file metadata, as the writer lays them out.

Shared by the writer (`shards.parquet.write`) and the reader's contract check
(`shards.parquet.layout`): column names and types, the image struct HF datasets
reads as `Image`, and the `shardpipe` and `huggingface` metadata documents.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pyarrow as pa

from shards.sample import IMAGE_FIELDS

ROW_GROUP_SIZE = 128
# Metadata fields copied out of the json document into typed columns.
METADATA_COLUMNS: dict[str, pa.DataType] = {
    "source": pa.string(),
    "split": pa.string(),
    "width": pa.int32(),
    "height": pa.int32(),
    "orig_width": pa.int32(),
    "orig_height": pa.int32(),
}


# Hugging Face `datasets` takes a column as `Image` with no cast only when its Arrow
# type is exactly this struct, nullable (a plain binary column loads as bytes).
IMAGE_STRUCT = pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])
# Our own key in each file's metadata; version 2 stores images as `IMAGE_STRUCT`
# (version 1, plain binary, is still read).
METADATA_KEY = b"shardpipe"
HF_METADATA_KEY = b"huggingface"
FORMAT_VERSION = 2
# Columns that hold an integer label: ours, then the one HF datasets writes.
LABEL_COLUMNS = ("cls", "label")
_HF_VALUE_TYPES = {
    pa.string(): "string",
    pa.int32(): "int32",
    pa.int64(): "int64",
    pa.float64(): "float64",
}
# The members a shard's samples may carry besides the image, in column order, with the
# column type each is written as (`json` always; the others when the samples have them).
MEMBER_COLUMNS: dict[str, pa.DataType] = {
    "cls": pa.int64(),
    "labels": pa.list_(pa.int64()),
    "json": pa.string(),
    "txt": pa.string(),
    "weight": pa.float64(),
}
DEFAULT_MEMBERS = ("cls", "json")
# Class names are the dataset's, kept once in its manifest. A shard repeats them (in both
# metadata documents, for pyarrow and HF datasets users who open one file alone) only
# while their JSON takes at most this many bytes (1,000 names of 50 characters take 54 KB).
# Past it a shard names only the class count (`num_classes`), which our reader's range
# check needs, and HF datasets reads the label as a plain int64 (HF takes a `ClassLabel`
# from metadata only with its names): 10,000 labels of 1,000 characters made 20 MB of
# metadata per shard.
CLASS_NAMES_IN_SHARD_BYTES = 64 * 2**10


def shard_schema(image_field: str, members: Sequence[str] = DEFAULT_MEMBERS) -> pa.Schema:
    """The Parquet schema of a shard whose images are stored in `image_field`, no metadata.

    Args:
        members: the sample members besides the image (`MEMBER_COLUMNS`); `json` is
            always written.
    """
    if image_field not in IMAGE_FIELDS:
        raise ValueError(f"image field must be one of {IMAGE_FIELDS}, got {image_field!r}")
    unknown = sorted(set(members) - set(MEMBER_COLUMNS))
    if unknown:
        raise ValueError(f"members {unknown} have no Parquet column; known: {list(MEMBER_COLUMNS)}")
    base = [
        pa.field("__key__", pa.string(), nullable=False),
        # Nullable as HF's features are: a non-nullable field makes HF ignore them.
        pa.field(image_field, IMAGE_STRUCT),
    ]
    for name, kind in MEMBER_COLUMNS.items():
        if name == "json":
            base.append(pa.field("json", kind, nullable=False))
        elif name in members:
            base.append(pa.field(name, kind))
    return pa.schema(base + [pa.field(n, t) for n, t in METADATA_COLUMNS.items()])


def shard_metadata(
    schema: pa.Schema,
    image_field: str,
    class_names: Sequence[str] | None = None,
    description: str | None = None,
    split: str | None = None,
) -> dict[bytes, bytes]:
    """The file metadata of a shard: our `shardpipe` document and HF's `huggingface` one.

    Both are JSON with sorted keys, so equal arguments give equal bytes. Without
    `class_names` the label column is declared a plain int64. Class names whose JSON
    is over `CLASS_NAMES_IN_SHARD_BYTES` are left out of both (the manifest holds
    them): `class_names` is then null, and HF's features declare the label a plain int64.
    """
    count = None if class_names is None else len(class_names)
    names = None if class_names is None else [str(name) for name in class_names]
    if names is not None and len(json.dumps(names).encode()) > CLASS_NAMES_IN_SHARD_BYTES:
        names = None
    ours = {
        "format_version": FORMAT_VERSION,
        "key_field": "__key__",
        "image_field": image_field,
        "label_field": "cls" if "cls" in schema.names else None,
        "class_names": names,
        "num_classes": count,
        "description": description,
        "split": split,
    }
    label = None if names is None else {"_type": "ClassLabel", "names": names}
    features = {}
    for field in schema:
        if field.name == image_field:
            features[field.name] = {"_type": "Image"}
        elif field.name == "cls" and label is not None:
            features[field.name] = label
        elif field.name == "labels":
            features[field.name] = {
                "_type": "List",
                "feature": label or {"_type": "Value", "dtype": "int64"},
            }
        else:
            features[field.name] = {"_type": "Value", "dtype": _HF_VALUE_TYPES[field.type]}
    hf = {"info": {"description": description or "", "features": features}}
    return {
        METADATA_KEY: json.dumps(ours, sort_keys=True, ensure_ascii=False).encode("utf-8"),
        HF_METADATA_KEY: json.dumps(hf, sort_keys=True, ensure_ascii=False).encode("utf-8"),
    }
