"""The manifest's `fields` entry: what each sample carries beyond image and class.

Written by the build's plan (`fields_entry`), checked by the reader (`check_fields_entry`).
"""

from __future__ import annotations

from typing import Any

from shards.errors import UsageError
from shards.manifest.parse import MISSING, key_path, show_value, wrong_value
from shards.manifest.state import ReadState
from shards.manifest.table import SplitInfo
from shards.sample import FIELD_KINDS, check_member_name

LABEL_MODES = ("single", "multi", "none")
_FIELDS_KEYS = frozenset(("label", "members", "columns", "label_counts"))


def fields_entry(
    label: str,
    members: dict[str, str],
    columns: dict[str, str],
    label_counts: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """The manifest's `fields`: what each sample carries and where it came from.

    Args:
        label: `single`, `multi` or `none` (`preprocess build-shards --label`).
        members: `{sample member: shards.sample field kind}` (`{"txt": "text", ...}`).
        columns: `{input-list column: member}` (`--fields`).
        label_counts: multi-label only: per split, the samples holding each class.
    """
    entry: dict[str, Any] = {
        "label": label,
        "members": dict(sorted(members.items())),
        "columns": dict(sorted(columns.items())),
    }
    if label_counts is not None:
        entry["label_counts"] = {split: label_counts[split] for split in sorted(label_counts)}
    return entry


def check_fields_entry(
    reader: ReadState, value: Any, splits: dict[str, SplitInfo]
) -> dict[str, Any] | None:
    """The `fields` entry checked: absent (None), or as `fields_entry` writes it.

    Members must be allowlisted shard fields of known kinds, columns must name one of
    them; `label_counts` are given exactly for multi-label, one count per class per
    split, none above the split's samples; a label-free dataset has no classes.
    """
    if value is None:
        return None
    if type(value) is not dict:
        reader.fail("fields", wrong_value(value, "an object"))
    reader.check_keys(value, "fields", _FIELDS_KEYS)
    label = value.get("label", MISSING)
    if type(label) is not str or label not in LABEL_MODES:
        reader.fail("fields.label", wrong_value(label, f"one of {list(LABEL_MODES)}"))
    members = value.get("members", MISSING)
    if type(members) is not dict or not members:
        reader.fail("fields.members", wrong_value(members, "an object of members and kinds"))
    for name, kind in members.items():
        if not readable_member(name) or type(kind) is not str or kind not in FIELD_KINDS:
            reader.fail(
                key_path("fields.members", name),
                f"{show_value(name)}: {show_value(kind)} is not a readable member (letters, "
                f"digits, '_' and '-', no pickle names) of a kind in {list(FIELD_KINDS)}",
            )
    columns = value.get("columns", {})
    if type(columns) is not dict:
        reader.fail("fields.columns", wrong_value(columns, "an object of columns and members"))
    for column, member in columns.items():
        if type(member) is not str or member not in members:
            reader.fail(key_path("fields.columns", column), wrong_value(member, "one of `members`"))
    if label == "none" and reader.classes:
        reader.fail("fields.label", "is `none` but the manifest lists classes")
    counts = value.get("label_counts")
    if (label == "multi") != (counts is not None):
        reader.fail("fields.label_counts", "must be given for multi-label datasets only")
    if counts is not None:
        _check_label_counts(reader, counts, splits)
    return value


def _check_label_counts(reader: ReadState, counts: Any, splits: dict) -> None:
    if type(counts) is not dict:
        reader.fail("fields.label_counts", wrong_value(counts, "an object of splits"))
    for split, row in counts.items():
        where = key_path("fields.label_counts", split)
        if split not in splits:
            reader.fail(where, f"names no split of the manifest ({', '.join(sorted(splits))})")
        if type(row) is not list or len(row) != len(reader.classes):
            reader.fail(where, wrong_value(row, f"a list of {len(reader.classes)} counts"))
        samples = splits[split].samples
        for index, count in enumerate(row):
            if type(count) is not int or not 0 <= count <= samples:
                reader.fail(
                    f"{where}[{index}]", wrong_value(count, f"a count of at most {samples}")
                )


def readable_member(name: object) -> bool:
    """Whether a reader may read the member `name` (`shards.sample.check_member_name`)."""
    try:
        check_member_name(name)
    except UsageError:
        return False
    return True
