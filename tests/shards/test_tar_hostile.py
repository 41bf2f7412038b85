"""The tar reader against hand-made hostile shards: each ends fast with the right ShardError.

Headers are built from `member_header` blocks patched by hand (checksums refixed with
`header_checksum`), so each test controls exactly the bytes a hostile server sends.
"""

import io
import json

import pytest

from shards.errors import MemberCap, ReadLimits, ShardError
from shards.sample import (
    Field,
    SampleError,
    field_value,
    loads_strict_json,
    member_caps,
    read_fields,
)
from shards.tar import (
    BLOCK,
    TarShardWriter,
    count_tar_samples,
    header_checksum,
    iter_tar_samples,
    member_header,
)

URL = "http://user:s3cr3t@host/x.tar"
SHOWN = "http://***@host/x.tar"
NO_FIELDS = frozenset()


class ForwardOnly(io.BytesIO):
    """A seekable stream that fails the test if the reader ever seeks backwards."""

    def seek(self, offset, whence=0):
        assert whence == 1 and offset >= 0, f"backward or absolute seek: {offset}, {whence}"
        return super().seek(offset, whence)


class Unseekable(io.BytesIO):
    def seekable(self):
        return False


STREAMS = {"seekable": ForwardOnly, "unseekable": Unseekable}


def fix_checksum(header: bytearray) -> bytes:
    header[148:156] = b"%06o\0 " % header_checksum(bytes(header))
    return bytes(header)


def block(name=b"a.jpg", size=0, *, size_field=None, kind=b"0") -> bytes:
    """One header block; `size_field` replaces the 12 size bytes verbatim."""
    header = bytearray(member_header("x", 0))
    header[0:100] = name.ljust(100, b"\0")
    header[124:136] = b"%011o\0" % size if size_field is None else size_field
    header[156:157] = kind
    return fix_checksum(header)


def member(name: bytes, data: bytes, kind=b"0") -> bytes:
    return block(name, len(data), kind=kind) + data + bytes(-len(data) % BLOCK)


def pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


def pax(records: bytes) -> bytes:
    return member(b"PaxHeader/a", records, kind=b"x")


def archive(*members: bytes) -> bytes:
    return b"".join(members) + bytes(2 * BLOCK)


def good_members(*keys: str) -> list[bytes]:
    return [member(f"{key}.cls".encode(), key.encode()) for key in keys]


def make_samples(n):
    return [
        {
            "__key__": f"k{i:04d}",
            "cls": str(i % 3).encode(),
            "jpg": bytes([i % 256]) * (1 + i * 97 % 1500),
            "json": json.dumps({"i": i}).encode(),
        }
        for i in range(n)
    ]


def write_tar(samples) -> bytes:
    buffer = io.BytesIO()
    writer = TarShardWriter(buffer)
    for sample in samples:
        writer.write(sample)
    writer.close()
    return buffer.getvalue()


def strip_url(samples):
    return [{k: v for k, v in s.items() if k != "__url__"} for s in samples]


def read_until_error(stream, reason, **kwargs):
    """Read `stream` to its ShardError; check the reason and that it names the shard."""
    seen = []
    with pytest.raises(ShardError) as info:
        for sample in iter_tar_samples(stream, URL, **kwargs):
            seen.append(sample)
    error = info.value
    assert error.reason == reason, str(error)
    assert SHOWN in str(error) and error.url == SHOWN
    assert "s3cr3t" not in str(error)
    return seen, error


@pytest.mark.timeout(10)
@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
@pytest.mark.parametrize(
    "size_field",
    [
        b"-0000001000\0",  # negative octal: used to seek back onto the same header forever
        b"\xff" * 12,  # GNU base-256 with the sign bit
        b"00000001008\0",  # an 8 is not octal
        b"+0000000010\0",
        b"0_000000010\0",
        b"\t0000000010\0",
        b"0000 000010\0",
        b"0000000x010\0",
        bytes(12),  # empty
        b"\x81" + bytes(11),  # a high bit that is not a base-256 marker
    ],
)
def test_malformed_or_negative_size_is_bad_header(stream, size_field):
    data = archive(*good_members("a", "b"), block(b"c.jpg", size_field=size_field), b"x" * 512)
    seen, error = read_until_error(stream(data), "bad_header", fields=NO_FIELDS)
    assert [s["__key__"] for s in seen] == ["a"]
    assert "preprocess verify" in str(error)


@pytest.mark.parametrize(
    "size_field", [b"00000000003\0", b"0000000003 \0", b"        3\0\0\0", b"000000000003"]
)
def test_octal_sizes_in_every_legal_spelling_are_read(size_field):
    data = archive(block(b"a.jpg", size_field=size_field) + b"abc" + bytes(509))
    assert [s["jpg"] for s in iter_tar_samples(io.BytesIO(data), URL)] == [b"abc"]


def test_base256_positive_size_is_read():
    size_field = b"\x80" + (3).to_bytes(11, "big")
    data = archive(block(b"a.jpg", size_field=size_field) + b"abc" + bytes(509))
    assert [s["jpg"] for s in iter_tar_samples(io.BytesIO(data), URL)] == [b"abc"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
@pytest.mark.parametrize(
    "records",
    [
        pax_record(b"size", b"-1536"),
        pax_record(b"size", b"lots"),
        pax_record(b"size", b"1" * 5000),  # past int()'s digit limit
        b"abc path=x\n",
        b"0 path=x\n",
        b"99 path=x\n",  # longer than the data
        b"9 path=x!",  # no newline
        b"5 x\n",  # no '='
        pax_record(b"path", b"a.jpg") + b"trailing",
        b"12345678901234567890123 path=x\n",
    ],
)
def test_malformed_pax_records_are_bad_header(stream, records):
    data = archive(*good_members("a", "b"), pax(records), member(b"c.jpg", b"c"))
    seen, _ = read_until_error(stream(data), "bad_header")
    assert [s["__key__"] for s in seen] == ["a"]


def test_pax_path_and_size_apply_to_the_next_member():
    records = pax_record(b"path", b"long" * 40 + b".jpg") + pax_record(b"size", b"5")
    data = archive(pax(records), block(b"short.jpg", 999999) + b"12345" + bytes(507))
    (sample,) = iter_tar_samples(io.BytesIO(data), URL)
    assert sample["__key__"] == "long" * 40 and sample["jpg"] == b"12345"


@pytest.mark.timeout(10)
def test_checksum_mismatch_first_is_not_tar_later_is_bad_header():
    members = good_members("a", "b", "c")
    broken = bytearray(members[2])
    broken[0] = ord("z")  # the checksum no longer matches
    data = archive(members[0], members[1], bytes(broken))
    seen, error = read_until_error(io.BytesIO(data), "bad_header")
    assert [s["__key__"] for s in seen] == ["a"]
    assert f"at byte {2 * 2 * BLOCK}" in str(error)
    read_until_error(io.BytesIO(archive(bytes(broken))), "not_tar")
    read_until_error(io.BytesIO(b"<html>not found</html>".ljust(4096)), "not_tar")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
@pytest.mark.parametrize("fields", [None, NO_FIELDS], ids=["read", "headers-only"])
@pytest.mark.parametrize("where", ["header", "data", "padding", "end block"])
def test_truncated_anywhere_is_truncated(stream, fields, where):
    first, second = member(b"a.jpg", b"A" * 700), member(b"b.jpg", b"B" * 700)
    complete = first + second + bytes(2 * BLOCK)
    cut = {
        "header": len(first) + 100,
        "data": len(first) + BLOCK + 300,
        "padding": len(first) + BLOCK + 710,
        "end block": len(first) + len(second),
    }[where]
    kwargs = {} if fields is None else {"fields": fields}
    seen, _ = read_until_error(stream(complete[:cut]), "truncated", **kwargs)
    # `a` is complete once `b`'s header reads whole; `b` never is.
    assert [s["__key__"] for s in seen] == ([] if where == "header" else ["a"])


@pytest.mark.parametrize("payload", [b"", b"\0" * 100])
def test_empty_or_short_streams_are_truncated(payload):
    read_until_error(io.BytesIO(payload), "truncated")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", [b"L", b"x"])
def test_extended_header_over_the_cap_is_too_large_before_it_is_read(kind):
    # The header claims 2 MiB but no data follows: the cap must refuse before reading.
    data = block(b"././@LongLink", 2 * 2**20, kind=kind)
    _, error = read_until_error(io.BytesIO(data), "too_large")
    assert "ReadLimits" in str(error)
    long_name = member(b"././@LongLink", b"n" * 2000 + b".jpg\0", kind=kind)
    small = ReadLimits(header_bytes=1024)
    read_until_error(
        io.BytesIO(archive(long_name, member(b"a.jpg", b"1"))), "too_large", limits=small
    )


class EndlessTar:
    """A server that answers 200 and streams valid one-member samples forever."""

    def __init__(self, data_size=1):
        self.pending = b""
        self.index = 0
        self.sent = 0
        self.data = b"x" * data_size

    def seekable(self):
        return False

    def read(self, size=-1):
        while len(self.pending) < size:
            self.pending += member(b"k%08d.jpg" % self.index, self.data)
            self.index += 1
        out, self.pending = self.pending[:size], self.pending[size:]
        self.sent += len(out)
        return out


@pytest.mark.timeout(10)
def test_member_cap_stops_an_endless_stream():
    stream = EndlessTar()
    seen, error = read_until_error(stream, "too_many_members", limits=ReadLimits(members=200))
    assert len(seen) == 199  # the 200th sample was not known to be complete
    assert stream.sent <= 201 * 2 * BLOCK
    assert "200" in str(error)


@pytest.mark.timeout(10)
def test_shard_byte_cap_stops_an_endless_stream():
    stream = EndlessTar(data_size=10_000)
    read_until_error(stream, "too_large", limits=ReadLimits(shard_bytes=2**20))
    assert stream.sent <= 2**20


@pytest.mark.timeout(10)
@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
@pytest.mark.parametrize("fields", [None, NO_FIELDS], ids=["read", "headers-only"])
def test_shard_byte_cap_counts_seeked_over_data(stream, fields):
    data = write_tar(make_samples(20))
    kwargs = {} if fields is None else {"fields": fields}
    exact = list(iter_tar_samples(stream(data), URL, limits=ReadLimits(shard_bytes=len(data))))
    assert len(exact) == 20
    seen, error = read_until_error(
        stream(data), "too_large", limits=ReadLimits(shard_bytes=len(data) // 2), **kwargs
    )
    assert 0 < len(seen) < 20
    assert "manifest's byte count" in str(error)


@pytest.mark.timeout(10)
def test_a_huge_member_is_refused_before_the_seek():
    data = archive(member(b"a.cls", b"1"), block(b"b.pkl", 2**40))
    read_until_error(ForwardOnly(data), "too_large", limits=ReadLimits(shard_bytes=2**30))


def test_member_over_member_cap_is_one_counted_skip_holding_no_bytes():
    data = archive(member(b"a.jpg", b"x" * 3000), member(b"a.cls", b"1"), *good_members("b"))
    samples = list(iter_tar_samples(io.BytesIO(data), URL, limits=ReadLimits(member_bytes=1000)))
    assert samples[0]["__error__"].reason == "member_too_large"
    # A sample found bad reads none of its other members: it only waits to be counted.
    assert set(samples[0]) == {"__key__", "__url__", "__error__"}
    assert samples[1]["cls"] == b"b" and "__error__" not in samples[1]


@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
def test_non_utf8_names_are_counted_skips_with_printable_unique_keys(stream):
    data = archive(
        *good_members("a"),
        member(b"b\xff.jpg", b"img"),
        member(b"b\xff.cls", b"1"),
        member(b"b\xfe.jpg", b"img"),
        pax(pax_record(b"path", b"p\xc3(.jpg")),
        member(b"ignored.jpg", b"img"),
        member(b"\x1b[31m\xff.jpg", b"img"),  # a terminal escape as well
        *good_members("c"),
    )
    samples = list(iter_tar_samples(stream(data), URL))
    keys = [s["__key__"] for s in samples]
    assert keys[0] == "a" and keys[-1] == "c" and len(keys) == 6
    assert samples[0]["cls"] == b"a" and samples[-1]["cls"] == b"c"
    bad = samples[1:-1]
    assert len({s["__key__"] for s in bad}) == 4
    for sample in bad:
        assert sample["__error__"].reason == "bad_name"
        assert set(sample) == {"__key__", "__url__", "__error__"}  # nothing read
        assert sample["__key__"].isprintable()
        sample["__key__"].encode("utf-8")  # no surrogate escapes
        assert SHOWN in str(sample["__error__"])
    assert bad[0]["__key__"] == "b\\xff"
    assert count_tar_samples(stream(data), URL) == 6
    listed = [s["__key__"] for s in iter_tar_samples(stream(data), URL, fields=NO_FIELDS)]
    assert listed == keys


@pytest.mark.parametrize("name", [b"line\nforged.jpg", b"\x1b[2Jclear.jpg", b"tab\tkey.jpg"])
def test_control_characters_in_a_valid_utf8_name_are_a_counted_skip(name):
    """A newline or terminal escape in a key would forge log lines: one skip, shown escaped."""
    data = archive(*good_members("a"), member(name, b"img"), *good_members("c"))
    samples = list(iter_tar_samples(io.BytesIO(data), URL))
    assert [s.get("__error__") is None for s in samples] == [True, False, True]
    assert samples[1]["__error__"].reason == "bad_name"
    assert samples[1]["__key__"].isprintable()


def test_non_adjacent_key_names_the_key():
    data = archive(*good_members("a", "b"), member(b"a.jpg", b"again"))
    seen, error = read_until_error(io.BytesIO(data), "non_adjacent_key")
    assert error.key == "a" and [s["__key__"] for s in seen] == ["a", "b"]


def test_too_many_members_for_one_key_is_too_many_fields():
    extras = [member(b"a.x%d" % i, b"1") for i in range(40)]
    read_until_error(io.BytesIO(archive(member(b"a.jpg", b"1"), *extras)), "too_many_fields")


def test_duplicate_field_is_found_even_when_not_read():
    data = archive(member(b"a.jpg", b"1"), member(b"a.jpg", b"2"))
    read_until_error(io.BytesIO(data), "duplicate_field", fields=NO_FIELDS)


@pytest.mark.parametrize("kwargs", [{"stop": 8}, {"declared": 8}, {"stop": 8, "declared": 9}])
def test_shard_short_after_every_sample_it_has(kwargs):
    samples = make_samples(5)
    seen, error = read_until_error(io.BytesIO(write_tar(samples)), "shard_short", **kwargs)
    assert strip_url(seen) == samples
    assert "after 5 samples, 8 expected" in str(error) and "preprocess verify" in str(error)


@pytest.mark.timeout(10)
def test_shard_long_yields_the_declared_samples_and_reads_no_further():
    samples = make_samples(8)
    data = write_tar(samples)
    # Cut the shard inside sample 6: reading past the declared 5 would say `truncated`.
    cut = data[: data.index(b"k0006.jpg") + 600]
    seen, error = read_until_error(io.BytesIO(cut), "shard_long", declared=5)
    assert strip_url(seen) == samples[:5]
    assert "5 samples" in str(error) and "preprocess verify" in str(error)
    _, error = read_until_error(io.BytesIO(data), "shard_long", start=3, declared=5)
    # A window that ends before `declared` stops at the next key's header, error-free.
    window = list(iter_tar_samples(io.BytesIO(cut), URL, start=1, stop=4, declared=8))
    assert strip_url(window) == samples[1:4]


@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
@pytest.mark.parametrize("declared", [None, 23])
def test_consecutive_windows_read_each_sample_exactly_once(stream, declared):
    samples = make_samples(23)
    data = write_tar(samples)
    got = []
    for start in range(0, 23, 5):
        stop = min(start + 5, 23)
        got += iter_tar_samples(stream(data), URL, start, stop, declared=declared)
    assert strip_url(got) == samples
    assert list(iter_tar_samples(stream(data), URL, 23, declared=declared)) == []
    assert list(iter_tar_samples(stream(data), URL, 4, 4)) == []


@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
def test_key_listing_equals_count_and_skips_no_sample(stream):
    samples = make_samples(12)
    samples[3] = {"__key__": samples[3]["__key__"], "txt": b"only text"}
    data = write_tar(samples)
    listed = list(iter_tar_samples(stream(data), URL, fields=NO_FIELDS))
    assert [s["__key__"] for s in listed] == [s["__key__"] for s in samples]
    assert all(set(s) == {"__key__", "__url__"} for s in listed)
    assert count_tar_samples(stream(data), URL) == len(listed) == 12
    # Indices count samples whatever `fields` asks for: sample 3 has no jpg.
    jpgs = list(iter_tar_samples(stream(data), URL, 3, 5, fields=frozenset({"jpg"})))
    assert [set(s) - {"__url__"} for s in jpgs] == [{"__key__"}, {"__key__", "jpg"}]


def test_credentials_never_reach_url_or_messages():
    url = "http://user:pw@host/x.tar"
    data = write_tar(make_samples(2))
    samples = list(iter_tar_samples(io.BytesIO(data), url))
    assert {s["__url__"] for s in samples} == {"http://***@host/x.tar"}
    with pytest.raises(ShardError) as info:
        list(iter_tar_samples(io.BytesIO(data[:700]), url))
    assert "pw" not in str(info.value) and "pw" not in info.value.url
    assert "http://***@host/x.tar" in str(info.value)


@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
@pytest.mark.parametrize("fields", [None, frozenset({"jpg", "cls"}), NO_FIELDS])
def test_good_shard_reads_the_same_seekable_or_not(stream, fields):
    samples = make_samples(30)
    samples[7]["__key__"] = "long_" + "k" * 120  # a pax header
    data = write_tar(samples)
    kwargs = {} if fields is None else {"fields": fields}
    got = list(iter_tar_samples(stream(data), URL, declared=30, **kwargs))
    wanted = fields if fields is not None else {"jpg", "cls", "json"}
    expected = [{k: v for k, v in s.items() if k == "__key__" or k in wanted} for s in samples]
    assert strip_url(got) == expected
    assert list(iter_tar_samples(io.BytesIO(data), URL, declared=30, **kwargs)) == got


@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
def test_pax_size_sets_the_padding_and_the_byte_count(stream):
    # The reader reads a member's padding with the next header: it must pad by the pax
    # size, not the ustar one, and count those bytes against the shard's byte cap.
    records = pax_record(b"size", b"5")
    data = archive(
        pax(records),
        block(b"a.jpg", 999999) + b"12345" + bytes(507),
        member(b"a.cls", b"3"),
        member(b"b.jpg", b"B" * 700),
    )
    samples = list(iter_tar_samples(stream(data), URL, limits=ReadLimits(shard_bytes=len(data))))
    assert [(s["__key__"], s.get("jpg"), s.get("cls")) for s in samples] == [
        ("a", b"12345", b"3"),
        ("b", b"B" * 700, None),
    ]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
@pytest.mark.parametrize("fields", [None, NO_FIELDS], ids=["read", "headers-only"])
def test_truncated_inside_padding_names_the_member_or_extended_header(stream, fields):
    kwargs = {} if fields is None else {"fields": fields}
    first = member(b"a.jpg", b"A" * 700)
    _, error = read_until_error(stream(first[: BLOCK + 710]), "truncated", **kwargs)
    assert "padding of member a.jpg" in str(error) and error.key == "a"
    extended = pax(pax_record(b"path", b"b.jpg"))
    _, error = read_until_error(stream(first + extended[: BLOCK + 20]), "truncated", **kwargs)
    assert "padding of an extended header" in str(error)


# --- member caps: a member's cap applies before its bytes are read -------------------------


class Recording(io.BytesIO):
    """Remembers every byte `read` returned, so a test can tell what was never read."""

    def __init__(self, data: bytes, seekable: bool = True) -> None:
        super().__init__(data)
        self.returned = bytearray()
        self._seekable = seekable
        self.largest_read = 0

    def seekable(self):
        return self._seekable

    def read(self, size=-1):
        data = super().read(size)
        self.returned += data
        self.largest_read = max(self.largest_read, len(data))
        return data


HUGE = b"\xab" * 5000  # a member's bytes no test may see read
CAPPED = (
    (Field("txt", "text", max_bytes=1000), "txt", "bad_text"),
    (Field("json", "json", max_bytes=1000), "json", "bad_json"),
    (Field("label", "label", max_bytes=1000), "cls", "bad_label"),
    (Field("t", "multi_label", num_classes=3, max_bytes=1000), "labels", "bad_labels"),
    (Field("w", "weight", max_bytes=1000), "weight", "bad_weight"),
)


@pytest.mark.parametrize("seekable", [True, False], ids=["seekable", "unseekable"])
@pytest.mark.parametrize(("field", "name", "reason"), CAPPED, ids=[c[1] for c in CAPPED])
def test_a_member_over_its_fields_cap_is_the_fields_skip_and_never_read(
    field, name, reason, seekable
):
    fields = (Field("image", "image"), field)
    data = archive(
        member(b"a.jpg", b"img"),
        member(f"a.{name}".encode(), HUGE),
        member(b"a.zzz", b"x"),  # not allowlisted: skipped as before
        member(b"b.jpg", b"img2"),
        member(f"b.{name}".encode(), b"1"),
    )
    stream = Recording(data, seekable)
    limits = ReadLimits(member_caps=member_caps(fields))
    samples = list(iter_tar_samples(stream, URL, fields=read_fields(fields), limits=limits))
    error = samples[0]["__error__"]
    assert error.reason == reason and set(samples[0]) == {"__key__", "__url__", "__error__"}
    # The detail names the member, the (redacted) shard and the cap, and the size.
    for part in (f"a.{name}", SHOWN, "1000-byte cap", repr(field.name), "5000 bytes"):
        assert part in error.detail
    assert samples[1] == {"__key__": "b", "__url__": SHOWN, "jpg": b"img2", name: b"1"}
    if seekable:
        assert HUGE[:600] not in stream.returned  # seeked over: not one block of it read
    # The same decode rules see the same member as the same skip: one reason either way.
    with pytest.raises(SampleError) as caught:
        field_value({"__key__": "a", name: HUGE}, field)
    assert caught.value.reason == reason


def test_without_field_caps_text_is_read_up_to_the_member_cap():
    data = archive(member(b"a.jpg", b"img"), member(b"a.txt", HUGE))
    (sample,) = iter_tar_samples(io.BytesIO(data), URL)
    assert sample["txt"] == HUGE and "__error__" not in sample


def test_an_image_over_member_bytes_is_member_too_large_and_a_field_cap_never_raises_it():
    fields = (Field("image", "image", max_bytes=10), Field("txt", "text", max_bytes=2**30))
    limits = ReadLimits(member_bytes=1000, member_caps=member_caps(fields))
    assert limits.cap_for("txt").reason == "member_too_large"  # member_bytes is tighter
    assert limits.cap_for("jpg").max_bytes == 1000  # images ignore Field.max_bytes
    data = archive(member(b"a.jpg", HUGE), member(b"b.jpg", b"img"), member(b"b.txt", HUGE))
    a, b = iter_tar_samples(io.BytesIO(data), URL, fields=read_fields(fields), limits=limits)
    assert a["__error__"].reason == "member_too_large" and "ReadLimits.member_bytes" in str(
        a["__error__"]
    )
    assert b["__error__"].reason == "member_too_large"


@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
def test_image_members_of_one_sample_share_one_images_cap(stream):
    """Five image members of 60 MiB would hold 300 MiB a sample; together they get one cap."""
    limits = ReadLimits(member_bytes=4000)
    data = archive(
        member(b"a.jpeg", b"j" * 3000),
        member(b"a.jpg", b"i" * 3000),  # 6000 > 4000: a, unread from here
        member(b"a.png", b"p" * 10),
        member(b"b.jpg", b"i" * 2000),
        member(b"b.png", b"p" * 2000),  # 4000: at the cap, kept
    )
    recording = Recording(data, stream is ForwardOnly)
    a, b = iter_tar_samples(recording, URL, limits=limits)
    assert a["__error__"].reason == "member_too_large" and "image members" in str(a["__error__"])
    assert set(a) == {"__key__", "__url__", "__error__"}
    assert b == {"__key__": "b", "__url__": SHOWN, "jpg": b"i" * 2000, "png": b"p" * 2000}
    if stream is ForwardOnly:
        assert b"i" * 2500 not in recording.returned  # a.jpg seeked over


def test_the_smallest_cap_of_fields_sharing_a_member_applies_with_its_reason():
    fields = (
        Field("json", "json", max_bytes=4000),
        Field("w", "weight", source="json", key="w", max_bytes=100),
    )
    assert member_caps(fields) == (MemberCap("json", 100, "bad_weight", "w"),)
    data = archive(member(b"a.json", b'{"w": 1, "pad": "' + b"x" * 200 + b'"}'))
    (sample,) = iter_tar_samples(
        io.BytesIO(data),
        URL,
        fields=read_fields(fields),
        limits=ReadLimits(member_caps=member_caps(fields)),
    )
    assert sample["__error__"].reason == "bad_weight"


@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
def test_samples_before_start_and_unasked_members_are_never_read(stream):
    """Every path past a member that nobody reads passes over it: before `start`,
    fields not asked for, members after a sample's error, and past `stop`."""
    fields = (Field("image", "image"), Field("txt", "text", max_bytes=1000))
    data = archive(
        member(b"a.jpg", HUGE),  # before start
        member(b"a.txt", HUGE),
        member(b"b.jpg", b"img"),
        member(b"b.json", HUGE),  # not asked for
        member(b"c.cls", b"1"),  # c's label is not asked for; its caption is over the cap
        member(b"c.txt", HUGE),
        member(b"c.webp", HUGE),  # after c's error
        member(b"d.jpg", HUGE),  # past stop
    )
    recording = Recording(data, stream is ForwardOnly)
    limits = ReadLimits(member_caps=member_caps(fields))
    got = list(iter_tar_samples(recording, URL, 1, 3, fields=read_fields(fields), limits=limits))
    assert [s["__key__"] for s in got] == ["b", "c"]
    assert got[0] == {"__key__": "b", "__url__": SHOWN, "jpg": b"img"}
    assert got[1]["__error__"].reason == "bad_text" and "webp" not in got[1]
    if stream is ForwardOnly:
        assert HUGE[:600] not in recording.returned


def test_an_unseekable_stream_reads_past_an_oversized_member_in_small_chunks():
    fields = (Field("image", "image"), Field("txt", "text"))
    caption = b"\xab" * (5 * 2**20)
    data = archive(member(b"a.jpg", b"img"), member(b"a.txt", caption), *good_members("b"))
    recording = Recording(data, seekable=False)
    limits = ReadLimits(member_caps=member_caps(fields))
    a, b = iter_tar_samples(recording, URL, fields=read_fields(fields), limits=limits)
    assert a["__error__"].reason == "bad_text" and "__error__" not in b
    assert recording.largest_read <= 2**20 + 2 * BLOCK  # never the 5 MiB at once


# --- strict JSON, dotted keys -------------------------------------------------------------


@pytest.mark.parametrize(
    "document",
    [
        b'{"a": NaN}',
        b'{"a": Infinity}',
        b'{"a": -Infinity}',
        b'{"a": 1e999}',
        b'{"a": 1, "a": 2}',
        b'{"x": {"b": 1, "b": 1}}',
        b'{"a": "\\ud800"}',
        b'{"\\udfff": 1}',
        b'{"a": ["ok", "\\ud83d x"]}',
    ],
)
def test_json_members_follow_the_manifest_parsers_rules(document):
    with pytest.raises(SampleError) as caught:
        field_value({"__key__": "k1", "json": document}, Field("json", "json"))
    assert caught.value.reason == "bad_json" and "k1" in caught.value.detail


def test_strict_json_keeps_what_json_allows():
    assert loads_strict_json('{"a": "\\ud83d\\ude00", "b": 1e308, "c": "\\\\ud800"}') == {
        "a": "😀",
        "b": 1e308,
        "c": "\\ud800",
    }


def dotted_archive() -> bytes:
    """What a writer that allows dots writes for keys `a`, `b.1`, `c`, `d.x.y`, `e`."""
    return archive(
        *good_members("a"),
        member(b"b.1.cls", b"1"),
        member(b"b.1.jpg", b"img"),
        *good_members("c"),
        member(b"d.x.y.json", b"{}"),
        *good_members("e"),
    )


@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
def test_a_key_with_a_dot_is_a_counted_dotted_key_sample_not_a_vanished_one(stream):
    data = dotted_archive()
    samples = list(iter_tar_samples(stream(data), URL))
    assert [s["__key__"] for s in samples] == ["a", "b", "c", "d", "e"]
    assert [s.get("__error__") and s["__error__"].reason for s in samples] == [
        None, "dotted_key", None, "dotted_key", None,
    ]  # fmt: skip
    detail = samples[1]["__error__"].detail
    assert "b.1.cls" in detail and "'1.cls'" in detail and "must not contain dots" in detail
    assert set(samples[1]) == {"__key__", "__url__", "__error__"}
    # Counting, listing and windows agree: the dotted groups hold sample indices.
    assert count_tar_samples(stream(data), URL) == 5
    listed = [s["__key__"] for s in iter_tar_samples(stream(data), URL, fields=NO_FIELDS)]
    assert listed == ["a", "b", "c", "d", "e"]
    windows = [
        s["__key__"] for i in range(5) for s in iter_tar_samples(stream(data), URL, i, i + 1)
    ]
    assert windows == listed
    read_until_error(stream(data), "shard_long", declared=4)


def test_a_dotted_extra_field_of_a_sample_is_ignored_as_before():
    """webdataset's `x.seg.png` beside `x.jpg`: one sample, the dotted field unread."""
    data = archive(
        member(b"x.aux.png", b"mask"),  # sorted before the allowlisted fields
        member(b"x.cls", b"1"),
        member(b"x.jpg", b"img"),
        member(b"x.seg.png", b"mask"),
    )
    (sample,) = iter_tar_samples(io.BytesIO(data), URL)
    assert sample == {"__key__": "x", "__url__": SHOWN, "cls": b"1", "jpg": b"img"}


def test_many_dotted_keys_sharing_a_prefix_are_too_many_fields_saying_why():
    data = archive(*(member(f"img.{i:04d}.jpg".encode(), b"img") for i in range(20)))
    _, error = read_until_error(io.BytesIO(data), "too_many_fields")
    assert "img.0000.jpg" in str(error) and "must not contain dots" in str(error)


def test_a_webdataset_tarwriter_shard_with_dotted_keys_counts_every_group():
    wds = pytest.importorskip("webdataset")
    keys = ["s0", "s1.a", "s2", "s3.b.c", "s4", "s5.d", "s6"]
    buffer = io.BytesIO()
    writer = wds.TarWriter(buffer)
    for index, key in enumerate(keys):
        writer.write({"__key__": key, "jpg": b"img%d" % index, "cls": b"%d" % index})
    writer.close()
    data = buffer.getvalue()
    samples = list(iter_tar_samples(io.BytesIO(data), URL))
    good = [s["__key__"] for s in samples if "__error__" not in s]
    dotted = [s["__key__"] for s in samples if "__error__" in s]
    assert good == ["s0", "s2", "s4", "s6"] and dotted == ["s1", "s3", "s5"]
    assert {s["__error__"].reason for s in samples if "__error__" in s} == {"dotted_key"}
    assert count_tar_samples(io.BytesIO(data), URL) == len(keys)


# --- members a Field maps (`caption`): read as asked, never a sample on their own ----------

MAPPED = frozenset(("jpg", "caption"))


@pytest.mark.parametrize("stream", list(STREAMS.values()), ids=list(STREAMS))
def test_a_held_caption_goes_with_its_sample_and_a_later_bad_member_drops_it(stream):
    data = archive(
        member(b"a.caption", b"for a"),
        member(b"a.jpg", HUGE),  # over the image cap below: the sample is one skip
        member(b"b.caption", b"for b"),
        member(b"b.jpg", b"img"),
    )
    limits = ReadLimits(member_bytes=1000)
    a, b = iter_tar_samples(stream(data), URL, fields=MAPPED, limits=limits)
    assert a["__error__"].reason == "member_too_large" and "caption" not in a
    assert b == {"__key__": "b", "__url__": SHOWN, "caption": b"for b", "jpg": b"img"}


def test_a_held_caption_with_a_bad_name_makes_its_sample_a_bad_name_skip():
    data = archive(member(b"a\x1b[2J.caption", b"x"), member(b"a\x1b[2J.jpg", b"img"))
    (sample,) = iter_tar_samples(io.BytesIO(data), URL, fields=MAPPED)
    assert sample["__error__"].reason == "bad_name" and "\x1b" not in sample["__key__"]


def test_a_caption_that_is_not_a_regular_file_is_never_read():
    data = archive(member(b"a.caption", b"", kind=b"2"), member(b"a.jpg", b"img"))
    (sample,) = iter_tar_samples(io.BytesIO(data), URL, fields=MAPPED)
    assert sample == {"__key__": "a", "__url__": SHOWN, "jpg": b"img"}


def test_a_caption_repeated_after_its_image_is_a_duplicate_field():
    data = archive(member(b"a.caption", b"1"), member(b"a.jpg", b"i"), member(b"a.caption", b"2"))
    with pytest.raises(ShardError) as caught:
        list(iter_tar_samples(io.BytesIO(data), URL, fields=MAPPED))
    assert caught.value.reason == "duplicate_field"


def test_orphan_captions_are_not_samples_and_keep_counts_and_windows_unchanged():
    members = []
    for index in range(6):
        members.append(member(f"o{index}.caption".encode(), b"orphan"))  # no image: no sample
        members.append(member(f"k{index}.caption".encode(), f"c{index}".encode()))
        members.append(member(f"k{index}.jpg".encode(), b"img"))
    data = archive(*members)
    assert count_tar_samples(io.BytesIO(data), URL) == 6
    for start, stop in ((0, 6), (2, 5), (5, 6)):
        window = list(iter_tar_samples(io.BytesIO(data), URL, start, stop, fields=MAPPED))
        assert [(s["__key__"], s["caption"]) for s in window] == [
            (f"k{i}", f"c{i}".encode()) for i in range(start, stop)
        ]


def test_mutated_archives_give_the_same_samples_and_errors_with_or_without_a_mapped_field():
    """Reading `caption` too never changes which samples a shard holds or how it fails."""
    import random

    members = []
    for index in range(8):
        if index % 3 == 0:
            members.append(member(f"o{index}.caption".encode(), b"orphan"))
        members.append(member(f"k{index}.caption".encode(), b"c" * (index * 100)))
        members.append(member(f"k{index}.jpg".encode(), b"j" * 700))
        if index % 2:
            members.append(member(f"k{index}.txt".encode(), b"t"))
    original = archive(*members)
    limits = ReadLimits(member_bytes=600)  # some captions and every image over it

    def run(data, fields, start=0, stop=None):
        got = []
        try:
            for sample in iter_tar_samples(
                io.BytesIO(data), URL, start, stop, fields=fields, limits=limits
            ):
                got.append(sample)
        except ShardError as error:
            return got, error.reason
        return got, None

    rng = random.Random(20)
    for _ in range(400):
        data = bytearray(original)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        plain, plain_error = run(bytes(data), frozenset(("jpg", "txt")))
        mapped, mapped_error = run(bytes(data), frozenset(("jpg", "txt", "caption")))
        assert mapped_error == plain_error
        assert [s["__key__"] for s in mapped] == [s["__key__"] for s in plain]
        start = rng.randrange(6)
        window, _ = run(bytes(data), frozenset(("jpg", "caption")), start, start + 3)
        assert [s["__key__"] for s in window] == [s["__key__"] for s in plain[start : start + 3]]
