"""Hostile Parquet shards: each one costs a counted skip or a ShardError naming it, never the job.

Every file here is a real Parquet file made with pyarrow, broken on purpose.
"""

import errno
import io
import json
import os
import random
import re
import string
import subprocess
import sys
import textwrap
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shards.errors import MemberCap, ReadLimits, ShardError
from shards.formats import PARQUET, TAR
from shards.parquet import ParquetShardWriter, count_parquet_samples, iter_parquet_samples
from shards.sample import check_key

pytestmark = pytest.mark.timeout(60)

SECRET_URL = "https://alice:hunter2@store.example/data/s-0001.parquet?X-Amz-Signature=deadbeef"


def make_samples(n, size=100):
    return [
        {
            "__key__": f"k{i:04d}",
            "jpg": bytes([i % 256]) * (size + i),
            "cls": str(i % 3).encode(),
            "json": json.dumps({"source": f"c/{i}.jpg", "split": "train"}).encode(),
        }
        for i in range(n)
    ]


def write_shard(samples, row_group_size=4):
    buffer = io.BytesIO()
    writer = ParquetShardWriter(buffer, "jpg", row_group_size)
    for sample in samples:
        writer.write(sample)
    writer.close()
    return buffer.getvalue()


def write_table(columns, row_group_size=None):
    """A Parquet file of `columns` ({name: pa.Array or list}), outside our writer's schema."""
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer, row_group_size=row_group_size)
    return buffer.getvalue()


def read(data, url="mem.parquet", *args, **kwargs):
    return list(iter_parquet_samples(io.BytesIO(data), url, *args, **kwargs))


def read_until_error(data, url="mem.parquet", *args, **kwargs):
    """The samples yielded before the reader raised ShardError, and that error."""
    got = []
    with pytest.raises(ShardError) as info:
        for sample in iter_parquet_samples(io.BytesIO(data), url, *args, **kwargs):
            got.append(sample)
    return got, info.value


def keys(samples):
    return [s["__key__"] for s in samples]


def column_range(data, group, name):
    """(start, end) of one column chunk's bytes in the file, from the footer of a good file."""
    meta = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(group)
    chunk = next(
        meta.column(i)
        for i in range(meta.num_columns)
        if meta.column(i).path_in_schema in (name, f"{name}.bytes")
    )
    start = chunk.data_page_offset
    if chunk.has_dictionary_page and chunk.dictionary_page_offset is not None:
        start = min(start, chunk.dictionary_page_offset)
    return start, start + chunk.total_compressed_size


def corrupt_column(data, group, name):
    """`data` with the page header of one column chunk overwritten with garbage."""
    start, _ = column_range(data, group, name)
    return data[:start] + b"\xff" * 16 + data[start + 16 :]


class LinkDown(OSError):
    """What a network stream raises mid-read (like shards.storage.ShardReadError)."""


class FailingStream(io.RawIOBase):
    """A seekable in-memory shard whose reads touching bytes `[fail_lo, fail_hi)` raise `error`."""

    def __init__(self, data, error, fail_lo=0, fail_hi=None):
        self._data = io.BytesIO(data)
        self.error = error
        self.fail = (fail_lo, len(data) if fail_hi is None else fail_hi)
        self.ranges = []

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        return self._data.seek(offset, whence)

    def tell(self):
        return self._data.tell()

    def read(self, size=-1):
        position = self._data.tell()
        end = position + max(size, 0)
        if position < self.fail[1] and end > self.fail[0]:
            raise self.error
        self.ranges.append((position, end))
        return self._data.read(size)


# --- Opening: not Parquet, cut short, corrupt footer -----------------------------------------


def test_truncated_file_is_a_shard_error_naming_the_shard():
    data = write_shard(make_samples(10))
    for cut in (len(data) // 2, len(data) - 1, 7):
        _, error = read_until_error(data[:cut], "s-0001.parquet")
        assert error.reason == "not_parquet"
        assert "s-0001.parquet" in str(error) and "preprocess build-shards" in str(error)


def test_garbage_and_empty_files_are_not_parquet():
    for data in (b"garbage!" * 200, b"", b"PAR1" + b"\0" * 100 + b"PAR1"):
        _, error = read_until_error(data, "junk.parquet")
        assert error.reason in ("not_parquet", "bad_footer")
        assert "junk.parquet" in str(error)
    with pytest.raises(ShardError, match="junk.parquet: not_parquet"):
        count_parquet_samples(io.BytesIO(b"garbage!" * 200), "junk.parquet")


def test_corrupt_footer_length_is_bad_footer():
    data = write_shard(make_samples(10))
    # Keep the magic, claim a footer 3 bytes long.
    broken = data[:-8] + (3).to_bytes(4, "little") + b"PAR1"
    _, error = read_until_error(broken)
    assert error.reason == "bad_footer" and "mem.parquet" in str(error)


def test_every_single_byte_flip_of_the_footer_reads_or_raises_shard_error():
    # In a child process: some flips (a size-statistics histogram of the wrong length)
    # make pyarrow's metadata objects abort the process, which the reader must avoid.
    script = textwrap.dedent(
        """
        import collections, io, json, sys
        from shards.errors import ShardError
        from shards.parquet import ParquetShardWriter, iter_parquet_samples
        buffer = io.BytesIO()
        writer = ParquetShardWriter(buffer, "jpg", 4)
        for i in range(10):
            meta = json.dumps({"source": f"c/{i}.jpg", "split": "train", "width": 3})
            writer.write({"__key__": f"k{i}", "jpg": b"x" * 50, "cls": b"1", "json": meta.encode()})
        writer.close()
        data = buffer.getvalue()
        footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
        outcomes = collections.Counter()
        for position in range(footer, len(data)):
            for mask in (0x01, 0xFF):
                mutant = bytearray(data)
                mutant[position] ^= mask
                try:
                    for sample in iter_parquet_samples(io.BytesIO(bytes(mutant)), "m.parquet"):
                        assert isinstance(sample["__key__"], str)
                    outcomes["read"] += 1
                except ShardError as error:
                    assert "m.parquet" in str(error), error
                    outcomes[error.reason] += 1
        print(json.dumps(outcomes))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr[-2000:]
    outcomes = json.loads(done.stdout)
    assert set(outcomes) <= {"read", "bad_footer", "not_parquet", "bad_data", "schema"}
    assert outcomes["bad_footer"] > 100 and outcomes["read"] > 100


def test_column_names_that_are_not_utf8_are_bad_footer():
    data = write_shard(make_samples(4))
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    name_at = data.index(b"source", footer)  # the schema comes first in the footer
    _, error = read_until_error(data[:name_at] + b"\xa0" + data[name_at + 1 :])
    assert error.reason == "bad_footer"


# --- Schema checked before any row is read ---------------------------------------------------


def test_missing_cls_is_a_schema_error_naming_it_unless_cls_is_not_asked_for():
    data = write_table({"__key__": ["a", "b"], "jpg": [b"1", b"2"]})
    _, error = read_until_error(data)
    assert error.reason == "schema" and "'cls'" in str(error)
    assert keys(read(data, fields=frozenset({"jpg"}))) == ["a", "b"]


def test_a_key_that_is_not_text_is_a_schema_error_naming_it():
    # A missing __key__ is read (keys are made from the row); a wrong one is refused.
    _, error = read_until_error(write_table({"__key__": [1], "jpg": [b"1"], "cls": [1]}))
    assert error.reason == "schema" and "'__key__'" in str(error)


def test_image_column_typed_string_is_a_schema_error_naming_column_and_type():
    _, error = read_until_error(write_table({"__key__": ["a"], "jpg": ["text"], "cls": [1]}))
    assert error.reason == "schema" and "'jpg' is string, not binary" in str(error)


def test_no_image_column_is_a_schema_error():
    _, error = read_until_error(write_table({"__key__": ["a"], "gif": [b"x"], "cls": [1]}))
    assert error.reason == "schema" and "image column" in str(error)


def test_two_image_columns_are_a_schema_error():
    data = write_table({"__key__": ["a"], "jpg": [b"x"], "png": [b"y"], "cls": [1]})
    _, error = read_until_error(data)
    assert error.reason == "schema" and "jpg" in str(error) and "png" in str(error)


def test_mistyped_cls_and_json_are_schema_errors_naming_them():
    data = write_table({"__key__": ["a"], "jpg": [b"x"], "cls": ["three"]})
    _, error = read_until_error(data)
    assert error.reason == "schema" and "'cls' is string, not an integer" in str(error)
    data = write_table({"__key__": ["a"], "jpg": [b"x"], "cls": [1], "json": [7]})
    _, error = read_until_error(data)
    assert error.reason == "schema" and "'json'" in str(error)
    # json is not asked for: its type does not matter.
    assert keys(read(data, fields=frozenset({"jpg", "cls"}))) == ["a"]


def test_large_types_and_a_missing_json_column_are_accepted():
    data = write_table(
        {
            "__key__": pa.array(["a", "b"], pa.large_string()),
            "png": pa.array([b"1", b"2"], pa.large_binary()),
            "cls": pa.array([1, 2], pa.int8()),
        }
    )
    got = read(data)
    assert [(s["__key__"], s["png"], s["cls"]) for s in got] == [
        ("a", b"1", b"1"),
        ("b", b"2", b"2"),
    ]
    assert all("json" not in s and "__error__" not in s for s in got)


# --- Per-sample problems: counted skips, the other rows delivered ----------------------------


def test_null_cells_are_counted_skips_and_other_rows_are_delivered():
    data = write_table(
        {
            "__key__": ["a", "b", "c", None, "e", "f"],
            "jpg": [b"A", None, b"C", b"D", b"E", b"F"],
            "cls": [0, 1, 2, 3, None, 5],
            "json": ["{}", "{}", "{}", "{}", "{}", None],
        },
        row_group_size=4,
    )
    got = read(data)
    assert len(got) == 6
    errors = {i: s["__error__"] for i, s in enumerate(got) if "__error__" in s}
    assert sorted(errors) == [1, 3, 4]
    assert all(error.reason == "null_cell" for error in errors.values())
    assert "'jpg'" in str(errors[1]) and "'__key__'" in str(errors[3]) and "'cls'" in str(errors[4])
    good = [s for s in got if "__error__" not in s]
    assert [(s["__key__"], s["jpg"], s["cls"]) for s in good] == [
        ("a", b"A", b"0"),
        ("c", b"C", b"2"),
        ("f", b"F", b"5"),
    ]
    assert "json" not in good[-1]  # a null json cell is a sample without json


def test_key_that_is_not_utf8_is_a_counted_skip():
    raw = [b"ok", b"\xff\xfe"]
    offsets = pa.array([0, 2, 4], pa.int32()).buffers()[1]
    key = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"".join(raw))])
    got = read(write_table({"__key__": key, "jpg": [b"1", b"2"], "cls": [1, 2]}))
    assert "__error__" not in got[0] and got[0]["__key__"] == "ok"
    assert got[1]["__error__"].reason == "bad_name"
    assert got[1]["__key__"] == "\\xff\\xfe"


def test_odd_keys_and_labels_are_passed_on_for_the_loader_to_judge():
    data = write_table({"__key__": ["a.b/c", "x"], "jpg": [b"1", b"2"], "cls": [-3, 2**40]})
    got = read(data)
    assert [(s["__key__"], s["cls"]) for s in got] == [("a.b/c", b"-3"), ("x", b"1099511627776")]
    assert not any("__error__" in s for s in got)


def test_cell_over_member_bytes_is_a_counted_skip_and_its_neighbours_survive():
    samples = make_samples(8, size=100)  # image i is 100 + i bytes
    limits = ReadLimits(member_bytes=104)
    got = read(write_shard(samples), limits=limits)
    assert keys(got) == keys(samples)
    skipped = [i for i, s in enumerate(got) if "__error__" in s]
    assert skipped == [5, 6, 7]
    assert all(got[i]["__error__"].reason == "member_too_large" for i in skipped)
    assert all("jpg" not in got[i] for i in skipped)
    assert "105 bytes, over the 104-byte cap" in str(got[5]["__error__"])
    assert [s["jpg"] for s in got[:5]] == [s["jpg"] for s in samples[:5]]


# --- Row group caps --------------------------------------------------------------------------


def test_row_group_over_the_cap_is_refused_with_a_rebuild_hint_that_works():
    samples = make_samples(32, size=1000)
    limits = ReadLimits(row_group_bytes=8000)
    _, error = read_until_error(write_shard(samples, row_group_size=16), limits=limits)
    assert error.reason == "row_group_too_large" and "--row-group-size" in str(error)
    suggested = int(re.search(r"--row-group-size (\d+)", str(error)).group(1))
    assert 1 <= suggested < 16
    rebuilt = write_shard(samples, row_group_size=suggested)
    assert keys(read(rebuilt, limits=limits)) == keys(samples)
    assert count_parquet_samples(io.BytesIO(rebuilt), "r.parquet", limits) == 32
    with pytest.raises(ShardError, match="row_group_too_large"):
        count_parquet_samples(io.BytesIO(write_shard(samples, 16)), "r.parquet", limits)


def _varint(value, width):
    """`value` as a thrift varint padded to exactly `width` bytes (readers accept padding)."""
    return bytes(((value >> 7 * i) & 0x7F) | (0x80 if i < width - 1 else 0) for i in range(width))


def test_row_group_whose_footer_understates_its_size_is_refused_while_reading():
    data = write_shard(make_samples(8, size=2000), row_group_size=8)
    true_size = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0).total_byte_size
    # RowGroup.total_byte_size: field 2, an i64 (header 0x16), a zigzag varint.
    width = 1
    while (true_size * 2) >> (7 * width):
        width += 1
    old = b"\x16" + _varint(true_size * 2, width)
    assert data.count(old) == 1
    lying = data.replace(old, b"\x16" + _varint(100 * 2, width))
    assert pq.ParquetFile(io.BytesIO(lying)).metadata.row_group(0).total_byte_size == 100
    got, error = read_until_error(lying, limits=ReadLimits(row_group_bytes=8000))
    assert got == [] and error.reason == "row_group_too_large"


# --- Declared counts, windows ----------------------------------------------------------------


def test_shard_shorter_than_declared_yields_its_rows_then_shard_short():
    samples = make_samples(10)
    got, error = read_until_error(write_shard(samples), declared=12)
    assert keys(got) == keys(samples)
    assert (
        error.reason == "shard_short" and "12" in str(error) and "preprocess verify" in str(error)
    )
    # A window that ends before the shard does is not short.
    assert keys(read(write_shard(samples), "u", 0, 8, declared=12)) == keys(samples[:8])


def test_window_past_the_end_without_a_declared_count_is_shard_short():
    got, error = read_until_error(write_shard(make_samples(10)), "u", 6, 14)
    assert keys(got) == keys(make_samples(10)[6:]) and error.reason == "shard_short"


def test_shard_longer_than_declared_stops_at_declared_and_never_reads_the_rest():
    samples = make_samples(10)
    data = write_shard(samples, row_group_size=4)
    # The third row group (rows 8-9) is garbage: reading it would be bad_data.
    data = corrupt_column(data, 2, "jpg")
    assert read_until_error(data)[1].reason == "bad_data"
    got, error = read_until_error(data, declared=6)
    assert keys(got) == keys(samples[:6])
    assert error.reason == "shard_long" and "preprocess verify" in str(error)
    assert "4 extra rows" in str(error)
    # Pieces that end before the declared count see nothing wrong.
    assert keys(read(data, "u", 0, 3, declared=6)) == keys(samples[:3])


def test_windows_cover_every_row_exactly_once():
    samples = make_samples(11)
    data = write_shard(samples, row_group_size=4)
    for start in range(12):
        for stop in range(start, 12):
            got = read(data, "u", start, stop, declared=11)
            assert keys(got) == keys(samples[start:stop]), (start, stop)
    for cuts in ([0, 11], [0, 3, 4, 8, 11], [0, 1, 2, 5, 9, 10, 11]):
        pieces = [read(data, "u", a, b, declared=11) for a, b in zip(cuts, cuts[1:], strict=False)]
        assert [k for piece in pieces for k in keys(piece)] == keys(samples)


def test_window_outside_the_declared_count_is_a_caller_bug():
    data = write_shard(make_samples(4))
    for start, stop, declared in ((-1, 2, None), (3, 2, None), (0, 5, 4)):
        with pytest.raises(ValueError):
            read(data, "u", start, stop, declared=declared)


# --- Columns read ----------------------------------------------------------------------------


def test_fields_choose_the_columns_and_an_unasked_image_column_is_never_read():
    samples = make_samples(8)
    data = write_shard(samples, row_group_size=4)
    broken = corrupt_column(corrupt_column(data, 0, "jpg"), 1, "jpg")
    assert read_until_error(broken)[1].reason == "bad_data"
    labels = read(broken, fields=frozenset({"cls"}))
    assert [(s["__key__"], s["cls"]) for s in labels] == [(s["__key__"], s["cls"]) for s in samples]
    assert all(set(s) == {"__key__", "__url__", "cls"} for s in labels)
    listed = read(broken, fields=frozenset())
    assert keys(listed) == keys(samples) and all(set(s) == {"__key__", "__url__"} for s in listed)
    # And the image bytes were not even fetched (pyarrow's first read takes the file's
    # last 64 KiB, so look at the first row group of a bigger shard).
    data = write_shard(make_samples(8, size=30_000), row_group_size=4)
    stream = FailingStream(
        data, LinkDown("the image column was read"), *column_range(data, 0, "jpg")
    )
    assert len(list(iter_parquet_samples(stream, "u", fields=frozenset({"cls"})))) == 8


# --- Stream failures are I/O, not bad shards -------------------------------------------------


def test_stream_oserror_mid_read_propagates_as_that_oserror():
    samples = make_samples(12, size=30_000)
    data = write_shard(samples, row_group_size=4)
    failure = LinkDown(errno.ECONNRESET, "connection reset by peer")
    # The second row group's images lie before the last 64 KiB that opening reads.
    stream = FailingStream(data, failure, *column_range(data, 1, "jpg"))
    got = []
    with pytest.raises(LinkDown) as info:
        for sample in iter_parquet_samples(stream, SECRET_URL):
            got.append(sample)
    assert info.value is failure
    assert keys(got) == keys(samples[:4])


def test_stream_oserror_while_opening_propagates_as_that_oserror():
    data = write_shard(make_samples(4))
    for failure in (LinkDown("gone"), OSError(errno.EIO, "Input/output error"), TimeoutError()):
        with pytest.raises(OSError) as info:
            list(iter_parquet_samples(FailingStream(data, failure), "u"))
        assert info.value is failure
        with pytest.raises(OSError) as info:
            count_parquet_samples(FailingStream(data, failure), "u")
        assert info.value is failure


def test_missing_local_file_is_an_oserror_and_a_path_reads_like_a_stream(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(iter_parquet_samples(tmp_path / "absent.parquet", "absent.parquet"))
    path = tmp_path / "s.parquet"
    path.write_bytes(write_shard(make_samples(6)))
    assert keys(iter_parquet_samples(str(path), str(path))) == keys(make_samples(6))
    assert count_parquet_samples(path, str(path)) == 6


# --- Secrets ---------------------------------------------------------------------------------


def test_credentials_in_the_url_reach_no_message_and_no_url_field():
    data = write_table({"__key__": ["a", "b"], "jpg": [b"1", None], "cls": [1, 2]})
    got, error = read_until_error(data, SECRET_URL, declared=3)
    texts = [str(error), error.url, *(s["__url__"] for s in got), str(got[1]["__error__"])]
    for garbage in (b"junk" * 100, write_table({"__key__": ["a"], "jpg": ["s"], "cls": [1]})):
        texts.append(str(read_until_error(garbage, SECRET_URL)[1]))
    assert error.reason == "shard_short" and got[1]["__error__"].reason == "null_cell"
    for text in texts:
        assert "hunter2" not in text and "deadbeef" not in text and "alice" not in text
        assert "store.example/data/s-0001.parquet" in text


# --- Memory ----------------------------------------------------------------------------------


def test_reading_a_big_row_group_holds_under_two_copies_of_it(tmp_path):
    # 96 rows of 1 MiB in one row group; the old reader peaked at ~3x the group.
    path = tmp_path / "big.parquet"
    blob = bytes(range(256)) * 4096 * 2
    group = 96
    with open(path, "wb") as file:
        writer = ParquetShardWriter(file, "jpg", group)
        for i in range(group):
            sample = make_samples(1)[0] | {"__key__": f"k{i:04d}"}
            writer.write(sample | {"jpg": blob[i : i + 2**20]})
        writer.close()
    script = textwrap.dedent(
        f"""
        import resource
        from shards.parquet import iter_parquet_samples
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with open({str(path)!r}, "rb") as file:
            count = sum(1 for _ in iter_parquet_samples(file, "big.parquet"))
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(count, (after - before) * 1024)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr[-2000:]
    count, grown = map(int, done.stdout.split())
    assert count == group
    assert grown < 2 * group * 2**20, f"peak grew by {grown / 2**20:.0f} MiB"


def test_a_key_with_control_characters_is_a_counted_skip_shown_escaped():
    buffer = io.BytesIO()
    table = pa.table({"__key__": ["a", "b\nforged"], "jpg": [b"x", b"y"], "cls": [1, 2]})
    pq.write_table(table, buffer)
    samples = list(iter_parquet_samples(io.BytesIO(buffer.getvalue()), "mem.parquet"))
    assert "__error__" not in samples[0] and samples[1]["__error__"].reason == "bad_name"
    assert samples[1]["__key__"] == "b\\nforged"


# --- Repeated keys: as in a tar ----------------------------------------------------------------


def tar_shard(samples) -> bytes:
    buffer = io.BytesIO()
    writer = TAR.open_writer(buffer, "jpg", 0)
    for sample in samples:
        writer.write(sample)
    writer.close()
    return buffer.getvalue()


def read_both(samples, start=0, stop=None, row_group_size=3):
    """(keys yielded, ShardError reason or None) of the same samples as a tar and a Parquet shard."""
    outcomes = []
    for fmt, data in ((TAR, tar_shard(samples)), (PARQUET, write_shard(samples, row_group_size))):
        got, reason = [], None
        try:
            for sample in fmt.iter_samples(io.BytesIO(data), f"s.{fmt.name}", start, stop):
                got.append(sample["__key__"])
        except ShardError as error:
            reason = error.reason
        outcomes.append((got, reason))
    return outcomes


@pytest.mark.parametrize(
    ("repeat", "window"),
    [
        ((7, 2), (0, None)),  # a later row group repeats an earlier one's key
        ((5, 3), (0, None)),  # within one row group
        ((5, 3), (3, 10)),  # both in the window
        ((7, 2), (0, 7)),  # the window stops before the repeat: nothing to see
        ((7, 2), (3, 7)),
    ],
)
def test_a_repeated_key_ends_a_tar_and_is_a_made_key_in_parquet(repeat, window):
    """A tar groups members by key, so a repeat breaks it; a Parquet row is a sample
    whatever its key: every row is read, a repeat under `{key}-{row:09d}` (issue 29)."""
    samples = make_samples(10)
    at, original = repeat
    samples[at]["__key__"] = samples[original]["__key__"]
    tar, parquet = read_both(samples, *window)
    start, stop = window
    wanted = [s["__key__"] for s in samples[start:stop]]
    if stop is None or stop > at:
        assert tar == (wanted[: at - start], "non_adjacent_key")
        if start <= original:
            wanted[at - start] += f"-{at:09d}"
    assert parquet == (wanted, None)


def test_a_window_sees_the_repeats_within_it_and_reads_no_row_group_outside_it():
    """A tar is read from its start, so it sees a key repeated from before the window;
    a Parquet window reads only its own row groups: a whole read sees every repeat."""
    samples = make_samples(10, size=30_000)  # row groups past pyarrow's 64 KiB footer read
    samples[7]["__key__"] = samples[2]["__key__"]
    data = write_shard(samples, row_group_size=3)
    assert keys(read(data, "mem.parquet", 5, 10)) == keys(samples[5:10])
    assert keys(read(data))[7] == f"{samples[2]['__key__']}-000000007"
    start, _ = column_range(data, 0, "__key__")
    _, stop = column_range(data, 1, "jpg")
    stream = FailingStream(data, LinkDown("a row group before the window was read"), start, stop)
    assert len(list(iter_parquet_samples(stream, "u", 6, 9))) == 3


def test_a_repeated_key_is_named_and_null_keys_are_not_repeats():
    got = read(
        write_table({"__key__": ["a", None, "b", None, "a"], "jpg": [b"1"] * 5}, 2),
        fields=frozenset({"jpg"}),
    )
    assert keys(got) == ["a", "<row 1>", "b", "<row 3>", "a-000000004"]
    assert got[4]["__repeated_key__"] == "a" and "__error__" not in got[4]


# --- Made keys: distinct across directories -----------------------------------------------------


def test_made_keys_differ_for_one_file_name_in_two_directories_and_repeat_across_runs(tmp_path):
    """HF's per-config layout: `cfgA/train-00000-of-00001.parquet`, `cfgB/...` of the same name."""
    data = write_table({"jpg": [b"x"] * 3, "label": [0, 1, 2]})
    paths = []
    for config in ("cfgA", "cfgB"):
        (tmp_path / config).mkdir()
        paths.append(tmp_path / config / "train-00000-of-00001.parquet")
        paths[-1].write_bytes(data)
    first, second = (keys(read(path.read_bytes(), str(path))) for path in paths)
    assert len(set(first) | set(second)) == 6
    assert all(check_key(key) and key.startswith("train-00000-of-00001-") for key in first)
    assert keys(read(data, str(paths[0]))) == first  # the same on every read
    relative = os.path.relpath(paths[0])
    assert keys(read(data, relative)) == first  # a relative path names the same file
    url = "https://u:secret@host.example/d/cfgA/train-00000-of-00001.parquet?sig=1"
    other = "https://u:other@host.example/d/cfgA/train-00000-of-00001.parquet?sig=2"
    assert keys(read(data, url)) == keys(read(data, other))  # not from credentials or query
    assert keys(read(data, url)) != keys(read(data, url.replace("cfgA", "cfgB")))
    child = (
        "import sys; from shards.parquet import synthetic_key_prefix; "
        "print(synthetic_key_prefix(sys.argv[1]))"
    )
    again = subprocess.run(
        [sys.executable, "-c", child, str(paths[1])], capture_output=True, text=True, check=True
    )
    assert first[0] != second[0] and second[0].startswith(again.stdout.strip() + "-")


# --- Labels against the classes the file names --------------------------------------------------


def test_a_label_outside_the_classes_our_metadata_names_is_a_bad_label_skip():
    buffer = io.BytesIO()
    writer = ParquetShardWriter(buffer, "jpg", 4, class_names=["cat", "dog", "eel"])
    samples = make_samples(6)
    samples[2]["cls"], samples[4]["cls"] = b"3", b"7"
    for sample in samples:
        writer.write(sample)
    writer.close()
    got = read(buffer.getvalue())
    assert keys(got) == keys(samples)
    bad = {i: s["__error__"] for i, s in enumerate(got) if "__error__" in s}
    assert sorted(bad) == [2, 4] and {e.reason for e in bad.values()} == {"bad_label"}
    assert "class 7, outside the 3 classes" in str(bad[4]) and "cls" not in got[4]
    assert [s["cls"] for s in got if "__error__" not in s] == [b"0", b"1", b"0", b"2"]


def test_a_label_outside_hf_classlabel_names_is_a_bad_label_skip():
    features = {"label": {"_type": "ClassLabel", "names": ["a", "b"]}, "jpg": {"_type": "Image"}}
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    table = pa.table({"jpg": [b"1", b"2", b"3"], "label": [1, 2, -1]}).replace_schema_metadata(
        metadata
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    got = read(buffer.getvalue(), fields=frozenset({"jpg", "label"}))
    assert [s.get("label") for s in got] == [b"1", None, None]
    assert [s["__error__"].reason for s in got[1:]] == ["bad_label", "bad_label"]
    # Metadata that names no classes (or is not JSON) checks nothing: the loader judges.
    for odd in (b"{not json", b'{"info": {"features": {"label": {"_type": "Value"}}}}'):
        buffer = io.BytesIO()
        pq.write_table(table.replace_schema_metadata({b"huggingface": odd}), buffer)
        assert not any("__error__" in s for s in read(buffer.getvalue()))


# --- Caps before memory -------------------------------------------------------------------------


def capped(*caps):
    return ReadLimits(member_caps=tuple(caps))


def test_a_text_cell_over_its_fields_cap_is_that_fields_skip_and_is_not_kept():
    txt = ["short", "x" * 5000, "fine", "y" * 1025]
    documents = ['{"a": 1}', '{"b": "' + "z" * 3000 + '"}', "{}", "{}"]
    columns = {"__key__": list("abcd"), "jpg": [b"1"] * 4, "cls": [0] * 4, "txt": txt}
    data = write_table({**columns, "json": documents})
    limits = capped(MemberCap("txt", 1024, "bad_text", "txt"), MemberCap("json", 2048, "bad_json"))
    got = read(data, limits=limits)
    reasons = [s["__error__"].reason if "__error__" in s else None for s in got]
    assert reasons == [None, "bad_json", None, "bad_text"]  # the first bad cell names the skip
    assert "txt" not in got[1] and "txt" not in got[3] and got[2]["txt"] == b"fine"
    assert "1025 bytes, over the 1024-byte cap of field 'txt'" in str(got[3]["__error__"])
    assert "json" not in got[1]  # the 3010-byte document, over its own cap, is not kept
    assert got[0]["txt"] == b"short" and got[0]["json"] == b'{"a": 1}'


def test_a_typed_label_list_over_its_cap_is_refused_before_it_is_converted():
    huge = list(range(400_000))  # 2.7 MB of JSON; as a Python list, ~15 MB of objects
    data = write_table(
        {"__key__": ["a", "b"], "jpg": [b"1", b"2"], "labels": pa.array([[1, 2], huge])}
    )
    del huge
    limits = capped(MemberCap("labels", 64 * 2**10, "bad_labels", "tags"))
    tracemalloc.start()
    try:
        got = read(data, limits=limits, fields=frozenset({"jpg", "labels"}))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got[0]["labels"] == b"[1, 2]" and "__error__" not in got[0]
    assert got[1]["__error__"].reason == "bad_labels" and "labels" not in got[1]
    assert peak < 8 * 2**20  # the 400k-id cell never became Python objects (~15 MB)


def test_the_default_caps_are_the_member_cap_and_unasked_text_is_never_read():
    samples = make_samples(8, size=100)
    rng = random.Random(3)
    for sample in samples:  # text that does not compress, so it is not in the footer's read
        sample["txt"] = "".join(rng.choices(string.ascii_letters, k=60_000)).encode()
    data = write_shard(samples, row_group_size=4)
    # Without member caps (a direct reader call) text keeps ReadLimits.member_bytes.
    assert [s["txt"] for s in read(data)] == [s["txt"] for s in samples]
    stream = FailingStream(data, LinkDown("the txt column was read"), *column_range(data, 0, "txt"))
    got = list(iter_parquet_samples(stream, "u", fields=frozenset({"jpg", "cls"})))
    assert len(got) == 8 and not any("txt" in s for s in got)


# --- columns a Field maps (`caption`): read as asked, typed and capped ---------------------


def test_a_mapped_column_of_a_type_no_field_decodes_is_a_schema_error_naming_it():
    data = write_table({"jpg": [b"i"], "caption": pa.array([{"a": 1}])})
    with pytest.raises(ShardError) as caught:
        read(data, fields=frozenset(("jpg", "caption")))
    assert caught.value.reason == "schema" and "'caption'" in caught.value.detail
    assert keys(read(data, fields=frozenset(("jpg",))))  # not asked for: never looked at


def test_mapped_numbers_and_id_lists_are_the_json_a_tar_member_holds():
    data = write_table(
        {
            "jpg": [b"i", b"j"],
            "score": pa.array([0.5, float("nan")]),
            "ids": pa.array([[1, 2], []], pa.list_(pa.int16())),
            "n": pa.array([3, None], pa.int8()),
        }
    )
    a, b = read(data, fields=frozenset(("jpg", "score", "ids", "n")))
    assert (a["score"], a["ids"], a["n"]) == (b"0.5", b"[1, 2]", b"3")
    assert (b["score"], b["ids"], "n" in b) == (b"NaN", b"[]", False)  # NaN: bad_weight later


def test_a_mapped_cell_over_its_cap_is_its_fields_skip_and_is_not_kept():
    data = write_table({"jpg": [b"i", b"j"], "caption": ["short", "x" * 5000]})
    limits = ReadLimits(member_caps=(MemberCap("caption", 100, "bad_text", "txt"),))
    a, b = read(data, fields=frozenset(("jpg", "caption")), limits=limits)
    assert a["caption"] == b"short"
    assert b["__error__"].reason == "bad_text" and "caption" not in b
