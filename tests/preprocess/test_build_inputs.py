"""build-shards on bad inputs and on manifest files: skip with a reason, count, never crash."""

from __future__ import annotations

import csv
import json
import shutil
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from preprocess.cli import main
from preprocess.job import run_build
from preprocess.listing import InputError
from preprocess.plan import sample_key
from preprocess.ray_job import BuildError
from shards.formats import get_format
from shards.parquet.layout import metadata_classes
from tests.conftest import shard_files, small_build_config
from tests.oddimages import make_odd_images


@pytest.fixture(scope="module")
def odd_tree(sample_dir, tmp_path_factory):
    """Good sample images plus every odd image, in two class directories."""
    root = tmp_path_factory.mktemp("odd") / "tree"
    shutil.copytree(sample_dir / "class_000", root / "good")
    expected = make_odd_images(root / "odd")
    (root / "odd" / ".hidden.jpg").write_bytes(b"ignored: hidden")
    (root / "odd" / "notes.txt").write_text("ignored: not an image suffix")
    (root / "stray.jpg").write_bytes(b"ignored: not inside a class directory")
    return root, expected


def test_every_bad_input_is_skipped_with_its_reason_and_nothing_is_lost(odd_tree, tmp_path):
    root, expected = odd_tree
    summary = run_build(small_build_config(root, tmp_path / "out", max_skip_fraction=1.0))
    manifest = summary.manifest
    good = len(list((root / "good").iterdir()))
    assert manifest.inputs == good + len(expected)  # hidden, .txt and stray files are not inputs
    assert manifest.written + sum(manifest.skipped.values()) == manifest.inputs
    want = Counter(reason for _, reason in expected.values() if reason)
    assert manifest.skipped == dict(want)
    errors = [
        json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()
    ]
    by_path = {e["path"]: e["reason"] for e in errors}
    for path, reason in expected.values():
        rel = f"odd/{path.name}"
        assert by_path.get(rel) == reason, rel
    assert main(["verify", str(tmp_path / "out")]) == 0


def test_skip_budget_fails_the_job_with_a_histogram_and_no_manifest(odd_tree, tmp_path):
    root, _ = odd_tree
    out = tmp_path / "out"
    with pytest.raises(BuildError, match=r"over --max-skip-fraction 1\.0%.*truncated: \d+"):
        run_build(small_build_config(root, out))
    assert not (out / "manifest.json").exists()
    assert (out / "errors.jsonl").read_text().count("\n") > 10
    # Raising the budget reuses every finished shard.
    summary = run_build(small_build_config(root, out, max_skip_fraction=1.0))
    assert summary.shards_built == 0 and summary.shards_reused > 0


def write_manifest(path, rows, kind):
    if kind == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet"])
def test_manifest_input_with_split_column_and_missing_files(sample_dir, tmp_path, kind):
    files = sorted(sample_dir.rglob("*.*"))[:60]
    rows = [
        {
            "path": str(f.relative_to(sample_dir)),
            "label": "cat" if i % 2 else "dog",
            "split": "test" if i < 10 else "train",
        }
        for i, f in enumerate(files)
    ]
    rows.append({"path": "class_000/does-not-exist.jpg", "label": "cat", "split": "train"})
    manifest_path = sample_dir / f"list-{kind}.{kind}"
    try:
        write_manifest(manifest_path, rows, kind)
        summary = run_build(
            small_build_config(manifest_path, tmp_path / "out", max_skip_fraction=0.5)
        )
    finally:
        manifest_path.unlink()
    manifest = summary.manifest
    assert manifest.classes == ["cat", "dog"]
    assert set(manifest.splits) == {"test", "train"}
    assert manifest.splits["test"].samples == 10
    assert manifest.skipped == {"missing": 1}
    assert manifest.inputs == 61


@pytest.mark.parametrize(
    "bad_path, message",
    [
        ("../outside.jpg", "lies outside"),
        ("/etc/passwd", "lies outside"),
        ("http://x/y.jpg", "a URL"),
    ],
)
def test_manifest_paths_escaping_the_root_are_refused_up_front_when_confined(
    tmp_path, bad_path, message
):
    """--confine-to-input keeps a list's paths in its folder (without it they are read)."""
    listing = tmp_path / "list.csv"
    listing.write_text(f"path,label\n{bad_path},a\n")
    with pytest.raises(InputError, match=f"list.csv line 2: path .*{message}"):
        run_build(small_build_config(listing, tmp_path / "out", confine_to_input=True))
    assert not (tmp_path / "out").exists()


def test_duplicate_manifest_rows_and_escaping_symlinks_are_refused(sample_dir, tmp_path):
    """Duplicates are refused up front; a link out of the root only under --confine-to-input."""
    one = next(sample_dir.rglob("*.jpg"))
    rel = one.relative_to(sample_dir)
    listing = sample_dir / "dupes.csv"
    listing.write_text(f"path,label\n{rel},a\n./{rel},a\n")
    try:
        with pytest.raises(InputError, match="duplicate"):
            run_build(small_build_config(listing, tmp_path / "out"))
    finally:
        listing.unlink()
    tree = tmp_path / "tree" / "cls"
    tree.mkdir(parents=True)
    shutil.copy(one, tree / "real.jpg")
    (tree / "link.jpg").symlink_to("/etc/hostname")
    config = small_build_config(
        tmp_path / "tree", tmp_path / "out2", confine_to_input=True, max_skip_fraction=1.0
    )
    summary = run_build(config)
    assert summary.manifest.skipped == {"outside_input": 1} and summary.manifest.written == 1


def test_numeric_labels_sort_as_numbers_and_keys_are_path_hashes(sample_dir, tmp_path):
    files = sorted(sample_dir.rglob("*.jpg"))[:12]
    listing = sample_dir / "numeric.jsonl"
    listing.write_text(
        "".join(
            json.dumps({"path": str(f.relative_to(sample_dir)), "label": [2, 10, 1][i % 3]}) + "\n"
            for i, f in enumerate(files)
        )
    )
    try:
        summary = run_build(small_build_config(listing, tmp_path / "out", val_fraction=0.0))
    finally:
        listing.unlink()
    assert summary.manifest.classes == ["1", "2", "10"]
    key = sample_key(str(files[0].relative_to(sample_dir)))
    assert len(key) == 16 and "." not in key


def test_empty_input_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    code = main(
        [
            "build-shards",
            "--input",
            str(tmp_path / "empty"),
            "--output",
            str(tmp_path / "o"),
            "--executor",
            "inline",
            "--no-progress",
        ]
    )
    assert code == 1
    assert "no images found" in capsys.readouterr().err


def test_inputs_in_an_object_store_are_listed_through_fsspec(sample_dir, built_shards, tmp_path):
    import fsspec

    memory = fsspec.filesystem("memory")
    for path in sorted(sample_dir.rglob("*")):
        if path.is_file():
            memory.pipe(f"/images/{path.relative_to(sample_dir).as_posix()}", path.read_bytes())
    memory.pipe("/images/.hidden/x.jpg", b"ignored")
    memory.pipe("/images/class_000/notes.txt", b"ignored")
    try:
        summary = run_build(small_build_config("memory://images", tmp_path / "out"))
        assert summary.manifest.inputs == built_shards.manifest.inputs
        listing = "path,label\nclass_000/img_0000000.jpg,a\n../escape.jpg,a\n"
        memory.pipe("/lists/bad.csv", listing.encode())
        with pytest.raises(InputError, match="inside the list's prefix"):
            run_build(small_build_config("memory://lists/bad.csv", tmp_path / "out2"))
        with pytest.raises(ValueError, match="BuildConfig.input: scheme not allowed: 'ftp'"):
            small_build_config("ftp://host/images", tmp_path / "out3")
    finally:
        memory.rm("/images", recursive=True)
        memory.rm("/lists", recursive=True)
    built = built_shards.output
    shards = [*shard_files(built, "tar"), *shard_files(built, "parquet")]
    assert len(shards) == 2 * sum(len(s.shards) for s in built_shards.manifest.splits.values())
    for shard in shards:
        name = shard.relative_to(built)
        assert (tmp_path / "out" / name).read_bytes() == shard.read_bytes(), name


# --- hostile input-list rows: every value bounded, every problem named by file and row -----

HUGE = "9" * 5000  # past Python's 4,300-digit int conversion limit


def test_a_huge_integer_in_an_undeclared_column_is_ignored_and_the_build_runs(
    sample_dir, tmp_path, capsys
):
    """The issue's case: one JSONL row's 5,000-digit `junk` refused the build unnamed."""
    files = sorted(sample_dir.rglob("*.jpg"))[:6]
    lines = [json.dumps({"path": str(f.relative_to(sample_dir)), "label": "a"}) for f in files]
    lines[2] = lines[2][:-1] + f', "junk": {HUGE}}}'
    listing = sample_dir / "huge.jsonl"
    listing.write_text("\n".join(lines) + "\n")
    try:
        out = tmp_path / "out"
        args = ["build-shards", "--input", str(listing), "--output", str(out)]
        code = main([*args, "--executor", "inline", "--no-progress", "--val-fraction", "0"])
    finally:
        listing.unlink()
    assert code == 0, capsys.readouterr().err
    assert json.loads((out / "manifest.json").read_text())["written"] == 6


def hostile_rows(kind: str) -> list[tuple[str, object, str]]:
    """(name, the bad row's cells or raw text, the expected outcome) for one list format.

    Outcomes: `ok` (the row is read, its bad undeclared column ignored), `skip:<reason>` (a
    counted skip naming the file and row), `error:<text>` (an InputError naming them).
    """
    ok = {"path": "a/bad.jpg", "label": "c", "caption": "fine", "meta": 1, "w": 1}
    if kind == "jsonl":
        text = json.dumps(ok)[:-1]
        return [
            ("huge_int_undeclared", text + f', "junk": {HUGE}}}', "ok"),
            ("huge_int_json", text.replace('"meta": 1', f'"meta": {HUGE}') + "}", "skip:bad_json"),
            ("huge_int_weight", text.replace('"w": 1', f'"w": {HUGE}') + "}", "skip:bad_weight"),
            ("huge_int_label", text.replace('"c"', HUGE) + "}", "error:label is an integer"),
            ("huge_int_split", text + f', "split": {HUGE}}}', "error:split is an integer"),
            ("inf_weight", text.replace('"w": 1', '"w": 1e999') + "}", "skip:bad_weight"),
            ("nan_json", text.replace('"meta": 1', '"meta": NaN') + "}", "skip:bad_json"),
            ("huge_float_undeclared", text + ', "junk": 1e99999}', "ok"),
            ("deep", text + ', "junk": ' + "[" * 50_000 + "]" * 50_000 + "}", "error:nested"),
            ("long_caption", json.dumps({**ok, "caption": "x" * 3_000_000}), "skip:bad_text"),
            ("long_path", json.dumps({**ok, "path": "a/" + "p" * 100_000}), "error:4096-byte"),
            ("long_label", json.dumps({**ok, "label": "l" * 100_000}), "error:1024-byte"),
            ("int_path", json.dumps({**ok, "path": 5}), "error:path must be text"),
            ("nul_path", json.dumps({**ok, "path": "a/\x00.jpg"}), "error:control character"),
            ("not_utf8", json.dumps(ok).replace("bad", "b\udce4d"), "error:not UTF-8"),
        ]
    if kind == "csv":
        return [
            ("huge_int_undeclared", f"a/bad.jpg,c,fine,1,1,{HUGE}", "ok"),
            ("huge_int_json", f"a/bad.jpg,c,fine,{HUGE},1,", "skip:bad_json"),
            ("huge_int_weight", f"a/bad.jpg,c,fine,1,{HUGE},", "skip:bad_weight"),
            ("inf_weight", "a/bad.jpg,c,fine,1,1e999,", "skip:bad_weight"),
            ("nan_weight", "a/bad.jpg,c,fine,1,NaN,", "skip:bad_weight"),
            (
                "deep_json",
                "a/bad.jpg,c,fine," + "[" * 50_000 + "]" * 50_000 + ",1,",
                "skip:bad_json",
            ),
            ("long_cell", "a/bad.jpg,c," + "x" * 3_000_000 + ",1,1,", "error:field larger"),
            ("nul_caption", "a/bad.jpg,c,fi\x00ne,1,1,", "ok"),
            ("long_path", "a/" + "p" * 100_000 + ",c,fine,1,1,", "error:4096-byte"),
            ("not_utf8", "a/b\udce4d.jpg,c,fine,1,1,", "error:not UTF-8"),
            ("many_cells", "a/bad.jpg,c,fine,1,1," + ",z" * 100_000, "ok"),
        ]
    return [
        ("inf_weight", {**ok, "w": float("inf")}, "skip:bad_weight"),
        ("nan_weight", {**ok, "w": float("nan")}, "skip:bad_weight"),
        ("long_caption", {**ok, "caption": "x" * 3_000_000}, "skip:bad_text"),
        ("huge_undeclared", {**ok, "junk": "x" * 50_000_000}, "ok"),
        ("binary_path", {**ok, "path": b"a/bad.jpg"}, "error:path must be text"),
        ("long_label", {**ok, "label": "l" * 100_000}, "error:1024-byte"),
        ("nul_path", {**ok, "path": "a/\x00.jpg"}, "error:control character"),
    ]


def write_hostile_list(path, kind: str, bad: object) -> None:
    """Two good rows around one bad one (row 2: line 2 of JSONL, line 3 of CSV)."""
    good = [
        {"path": f"a/{n}.jpg", "label": "c", "caption": "fine", "meta": 1, "w": 1} for n in "xy"
    ]
    if kind == "jsonl":
        lines = [json.dumps(good[0]), bad, json.dumps(good[1])]
        path.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")
    elif kind == "csv":
        lines = [
            "path,label,caption,meta,w,junk",
            "a/x.jpg,c,fine,1,1,",
            bad,
            "a/y.jpg,c,fine,1,1,",
        ]
        path.write_bytes("\r\n".join(lines).encode("utf-8", "surrogateescape") + b"\r\n")
    else:
        rows = [{**good[0], "junk": None}, {"junk": None, **bad}, {**good[1], "junk": None}]
        pq.write_table(pa.Table.from_pylist([{**r, "w": float(r["w"])} for r in rows]), path)


@pytest.mark.parametrize(
    "kind, name, bad, outcome",
    [(kind, *case) for kind in ("jsonl", "csv", "parquet") for case in hostile_rows(kind)],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "",
)
def test_hostile_list_rows_are_read_skipped_or_refused_naming_the_file_and_row(
    tmp_path, kind, name, bad, outcome
):
    from preprocess.columns import InputColumns
    from preprocess.sources import stream_sources

    listing = tmp_path / f"list.{kind}"
    write_hostile_list(listing, kind, bad)
    where = f"{listing} {'row 2' if kind == 'parquet' else 'line 3' if kind == 'csv' else 'line 2'}"
    if name == "binary_path":  # one bytes cell makes the whole column binary: row 1 is first
        where = f"{listing} row 1"
    columns = InputColumns.parse("single", ("caption:txt", "meta:json", "w:weight"))
    found, items = stream_sources(str(listing), columns=columns)
    if outcome.startswith("error:"):
        with pytest.raises(InputError) as caught:
            list(items)
        message = str(caught.value)
        assert message.startswith(where) and outcome[6:] in message, message
        assert len(message) < 600  # never the hostile value itself
        return
    rels = sorted(item.rel for item in items)
    if outcome == "ok":
        assert len(rels) == 3 and not found.left_out
        return
    assert rels == ["a/x.jpg", "a/y.jpg"]
    (left,) = found.left_out
    assert (left.reason, left.is_input) == (outcome[5:], True)
    assert left.detail.startswith(where) and len(left.detail) < 600


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_100_mb_line_is_refused_naming_it_without_being_held(tmp_path, kind):
    import tracemalloc

    from preprocess.list_file import MAX_ROW_CHARS
    from preprocess.sources import stream_sources

    listing = tmp_path / f"list.{kind}"
    with open(listing, "w") as f:
        f.write(
            "path,label\na/x.jpg,c\n" if kind == "csv" else '{"path": "a/x.jpg", "label": "c"}\n'
        )
        f.write("a/y.jpg,c," if kind == "csv" else '{"path": "a/y.jpg", "label": "c", "x": "')
        for _ in range(100):
            f.write("x" * 2**20)
        f.write("\n")
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match=r"line \d: a row of over \d+ characters") as caught:
            list(stream_sources(str(listing))[1])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"{listing} line {3 if kind == 'csv' else 2}" in str(caught.value)
    assert peak < 4 * MAX_ROW_CHARS  # ~2x the bound (the line and its decode), not 100 MB


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_byte_order_mark_and_crlf_line_ends_are_read(tmp_path, kind):
    from preprocess.sources import stream_sources

    listing = tmp_path / f"list.{kind}"
    if kind == "csv":
        text = "path,label\r\na/x.jpg,c\r\na/y.jpg,d\r\n"
    else:
        text = '{"path": "a/x.jpg", "label": "c"}\r\n{"path": "a/y.jpg", "label": "d"}\r\n'
    listing.write_bytes(b"\xef\xbb\xbf" + text.encode())
    items = sorted((item.rel, item.label) for item in stream_sources(str(listing))[1])
    assert items == [("a/x.jpg", "c"), ("a/y.jpg", "d")]


def test_a_parquet_list_reads_only_the_columns_the_build_uses(tmp_path, monkeypatch):
    """A hostile column nobody declared is never decoded: its 50 MB cost nothing."""
    import tracemalloc

    from preprocess.sources import stream_sources

    listing = tmp_path / "list.parquet"
    rows = [{"path": "a/x.jpg", "label": "c", "junk": "x" * 50_000_000}]
    pq.write_table(pa.Table.from_pylist(rows), listing)
    tracemalloc.start()
    try:
        items = list(stream_sources(str(listing))[1])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [item.rel for item in items] == ["a/x.jpg"] and peak < 10 * 2**20


def test_a_parquet_row_group_decoding_past_the_cap_is_refused_naming_its_rows(
    tmp_path, monkeypatch
):
    from preprocess import list_file
    from preprocess.sources import stream_sources

    listing = tmp_path / "list.parquet"
    rows = [{"path": f"a/{i}.jpg", "label": "c"} for i in range(100)]
    pq.write_table(pa.Table.from_pylist(rows), listing, row_group_size=40)
    monkeypatch.setattr(list_file, "MAX_LIST_ROW_GROUP_BYTES", 300)
    with pytest.raises(InputError, match=r"list\.parquet rows 1-40 \(row group 0\).*smaller row"):
        list(stream_sources(str(listing))[1])


def test_an_unreadable_parquet_schema_is_one_error_naming_the_file(tmp_path):
    from preprocess.sources import stream_sources

    nested = pa.array([1])
    for _ in range(120):  # past Arrow's schema depth limit of 100
        nested = pa.ListArray.from_arrays(pa.array([0, 1], pa.int32()), nested)
    listing = tmp_path / "list.parquet"
    pq.write_table(pa.table({"path": ["a/x.jpg"], "label": ["c"], "deep": nested}), listing)
    with pytest.raises(InputError, match=r"list\.parquet: not a readable Parquet file"):
        list(stream_sources(str(listing))[1])


# --- multi-label: ids per row and classes per list are capped ------------------------------


def test_a_multi_label_row_with_too_many_ids_is_a_skip_naming_the_row_and_limit(tmp_path):
    from preprocess.columns import MAX_LABELS_PER_ROW, InputColumns
    from preprocess.sources import stream_sources

    listing = tmp_path / "list.jsonl"
    rows = [
        {"path": "a/x.jpg", "label": ["cat", "dog"]},
        {"path": "a/y.jpg", "label": list(range(100_000))},  # the 100,001 classes
    ]
    listing.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found, items = stream_sources(str(listing), columns=InputColumns.parse("multi", ()))
    assert [(i.rel, i.label) for i in items] == [("a/x.jpg", ["cat", "dog"])]
    (left,) = found.left_out
    assert left.reason == "bad_labels" and left.path == "a/y.jpg"
    assert f"{listing} line 2 column 'label' holds 100000 labels" in left.detail
    assert f"--label multi takes at most {MAX_LABELS_PER_ROW}" in left.detail


def test_a_multi_label_list_naming_too_many_classes_is_refused_naming_the_row(tmp_path):
    from preprocess.columns import MAX_LABELS_PER_ROW, MAX_MULTI_LABEL_CLASSES

    listing = tmp_path / "list.jsonl"
    rows = MAX_MULTI_LABEL_CLASSES // MAX_LABELS_PER_ROW + 1
    with open(listing, "w") as f:
        for row in range(rows):
            ids = range(row * MAX_LABELS_PER_ROW, (row + 1) * MAX_LABELS_PER_ROW)
            f.write(json.dumps({"path": f"a/{row}.jpg", "label": list(ids)}) + "\n")
    out = tmp_path / "out"
    with pytest.raises(InputError) as caught:
        run_build(small_build_config(listing, out, label="multi"))
    message = str(caught.value)
    assert message.startswith(f"{listing} line {rows}: the list names over 65536 classes")
    assert "--label multi" in message and "MAX_MULTI_LABEL_CLASSES" in message
    assert not (out / "manifest.json").exists()


# --- credentials in object-store URLs ------------------------------------------------------


@pytest.mark.parametrize("flag", ["--input", "--output"])
def test_build_urls_with_credentials_are_refused_redacted(tmp_path, capsys, flag):
    url = "s3://AKIAEXAMPLE:s3cr3tKEY@bucket/prefix"
    other = str(tmp_path / ("out" if flag == "--input" else "in"))
    args = {"--input": other, "--output": other, flag: url}
    with pytest.raises(SystemExit):
        main(["build-shards", *[x for pair in args.items() for x in pair], "--executor", "inline"])
    err = capsys.readouterr().err
    assert f"{flag} 's3://***@bucket/prefix' holds credentials" in err
    assert "s3cr3tKEY" not in err and "AKIAEXAMPLE" not in err
    assert "storage_options" in err and "credential chain" in err


def test_listing_an_object_store_url_with_credentials_is_refused():
    from preprocess.sources import stream_sources

    with pytest.raises(
        InputError, match=r"memory://\*\*\*@bucket/images' holds credentials"
    ) as info:
        list(stream_sources("memory://user:s3cr3tKEY@bucket/images")[1])
    assert "s3cr3tKEY" not in str(info.value)


# --- per-input OS errors ----------------------------------------------------------------


def test_a_list_row_the_os_cannot_open_is_one_counted_skip_not_the_builds_end(
    sample_dir, tmp_path, capsys
):
    """Issue 29: a 300-byte file name ended the build as an "environment error"."""
    files = sorted(sample_dir.rglob("*.jpg"))[:4]
    (tmp_path / "loop.jpg").symlink_to(tmp_path / "loop.jpg")
    (tmp_path / "folder.jpg").mkdir()
    (tmp_path / "n").mkdir()
    bad = {
        str(tmp_path / ("n" * 300 + ".jpg")): "bad_path",  # ENAMETOOLONG
        str(tmp_path / "n" / ("n" * 300) / "a.jpg"): "bad_path",  # ENAMETOOLONG in a folder
        str(tmp_path / "loop.jpg"): "loop",  # ELOOP
        str(tmp_path / "folder.jpg"): "missing",  # a directory: not a regular file
        str(files[0]) + "/a.jpg": "missing",  # ENOTDIR
    }
    rows = [{"path": str(f), "label": "a"} for f in files] + [
        {"path": path, "label": "b"} for path in bad
    ]
    listing = tmp_path / "list.jsonl"
    listing.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    args = ["build-shards", "--input", str(listing), "--output", str(out), "--val-fraction", "0"]
    code = main([*args, "--executor", "inline", "--no-progress", "--max-skip-fraction", "0.9"])
    assert code == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["written"] == len(files)
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    # errors.jsonl names each input relative to the list's common root.
    assert sorted((e["path"][-12:], e["reason"]) for e in errors) == sorted(
        (path[-12:], reason) for path, reason in bad.items()
    )
    too_long = next(e for e in errors if e["reason"] == "bad_path")
    assert "File name too long" in too_long["detail"]


def test_long_distinct_labels_are_not_copied_into_every_parquet_shard(sample_dir, tmp_path):
    """Issue 29: 10,000 distinct 1,000-character labels made 1,033 MB of shards.

    Every Parquet shard carried every class name twice. Past `CLASS_NAMES_IN_SHARD_BYTES`
    the names live in the manifest alone; a shard names its class count, which our
    reader's label check needs (HF datasets reads the label as an int64).
    """
    image = next(sample_dir.rglob("*.jpg"))
    labels = [f"{index:04d}" + "x" * 996 for index in range(240)]
    rows = []
    for index, label in enumerate(labels):
        path = tmp_path / "images" / f"{index}.jpg"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(image.read_bytes())
        rows.append({"path": str(path), "label": label})
    listing = tmp_path / "list.jsonl"
    listing.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    summary = run_build(small_build_config(listing, out, val_fraction=0.0, formats=("parquet",)))
    assert summary.manifest.classes == labels and summary.manifest.written == 240
    files = shard_files(out, "parquet")
    # Before: each of the 8 shards carried 2 x 240 KB of names (4.4 MB of shards in all,
    # 0.55 MB now).
    assert len(files) == 8 and sum(path.stat().st_size for path in files) < 2**20
    for path in files:
        metadata = pq.read_schema(path).metadata
        assert sum(len(value) for value in metadata.values()) < 4096
        assert metadata_classes(metadata) == {"cls": 240}
        ours = json.loads(metadata[b"shardpipe"])
        assert ours["class_names"] is None and ours["num_classes"] == 240
        features = json.loads(metadata[b"huggingface"])["info"]["features"]
        assert features["cls"] == {"_type": "Value", "dtype": "int64"}
    samples = [s for path in files for s in get_format("parquet").iter_samples(path, str(path))]
    assert not any("__error__" in sample for sample in samples)
    assert sorted(int(sample["cls"]) for sample in samples) == list(range(240))
