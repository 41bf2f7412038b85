"""Listing accounts for every file: inputs by the decode policy's suffixes, the rest by suffix."""

from __future__ import annotations

import fsspec
import pytest
from PIL import Image

from preprocess.images import ImageConfig, process_image, read_source
from preprocess.listing import IMAGE_SUFFIXES, NOT_DECODED, Listing
from preprocess.sources import scan_sources, stream_sources
from shards.image.policy import INPUT_FORMATS
from shards.sample import SampleError
from tests import oddimages


@pytest.fixture
def mixed_tree(tmp_path):
    """One class of every widely used image type, plus files that are not inputs."""
    root = tmp_path / "tree"
    cls = root / "things"
    cls.mkdir(parents=True)
    foreign = oddimages.foreign_format_bytes()
    for filename, data, _ in foreign.values():
        (cls / filename).write_bytes(data)
    (cls / "photo.JPG").write_bytes(oddimages.photo_jpeg(64, 48))
    for name in ("a.txt", "b.txt", "c.TXT"):
        (cls / name).write_text("notes")
    for name in ("x.tga", "y.tga"):
        (cls / name).write_bytes(oddimages.encode(oddimages.noise_image(16, 16), "TGA"))
    (cls / "README").write_text("no suffix")
    (cls / ".hidden.jpg").write_bytes(b"hidden")
    return root, foreign


def test_every_file_is_an_input_or_counted_by_suffix(mixed_tree):
    root, foreign = mixed_tree
    listing = scan_sources(str(root))
    names = sorted(item.rel.split("/")[-1] for item in listing.items)
    assert names == sorted([filename for filename, _, _ in foreign.values()] + ["photo.JPG"])
    assert listing.suffix_counts() == {".tga": 2, ".txt": 3, "(none)": 1}
    assert listing.left_out_counts() == {"hidden": 1, "other_suffix": 6}
    line = listing.describe_suffixes()
    assert line.startswith(".txt: 3, .tga: 2 (TGA has no magic bytes")
    assert line.endswith("(none): 1")


def test_accepted_types_go_through_the_decode_policy(mixed_tree):
    root, foreign = mixed_tree
    for item in scan_sources(str(root)).items:
        name = item.rel.split("/")[-1]
        expected = next((r for f, _, r in foreign.values() if f == name), None)
        try:
            process_image(read_source(item.path, 2**20), ImageConfig())
            outcome = None
        except SampleError as error:
            outcome = error.reason
        assert outcome == expected, name


def test_suffixes_follow_the_input_formats():
    for suffix in (".ppm", ".pgm", ".pbm", ".pnm", ".mpo", ".ico", ".jpg", ".tif"):
        assert suffix in IMAGE_SUFFIXES
    assert (".avif" in IMAGE_SUFFIXES) == ("AVIF" in INPUT_FORMATS)
    assert (".avif" in NOT_DECODED) != ("AVIF" in INPUT_FORMATS)
    assert not set(NOT_DECODED) & IMAGE_SUFFIXES  # a suffix is read or named, never both


# Modes Pillow needs to write a suffix's own kind of file (`.pbm` is bilevel, `.pfm` float).
_SAVE_MODES = {".pbm": "1", ".pgm": "L", ".pfm": "F"}


def sample_for_suffix(path, suffix: str) -> None:
    """A small picture written by Pillow in the format it registers for `suffix`."""
    image = oddimages.noise_image(40, 32).convert(_SAVE_MODES.get(suffix, "RGB"))
    name = Image.registered_extensions()[suffix]
    if name == "MPO":  # a camera's two-picture JPEG
        image.save(path, "MPO", save_all=True, append_images=[image.transpose(0)])
    else:
        image.save(path, name)


def test_every_listed_suffix_decodes_through_the_builds_image_function(tmp_path):
    """The listing's suffixes are exactly what the decoder opens: a file of each, written in
    the format Pillow registers for its suffix, is processed (before, `.dib` was listed and
    always skipped `unidentified`, and `.pfm` decoded but was never listed)."""
    registered = Image.registered_extensions()
    assert ".dib" not in IMAGE_SUFFIXES and ".pfm" in IMAGE_SUFFIXES
    for suffix in sorted(IMAGE_SUFFIXES):
        path = tmp_path / f"sample{suffix}"
        sample_for_suffix(path, suffix)
        result = process_image(read_source(str(path), 2**24), ImageConfig(image_size=16))
        assert result.width == 16 or result.height == 16, suffix
    # And every suffix Pillow registers for an allowed format is listed.
    opened = {"MPO": "JPEG"}
    allowed = {s for s, name in registered.items() if opened.get(name, name) in INPUT_FORMATS}
    assert allowed == IMAGE_SUFFIXES


def test_a_suffix_of_a_format_the_decoder_refuses_is_counted_with_its_reason(tmp_path):
    """A `.dib` Pillow writes (a headerless bitmap, format DIB) is not an input: it is left out
    by suffix with the reason, never listed and then skipped as `unidentified`."""
    cls = tmp_path / "tree" / "things"
    cls.mkdir(parents=True)
    oddimages.noise_image(16, 16).save(cls / "icon.dib", "DIB")
    (cls / "ok.png").write_bytes(oddimages.encode(oddimages.noise_image(16, 16), "PNG"))
    with pytest.raises(SampleError, match="unidentified"):  # what listing it would have cost
        process_image((cls / "icon.dib").read_bytes(), ImageConfig())
    listing = scan_sources(str(tmp_path / "tree"))
    assert [item.rel for item in listing.items] == ["things/ok.png"]
    assert listing.suffix_counts() == {".dib": 1}
    assert (
        "DIB" in listing.describe_suffixes()
        and "not on the decoder allowlist" in NOT_DECODED[".dib"]
    )


def test_describe_suffixes_sums_the_long_tail():
    listing = Listing([])
    listing.left_out_suffixes.update({f".x{i:02d}": 1 for i in range(12)})
    listing.left_out_suffixes[".txt"] = 5
    line = listing.describe_suffixes(limit=3)
    assert line == ".txt: 5, .x00: 1, .x01: 1, 10 more suffixes: 10"
    assert Listing([]).describe_suffixes() == ""


def test_remote_tree_is_counted_like_a_local_one():
    fs = fsspec.filesystem("memory")
    base = "/h4-listing-tree"
    for path, data in {
        "cats/a.jpg": oddimages.photo_jpeg(32, 32),
        "cats/b.pgm": oddimages.encode(oddimages.banded("L", oddimages.BANDS["L"]), "PPM"),
        "cats/notes.txt": b"x",
        "cats/pic.tga": b"x",
        "cats/.DS_Store": b"x",
        "stray.jpg": b"x",
    }.items():
        fs.pipe(f"{base}/{path}", data)
    try:
        listing, items = stream_sources(f"memory://{base}")
        rels = sorted(item.rel for item in items)
    finally:
        fs.rm(base, recursive=True)
    assert rels == ["cats/a.jpg", "cats/b.pgm"]
    assert listing.suffix_counts() == {".tga": 1, ".txt": 1}
    assert listing.left_out_counts() == {"hidden": 1, "no_class": 1, "other_suffix": 2}
