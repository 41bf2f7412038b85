"""One training sample as it travels between preprocess, shards and pipeline.

A `Sample` is a plain dict, as in webdataset: `__key__` plus one entry per
field, each holding bytes. Tar and Parquet readers both yield exactly this.
A `Field` says how one of those entries becomes a value of a batch (image, class,
caption, metadata document, multi-label target, weight); the decoding and collation
helpers here are torch-free, so the build can validate fields with the same rules.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from shards.errors import DataError, MemberCap, UsageError

# Field names a shard may carry: a tar key group holding one of them is a sample, and
# these are what readers read unless a `Field` names another member (`source=`,
# `check_member_name`). Members nothing asks for are passed over unread. Image
# fields are tried in this order: ours first, then the names other writers use
# (webdataset's `ShardWriter` and img2dataset write `jpeg`, HF Parquet `image`).
IMAGE_FIELDS = ("jpg", "webp", "png", "jpeg", "image")
# Class index fields, tried in this order: webdataset's `cls`, then HF's `label`.
LABEL_FIELDS = ("cls", "label")
# `labels` (a JSON list of class ids) and `weight` (a JSON number) are dedicated
# members for multi-label targets and per-sample weights; both can come from `json`.
ALLOWED_FIELDS = frozenset((*IMAGE_FIELDS, *LABEL_FIELDS, "json", "txt", "labels", "weight"))

Sample = dict  # {"__key__": str, "__url__": str, field: bytes, ...}

# Members that hold pickles, or may (`np.load(allow_pickle=True)` reads object arrays
# from `.npy`/`.npz`): webdataset's decoders unpickle `.pyd` and `.pickle` and
# `torch.load` a `.pth`. No reader ever reads them, whatever a `Field` names, so their
# bytes never reach a transform or a user's stage that might decode them by name.
PICKLE_MEMBERS = frozenset(("pyd", "pickle", "pkl", "pth", "pt", "ckpt", "joblib", "npy", "npz"))
# A member (tar: the name after the key's dot; Parquet: a column) a `Field` may name:
# no dot (webdataset splits a member name at its first dot, so `a.b.jpg` is key `a`
# with field `b.jpg`), no slash or other path character, no leading `_` (the sample
# dict's own `__key__`, `__url__`, `__error__`).
_MEMBER_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_KEY_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_MAX_LABEL_DIGITS = 18  # fits int64; anything longer is garbage, not a class index


class SampleError(DataError):
    """A data error tied to one input or sample: skipped and counted, never fatal alone.

    Attributes:
        reason: a short stable slug (`truncated`, `too_many_pixels`, ...) used as
            the key of skip histograms in manifests and loader stats.
        detail: human-readable explanation.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def check_key(key: str) -> str:
    """Return `key` if it is a valid sample key, else raise ValueError.

    Keys hold no dots or slashes: webdataset splits member names at the first
    dot, and a slash would make a tar member a path.
    """
    if not _KEY_PATTERN.match(key):
        raise ValueError(f"invalid sample key {key!r}: use 1-128 characters of [A-Za-z0-9_-]")
    return key


def check_member_name(name: object) -> str:
    """Return `name` if a reader may read the member (tar) or column (Parquet) it names.

    Any name of up to 64 characters of `[A-Za-z0-9_-]`, starting with a letter or
    digit, except the pickle-bearing `PICKLE_MEMBERS` (in any case). Readers read a
    member only as bytes (a Parquet cell as bytes, a number or an id list's JSON) and
    `field_value` decodes it only as its field's kind, so no name makes a member code.

    Raises:
        UsageError: naming the member and what a member name may be.
    """
    if not isinstance(name, str) or not _MEMBER_PATTERN.match(name):
        raise UsageError(
            f"{name!r} is not a readable member name: use 1-64 characters of [A-Za-z0-9_-] "
            "starting with a letter or digit (no dots: a tar member `KEY.a.b` is field `a.b` "
            "of key KEY, which no reader reads; no leading `_`: `__key__` and its kin are "
            "the sample's own entries)"
        )
    if name.lower() in PICKLE_MEMBERS:
        raise UsageError(
            f"member {name!r} may hold a pickle ({', '.join(sorted(PICKLE_MEMBERS))} are never "
            "read): store the value as text, JSON or an image instead"
        )
    return name


def mapped_members(fields: Iterable[str]) -> frozenset[str]:
    """The members of `fields` beyond the allowlist (`ALLOWED_FIELDS`), each checked.

    For readers: these are read when asked for, but never make a group of tar members a
    sample, so a shard's sample count does not depend on what is read.

    Raises:
        UsageError: a name `check_member_name` refuses.
    """
    return frozenset(check_member_name(name) for name in fields if name not in ALLOWED_FIELDS)


def image_field_of(sample: Sample, fields: Sequence[str] = IMAGE_FIELDS) -> str:
    """Return the name of the image field a sample holds, the first of `fields` present.

    By default `jpg`, `webp`, `png`, `jpeg`, `image`, tried in that order, so a
    sample holding several uses the first.

    Raises:
        SampleError: `no_image` when the sample holds none of them.
    """
    for field in fields:
        if field in sample:
            return field
    present = sorted(name for name in sample if not name.startswith("__"))
    raise SampleError(
        "no_image",
        f"sample {sample.get('__key__')!r} has no {'/'.join(fields)} field "
        f"(fields: {', '.join(present) or 'none'})",
    )


def decode_label(sample: Sample, fields: Sequence[str] = LABEL_FIELDS) -> int:
    """Return the class index in the first of `fields` the sample has (`cls`, then `label`).

    The value is ASCII digits (`b"3"`, as webdataset writes `.cls`) or an int (a
    Parquet integer column).

    Raises:
        SampleError: `no_label` when none of `fields` is present, `bad_label` when
            the value is not a non-negative integer of at most 18 digits.
    """
    key = sample.get("__key__")
    name = next((field for field in fields if field in sample), None)
    if name is None:
        raise SampleError(
            "no_label",
            f"sample {key!r} has no {' or '.join(fields)} field; for shards without "
            "classes leave `label` out of LoaderConfig.fields",
        )
    value = sample[name]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value  # already decoded by a user's own reader stage, or a Parquet int
    text = value.encode("ascii", "replace") if isinstance(value, str) else value
    if isinstance(text, (bytes, bytearray)):
        text = text.strip()
        # bytes.isdigit() is ASCII-only, so no sign, no underscores, no Unicode digits.
        if 0 < len(text) <= _MAX_LABEL_DIGITS and text.isdigit():
            return int(text)
    raise SampleError(
        "bad_label", f"sample {key!r}: {name} {value!r:.40} is not a non-negative integer"
    )


# --- fields beyond image and class --------------------------------------------------------

FIELD_KINDS = ("image", "label", "text", "json", "multi_label", "weight")
# Where each kind is read from unless a `Field` names its own members.
DEFAULT_SOURCES = {
    "image": IMAGE_FIELDS,
    "label": LABEL_FIELDS,
    "text": ("txt",),
    "json": ("json",),
    "multi_label": ("labels",),
    "weight": ("weight",),
}
# A caption or metadata document is a few KiB; 1 MiB is ~1000x that and keeps a batch
# of 256 under 256 MiB of text. JSON nesting beyond 32 levels is no metadata we know of,
# and a cap well under Python's recursion limit keeps hostile documents harmless.
MAX_FIELD_BYTES = 1 * 2**20
MAX_JSON_DEPTH = 32


@dataclass(frozen=True)
class Field:
    """One entry of a batch: which sample members it comes from and what it becomes.

    Attributes:
        name: its place in `LoaderConfig.fields` and in messages (`image`, `txt`, `tags`).
        kind: `image` (bytes for the image transform), `label` (int class index),
            `text` (UTF-8 str), `json` (a JSON object as a dict), `multi_label` (a
            JSON list of class ids in `[0, num_classes)`, collated multi-hot) or
            `weight` (a finite JSON number >= 0, collated to float32).
        source: the sample members (tar) or columns (Parquet) tried in order
            (default: `DEFAULT_SOURCES[kind]`): any name `check_member_name` takes, e.g.
            `source="caption"` for img2dataset's Parquet; an image field reads one of
            `IMAGE_FIELDS`, the members a sample is found by. A member is decoded only
            as this field's kind, never unpickled, and pickle-bearing names
            (`PICKLE_MEMBERS`) are refused.
        key: for `json`, `multi_label` and `weight`: take this key of the JSON
            object the member holds (e.g. `source="json", key="tags"`).
        num_classes: `multi_label` only: the width of the multi-hot target.
        max_bytes: members this field reads over this many bytes are a counted skip
            (its `bad_` reason), passed over unread by the shard readers
            (`member_caps`); not applied to images, capped by `ReadLimits.member_bytes`.
        transform: `transform(value, rng) -> tensor | ndarray | object`, run in the
            worker on the decoded value (a tokenizer, a caption picker); the same rules
            as the image transform: picklable (a module-level class or
            `functools.partial`, never a lambda), raises `SampleError` on bad data
            (a counted skip) and nothing broader (anything else propagates as a bug).
            Tensors and arrays are stacked, anything else is collated as a list.
    """

    name: str
    kind: str
    source: tuple[str, ...] | str = ()
    key: str | None = None
    num_classes: int | None = None
    max_bytes: int = MAX_FIELD_BYTES
    transform: Callable | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise UsageError(f"a field's name must be a non-empty string, got {self.name!r}")
        if self.kind not in FIELD_KINDS:
            raise UsageError(
                f"field {self.name!r}: kind {self.kind!r} is not one of {', '.join(FIELD_KINDS)}"
            )
        object.__setattr__(self, "source", self._checked_source())  # frozen: normalise once
        if (self.kind == "multi_label") != (self.num_classes is not None):
            raise UsageError(f"field {self.name!r}: num_classes is for multi_label fields only")
        if self.num_classes is not None and (
            not isinstance(self.num_classes, int) or self.num_classes < 1
        ):
            raise UsageError(f"field {self.name!r}: num_classes must be a positive integer")
        if self.key is not None and self.kind not in ("json", "multi_label", "weight"):
            raise UsageError(f"field {self.name!r}: key is for json, multi_label, weight fields")
        if self.transform is not None and self.kind == "image":
            raise UsageError("the image's transform is LoaderConfig.transform")
        if not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise UsageError(f"field {self.name!r}: max_bytes must be a positive integer")

    def _checked_source(self) -> tuple[str, ...]:
        """`source` as a tuple of readable member names (the kind's defaults when empty)."""
        source = (self.source,) if isinstance(self.source, str) else tuple(self.source)
        source = source or DEFAULT_SOURCES[self.kind]
        for name in source:
            try:
                check_member_name(name)
            except UsageError as error:
                raise UsageError(f"field {self.name!r}: {error}") from None
        if self.kind == "image" and not set(source) <= set(IMAGE_FIELDS):
            raise UsageError(
                f"field {self.name!r}: an image field reads one of {', '.join(IMAGE_FIELDS)} "
                f"(the members a sample is found by), not {[n for n in source if n not in IMAGE_FIELDS]}"
            )
        return source


# The names `LoaderConfig.fields` understands as plain strings.
NAMED_FIELDS = {
    "image": Field("image", "image"),
    "label": Field("label", "label"),
    "txt": Field("txt", "text"),
    "json": Field("json", "json"),
}
DEFAULT_FIELDS = (NAMED_FIELDS["image"], NAMED_FIELDS["label"])


def resolve_fields(fields: Sequence[str | Field]) -> tuple[Field, ...]:
    """`Field`s for a fields option: names from `NAMED_FIELDS`, or `Field`s as they are.

    Raises:
        UsageError: no fields, an unknown name, a name used twice, or two image fields.
    """
    if isinstance(fields, (str, Field)):
        fields = (fields,)
    resolved = []
    for item in fields:
        if isinstance(item, Field):
            resolved.append(item)
        elif item in NAMED_FIELDS:
            resolved.append(NAMED_FIELDS[item])
        else:
            raise UsageError(
                f"unknown field {item!r}: name one of {', '.join(NAMED_FIELDS)} or pass a "
                "shards.sample.Field (multi-label targets, weights, other members: "
                f"Field({item!r}, 'text', source={item!r}) reads member {item!r} as text)"
            )
    names = [field.name for field in resolved]
    if not names or len(set(names)) != len(names):
        raise UsageError(f"fields must name at least one field, each once; got {names}")
    if sum(field.kind == "image" for field in resolved) > 1:
        raise UsageError("fields may hold one image field")
    return tuple(resolved)


# Member names that usually hold each kind, for the `Field` a missing-field hint writes.
_LIKELY_SOURCES = {
    "text": ("caption", "text", "prompt", "description", "title", "alt", "txt"),
    "json": ("json", "metadata", "meta", "info"),
    "label": ("cls", "label", "class", "class_id", "target", "category"),
    "multi_label": ("labels", "tags", "classes"),
    "weight": ("weight", "score", "weights"),
}


def missing_field_hint(field: Field, members_seen: Collection[str]) -> str:
    """One line for a field that no sample has: the field, the members the samples do
    have, and the `Field` that reads one of them instead.

    Args:
        field: the field none of whose `source` members any sample holds.
        members_seen: the member (tar) or column (Parquet) names the samples have.
    """
    seen = sorted(name for name in set(members_seen) if not name.startswith("__"))
    wanted = " or ".join(field.source)
    line = (
        f"field {field.name!r} reads member {wanted}, which no sample has; the samples have "
        f"{', '.join(seen) if seen else 'no members'}"
    )
    if field.kind == "image":
        return (
            f"{line}: an image is read from one of {', '.join(IMAGE_FIELDS)}; rewrite the "
            "shards with the image in one of those members"
        )
    readable = [
        name
        for name in seen
        if name not in IMAGE_FIELDS
        and _MEMBER_PATTERN.match(name)
        and name.lower() not in PICKLE_MEMBERS
    ]
    likely = [name for name in _LIKELY_SOURCES[field.kind] if name in readable]
    if field.kind in ("label", "multi_label") and not likely:
        # A label read from whatever member is there (`json`, `txt`) is no label: such
        # samples are label-free, and the fields that work are the ones they do hold.
        return (
            f"{line}: these samples hold no class labels; leave {field.name!r} out of "
            f"fields, e.g. {label_free_fields(seen)}"
        )
    if not readable:
        return (
            f"{line}: none of them can be read as {field.kind}; leave {field.name!r} out of fields"
        )
    source = (likely or readable)[0]
    extras = "".join(
        f", {name}={value!r}"
        for name, value in (("key", field.key), ("num_classes", field.num_classes))
        if value is not None
    )
    return (
        f"{line}: to read {source} as {field.kind}, write "
        f"Field({field.name!r}, {field.kind!r}, source={source!r}{extras})"
    )


def label_free_fields(members_seen: Collection[str]) -> str:
    """The `fields=` that reads label-free samples holding `members_seen`: the image, and
    their text as `txt` when a member holds some (`txt`, or img2dataset's `caption`
    column, read through a `Field`)."""
    if "txt" in set(members_seen):
        return "fields=('image', 'txt')"
    text = [name for name in _LIKELY_SOURCES["text"] if name in set(members_seen)]
    if not text:
        return "fields=('image',)"
    return f"fields=('image', Field('txt', 'text', source={text[0]!r})) (Field: shards.sample)"


class MissingFieldError(UsageError):
    """A field reads a member that the samples do not hold, found before any worker starts.

    Attributes:
        field: the field asked for.
        members: the members (tar) or columns (Parquet) the samples do hold.
    """

    def __init__(self, where: str, field: Field, members: Collection[str]) -> None:
        self.field = field
        self.members = tuple(sorted(name for name in members if not name.startswith("__")))
        super().__init__(f"{where}: {missing_field_hint(field, members)}")


def missing_reason(field: Field) -> str:
    """The skip reason of a sample without any of `field`'s members (`no_text`, ...)."""
    return "no_image" if field.kind == "image" else f"no_{_SLUG.get(field.kind, field.kind)}"


def skip_budget_hint(
    fields: Sequence[Field],
    skipped: Mapping[str, int],
    members_seen: Collection[str] | None = None,
) -> str:
    """What to do when a worker's skips pass its budget, for the end of that error.

    When every skip is one field's missing member (`no_text` only, say), the data is
    not bad: the field names a member the shards do not have, so the line names the
    field and, given `members_seen` (`ShardFormat.list_members`), the members the
    samples have and the `Field` to write (`missing_field_hint`). Otherwise: check the
    shards, or allow more skips.
    """
    reasons = {reason for reason, count in skipped.items() if count}
    candidates = [spec for spec in fields if {missing_reason(spec)} == reasons]
    if members_seen is not None:
        candidates = [s for s in candidates if not set(s.source) & set(members_seen)]
    if not candidates:
        return "Check the shards with `preprocess verify` or raise max_skip_fraction."
    field = candidates[0]
    if members_seen is not None:
        return f"Every skip is a missing field: {missing_field_hint(field, members_seen)}."
    return (
        f"Every skip is a sample without member {' or '.join(field.source)} of field "
        f"{field.name!r}: if the shards keep it under another name, read that member with "
        f"Field({field.name!r}, {field.kind!r}, source=...)."
    )


def read_fields(fields: Sequence[Field]) -> frozenset[str]:
    """The sample members a reader must read to decode `fields`."""
    return frozenset(name for field in fields for name in field.source)


def field_value(sample: Sample, field: Field, parsed: dict | None = None) -> object:
    """The decoded value of `field` in `sample` (before its transform).

    Image: the encoded bytes. Label: int. Text: str. JSON: dict. Multi-label: a list
    of class ids. Weight: float.

    Args:
        parsed: a per-sample cache of parsed JSON members, so fields that share a
            member (`json` and `key="tags"` of it) parse it once.

    Raises:
        SampleError: `no_<kind>` (`no_image`, `no_label`, `no_text`, ...) when none of
            the field's members is present, the kind's `BAD_VALUE_REASONS` entry
            (`bad_text`, `bad_weight`, ...) when its value is invalid, unparsable or
            over `field.max_bytes`.
    """
    if field.kind == "image":
        return sample[image_field_of(sample, field.source)]
    if field.kind == "label":
        return decode_label(sample, field.source)
    member = next((name for name in field.source if name in sample), None)
    where = f"sample {sample.get('__key__')!r}"
    if member is None:
        raise SampleError(
            f"no_{_SLUG[field.kind]}",
            f"{where} has no {' or '.join(field.source)} field for {field.name!r}",
        )
    where = f"{where} field {member}"
    if field.kind == "text":
        return decode_text(sample[member], where, field.max_bytes)
    cache = {} if parsed is None else parsed
    if member not in cache:
        try:
            cache[member] = parse_json(sample[member], where, field.max_bytes)
        except SampleError as error:
            if field.kind == "json":
                raise
            # A `.weight` of `nan` or a `.labels` that is not JSON is a bad weight or
            # bad labels: each field kind has one `bad_` reason, as the docs' table says.
            raise SampleError(BAD_VALUE_REASONS[field.kind], error.detail) from error
    value = cache[member]
    if field.key is not None:
        if not isinstance(value, dict) or field.key not in value:
            raise SampleError(
                f"no_{_SLUG[field.kind]}", f"{where} holds no JSON object with key {field.key!r}"
            )
        value, where = value[field.key], f"{where} key {field.key!r}"
    return _CHECKS[field.kind](value, where, field)


_SLUG = {"text": "text", "json": "json", "multi_label": "labels", "weight": "weight"}
# The one skip reason of a bad value of each field kind (an image's come from its decoder).
BAD_VALUE_REASONS = {
    "label": "bad_label",
    "text": "bad_text",
    "json": "bad_json",
    "multi_label": "bad_labels",
    "weight": "bad_weight",
}


def member_caps(fields: Sequence[Field]) -> tuple[MemberCap, ...]:
    """The caps `fields` put on the members they read, for `ReadLimits.member_caps`.

    Every member a text, JSON, label, multi-label or weight field reads is capped at
    that field's `max_bytes` (the smallest, and the first field of those, when several
    read it), with the field kind's `bad_` reason: what decoding the member would give,
    so a reader can skip an oversized member unread and count the same skip. Image
    members keep `ReadLimits.member_bytes` (`member_too_large`).
    """
    caps: dict[str, MemberCap] = {}
    for field in fields:
        if field.kind == "image":
            continue
        for member in field.source:
            known = caps.get(member)
            if known is None or field.max_bytes < known.max_bytes:
                reason = BAD_VALUE_REASONS[field.kind]
                caps[member] = MemberCap(member, field.max_bytes, reason, field.name)
    return tuple(caps.values())


def oversized_member(cap: MemberCap, where: str, size: int) -> SampleError:
    """The skip of a member of `size` bytes over `cap`, passed over unread.

    Args:
        where: the member and the shard, e.g. `member k1.txt of s3://b/x.tar` or
            `column 'txt' of row 5 in x.parquet`.
    """
    if cap.field:
        limit = f"the {cap.max_bytes}-byte cap of field {cap.field!r} (Field.max_bytes)"
    else:
        limit = f"the {cap.max_bytes}-byte cap (ReadLimits.member_bytes)"
    return SampleError(cap.reason, f"{where} is {size} bytes, over {limit}; not read")


def decode_text(data: object, where: str, max_bytes: int = MAX_FIELD_BYTES) -> str:
    """UTF-8 bytes as str (a str passes as it is).

    Raises:
        SampleError: `bad_text`: not UTF-8, over `max_bytes`, or not bytes at all.
    """
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SampleError("bad_text", f"{where} is a {type(data).__name__}, not text")
    if len(data) > max_bytes:
        raise SampleError("bad_text", f"{where} is {len(data)} bytes (cap {max_bytes})")
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as error:
        raise SampleError("bad_text", f"{where} is not UTF-8 ({error.reason})") from error


def parse_json(
    data: object, where: str, max_bytes: int = MAX_FIELD_BYTES, max_depth: int = MAX_JSON_DEPTH
) -> object:
    """A JSON document (UTF-8 bytes or str) parsed, within a size and a nesting cap.

    Raises:
        SampleError: `bad_json`: over `max_bytes`, not UTF-8, not strict JSON
            (`loads_strict_json`), or nested deeper than `max_depth`.
    """
    try:
        text = decode_text(data, where, max_bytes)
    except SampleError as error:
        raise SampleError("bad_json", error.detail) from error
    try:
        value = loads_strict_json(text)
    # ValueError: not JSON (JSONDecodeError), not strict JSON, or an int past Python's
    # digit limit; RecursionError: nesting deep enough to exhaust the parser's stack.
    except (ValueError, RecursionError) as error:
        raise SampleError("bad_json", f"{where} is not JSON ({error})"[:300]) from error
    # Containers are never deeper than there are brackets: most documents skip the walk.
    if text.count("[") + text.count("{") > max_depth and _depth(value) > max_depth:
        raise SampleError("bad_json", f"{where} nests deeper than {max_depth} levels")
    return value


# A `\uD800`-`\uDFFF` escape: the only way a lone surrogate gets into parsed JSON
# (UTF-8 text cannot hold one). Pairs are joined by the parser; lone ones survive.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def loads_strict_json(text: str) -> object:
    """`json.loads` under the manifest parser's rules (RFC 8259 as interchange needs it).

    Python's parser takes `NaN`, `Infinity` and `-Infinity`, turns `1e999` into an
    infinite float, keeps the last of repeated keys and passes lone surrogates
    (`"\\ud800"`) into strings that cannot be encoded again; other readers of the
    same document (a Rust or JS trainer, `jq`) refuse or read them differently.

    Raises:
        ValueError: not JSON (`json.JSONDecodeError`), or any of those four, named.
    """
    value = _STRICT_DECODER.decode(text)
    if _SURROGATE_ESCAPE.search(text):
        try:  # a C-speed walk of every string; only documents with such escapes pay it
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError("a string holds a lone surrogate escape (\\ud800-\\udfff)") from error
    return value


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {json.dumps(key)[:60]} appears twice in one object")
    return obj


def _refuse_constant(text: str) -> float:
    raise ValueError(f"{text} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf (1e999); NaN cannot come from a JSON number
        raise ValueError(f"{text[:40]} overflows to infinity")
    return value


# One decoder for every document: `json.loads` with hooks builds a new one per call
# (~1 us of a 4 us parse of a 200-byte document).
_STRICT_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_keys, parse_constant=_refuse_constant, parse_float=_finite_float
)


def _depth(value: object) -> int:
    """Nesting depth of containers in a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_json(value: object, where: str, field: Field) -> dict:
    if not isinstance(value, dict):
        raise SampleError("bad_json", f"{where} is a JSON {type(value).__name__}, not an object")
    return value


def _check_labels(value: object, where: str, field: Field) -> list[int]:
    ok = isinstance(value, list) and all(
        type(item) is int and 0 <= item < field.num_classes for item in value
    )
    if not ok:
        raise SampleError(
            "bad_labels",
            f"{where}: {json.dumps(value)[:60]} is not a list of class ids in "
            f"[0, {field.num_classes})",
        )
    return value


def _check_weight(value: object, where: str, field: Field) -> float:
    weight = -1.0
    if type(value) in (int, float):
        try:
            weight = float(value)
        except OverflowError:  # an int of hundreds of digits
            weight = -1.0
    if not (math.isfinite(weight) and weight >= 0):
        raise SampleError(
            "bad_weight", f"{where}: {json.dumps(value)[:60]} is not a finite number >= 0"
        )
    return weight


_CHECKS = {"json": _check_json, "multi_label": _check_labels, "weight": _check_weight}


def check_value(field: Field, value: object, where: str) -> object:
    """A parsed JSON value checked as `field_value` checks it (`json`, `multi_label`, `weight`).

    For the build, which validates input-list cells with the loader's own rules.

    Raises:
        SampleError: `bad_json`, `bad_labels`, `bad_weight`, naming `where`.
    """
    return _CHECKS[field.kind](value, where, field)


def class_ranged_fields(fields: Sequence[Field], num_classes: int | None) -> frozenset[int]:
    """Indices of the label and multi-label fields whose classes the manifest bounds.

    A multi-label field no wider than the manifest's classes is bounded by its own
    `num_classes` already (`bad_labels` in `field_value`).
    """
    if num_classes is None:
        return frozenset()
    return frozenset(
        index
        for index, spec in enumerate(fields)
        if spec.kind == "label" or (spec.kind == "multi_label" and spec.num_classes > num_classes)
    )


def check_class_range(spec: Field, value: object, num_classes: int, key: str) -> None:
    """Refuse a class id the manifest does not name: one compare for a label.

    Raises:
        SampleError: `bad_label` or `bad_labels`, as the field's own checks name them.
    """
    if spec.kind == "label":
        if value < num_classes:
            return
        reason, shown = "bad_label", f"class {value}"
    else:
        if not value or max(value) < num_classes:
            return
        reason, shown = "bad_labels", f"class {max(value)}"
    raise SampleError(
        reason,
        f"sample {key!r} field {spec.name!r}: {shown} is not one of the {num_classes} "
        "classes the manifest names; rebuild the shard or its manifest",
    )


def collate_values(field: Field, values: list) -> np.ndarray | list:
    """One batch's decoded values of a non-image field, without a transform.

    Labels: int64 `[B]`. Multi-label: float32 multi-hot `[B, num_classes]`. Weights:
    float32 `[B]`. Text and JSON: the list as it is (str, dict).
    """
    if field.kind == "label":
        return np.asarray(values, dtype=np.int64)
    if field.kind == "weight":
        return np.asarray(values, dtype=np.float32)
    if field.kind == "multi_label":
        hot = np.zeros((len(values), field.num_classes), dtype=np.float32)
        rows = np.repeat(np.arange(len(values)), [len(ids) for ids in values])
        hot[rows, np.fromiter((i for ids in values for i in ids), np.int64, len(rows))] = 1.0
        return hot
    return list(values)


SINGLE_LABEL_MEMBERS = ("cls", "label")  # one class id per sample
MULTI_LABEL_MEMBER = "labels"  # a JSON list of class ids; or json:KEY


@dataclass(frozen=True)
class LabelField:
    """Where the labels are read: a member holding one class id, or a list of them.

    Attributes:
        text: as given: `cls`, `label` (one class id), `labels` (a JSON list of class
            ids) or `json:KEY` (a key of the json member: a class id or a list of them).
        member: the sample member read.
        key: the key of the json member, or None.
        multi: the member holds a list of class ids (json:KEY decides per sample).
    """

    text: str
    member: str
    key: str | None
    multi: bool

    @classmethod
    def parse(cls, text: str) -> LabelField:
        """Raises UsageError (a ValueError) naming the values allowed."""
        member, _, key = text.partition(":")
        if text in SINGLE_LABEL_MEMBERS:
            return cls(text, text, None, False)
        if text == MULTI_LABEL_MEMBER or (member == "json" and key):
            return cls(text, member, key or None, True)
        raise UsageError(
            f"--label-field {text!r}: name {', '.join(SINGLE_LABEL_MEMBERS)} (one class id), "
            f"{MULTI_LABEL_MEMBER} (a JSON list of class ids) or json:KEY (a key of the json member)"
        )
