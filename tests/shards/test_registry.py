"""The format registry: one place that knows the formats, one reader contract for both."""

from __future__ import annotations

import io
import json
import re
import subprocess
from pathlib import Path

import pytest

from shards.formats import FORMATS, PARQUET, TAR, format_of_url, get_format

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_both_formats_follow_one_contract(fmt):
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
    tracked = subprocess.run(
        ["git", "ls-files", "pipeline", "preprocess", "trainers"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    pattern = re.compile(r"""(fmt|format|kind)\w* ?[!=]= ?["'](tar|parquet)["']""")
    offenders = [
        f"{name}:{number}"
        for name in tracked
        if name.endswith(".py")
        for number, line in enumerate((ROOT / name).read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
