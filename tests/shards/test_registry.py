"""The format registry: one place that knows the formats, one reader contract for all.

A third format is its module and one registry entry: `JSONL` below, a toy format defined
here and registered by the test that uses it, is built, verified and read by the loader
through the code paths tar and Parquet take.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import io
import json
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from preprocess.job import run_build
from preprocess.verify import verify_source
from shards.errors import DEFAULT_LIMITS, ShardError
from shards.formats import (
    DEFAULT_FORMAT,
    FORMATS,
    PARQUET,
    TAR,
    ShardFormat,
    format_of_url,
    get_format,
)
from shards.manifest import read_manifest
from shards.manifest.foreign import survey_fields
from shards.redact import redact_url
from shards.sample import ALLOWED_FIELDS
from tests.conftest import small_build_config
from tests.pipeline.conftest import loader_for

ROOT = Path(__file__).resolve().parents[2]


# A toy format: one JSON line a sample, `{"key": ..., "members": {name: base64}}`. ------


class JsonlWriter:
    def __init__(self, fileobj, image_field, row_group_size, **dataset):
        self.fileobj, self.count = fileobj, 0

    def write(self, sample):
        self.fileobj.write(jsonl_line(sample))
        self.count += 1

    def close(self):
        self.fileobj.flush()


def jsonl_line(sample) -> bytes:
    members = {
        name: base64.b64encode(data).decode()
        for name, data in sorted(sample.items())
        if not name.startswith("__")
    }
    return json.dumps({"key": sample["__key__"], "members": members}).encode() + b"\n"


def iter_jsonl_lines(stream, url, limits):
    while line := stream.readline(limits.member_bytes):
        try:
            yield json.loads(line)
        except ValueError as error:
            raise ShardError("bad_record", url, f"not a JSON line: {error}") from error


def iter_jsonl_samples(
    stream, url, start=0, stop=None, *, fields=ALLOWED_FIELDS, limits=DEFAULT_LIMITS, declared=None
):
    end = declared if stop is None else stop
    index = -1
    for index, record in enumerate(iter_jsonl_lines(stream, url, limits)):
        if end is not None and index == end:
            if stop is None:  # reading to `declared`: one more sample is a lying manifest
                raise ShardError("shard_long", url, f"more than the {declared} declared")
            return
        if index >= start:
            sample = {"__key__": record["key"], "__url__": redact_url(url)}
            for name, text in record["members"].items():
                if name in fields:
                    sample[name] = base64.b64decode(text)
            yield sample
    if end is not None and index + 1 < end:
        raise ShardError("shard_short", url, f"{index + 1} samples, {end} expected")


def count_jsonl_samples(stream, url, limits=DEFAULT_LIMITS):
    return sum(1 for _ in iter_jsonl_lines(stream, url, limits))


def jsonl_members(stream, url, limits=DEFAULT_LIMITS):
    record = next(iter_jsonl_lines(stream, url, limits), {"members": {}})
    return tuple(record["members"])


JSONL = ShardFormat(
    name="jsonl",
    suffix=".jsonl",
    random_access=False,
    columnar=False,
    schema=False,
    min_sample_bytes=len(b'{"key": "", "members": {}}\n'),
    open_writer=JsonlWriter,
    iter_samples=iter_jsonl_samples,
    count_samples=count_jsonl_samples,
    list_members=jsonl_members,
    sample_bytes=lambda sample: len(jsonl_line(sample)),
)


@pytest.fixture
def jsonl(monkeypatch):
    """The toy format, registered: its one registry entry, for this test only."""
    monkeypatch.setitem(FORMATS, JSONL.name, JSONL)
    return JSONL


def make_samples(count: int) -> list[dict]:
    return [
        {
            "__key__": f"k{i:04d}",
            "jpg": bytes([i % 251]) * (100 + 37 * i),
            "cls": str(i % 3).encode(),
            "json": json.dumps({"source": f"s{i}", "split": "train"}).encode(),
        }
        for i in range(count)
    ]


def write_shard(fmt, samples) -> bytes:
    buffer = io.BytesIO()
    writer = fmt.open_writer(buffer, "jpg", 4)
    for sample in samples:
        writer.write(sample)
    writer.close()
    return buffer.getvalue()


def library_files(*packages: str) -> list[str]:
    """The Python files git tracks in `packages`."""
    listed = subprocess.run(
        ["git", "ls-files", *packages], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return [name for name in listed.stdout.split() if name.endswith(".py")]


def test_get_format_names_the_known_ones():
    assert get_format("tar") is TAR and get_format("parquet") is PARQUET
    with pytest.raises(ValueError, match="known formats: tar, parquet"):
        get_format("zip")


def test_tar_sample_bytes_is_what_the_writer_adds():
    samples = make_samples(3) + [{"__key__": "x" * 120, "jpg": b"y" * 513, "cls": b"1"}]
    sizes = [len(write_shard(TAR, samples[: n + 1])) for n in range(len(samples))]
    # The writer pads the archive's end to 10 KiB records; compare without that padding.
    body = io.BytesIO()
    writer = TAR.open_writer(body, "jpg", 0)
    for sample in samples:
        before = body.tell()
        writer.write(sample)
        assert body.tell() - before == TAR.sample_bytes(sample)
    assert sizes[-1] >= body.tell()


@pytest.mark.parametrize("fmt", [*FORMATS.values(), JSONL], ids=[*FORMATS, JSONL.name])
def test_every_format_follows_one_contract(fmt):
    samples = make_samples(11)
    data = write_shard(fmt, samples)
    fields = frozenset({"jpg", "cls"})
    read = list(fmt.iter_samples(io.BytesIO(data), "mem.x", fields=fields, declared=11))
    assert [s["__key__"] for s in read] == [s["__key__"] for s in samples]
    assert all(
        r["jpg"] == s["jpg"] and r["cls"] == s["cls"] for r, s in zip(read, samples, strict=True)
    )
    assert all("json" not in r for r in read)
    assert fmt.count_samples(io.BytesIO(data), "mem.x") == 11
    keys = [s["__key__"] for s in fmt.iter_samples(io.BytesIO(data), "m", fields=frozenset())]
    assert keys == [s["__key__"] for s in samples]
    windows = [
        s["__key__"]
        for start, stop in ((0, 4), (4, 5), (5, 11))
        for s in fmt.iter_samples(io.BytesIO(data), "m", start, stop, fields=fields, declared=11)
    ]
    assert windows == keys


def test_format_of_url_ignores_queries():
    assert format_of_url("https://h/a.parquet?X-Amz-Signature=x.tar") is PARQUET
    assert format_of_url("/d/A.TAR") is TAR


def test_no_format_dispatch_outside_shards():
    """One registry: code outside shards/ never branches on a format's name."""
    tracked = library_files("pipeline", "preprocess", "trainers")
    pattern = re.compile(r"""(fmt|format|kind)\w* ?[!=]= ?["'](tar|parquet)["']""")
    offenders = [
        f"{name}:{number}"
        for name in tracked
        if name.endswith(".py")
        for number, line in enumerate((ROOT / name).read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


def test_a_registered_format_is_known_by_name_and_suffix(jsonl):
    assert get_format("jsonl") is jsonl and format_of_url("s3://b/train-000000.jsonl") is jsonl
    with pytest.raises(ValueError, match="known formats: tar, parquet, jsonl"):
        get_format("zip")


def test_a_registered_format_is_built_verified_and_read_by_the_loader(jsonl, sample_dir, tmp_path):
    """Written, recorded in the manifest, verified and streamed with no code of its own
    outside this file: the same keys and labels as the tar shards of the same build."""
    out = tmp_path / "out"
    run_build(small_build_config(sample_dir, out, formats=("tar", "jsonl"), val_fraction=0))
    manifest = read_manifest(out)
    assert manifest.formats == ["tar", "jsonl"]
    assert sorted(p.name for p in (out / "jsonl").iterdir())[0] == "train-000000.jsonl"
    report = verify_source(str(out))  # checksums, counts, both formats agree, images decode
    assert report.samples == sum(split.samples for split in manifest.splits.values())
    assert report.files == 2 * report.shards and not report.skipped

    def epoch(fmt):
        return [
            (key, int(label))
            for _, labels, keys in loader_for(out, format=fmt, seed=5)
            for key, label in zip(keys, labels, strict=True)
        ]

    read = epoch("jsonl")
    assert read == epoch("tar") and len(read) == report.samples // 8 * 8
    assert Counter(label for _, label in read).keys() == {0, 1, 2, 3}


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of a module's tree."""
    owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, owners)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def test_formats_are_named_only_in_the_registry():
    """`DEFAULT_FORMAT` is the one default and `FORMATS` the one list: no code outside
    shards/formats.py names a format by a string of its own (a default, a list, a test)."""
    tracked = library_files("shards", "pipeline", "preprocess", "trainers")
    offenders = []
    for name in tracked:
        if not name.endswith(".py") or name == "shards/formats.py":
            continue
        tree = ast.parse((ROOT / name).read_text())
        skip = docstrings(tree)
        offenders += [
            f"{name}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in FORMATS and id(node) not in skip
        ]
    assert offenders == []
    assert TAR.name == DEFAULT_FORMAT


def test_a_survey_asks_by_schema_not_by_seeking():
    """A seekable format without a schema is surveyed as tar is: every member asked for,
    whatever its first sample holds (`random_access` once stood for "is Parquet")."""
    seekable = dataclasses.replace(JSONL, random_access=True)
    first_without_label = [
        {"__key__": "a", "jpg": b"x"},
        {"__key__": "b", "jpg": b"y", "cls": b"1"},
    ]
    stream = io.BytesIO(b"".join(jsonl_line(sample) for sample in first_without_label))
    assert survey_fields(seekable, stream, "m.jsonl") == ALLOWED_FIELDS
