"""Member caps apply while a shard is read, so hostile members never reach the shuffle buffer.

A text or JSON member over its field's cap used to be read (up to the 64 MiB member cap)
and held in the shuffle buffer until its decode refused it: 24 captions of 40 MiB took
a worker from 309 to 1,250 MiB. Now the reader skips it from its header, unread, and
the sample is the same counted skip. The memory checks run the loader in a child
process and read its peak RSS.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.config import Batching
from shards.sample import Field
from shards.tar import BLOCK, TarShardWriter, member_header
from tests.pipeline.conftest import loader_for

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = 24  # samples with an oversized caption
GOOD = 8  # samples the batches are filled (and refilled) with
CAPTION_BYTES = 40 * 2**20


def jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (24, 24, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG")
    return buffer.getvalue()


def write_member(file, name: str, data: bytes | int) -> None:
    """One member; an int writes that many zero bytes as a hole (a sparse file: no disk)."""
    size = data if isinstance(data, int) else len(data)
    file.write(member_header(name, size))
    if isinstance(data, int):
        file.seek(size, 1)
    else:
        file.write(data)
    file.write(bytes(-size % BLOCK))


def caption_shard(path: Path, caption: int | bytes) -> str:
    """`HOSTILE` samples whose caption is `caption` (bytes, or that many NULs: valid UTF-8,
    bad only by their size), interleaved with `GOOD` samples with a short caption."""
    with open(path, "wb") as file:
        for index in range(HOSTILE + GOOD):
            key = f"s{index:04d}"
            good = index % 4 == 3
            write_member(file, f"{key}.cls", b"%d" % (index % 3))
            write_member(file, f"{key}.jpg", jpeg(index))
            write_member(file, f"{key}.txt", b"a short caption" if good else caption)
        file.write(bytes(2 * BLOCK))
    return str(path)


CHILD = """
import json, sys
from pipeline.config import Batching, Crop, Shuffle, Workers
from pipeline.loader import LoaderConfig, build_loader

def peak_kib():  # VmHWM: ru_maxrss would carry the parent's peak over execve
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))

loader = build_loader(LoaderConfig(
    source=sys.argv[1], fields=("image", "label", "txt"), batch=Batching(size=8),
    crop=Crop(image_size=16), workers=Workers(count=0), shuffle=Shuffle(buffer=64, initial=64),
    max_skip_fraction=1.0, train=True, with_keys=True,
))
base = peak_kib()
captions = [text for _, _, texts, _ in loader for text in texts]
print(json.dumps({"base_mib": base / 1024, "peak_mib": peak_kib() / 1024,
                  "skipped": loader.stats.skipped, "captions": sorted(set(captions))}))
"""


def run_child(shard: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, shard],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_oversized_captions_are_bad_text_skips_that_never_reach_memory(tmp_path):
    hostile = run_child(caption_shard(tmp_path / "hostile.tar", CAPTION_BYTES))
    # The baseline: the same skips for a reason that costs no memory (not UTF-8).
    baseline = run_child(caption_shard(tmp_path / "baseline.tar", b"\xff not utf-8"))
    assert hostile["skipped"] == baseline["skipped"] == {"bad_text": HOSTILE}
    assert hostile["captions"] == baseline["captions"] == ["a short caption"]
    growth = hostile["peak_mib"] - baseline["peak_mib"]
    print(
        f"peak RSS: baseline {baseline['peak_mib']:.0f} MiB, 24 x 40 MiB captions "
        f"{hostile['peak_mib']:.0f} MiB ({growth:+.0f})"
    )
    # Held in the buffer, the captions would add 960 MiB; skipped unread, nothing.
    assert growth < 200, (baseline, hostile)


def test_the_loader_gives_the_readers_its_fields_caps(tmp_path):
    """A caption over a field's own `max_bytes` is skipped unread, with the field's reason."""
    path = tmp_path / "train-000000.tar"
    with open(path, "wb") as file:
        writer = TarShardWriter(file)
        for index in range(12):
            writer.write(
                {
                    "__key__": f"s{index:04d}",
                    "jpg": jpeg(index),
                    "txt": (b"x" * 5000) if index % 3 == 0 else b"fits",
                    "json": b'{"w": 1}' if index % 4 else b'{"w": 1, "pad": "' + b"p" * 900 + b'"}',
                }
            )
        writer.close()
    fields = (
        "image",
        Field("txt", "text", max_bytes=4096),
        Field("w", "weight", source="json", key="w", max_bytes=512),
    )
    loader = loader_for(
        str(path), fields=fields, train=False, batch=Batching(size=4), max_skip_fraction=1.0
    )
    caps = {cap.member: cap for cap in loader.dataset.read_limits.member_caps}
    assert (caps["txt"].max_bytes, caps["txt"].reason) == (4096, "bad_text")
    assert (caps["json"].max_bytes, caps["json"].reason) == (512, "bad_weight")
    keys = [k for *_, keys in loader for k in keys]
    # 0, 3, 6, 9 have long captions; 0, 4, 8 a long document: 0 is counted once, for
    # the first problem met in the shard (members come sorted: json before txt).
    assert loader.stats.skipped == {"bad_text": 3, "bad_weight": 3}
    assert set(keys) == {f"s{i:04d}" for i in (1, 2, 5, 7, 10, 11)}
