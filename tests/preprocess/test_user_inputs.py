"""Build inputs as users have them: lists of absolute, outside or URL paths; flat folders."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

import preprocess.images
from preprocess.cli import main
from preprocess.job import run_build
from preprocess.listing import InputError
from preprocess.plan import sample_key
from shards.storage import RetryPolicy
from tests.conftest import small_build_config
from tests.httpserver import LocalHTTPServer

FAST = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02, timeout=0.5, deadline=2.0)
IMAGES = 12


@pytest.fixture(autouse=True)
def fast_input_retry(monkeypatch):
    """Inline builds read in this process: a short budget keeps failures short."""
    monkeypatch.setattr(preprocess.images, "INPUT_RETRY", FAST)


@pytest.fixture
def images(sample_dir, tmp_path):
    """`IMAGES` sample JPEGs (3 of each of 4 classes) under `tmp_path/data/images/<class>/`,
    and their tree paths."""
    root = tmp_path / "data" / "images"
    rels = []
    for path in [p for d in sorted(sample_dir.iterdir()) for p in sorted(d.glob("*.jpg"))[:3]]:
        rel = path.relative_to(sample_dir).as_posix()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, root / rel)
        rels.append(rel)
    return root, rels


def write_list(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("path,label\n" + "".join(f"{p},{label}\n" for p, label in rows))
    return path


def build(input_path, out, **overrides):
    options = {"val_fraction": 0.0, "max_skip_fraction": 1.0, **overrides}
    return run_build(small_build_config(input_path, out, **options))


def keys_of(output) -> set[str]:
    index = json.loads((output / "manifest.json").read_text())
    return {key for split in index["splits"].values() for key in split.get("keys", [])} or {
        line.split("\t")[0] for line in _tar_keys(output)
    }


def _tar_keys(output):
    import tarfile

    for tar in sorted(output.rglob("*.tar")):
        with tarfile.open(tar) as archive:
            yield from sorted({name.split(".", 1)[0] for name in archive.getnames()})


def shard_bytes(output) -> dict[str, bytes]:
    return {
        str(p.relative_to(output)): p.read_bytes()
        for p in sorted(output.rglob("*"))
        if p.suffix in (".tar", ".parquet") and "_build" not in p.parts
    }


def test_a_list_of_absolute_paths_keys_them_as_the_tree_does(images, tmp_path):
    root, rels = images
    tree_out = tmp_path / "tree_out"
    build(root, tree_out)
    listing = write_list(
        tmp_path / "lists" / "abs.csv", [(root / r, r.split("/")[0]) for r in rels]
    )
    summary = build(listing, tmp_path / "abs_out")
    assert summary.manifest.written == IMAGES and not summary.manifest.skipped
    # The deepest common folder of the paths is the tree's root: the same keys, same bytes.
    assert set(_tar_keys(tmp_path / "abs_out")) == {sample_key(r) for r in rels}
    assert shard_bytes(tmp_path / "abs_out") == shard_bytes(tree_out)
    again = build(listing, tmp_path / "abs_out")  # resume: nothing to do
    assert again.shards_built == 0 and again.shards_reused == summary.shards_built
    build(listing, tmp_path / "abs_again")
    assert shard_bytes(tmp_path / "abs_again") == shard_bytes(tree_out)


def test_paths_outside_the_list_folder_are_keyed_from_their_common_folder(images, tmp_path):
    root, rels = images
    listing = write_list(
        tmp_path / "data" / "lists" / "train.csv",
        [(f"../images/{r}", r.split("/")[0]) for r in rels],
    )
    summary = build(listing, tmp_path / "out")
    assert summary.manifest.written == IMAGES
    assert set(_tar_keys(tmp_path / "out")) == {sample_key(r) for r in rels}


def test_input_root_names_the_key_root_and_refuses_paths_outside_it(images, tmp_path):
    root, rels = images
    listing = write_list(tmp_path / "l.csv", [(root / r, "x") for r in rels])
    build(listing, tmp_path / "out", input_root=str(root.parent))
    assert set(_tar_keys(tmp_path / "out")) == {sample_key(f"images/{r}") for r in rels}
    inner = root / rels[0].split("/")[0]
    with pytest.raises(InputError) as refused:
        build(listing, tmp_path / "out2", input_root=str(inner))
    outside = next(r for r in rels if not r.startswith(rels[0].split("/")[0] + "/"))
    message = str(refused.value)  # the path is shown cut to about 80 characters
    assert message.startswith(f"{listing} line {rels.index(outside) + 2}: path '/")
    assert message.endswith(
        f" lies outside --input-root {inner}; pass an --input-root that holds every listed "
        "path, or leave it out"
    )
    assert not (tmp_path / "out2").exists()


def test_confine_to_input_keeps_a_list_inside_its_folder(images, tmp_path):
    root, rels = images
    listing = write_list(tmp_path / "lists" / "l.csv", [(f"../data/images/{rels[0]}", "a")])
    with pytest.raises(
        InputError,
        match=r"line 2: path .* lies outside the list's folder .*"
        r"\(--confine-to-input\)",
    ):
        build(listing, tmp_path / "out", confine_to_input=True)
    write_list(listing, [("https://example.com/a.jpg", "a")])
    with pytest.raises(InputError, match="line 2: path 'https://example.com/a.jpg' is a URL"):
        build(listing, tmp_path / "out", confine_to_input=True)


def test_urls_in_a_list_are_read_with_retries_and_a_failure_is_a_skip_a_rerun_retries(
    images, tmp_path
):
    root, rels = images
    server = LocalHTTPServer(root)
    server.fail(f"/{rels[1]}", count=1, status=503)  # one retry serves it
    server.fail(f"/{rels[2]}", count=2, status=500)  # fails past both attempts, then serves
    with server as base:
        listing = write_list(tmp_path / "urls.csv", [(f"{base}/{r}", "a") for r in rels])
        first = build(listing, tmp_path / "out")
        assert first.manifest.skipped == {"io_error": 1}
        assert first.manifest.written == IMAGES - 1
        # Keys are relative to the URLs' common prefix: the tree paths.
        assert set(_tar_keys(tmp_path / "out")) == {sample_key(r) for r in rels if r != rels[2]}
        again = build(listing, tmp_path / "out")  # the server recovered: retried and written
    assert again.retried == 1 and again.recovered == 1
    assert again.manifest.written == IMAGES and not again.manifest.skipped
    # A 503 then the image; the rerun rebuilds the one shard (with the skipped input) again.
    assert server.count(f"/{rels[1]}") == 3


def test_local_and_url_inputs_get_keys_that_name_the_host(images, tmp_path):
    root, rels = images
    with LocalHTTPServer(root) as base:
        host = base.split("://", 1)[1]
        rows = [(root / rels[0], "a"), (root / rels[3], "a"), (f"{base}/{rels[1]}", "a")]
        listing = write_list(tmp_path / "mixed.csv", rows)
        summary = build(listing, tmp_path / "out")
    assert summary.manifest.written == 3
    # Local paths inside the list's folder from there; the URL from its host's common
    # prefix (its folder), after its host: two places never share a key.
    url_key = f"{host}/{rels[1].rsplit('/', 1)[1]}"
    local = [f"data/images/{rels[i]}" for i in (0, 3)]
    assert set(_tar_keys(tmp_path / "out")) == {sample_key(k) for k in (*local, url_key)}


def test_two_inputs_that_would_share_a_key_are_refused_naming_both(tmp_path):
    listing = write_list(
        tmp_path / "clash.csv", [("http://h.test/a/x.jpg", "a"), ("https://h.test/a/x.jpg", "a")]
    )
    with pytest.raises(InputError) as clash:
        build(listing, tmp_path / "out")
    assert str(clash.value) == (
        f"{listing} line 2 and {listing} line 3: two inputs would get one key 'h.test/x.jpg': "
        "http://h.test/a/x.jpg and https://h.test/a/x.jpg; pass an --input-root that tells "
        "them apart, or list only one of them"
    )


def test_a_malformed_input_url_is_one_line_naming_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["build-shards", "--input", "http://[::1", "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("preprocess build-shards: error: --input: ")
    assert "Traceback" not in err and not (tmp_path / "o").exists()


# Folders ----------------------------------------------------------------------------


@pytest.fixture
def flat(images, tmp_path):
    """The images directly under one folder, no class folders."""
    root, rels = images
    folder = tmp_path / "flat"
    folder.mkdir()
    for rel in rels:
        shutil.copy(root / rel, folder / rel.replace("/", "_"))
    (folder / "notes.txt").write_text("not an image")
    return folder, sorted(rel.replace("/", "_") for rel in rels)


def test_a_flat_folder_builds_with_label_none(flat, tmp_path):
    folder, names = flat
    summary = build(folder, tmp_path / "out", label="none")
    assert summary.manifest.written == IMAGES and summary.manifest.classes == []
    assert set(_tar_keys(tmp_path / "out")) == {sample_key(n) for n in names}
    assert summary.left_out_suffixes == {".txt": 1}


def test_a_flat_folder_without_label_none_says_how_many_images_and_which_flag(flat, tmp_path):
    folder, _ = flat
    with pytest.raises(InputError) as refused:
        build(folder, tmp_path / "out")
    assert str(refused.value) == (
        f"no images found under {folder}; {IMAGES} images sit directly under the root, which "
        "has no class folders; pass --label none to build them without classes, or put them "
        "in one folder per class, or list them with their classes in a CSV (path,label)"
    )


def test_a_flat_folder_with_classes_from_a_list_file_builds(flat, tmp_path):
    folder, names = flat
    listing = write_list(folder / "labels.csv", [(n, n.split("_")[0]) for n in names])
    summary = build(listing, tmp_path / "out")
    assert summary.manifest.written == IMAGES
    assert summary.manifest.classes == sorted({n.split("_")[0] for n in names})


def test_a_one_class_tree_and_unequal_classes_warn_in_one_line(images, tmp_path, caplog):
    root, rels = images
    one = tmp_path / "one"
    shutil.copytree(root / rels[0].split("/")[0], one / "only")
    with caplog.at_level(logging.WARNING, logger="preprocess.sources"):
        build(one, tmp_path / "out1")
    count = len(list((one / "only").iterdir()))
    assert [r.getMessage() for r in caplog.records] == [
        f"input {one} has one class folder (only, {count} images): every sample gets label 0; "
        "pass --label none for data without classes"
    ]
    caplog.clear()
    uneven = tmp_path / "uneven"
    (uneven / "big").mkdir(parents=True)
    (uneven / "small").mkdir()
    jpg = root / rels[0]
    for index in range(11):
        shutil.copy(jpg, uneven / "big" / f"{index}.jpg")
    shutil.copy(jpg, uneven / "small" / "0.jpg")
    with caplog.at_level(logging.WARNING, logger="preprocess.sources"):
        summary = build(uneven, tmp_path / "out2")
    assert summary.manifest.written == 12
    assert [r.getMessage() for r in caplog.records] == [
        f"input {uneven} has very unequal classes: big holds 11 images, small only 1 (over "
        "10x); check for stray or unfinished folders"
    ]
