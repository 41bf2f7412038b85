"""Check that open_clip's own trainer trains on a caption build, counting it by `sizes.json`.

open_clip needs torchvision, which pins another torch than ours (`torch==2.14.1
torchvision==0.29.1`, a multi-GB CUDA build), so this script makes a virtual
environment of its own (default `/tmp/openclip-venv`, kept for reruns), builds a small
image-caption dataset with this checkout (`--label none`, a list whose `caption`
column becomes each sample's `txt`; the default `by_format` layout), and runs

    python -m open_clip_train.main --dataset-type webdataset \\
        --train-data 'OUT/tar/train-{000000..00000N}.tar' --val-data 'OUT/tar/val-...'

there with no `--train-num-samples`: open_clip then sums the shards' counts from
`OUT/tar/sizes.json`, or refuses to start. The model is a tiny ViT given to open_clip as
a `local-dir:` config (no weights, nothing downloaded), trained 1 epoch on the CPU.
It prints one JSON line (steps, samples trained, samples per epoch against the
manifest, whether val was evaluated) and exits 0, or prints one line starting
`openclip_check: FAILED` and exits 1.

    .venv/bin/python benchmarks/openclip_check.py [--venv DIR] [--keep OUT]

Not part of the test suite (minutes, gigabytes): `tests/test_clients.py` runs it only
when `SHARDPIPE_OPENCLIP_CHECK=1`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# open_clip's training extra, as its README installs it: pandas, and webdataset<=0.2.86
# (webdataset 1.x ends each shard with an empty dict that open_clip 3.3's grouping
# stage cannot read: `KeyError: 'fname'`).
PACKAGES = ["torch==2.14.1", "torchvision==0.29.1", "open_clip_torch[training]"]
BATCH_SIZE = 8
IMAGE_SIZE = 64
# A ViT small enough to train an epoch on a shared CPU in seconds; the text tower keeps
# open_clip's tokenizer (its vocabulary ships with the package) and context length.
TINY_MODEL = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": IMAGE_SIZE, "layers": 2, "width": 64, "patch_size": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
# open_clip_train/train.py logs `Train Epoch: 0 [  72/72 (100%)] ...` every step asked for.
TRAIN_LINE = re.compile(r"Train Epoch: (\d+) \[\s*(\d+)/(\d+) \((\d+)%\)\]")


def make_env(directory: Path) -> Path:
    """The environment's python, with open_clip's training extra installed.

    pip runs every time (seconds when nothing is missing), so an environment made by
    hand with another webdataset is put back to the versions open_clip asks for.
    """
    python = directory / "bin" / "python"
    if not python.exists():
        venv.create(directory, with_pip=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES], check=True)
    return python


def build_captions(output: Path):
    """Build image-caption shards (train and val) into `output`; its manifest."""
    from preprocess.config import BuildConfig
    from preprocess.images import ImageConfig
    from preprocess.job import run_build
    from preprocess.sample import make_sample

    images = output.parent / "images"
    make_sample(images, 96, classes=4, seed=1, workers=1)
    rows = [
        {"path": path.relative_to(images).as_posix(), "caption": f"a photo of {path.parent.name}"}
        for path in sorted(p for p in images.rglob("*") if p.is_file())
    ]
    listing = images / "captions.jsonl"
    listing.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = BuildConfig(
        input=str(listing),
        output=str(output),
        image=ImageConfig(image_size=IMAGE_SIZE),
        shard_size=16,
        val_fraction=0.25,
        label="none",
        fields=("caption:txt",),
        executor="inline",
        progress=False,
    )
    return run_build(config).manifest


def split_pattern(manifest, output: Path, split: str) -> str:
    """`OUT/tar/train-{000000..000004}.tar`: the brace pattern open_clip expands."""
    from shards.manifest import shard_pattern

    count = len(manifest.shard_table(split, "tar"))
    return str(output / shard_pattern(split, count, "tar", manifest.layout))


def train_command(python: Path, manifest, output: Path, work: Path) -> list[str]:
    """open_clip's trainer on the build, 1 epoch on the CPU, without `--train-num-samples`."""
    model_dir = work / "tiny-model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_MODEL}))
    return [
        str(python), "-m", "open_clip_train.main",
        "--dataset-type", "webdataset",
        "--train-data", split_pattern(manifest, output, "train"),
        "--val-data", split_pattern(manifest, output, "val"),
        "--model", f"local-dir:{model_dir}",
        "--epochs", "1", "--batch-size", str(BATCH_SIZE), "--workers", "1",
        "--lr", "5e-4", "--warmup", "2", "--precision", "fp32", "--seed", "0",
        "--log-every-n-steps", "1", "--save-frequency", "0",
        "--logs", str(work / "logs"), "--name", "openclip-check",
    ]  # fmt: skip


def summarize(log: str, train_samples: int) -> dict:
    """Steps and samples trained, read off the trainer's log, against the manifest."""
    lines = TRAIN_LINE.findall(log)
    if not lines:
        return {"error": "the trainer logged no training step"}
    _, seen, per_epoch, _ = lines[-1]
    expected = math.ceil(train_samples / BATCH_SIZE) * BATCH_SIZE  # open_clip rounds up
    result = {
        "steps": int(seen) // BATCH_SIZE,
        "samples_trained": int(seen),
        "samples_per_epoch": int(per_epoch),
        "manifest_train_samples": train_samples,
        "expected_samples_per_epoch": expected,
        "val_evaluated": "Eval Epoch:" in log,  # open_clip's zero-shot retrieval on val
    }
    if int(per_epoch) != expected:
        result["error"] = f"open_clip counted {per_epoch} samples an epoch, not {expected}"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default="/tmp/openclip-venv", help="open_clip's environment")
    parser.add_argument("--keep", help="build and train in this directory and keep it")
    args = parser.parse_args(argv)
    python = make_env(Path(args.venv))
    with tempfile.TemporaryDirectory(prefix="openclip-check-") as scratch:
        work = Path(args.keep) if args.keep else Path(scratch)
        output = work / "out"
        manifest = build_captions(output)
        run = subprocess.run(
            train_command(python, manifest, output, work),
            capture_output=True,
            text=True,
            check=False,
            cwd=work,
        )
    log = run.stdout + run.stderr
    result = summarize(log, manifest.splits["train"].samples)
    if run.returncode != 0:
        result["error"] = f"the trainer exited {run.returncode}"
    print(json.dumps(result))
    if "error" in result:
        last = [line for line in log.splitlines() if line.strip()][-1:] or ["no output"]
        print(log[-4000:], file=sys.stderr)
        print(f"openclip_check: FAILED: {result['error']} (last line: {last[0][:300]})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
