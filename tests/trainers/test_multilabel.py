"""Multi-label training: BCE, mAP/F1 on validation, per-class thresholds, and the metrics maths."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shards.tar import TarShardWriter
from tests.trainers.conftest import read_rows, train_main
from trainers.config import Data, TrainConfig, parse_command_line
from trainers.metrics import f1_scores, multi_label_report, summary_line

# Saturated colours far apart: stripes of a sample's label colours encode its label set.
COLOURS = ((230, 30, 30), (30, 200, 40), (40, 60, 230), (240, 240, 240), (20, 20, 20))
CLASSES = len(COLOURS)
IMAGE_SIDE = 48
STRIPE = 4  # pixels; with up to 3 labels any crop of 12+ pixels shows every label


def stripe_image(labels: list[int], rng: random.Random) -> bytes:
    """Horizontal stripes cycling through the labels' colours, a little noise, as JPEG."""
    pixels = np.zeros((IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.int16)
    offset = rng.randrange(len(labels))
    for row in range(IMAGE_SIDE):
        pixels[row] = COLOURS[labels[(row // STRIPE + offset) % len(labels)]]
    noise = np.random.default_rng(rng.randrange(2**32)).integers(-20, 21, pixels.shape)
    image = Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))
    encoded = io.BytesIO()
    image.save(encoded, "JPEG", quality=90)
    return encoded.getvalue()


def write_multilabel_shards(root: Path, split: str, shards: int, per_shard: int, seed: int) -> str:
    """Tar shards of `{key}.jpg` + `{key}.labels` (a JSON list of 1-3 class ids)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        with open(root / f"{split}-{shard:06d}.tar", "wb") as stream:
            writer = TarShardWriter(stream)
            for i in range(per_shard):
                labels = sorted(rng.sample(range(CLASSES), rng.choice((1, 2, 2, 3))))
                writer.write(
                    {
                        "__key__": f"{split}_{shard}_{i:04d}",
                        "jpg": stripe_image(labels, rng),
                        "labels": json.dumps(labels).encode(),
                    }
                )
            writer.close()
    return str(root / f"{split}-{{000000..{shards - 1:06d}}}.tar")


@pytest.fixture(scope="module")
def multilabel_shards(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("multilabel")
    train = write_multilabel_shards(root, "train", shards=4, per_shard=80, seed=1)
    val = write_multilabel_shards(root, "val", shards=2, per_shard=48, seed=2)
    return train, val


def label_frequencies(pattern_dir: Path, split: str) -> np.ndarray:
    """Share of samples holding each class: the AP a model without signal gets."""
    from shards.tar import iter_tar_samples

    counts, total = np.zeros(CLASSES), 0
    for path in sorted(pattern_dir.glob(f"{split}-*.tar")):
        with open(path, "rb") as stream:
            for sample in iter_tar_samples(stream, str(path)):
                counts[json.loads(sample["labels"])] += 1
                total += 1
    return counts / total


def train_multilabel(train: str, val: str, run_dir: Path, **flags) -> int:
    """4 epochs of `cnn` at 24 px on the stripes data; `flags` add to or replace the flags."""
    options = dict(task="multi-label", val_shards=val, num_classes=CLASSES, epochs=4)
    options.update(batch_size=16, lr=0.2, image_size=24, overlap_check="urls")
    return train_main(Path(train), run_dir, **{**options, **flags})


@pytest.mark.timeout(120)
def test_multilabel_training_learns_label_sets_above_the_frequency_baseline(
    multilabel_shards, tmp_path
):
    train, val = multilabel_shards
    run_dir = tmp_path / "run"
    assert train_multilabel(train, val, run_dir) == 0
    evals = read_rows(run_dir, "eval")
    baseline = float(label_frequencies(Path(train).parent, "val").mean())
    last = evals[-1]
    assert last["val_samples"] == 96  # every val sample once
    assert "val_accuracy" not in last
    assert last["val_map"] > baseline + 0.3, (last, baseline)
    assert last["val_map"] > evals[0]["val_map"] or evals[0]["val_map"] > 0.9
    assert 0 < last["val_f1_micro"] <= 1 and 0 < last["val_f1_macro"] <= 1
    assert last["val_f1_tuned"] >= last["val_f1_macro"] - 1e-9  # chosen for F1 on this split
    thresholds = json.loads((run_dir / "thresholds.json").read_text())
    assert [row["class"] for row in thresholds["classes"]] == list(range(CLASSES))
    assert all(0 < row["threshold"] <= 1 and row["positives"] > 0 for row in thresholds["classes"])
    assert thresholds["val_map"] == pytest.approx(last["val_map"])
    end = read_rows(run_dir, "end")[-1]
    assert end["val_map"] == last["val_map"]
    csv_header = (run_dir / "metrics.csv").read_text().splitlines()[0]
    assert "val_map" in csv_header and "val_f1_tuned" in csv_header


def test_multilabel_reads_targets_from_a_json_key(tmp_path):
    rng = random.Random(3)
    root = tmp_path / "shards"
    root.mkdir()
    with open(root / "train-000000.tar", "wb") as stream:
        writer = TarShardWriter(stream)
        for i in range(32):
            labels = sorted(rng.sample(range(CLASSES), 2))
            meta = {"tags": labels, "source": "test"}
            writer.write(
                {
                    "__key__": f"k{i:03d}",
                    "jpg": stripe_image(labels, rng),
                    "json": json.dumps(meta).encode(),
                }
            )
        writer.close()
    run_dir = tmp_path / "run"
    code = train_main(
        root / "train-000000.tar",
        run_dir,
        task="multi-label",
        label_field="json:tags",
        num_classes=CLASSES,
        epochs=1,
        batch_size=8,
    )
    assert code == 0
    assert len(read_rows(run_dir, "train")) == 4  # 32 samples, batches of 8


def test_multilabel_without_a_class_count_is_one_clear_error(multilabel_shards, tmp_path, capsys):
    train, val = multilabel_shards
    code = train_main(Path(train), tmp_path / "run", task="multi-label", val_shards=val)
    assert code == 1
    err = capsys.readouterr().err
    assert "no class list" in err and "--num-classes" in err
    assert not (tmp_path / "run").exists()  # found before the run directory is made


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--task", "multi-label", "--label-field", "cls"], "does not hold multi-label targets"),
        (["--label-field", "labels"], "does not hold single-label targets"),
        (["--label-field", "txt"], "(one class id)"),
        (["--label-field", "json:"], "(one class id)"),
        (["--task", "multi-label", "--label-smoothing", "0.1"], "single-label training"),
    ],
)
def test_label_flag_mistakes_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_command_line(["--train-shards", "x", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_single_label_stays_the_default():
    config = TrainConfig(data=Data(train_shards="x"))
    assert config.data.task == "single-label" and config.data.label_field is None


def test_report_on_known_scores():
    targets = np.array([[1, 0], [1, 1], [0, 0], [0, 1]], dtype=bool)
    scores = np.array([[0.9, 0.2], [0.8, 0.7], [0.3, 0.6], [0.1, 0.4]])
    report = multi_label_report(scores, targets)
    # Class 0 ranks both positives first: AP 1. Class 1: ranks 0.7 (hit), 0.6, 0.4 (hit).
    assert report.ap[0] == pytest.approx(1.0)
    assert report.ap[1] == pytest.approx((1 + 2 / 3) / 2)
    assert report.mean_ap == pytest.approx((1 + (1 + 2 / 3) / 2) / 2)
    assert report.thresholds[0] == pytest.approx(0.8)  # predicting the top two is perfect
    assert report.f1[0] == pytest.approx(1.0)
    assert report.f1_tuned >= report.f1_macro
    micro, macro = f1_scores(scores >= 0.5, targets)
    # At 0.5: class 0 tp 2; class 1 predicts 0.7 (hit) and 0.6 (miss), misses 0.4.
    assert micro == pytest.approx(2 * 3 / (2 * 3 + 1 + 1))
    assert macro == pytest.approx((1.0 + 2 * 1 / (2 + 2)) / 2)


def test_thresholds_never_split_tied_scores_and_absent_classes_are_left_out():
    targets = np.array([[1, 0], [0, 0], [1, 0]], dtype=bool)
    scores = np.array([[0.5, 0.1], [0.5, 0.2], [0.2, 0.3]])
    report = multi_label_report(scores, targets)
    assert report.thresholds[0] in (0.5, 0.2)  # never a cut between the two 0.5s
    assert np.isnan(report.ap[1]) and report.thresholds[1] == 0.5
    assert report.mean_ap == pytest.approx(report.ap[0])
    empty = multi_label_report(np.zeros((0, 3)), np.zeros((0, 3), bool))
    assert empty.samples == 0 and empty.mean_ap == 0.0


def test_summary_line_shows_map_for_multilabel_runs():
    end = {
        "step": 10,
        "time_s": 1.0,
        "loss": 0.2,
        "val_map": 0.9,
        "val_f1_micro": 0.8,
        "val_f1_macro": 0.7,
        "val_loss": 0.1,
        "val_samples": 96,
        "images_per_s": 100.0,
        "verdict": "compute-bound",
    }
    assert "val mAP 0.9000, F1 micro 0.8000 / macro 0.7000" in summary_line(end, 5)


@pytest.mark.timeout(120)
def test_multilabel_training_with_mixup_and_cutmix_learns(multilabel_shards, tmp_path):
    """Mixed batches mix the multi-hot targets too (BCE takes them): still well above the
    label-frequency baseline."""
    train, val = multilabel_shards
    run_dir = tmp_path / "run"
    assert train_multilabel(train, val, run_dir, mixup=0.8, cutmix=1.0) == 0
    baseline = float(label_frequencies(Path(train).parent, "val").mean())
    last = read_rows(run_dir, "eval")[-1]
    assert last["val_map"] > baseline + 0.3, (last, baseline)
