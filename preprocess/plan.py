"""Turn the streamed input listing into shard tasks, deterministically, before any image is read.

Each input gets a key from a hash of its relative path (stable across shard
sizes and seeds), a split (from the list file, or from a second path hash so
that the val set does not move when the seed changes) and a place in its
split's order: the order of a keyed hash of its key, keyed by `--seed`, a seeded
pseudo-random permutation that needs no input in memory. The listing is spilled
to bucket files by the hash's top byte (`Spill`); buckets cover consecutive
hash ranges, so sorting each bucket on its own and reading them one after
another yields the whole split in order (`order_spill`), and shards are cut
from that stream every `shard_size` inputs. The driver holds one bucket, the
class names and one small `ShardPiece` per shard; the pieces themselves (one
JSON line per input: key, path, relative path, label, and the extra columns'
values when the list has some) stay in the plan files and hold paths, labels and
those values (each capped at `shards.sample.MAX_FIELD_BYTES`), never pixels.
A label is a class index, a sorted list of them (multi-label), or None (label-free).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any

from preprocess.columns import MAX_MULTI_LABEL_CLASSES, InputColumns
from preprocess.listing import InputError, SourceItem
from shards.errors import DataError
from shards.manifest import fields_entry
from shards.redact import redact_url
from shards.sample import check_key
from shards.storage.write import atomic_write_bytes

# 1: every split listed in memory and shuffled with `random.Random(f"{seed}:{split}")`.
# 2: the keyed-hash order below. Samples land in other shards, so a build started
# by version 1 cannot be resumed by this one (`preprocess.output.prepare_output`).
PLAN_VERSION = 2
PLAN_INDEX = "plan.json"
SPILL_DIR = "spill"
SPILL_BUCKETS = 256  # one level of buckets per byte of the 64-bit order hash
# A bucket file larger than this is split again by the next byte of the hash before it
# is sorted, so the driver never holds more than about this much of the listing.
MAX_BUCKET_BYTES = 8 << 20
PROBE_SIZE = 64  # inputs with the smallest keys, processed to measure sizes (`sizing`)
_MAX_OPEN_SPLIT_FILES = 64
_BY_ORDER = itemgetter(0, 1, 4)  # spill records: (order hash, key, relative path)


class PlanError(DataError, ValueError):
    """A plan file of this build does not hold what the plan says; rerun to plan again."""


@dataclass(frozen=True)
class PlannedSample:
    """One input, assigned to a shard.

    Attributes:
        label: the class index; a sorted list of class indices (`--label multi`), or
            None (`--label none`).
        fields: the extra columns' values by sample member (see `SourceItem.fields`).
    """

    key: str
    path: str
    rel: str
    label: int | list[int] | None
    fields: dict | None = None


@dataclass(frozen=True)
class ShardTask:
    """Everything one worker needs to write one shard; small enough to ship to Ray."""

    split: str
    index: int
    samples: tuple[PlannedSample, ...]

    @property
    def size(self) -> int:
        return len(self.samples)


@dataclass(frozen=True)
class ShardPiece:
    """Where one shard's planned inputs lie in its split's plan file: all the driver keeps.

    A task given a piece reads its inputs itself (`load_task`); for an object-store
    output the driver loads the piece and ships the `ShardTask` instead.
    """

    split: str
    index: int
    size: int  # inputs planned for the shard
    path: str  # the split's plan file, absolute
    offset: int
    length: int


@dataclass(frozen=True)
class Plan:
    """Every input assigned to exactly one shard of one split.

    Attributes:
        classes: class names; a label is an index into this list.
        shards: one piece per shard, in plan order (split name, then index).
        inputs: inputs planned (files refused at listing are not among them).
        digest: changes whenever any input path, label, split or order changes,
            or the shard size or the plan version.
        split_counts, class_counts: inputs per split, and per split and label (for
            multi-label: the inputs holding each label; empty without labels).
        probe: the `PROBE_SIZE` inputs with the smallest keys (for `sizing`).
        directory: where the plan files are.
    """

    classes: list[str]
    shards: list[ShardPiece]
    inputs: int
    digest: str
    shard_size: int
    split_counts: dict[str, int] = field(default_factory=dict)
    class_counts: dict[str, list[int]] = field(default_factory=dict)
    probe: tuple[SourceItem, ...] = ()
    directory: str = ""
    # Keeps a temporary plan directory (`build_plan` without one) alive with the plan.
    scratch: Any = field(default=None, repr=False, compare=False)

    @property
    def tasks(self) -> list[ShardTask]:
        """Every shard with its inputs loaded: for small plans and tests, not for a build."""
        return [load_task(piece) for piece in self.shards]


def path_digest(rel: str) -> bytes:
    return hashlib.blake2b(rel.encode("utf-8"), digest_size=8, person=b"shardkey").digest()


def sample_key(rel: str) -> str:
    """16 hex characters from the relative path: no dots or slashes, stable across builds."""
    return path_digest(rel).hex()


def hash_split(rel: str, val_fraction: float) -> str:
    """`val` for a stable pseudo-random `val_fraction` of paths, else `train`."""
    unit = (
        int.from_bytes(
            hashlib.blake2b(rel.encode("utf-8"), digest_size=8, person=b"shardspl").digest(), "big"
        )
        / 2**64
    )
    return "val" if unit < val_fraction else "train"


def order_key(seed: int) -> bytes:
    """The blake2b key of the order hash for `seed` (any int, however long)."""
    return hashlib.blake2b(str(seed).encode(), digest_size=32, person=b"shardsee").digest()


def order_hash(key: str, keyed_by: bytes) -> int:
    """A sample's place in its split: 64 bits of a hash of its key, keyed by the seed."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, key=keyed_by, person=b"shardord")
    return int.from_bytes(digest.digest(), "big")


def class_names(labels: Iterable[str]) -> list[str]:
    """Sorted class names; numeric labels sort as numbers so `2` comes before `10`."""
    names = set(labels)
    if all(name.lstrip("-").isdigit() for name in names):
        return sorted(names, key=int)
    return sorted(names)


class Spill:
    """Inputs on their way into the plan: checked, counted, appended to bucket files, never kept.

    Use as a context manager (the bucket files are closed on leaving), `add` every
    input, then pass it to `order_spill`. A spill record is a JSON list
    `[order hash, key, split, class name(s), rel, path, where, fields]`.
    """

    def __init__(self, directory: str | os.PathLike, val_fraction: float, seed: int) -> None:
        self.directory = Path(directory)
        self.val_fraction = val_fraction
        self.seed = seed
        self.inputs = 0
        self.counts: Counter = Counter()  # (split, class name) -> inputs
        self.split_inputs: Counter = Counter()  # split -> inputs
        self._keyed_by = order_key(seed)
        self._splits: set[str] = set()
        self._multi_classes: set[str] = set()  # `--label multi`: checked against the cap
        self._probe: list[tuple[int, int, SourceItem]] = []  # max-heap on the key, bounded
        spill = self.directory / SPILL_DIR
        shutil.rmtree(spill, ignore_errors=True)
        spill.mkdir(parents=True)
        # Binary files: one 8 KiB buffer each (a text file adds a second one).
        self._files = [
            open(spill / f"{bucket:03d}.jsonl", "wb")  # noqa: SIM115
            for bucket in range(SPILL_BUCKETS)
        ]

    def __enter__(self) -> Spill:
        return self

    def __exit__(self, *exc_info) -> None:
        for file in self._files:
            file.close()

    def add(self, item: SourceItem) -> None:
        """Take one input.

        Raises:
            InputError: a path that is not valid Unicode, or a split name unusable in
                file names.
        """
        try:
            key = sample_key(item.rel)
        except UnicodeEncodeError as error:
            # Listing refuses such names (`bad_name`); a caller's own list may not.
            raise InputError(
                f"input path {ascii(item.rel)} is not valid UTF-8; rename the file and rerun"
            ) from error
        split = item.split or hash_split(item.rel, self.val_fraction)
        if split not in self._splits:
            try:
                check_key(split)
            except ValueError as error:
                raise InputError(
                    f"split name {split!r} of {item.rel} is not usable in file names"
                ) from error
            self._splits.add(split)
        order = order_hash(key, self._keyed_by)
        record = [order, key, split, item.label, item.rel, item.path, item.where, item.fields]
        line = json.dumps(record, ensure_ascii=False) + "\n"
        self._files[order >> 56].write(line.encode("utf-8"))
        if isinstance(item.label, str):
            self.counts[(split, item.label)] += 1
        elif item.label is not None:
            self._add_classes(item)
            self.counts.update((split, name) for name in item.label)
        self.split_inputs[split] += 1
        self.inputs += 1
        self._keep_for_probe(key, item)

    def _add_classes(self, item: SourceItem) -> None:
        """Note a multi-label input's classes; past `MAX_MULTI_LABEL_CLASSES`, refuse the list.

        Raises:
            InputError: naming the row that names one class too many.
        """
        known = self._multi_classes
        if all(name in known for name in item.label):
            return
        known.update(item.label)
        if len(known) > MAX_MULTI_LABEL_CLASSES:
            raise InputError(
                f"{item.where or item.rel}: the list names over {MAX_MULTI_LABEL_CLASSES} "
                f"classes by this row ({len(known)}), more than --label multi takes "
                f"(MAX_MULTI_LABEL_CLASSES, multi-hot targets of that width); check the "
                "row's `label` column, or merge rare classes"
            )

    def _keep_for_probe(self, key: str, item: SourceItem) -> None:
        entry = (-int(key, 16), self.inputs, item)
        if len(self._probe) < PROBE_SIZE:
            heapq.heappush(self._probe, entry)
        elif entry[0] > self._probe[0][0]:
            heapq.heapreplace(self._probe, entry)

    @property
    def probe(self) -> tuple[SourceItem, ...]:
        """The inputs with the smallest keys so far, by key: the same on every run."""
        return tuple(item for _, _, item in sorted(self._probe, reverse=True))

    def bucket_paths(self) -> list[Path]:
        return [Path(file.name) for file in self._files]


def build_plan(
    items: Iterable[SourceItem],
    shard_size: int,
    val_fraction: float,
    seed: int,
    directory: str | os.PathLike | None = None,
) -> Plan:
    """Assign every input to exactly one shard of one split (the whole of planning).

    Args:
        directory: where the plan files go; None: a temporary directory that lives as
            long as the returned plan.

    Raises:
        InputError: two inputs hash to the same key, a path is listed twice, a split
            name is invalid, or a path is not valid Unicode.
    """
    scratch = None
    if directory is None:
        scratch = tempfile.TemporaryDirectory(prefix="shardpipe-plan-")
        directory = scratch.name
    with Spill(directory, val_fraction, seed) as spill:
        for item in items:
            spill.add(item)
    return order_spill(spill, shard_size, scratch)


def order_spill(spill: Spill, shard_size: int, scratch: Any = None) -> Plan:
    """Sort the spilled inputs bucket by bucket and cut each split into shards.

    Writes one plan file per split (`{split}.jsonl`, records in plan order) and
    `plan.json` (the index of pieces), and removes the bucket files.

    Raises:
        InputError: a path listed twice, or two paths with the same key.
    """
    classes = class_names(label for _, label in spill.counts)
    label_of = {name: index for index, name in enumerate(classes)}
    splits = _SplitFiles(spill.directory, shard_size)
    previous = None
    for bucket in spill.bucket_paths():
        for record in iter_sorted_bucket(bucket, 1):
            if previous is not None and previous[1] == record[1]:
                raise _duplicate(previous, record)
            previous = record
            _, key, split, label, rel, path, _, fields = record
            splits.append(split, key, path, rel, _label_index(label, label_of), fields)
    shutil.rmtree(spill.directory / SPILL_DIR, ignore_errors=True)
    shards = splits.finish()
    digest = hashlib.sha256(f"shardpipe plan v{PLAN_VERSION}\tshard_size {shard_size}\n".encode())
    for split in sorted(splits.digests):
        digest.update(f"{split}\t{splits.digests[split].hexdigest()}\n".encode())
    plan = Plan(
        classes=classes,
        shards=shards,
        inputs=spill.inputs,
        digest=digest.hexdigest(),
        shard_size=shard_size,
        split_counts={s: spill.split_inputs[s] for s in sorted(splits.digests)},
        class_counts={s: [spill.counts[(s, c)] for c in classes] for s in sorted(splits.digests)},
        probe=spill.probe,
        directory=str(spill.directory),
        scratch=scratch,
    )
    write_plan_index(plan)
    return plan


def _label_index(label: str | list[str] | None, label_of: dict[str, int]) -> int | list | None:
    """A spilled class name (or sorted list of names, or None) as the plan's index(es)."""
    if isinstance(label, str):
        return label_of[label]
    if label is None:
        return None
    return sorted(label_of[name] for name in label)


def _duplicate(first: list, second: list) -> InputError:
    """A path listed twice, or two inputs (named both) that would get one key."""
    if first[4] == second[4] and first[5] != second[5]:
        where = " and ".join(sorted(w for w in (first[6], second[6]) if w))
        return InputError(
            f"{where + ': ' if where else ''}two inputs would get one key {first[4]!r}: "
            f"{redact_url(first[5])} and {redact_url(second[5])}; pass an --input-root that "
            "tells them apart, or list only one of them"
        )
    if first[4] == second[4]:
        where = " and ".join(sorted(w for w in (first[6], second[6]) if w)) or first[4]
        return InputError(f"{where}: duplicate path {second[4]!r}; list each file once")
    return InputError(
        f"two inputs share the key {first[1]} ({first[4]} and {second[4]}); rename one of them"
    )


def iter_sorted_bucket(path: Path, depth: int) -> Iterator[list]:
    """A bucket's records sorted by (order hash, key, path); removes the bucket file.

    A bucket over `MAX_BUCKET_BYTES` is split by the hash's next byte first, so at
    most one small bucket is in memory, however many inputs there are.
    """
    if path.stat().st_size <= MAX_BUCKET_BYTES or depth >= 8:
        with open(path, "rb") as file:
            records = [json.loads(line) for line in file]
        path.unlink()
        records.sort(key=_BY_ORDER)
        yield from records
        return
    shift = 56 - 8 * depth
    subs = [path.with_name(f"{path.stem}-{sub:03d}.jsonl") for sub in range(SPILL_BUCKETS)]
    outs = [open(sub, "wb") for sub in subs]  # noqa: SIM115
    try:
        with open(path, "rb") as file:
            for line in file:
                order = int(line[1 : line.index(b",")])
                outs[(order >> shift) & 0xFF].write(line)
    finally:
        for out in outs:
            out.close()
    path.unlink()
    for sub in subs:
        yield from iter_sorted_bucket(sub, depth + 1)


class _SplitFiles:
    """The plan files being written, one per split, cut into pieces of `shard_size`.

    At most `_MAX_OPEN_SPLIT_FILES` stay open (a list file may name many splits);
    a closed one is reopened for appending.
    """

    def __init__(self, directory: Path, shard_size: int) -> None:
        self.directory = directory.resolve()
        self.shard_size = shard_size
        self.digests: dict[str, Any] = {}
        self._state: dict[str, list[int]] = {}  # split -> [offset, piece start, piece size]
        self._open: dict[str, Any] = {}
        self._pieces: list[ShardPiece] = []
        self._next_index: Counter = Counter()

    def _file(self, split: str):
        file = self._open.get(split)
        if file is None:
            if len(self._open) >= _MAX_OPEN_SPLIT_FILES:
                for other in self._open.values():
                    other.close()
                self._open.clear()
            mode = "ab" if split in self._state else "wb"
            file = self._open[split] = open(self._path(split), mode)  # noqa: SIM115
            if split not in self._state:
                self._state[split] = [0, 0, 0]
                self.digests[split] = hashlib.sha256()
        return file

    def _path(self, split: str) -> Path:
        return self.directory / f"{split}.jsonl"

    def append(
        self,
        split: str,
        key: str,
        path: str,
        rel: str,
        label: int | list[int] | None,
        fields: dict | None = None,
    ) -> None:
        record = [key, path, rel, label] if fields is None else [key, path, rel, label, fields]
        line = (json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")
        self._file(split).write(line)
        state = self._state[split]
        state[0] += len(line)
        state[2] += 1
        # Without extra columns the digest is the one plans always had, so builds resume.
        if fields is None:
            self.digests[split].update(f"{rel}\t{label}\n".encode())
        else:
            values = json.dumps(fields, ensure_ascii=False, sort_keys=True)
            self.digests[split].update(f"{rel}\t{label}\t{values}\n".encode())
        if state[2] == self.shard_size:
            self._cut(split)

    def _cut(self, split: str) -> None:
        offset, start, size = self._state[split]
        index = self._next_index[split]
        self._next_index[split] += 1
        path = str(self._path(split))
        self._pieces.append(ShardPiece(split, index, size, path, start, offset - start))
        self._state[split] = [offset, offset, 0]

    def finish(self) -> list[ShardPiece]:
        """Close the files; every piece, a split's short last one included, in plan order."""
        for file in self._open.values():
            file.close()
        self._open.clear()
        for split, state in self._state.items():
            if state[2]:
                self._cut(split)
        return sorted(self._pieces, key=_piece_order)


def _piece_order(piece: ShardPiece) -> tuple[str, int]:
    return piece.split, piece.index


def load_task(piece: ShardPiece) -> ShardTask:
    """A shard's planned inputs, read from its split's plan file.

    Raises:
        PlanError: the file does not hold the piece (changed since it was planned).
    """
    name = f"shard {piece.split}-{piece.index:06d}"
    try:
        with open(piece.path, "rb") as file:
            file.seek(piece.offset)
            data = file.read(piece.length)
        samples = tuple(_planned_sample(line) for line in data.splitlines())
    except (OSError, ValueError) as error:
        raise PlanError(
            f"{piece.path}: cannot read the plan of {name} ({error}); "
            "rerun the same command, which plans again"
        ) from error
    if len(samples) != piece.size:
        raise PlanError(
            f"{piece.path}: the plan of {name} holds {len(samples)} inputs, not "
            f"{piece.size}; rerun the same command, which plans again"
        )
    return ShardTask(piece.split, piece.index, samples)


def _planned_sample(line: bytes) -> PlannedSample:
    record = json.loads(line)
    if not (
        isinstance(record, list)
        and len(record) in (4, 5)
        and _is_label(record[3])
        and (len(record) == 4 or isinstance(record[4], dict))
    ):
        raise ValueError(f"not a plan record: {line[:80]!r}")
    return PlannedSample(*record)


def _is_label(value: object) -> bool:
    if value is None or type(value) is int:
        return True
    return type(value) is list and all(type(item) is int for item in value)


def manifest_fields(
    columns: InputColumns, image_field: str, plan: Plan, skipped: dict[tuple[str, int], set[str]]
) -> dict | None:
    """The manifest's `fields` entry of a build (None for a plain single-label one).

    Args:
        skipped: `{(split, shard index): relative paths skipped}` of every shard.
    """
    if columns.plain:
        return None
    counts = written_label_counts(plan, skipped) if columns.label == "multi" else None
    by_column = {spec.column: spec.member for spec in columns.fields}
    return fields_entry(columns.label, columns.members(image_field), by_column, counts)


def written_label_counts(plan: Plan, skipped: dict[tuple[str, int], set[str]]) -> dict:
    """Multi-label: per split, the written samples holding each class.

    The plan's counts less the skipped inputs' labels; only the pieces of shards
    with skips (`{(split, index): relative paths skipped}`) are read again.
    """
    counts = {split: list(row) for split, row in plan.class_counts.items()}
    for piece in plan.shards:
        rels = skipped.get((piece.split, piece.index))
        if not rels:
            continue
        for sample in load_task(piece).samples:
            if sample.rel in rels and isinstance(sample.label, list):
                for index in sample.label:
                    counts[piece.split][index] -= 1
    return counts


def write_plan_index(plan: Plan) -> None:
    """`plan.json`: what would be built, for `--dry-run` readers and for a look after a crash."""
    document = {
        "version": PLAN_VERSION,
        "digest": plan.digest,
        "inputs": plan.inputs,
        "shard_size": plan.shard_size,
        "classes": plan.classes,
        "splits": {
            split: {"inputs": count, "class_counts": plan.class_counts[split]}
            for split, count in plan.split_counts.items()
        },
        "shards": [
            [p.split, p.index, p.size, os.path.basename(p.path), p.offset, p.length]
            for p in plan.shards
        ],
    }
    data = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    atomic_write_bytes(Path(plan.directory) / PLAN_INDEX, data)
