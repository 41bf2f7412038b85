"""Tar and Parquet shard writers and readers: round trips, determinism, hostile tars."""

import io
import json
import subprocess
import sys
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shards.errors import ReadLimits, ShardError
from shards.parquet import ParquetShardWriter, iter_parquet_samples
from shards.sample import check_key
from shards.tar import TarShardWriter, iter_tar_samples


def make_samples(n):
    return [
        {
            "__key__": f"k{i:04d}",
            "jpg": bytes([i % 256]) * (100 + i),
            "cls": str(i % 3).encode(),
            "json": json.dumps(
                {"source": f"c/{i}.jpg", "split": "train", "width": 10, "height": 20}
            ).encode(),
        }
        for i in range(n)
    ]


def write_tar(samples):
    buffer = io.BytesIO()
    writer = TarShardWriter(buffer)
    for s in samples:
        writer.write(s)
    writer.close()
    return buffer.getvalue()


def write_parquet(samples, row_group_size=4):
    buffer = io.BytesIO()
    writer = ParquetShardWriter(buffer, "jpg", row_group_size)
    for s in samples:
        writer.write(s)
    writer.close()
    return buffer.getvalue()


def strip_url(samples):
    return [{k: v for k, v in s.items() if k != "__url__"} for s in samples]


def test_tar_round_trip_and_parquet_give_identical_samples():
    samples = make_samples(10)
    from_tar = list(iter_tar_samples(io.BytesIO(write_tar(samples)), "mem.tar"))
    from_parquet = list(iter_parquet_samples(io.BytesIO(write_parquet(samples)), "mem.parquet"))
    assert strip_url(from_tar) == samples
    assert strip_url(from_parquet) == samples
    assert from_tar[0]["__url__"] == "mem.tar"


def test_parquet_range_reads_only_the_requested_rows():
    samples = make_samples(10)
    data = write_parquet(samples, row_group_size=4)
    for start, stop in [(0, 10), (3, 9), (4, 8), (9, 10), (5, 5)]:
        got = list(iter_parquet_samples(io.BytesIO(data), "u", start, stop))
        assert strip_url(got) == samples[start:stop]


def test_writers_are_byte_deterministic():
    samples = make_samples(7)
    assert write_tar(samples) == write_tar(samples)
    assert write_parquet(samples) == write_parquet(samples)


def test_tar_members_have_fixed_metadata_and_stock_tar_reads_them(tmp_path):
    path = tmp_path / "s.tar"
    path.write_bytes(write_tar(make_samples(2)))
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == [
        "k0000.cls",
        "k0000.jpg",
        "k0000.json",
        "k0001.cls",
        "k0001.jpg",
        "k0001.json",
    ]
    assert {(m.mtime, m.uid, m.gid, m.mode) for m in members} == {(0, 0, 0, 0o444)}
    listing = subprocess.run(["tar", "tf", str(path)], capture_output=True, text=True, check=True)
    assert listing.stdout.split() == [m.name for m in members]


def tarfile_ustar(samples):
    """What `tarfile` writes for the same members: the reference our packer must match."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            for field in sorted(f for f in sample if not f.startswith("__")):
                info = tarfile.TarInfo(f"{sample['__key__']}.{field}")
                info.size, info.mtime, info.mode, info.uid, info.gid = (
                    len(sample[field]),
                    0,
                    0o444,
                    0,
                    0,
                )
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(sample[field]))
    return buffer.getvalue()


@pytest.mark.parametrize("count", [0, 1, 7, 40])
def test_tar_writer_bytes_equal_tarfile_ustar(count):
    samples = make_samples(count)
    # Keys of many lengths and payloads that end on and off block boundaries.
    for i, sample in enumerate(samples):
        sample["__key__"] = f"k{i}_" + "x" * (i * 7 % 90)
        sample["jpg"] = bytes(range(256)) * (i % 5) + b"z" * (i * 37 % 512)
    assert write_tar(samples) == tarfile_ustar(samples)


def test_long_keys_get_a_pax_header_that_every_reader_follows(tmp_path):
    import webdataset as wds

    key = "a" * 128  # the longest valid key: past ustar's 100-byte name field
    path = tmp_path / "long.tar"
    path.write_bytes(write_tar([{"__key__": key, "jpg": b"xyz", "cls": b"1"}]))
    with tarfile.open(path) as tar:
        assert tar.getnames() == [f"{key}.cls", f"{key}.jpg"]
    ours = list(iter_tar_samples(io.BytesIO(path.read_bytes()), "long.tar"))
    assert [(s["__key__"], s["jpg"], s["cls"]) for s in ours] == [(key, b"xyz", b"1")]
    stock = list(wds.WebDataset(str(path), shardshuffle=False))
    assert [(s["__key__"], s["jpg"]) for s in stock] == [(key, b"xyz")]


def test_parquet_row_groups_and_typed_metadata_columns():
    data = write_parquet(make_samples(10), row_group_size=4)
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [4, 4, 2]
    table = pq.read_table(io.BytesIO(data))
    assert table.column("width").to_pylist() == [10] * 10
    assert table.column("cls").to_pylist()[:4] == [0, 1, 2, 0]
    assert table.schema.field("jpg").type == pa.struct(
        [("bytes", pa.binary()), ("path", pa.string())]
    )


def test_invalid_keys_are_refused():
    for bad in ("a.b", "a/b", "", "x" * 200, "a b"):
        with pytest.raises(ValueError):
            check_key(bad)
    with pytest.raises(ValueError):
        TarShardWriter(io.BytesIO()).write({"__key__": "a.b", "jpg": b"x"})


def tar_with(entries):
    """entries: (name, bytes data) or (name, ("type", tarfile type)) for hostile tars."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, payload in entries:
            info = tarfile.TarInfo(name)
            if isinstance(payload, bytes):
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            else:
                info.type = payload[1]
                info.linkname = "/etc/passwd"
                tar.addfile(info)
    return buffer.getvalue()


def test_reader_ignores_links_devices_and_unlisted_fields():
    data = tar_with(
        [
            ("a.jpg", b"img"),
            ("a.cls", b"1"),
            ("a.pkl", b"cos\nsystem\n(S'touch /tmp/x'\ntR."),
            ("a.pth", b"x"),
            ("a.jpg.gz", b"gz"),
            ("b.jpg", ("type", tarfile.SYMTYPE)),
            ("c.jpg", ("type", tarfile.CHRTYPE)),
            ("d.jpg", b"img2"),
        ]
    )
    samples = list(iter_tar_samples(io.BytesIO(data), "u"))
    assert [s["__key__"] for s in samples] == ["a", "d"]
    assert set(samples[0]) == {"__key__", "__url__", "jpg", "cls"}


def test_reader_rejects_non_adjacent_and_duplicate_members():
    with pytest.raises(ShardError) as info:
        list(
            iter_tar_samples(
                io.BytesIO(tar_with([("a.jpg", b"1"), ("b.jpg", b"2"), ("a.cls", b"3")])), "u"
            )
        )
    assert info.value.reason == "non_adjacent_key"
    with pytest.raises(ShardError) as info:
        list(iter_tar_samples(io.BytesIO(tar_with([("a.jpg", b"1"), ("a.jpg", b"2")])), "u"))
    assert info.value.reason == "duplicate_field"


def test_oversized_member_skips_only_that_sample():
    data = tar_with([("a.jpg", b"x" * 5000), ("a.cls", b"1"), ("b.jpg", b"y"), ("b.cls", b"2")])
    samples = list(iter_tar_samples(io.BytesIO(data), "u", limits=ReadLimits(member_bytes=1000)))
    assert samples[0]["__error__"].reason == "member_too_large"
    assert "jpg" not in samples[0]
    assert samples[1]["jpg"] == b"y" and "__error__" not in samples[1]


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.93, 0.999])
def test_truncated_tar_never_yields_a_partial_sample(fraction):
    samples = make_samples(6)
    data = write_tar(samples)
    end_of_members = len(data.rstrip(b"\0"))
    cut = data[: int(end_of_members * fraction)]
    seen = []
    with pytest.raises(ShardError):
        for sample in iter_tar_samples(io.BytesIO(cut), "u"):
            seen.append(sample)
    # Everything yielded is complete and equal to what was written.
    assert strip_url(seen) == samples[: len(seen)]


def test_shards_imports_neither_torch_nor_ray():
    code = (
        "import sys, shards.tar, shards.parquet, shards.manifest, shards.storage.write, shards.sample;"
        "bad = [m for m in ('torch', 'ray') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_tar_cut_at_a_member_boundary_is_still_truncated():
    samples = make_samples(3)
    data = write_tar(samples[:2])
    complete = write_tar(samples)
    boundary = len(data.rstrip(b"\0"))
    boundary += -boundary % 512
    with pytest.raises(ShardError):
        list(iter_tar_samples(io.BytesIO(complete[:boundary]), "u"))


@pytest.mark.parametrize("payload", [b"", b"<html>not a tar</html>" * 40, bytes(range(256)) * 4])
def test_garbage_and_empty_streams_are_not_tars(payload):
    with pytest.raises(ShardError):
        list(iter_tar_samples(io.BytesIO(payload), "u"))


def test_negative_size_header_is_rejected_not_looped():
    header = bytearray(tarfile.TarInfo("a.jpg").tobuf(format=tarfile.USTAR_FORMAT))
    header[124:136] = b"\xff" + b"\xff" * 11  # base-256 with the sign bit set
    header[148:156] = b" " * 8
    checksum = sum(header[:512])
    header[148:156] = b"%06o\0 " % checksum
    with pytest.raises(ShardError):
        list(iter_tar_samples(io.BytesIO(bytes(header) + b"\0" * 1024), "u"))


def test_stock_tarfile_reads_gnu_long_names_through_our_reader():
    buffer = io.BytesIO()
    long_key = "d" * 150
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo(f"{long_key}.jpg")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    samples = list(iter_tar_samples(io.BytesIO(buffer.getvalue()), "u"))
    assert samples[0]["__key__"] == long_key and samples[0]["jpg"] == b"abc"


@pytest.mark.parametrize("seekable", [True, False])
def test_tar_reader_can_start_mid_shard(seekable):
    samples = make_samples(9)
    data = write_tar(samples)

    class Unseekable(io.BytesIO):
        def seekable(self):
            return False

    stream = io.BytesIO(data) if seekable else Unseekable(data)
    assert strip_url(list(iter_tar_samples(stream, "u", start=4))) == samples[4:]
    assert list(iter_tar_samples(io.BytesIO(data), "u", start=9)) == []
    with pytest.raises(ShardError):  # truncation inside skipped data still shows
        list(iter_tar_samples(io.BytesIO(data[: len(data.rstrip(b"\0")) - 300]), "u", start=7))


def test_header_checksum_is_the_byte_sum_even_at_the_extremes():
    from shards.tar import header_checksum

    # All-0xFF is the largest sum each Adler-32 piece must hold exactly.
    for header in (bytes(512), b"\xff" * 512, bytes(range(256)) * 2):
        assert header_checksum(header) == sum(header[:148]) + 8 * 32 + sum(header[156:])


def test_readers_leave_out_fields_not_asked_for():
    samples = make_samples(6)
    wanted = frozenset({"jpg", "cls"})
    from_tar = list(iter_tar_samples(io.BytesIO(write_tar(samples)), "m.tar", fields=wanted))
    from_parquet = list(
        iter_parquet_samples(io.BytesIO(write_parquet(samples)), "m.parquet", fields=wanted)
    )
    expected = [{k: s[k] for k in ("__key__", "jpg", "cls")} for s in samples]
    assert strip_url(from_tar) == expected
    assert strip_url(from_parquet) == expected
