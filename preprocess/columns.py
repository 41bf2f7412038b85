"""What an input list's columns hold beyond `path` and `split`: `--label` and `--fields`.

`InputColumns` names the columns a list must have and checks each row's extra values
as the loader checks the sample members they fill (`shards.sample`), so a value the
loader would refuse is that row's counted skip, never a shard the loader trips on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from preprocess.listing import CONTROL_CHARACTER, is_utf8
from shards.errors import UsageError
from shards.sample import MAX_FIELD_BYTES, Field, SampleError, check_value, decode_text, parse_json

LABEL_MODES = ("single", "multi", "none")
# Sample members an input-list column may fill (`--fields caption:txt`): the caption, a
# key of the metadata document, a per-sample weight. Multi-label targets come from the
# `label` column (`--label multi`) and go to `labels`; all are in `shards.sample`'s allowlist.
FIELD_MEMBERS = ("txt", "json", "weight")
# Keys the build writes into each sample's metadata document itself; a `json` column
# may not take one of them.
META_KEYS = frozenset(
    ("source", "split", "label", "labels", "width", "height")
    + ("orig_width", "orig_height", "orig_format", "orig_mode")
)
_COLUMN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_LIST_COLUMNS = frozenset(("path", "label", "split"))
# The loader's own checks of each member (`shards.sample.field_value`), applied per row.
_WEIGHT = Field("weight", "weight")
_NO_VALUE = {"txt": "no_text", "json": "no_json", "weight": "no_weight"}
# Multi-label targets are multi-hot: a batch of 256 at 65,536 classes is 64 MiB of float32,
# and every class costs a count per split and shard. ImageNet-21k has 21,841 classes,
# OpenImages' image-level labels ~20k. A row may name this many labels (OpenImages' most
# labelled images have a few hundred); a row naming more is a counted skip (`bad_labels`),
# and a list naming more classes than this is refused (`preprocess.plan.Spill.add`).
MAX_LABELS_PER_ROW = 1024
MAX_MULTI_LABEL_CLASSES = 65_536


@dataclass(frozen=True)
class FieldColumn:
    """One `--fields` entry: input-list column `column` becomes sample member `member`."""

    column: str
    member: str


@dataclass(frozen=True)
class InputColumns:
    """What an input list's columns hold beyond `path` and `split`.

    Attributes:
        label: `single` (a class name in `label`, the default), `multi` (a list of
            class names in `label`) or `none` (no classes: `label` is not read).
        fields: the extra columns and the sample members they fill.
    """

    label: str = "single"
    fields: tuple[FieldColumn, ...] = ()

    @classmethod
    def parse(cls, label: str, specs: tuple[str, ...]) -> InputColumns:
        """From `--label` and `--fields COLUMN:MEMBER,...`.

        Raises:
            ValueError: an unknown label mode, a malformed entry, a member that is not
                one of `FIELD_MEMBERS`, a column used twice, or a member other than
                `json` filled twice; the message says what to write instead.
        """
        if label not in LABEL_MODES:
            raise UsageError(f"--label must be one of {', '.join(LABEL_MODES)}, got {label!r}")
        fields = tuple(_field_column(spec) for spec in specs)
        columns = [f.column for f in fields]
        if len(set(columns)) != len(columns):
            raise UsageError(f"--fields names a column twice: {','.join(specs)}")
        for member in ("txt", "weight"):
            if sum(f.member == member for f in fields) > 1:
                raise UsageError(
                    f"--fields fills `{member}` from two columns; a sample holds one {member}: "
                    "send the other column to `json`"
                )
        return cls(label, fields)

    @property
    def plain(self) -> bool:
        """Single-label with no extra columns: what every build did before these options."""
        return self.label == "single" and not self.fields

    @property
    def required(self) -> tuple[str, ...]:
        """The columns an input list must have."""
        label = ("label",) if self.label != "none" else ()
        return ("path", *label, *(f.column for f in self.fields))

    def members(self, image_field: str) -> dict[str, str]:
        """`{sample member: shards.sample field kind}` of every sample the build writes."""
        members = {image_field: "image", "json": "json"}
        if self.label == "single":
            members["cls"] = "label"
        elif self.label == "multi":
            members["labels"] = "multi_label"
        for spec in self.fields:
            members[spec.member] = {"txt": "text", "json": "json", "weight": "weight"}[spec.member]
        return dict(sorted(members.items()))

    def row_values(
        self, where: str, row: dict, from_text: bool
    ) -> tuple[list[str] | None, dict | None]:
        """A row's multi-label names (None unless `--label multi`) and its fields.

        Args:
            from_text: the row is a CSV line: its cells are text, an empty cell is no
                value, and `json`/`weight` cells hold JSON text (`["a", "b"]`, `0.5`).

        Raises:
            SampleError: a value the loader would refuse (`bad_text`, `bad_json`,
                `bad_weight`, `bad_labels`) or none at all (`no_text`, ...): the row is
                a counted skip.
        """
        labels = _label_names(where, row.get("label"), from_text) if self.label == "multi" else None
        if not self.fields:
            return labels, None
        values: dict = {}
        for spec in self.fields:
            value = row.get(spec.column)
            at = f"{where} column {spec.column!r}"
            if value is None or (from_text and value == ""):
                raise SampleError(_NO_VALUE[spec.member], f"{at} is empty")
            if spec.member == "txt":
                values["txt"] = decode_text(value, at)
                continue
            if spec.member == "weight":
                values["weight"] = _weight_value(value, at, from_text)
            else:
                parsed = parse_json(value if from_text else _json_text(value, at), at)
                values.setdefault("json", {})[spec.column] = parsed
        if "json" in values and len(_json_text(values["json"], where)) > MAX_FIELD_BYTES // 2:
            raise SampleError(
                "bad_json", f"{where}: the json columns take over {MAX_FIELD_BYTES // 2} bytes"
            )
        return labels, values


def _field_column(spec: str) -> FieldColumn:
    column, sep, member = spec.partition(":")
    column, member = column.strip(), member.strip()
    if not sep or not _COLUMN_NAME.match(column):
        raise UsageError(
            f"--fields entry {spec!r}: write COLUMN:MEMBER, e.g. caption:txt,tags:json,w:weight "
            "(a column name is letters, digits and _, at most 64)"
        )
    if member not in FIELD_MEMBERS:
        raise UsageError(
            f"--fields entry {spec!r}: member {member!r} is not one of {', '.join(FIELD_MEMBERS)} "
            "(multi-label targets come from the `label` column with --label multi)"
        )
    if column in _LIST_COLUMNS:
        raise UsageError(f"--fields entry {spec!r}: `{column}` is a column the build reads itself")
    if member == "json" and column in META_KEYS:
        raise UsageError(
            f"--fields entry {spec!r}: the metadata document already holds `{column}` "
            f"(the build writes {', '.join(sorted(META_KEYS))}); rename the column"
        )
    return FieldColumn(column, member)


def _weight_value(value: object, where: str, from_text: bool) -> float:
    """A weight cell checked as the loader checks `.weight`: anything else is `bad_weight`."""
    try:
        parsed = parse_json(value if from_text else _json_text(value, where), where)
    except SampleError as error:  # NaN, infinity, a huge integer, not JSON at all
        raise SampleError("bad_weight", error.detail) from error
    return check_value(_WEIGHT, parsed, where)


def _json_text(value: object, where: str) -> str:
    """A JSONL or Parquet cell as JSON text; a value JSON cannot hold is `bad_json`."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, default=_RefuseValue(where))
    except ValueError as error:  # NaN or infinity
        raise SampleError("bad_json", f"{where}: {error}") from error


class _RefuseValue:
    """`json.dumps`'s `default`: a cell value JSON has no type for (bytes, a date) is a skip."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __call__(self, value: object) -> object:
        if isinstance(value, HugeInteger):
            raise SampleError(
                "bad_json", f"{self.where}: {value}, more than a JSON reader converts"
            )
        raise SampleError("bad_json", f"{self.where}: a {type(value).__name__} is not JSON")


def _label_names(where: str, value: object, from_text: bool) -> list[str]:
    """A multi-label cell as sorted distinct class names.

    A CSV cell holds a JSON list (`["cat", "dog"]`) or names separated by `|`
    (`cat|dog`; empty: no labels); a JSONL or Parquet cell a list of names or ids.
    """
    at = f"{where} column 'label'"
    if from_text and isinstance(value, str) and not value.lstrip().startswith("["):
        value = [name.strip() for name in value.split("|")] if value.strip() else []
    elif from_text and isinstance(value, str):
        try:
            value = parse_json(value, at)
        except SampleError as error:
            raise SampleError("bad_labels", error.detail) from error
    if not isinstance(value, list):
        raise SampleError("bad_labels", f"{at} is not a list of class names")
    if len(value) > MAX_LABELS_PER_ROW:
        raise SampleError(
            "bad_labels",
            f"{at} holds {len(value)} labels; --label multi takes at most {MAX_LABELS_PER_ROW} "
            "a row (MAX_LABELS_PER_ROW)",
        )
    names = set()
    for item in value:
        if type(item) not in (str, int):
            raise SampleError("bad_labels", f"{at}: {item!r:.40} is not a class name or id")
        name = str(item)
        if not name or CONTROL_CHARACTER.search(name) or not is_utf8(name):
            raise SampleError(
                "bad_labels",
                f"{at}: class name {ascii(name):.60} is empty, holds a control character or "
                "is not valid Unicode",
            )
        if len(name) > MAX_NAME_BYTES // 4 and len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise SampleError(
                "bad_labels", f"{at}: a class name over the {MAX_NAME_BYTES}-byte limit"
            )
        names.add(name)
    return sorted(names)


MAX_NAME_BYTES = 1024  # a class name (or a split's): 4x NAME_MAX, the longest directory name


class HugeInteger:
    """A JSON integer too long for Python to convert (over `sys.get_int_max_str_digits()`).

    Stands in for the value in a parsed row: a column nobody declared is never read, a
    declared one holding it is refused (`bad_json`, `bad_weight`, `bad_labels`).
    """

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __str__(self) -> str:
        return f"an integer of {self.digits} digits"

    __repr__ = __str__
