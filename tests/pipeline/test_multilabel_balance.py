"""Class balance with multi-label samples: each drawn sample weighs as its rarest label."""

from __future__ import annotations

import dataclasses
import io
import json
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from pipeline.config import Batching, Crop, Resampled, Workers
from pipeline.dataset import ShardStream
from pipeline.loader import LoaderConfig, build_loader
from pipeline.stages import BalanceRule
from shards.sample import DEFAULT_FIELDS, Field
from shards.tar import TarShardWriter

TAGS = Field("tags", "multi_label", num_classes=3)
# Class 0 in every sample, class 1 in every other one, class 2 in one of ten.
SAMPLES = 200


def label_set(i: int) -> list[int]:
    return [0] + ([1] if i % 2 else []) + ([2] if i % 10 == 0 else [])


@pytest.fixture(scope="module")
def skewed_multilabel(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("ml-skew")
    encoded = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 120, 200)).save(encoded, "JPEG")
    for shard in range(4):
        with open(root / f"train-{shard:06d}.tar", "wb") as stream:
            writer = TarShardWriter(stream)
            for i in range(shard * 50, shard * 50 + 50):
                labels = json.dumps(label_set(i)).encode()
                writer.write({"__key__": f"s{i:04d}", "jpg": encoded.getvalue(), "labels": labels})
            writer.close()
    return str(root / "train-{000000..000003}.tar")


def drawn_label_sets(source: str, weights: tuple[float, ...] | None) -> list[tuple[int, ...]]:
    """600 draws of a resampled stream over the tags field, balanced by `weights`."""
    config = LoaderConfig(
        source=source,
        fields=("image", TAGS),
        batch=Batching(size=20),
        sampling=Resampled(epoch_samples=600),
        crop=Crop(image_size=16),
        workers=Workers(count=0, reuse_buffers=False),
    )
    loader = build_loader(config)
    # The loader takes class counts from a manifest (single-label counts for now); the
    # stream's rule is what this test is about, so the weights are given to it directly.
    settings = dataclasses.replace(loader.settings, class_weights=weights)
    stream = ShardStream(loader.dataset.sources, settings, loader.make_transform(), loader.shared)
    sets = []
    for values, *_ in stream:
        for row in values[1]:
            sets.append(tuple(int(i) for i in np.flatnonzero(np.asarray(row))))
    return sets


def test_multilabel_balance_draws_rare_labels_as_often_as_their_samples_allow(skewed_multilabel):
    counts = Counter(i for n in range(SAMPLES) for i in label_set(n))  # 200 : 100 : 20
    weights = tuple(1.0 / counts[c] for c in range(3))
    plain = drawn_label_sets(skewed_multilabel, None)
    balanced = drawn_label_sets(skewed_multilabel, weights)
    assert len(plain) == len(balanced) == 600

    def share(sets, label):
        return sum(label in s for s in sets) / len(sets)

    assert share(plain, 2) < 0.2  # 10% without balancing
    # Rarest-label weights: 20 x 1/20 : 90 x 1/100 : 90 x 1/200 -> 2 in ~43% of draws.
    assert 0.3 < share(balanced, 2) < 0.6, share(balanced, 2)
    only_zero = sum(s == (0,) for s in balanced) / len(balanced)
    assert only_zero < sum(s == (0,) for s in plain) / len(plain)


def test_the_rule_per_sample():
    weights = (0.01, 0.1, 0.5, 0.0)
    rule = BalanceRule.build(
        weights, (DEFAULT_FIELDS[0], Field("tags", "multi_label", num_classes=4))
    )

    def sample(member: bytes) -> dict:
        return {"__key__": "k", "labels": member}

    assert rule.weight(sample(b"[0, 2]"), 9.0) == 0.5  # its rarest label
    assert rule.weight(sample(b"[0]"), 9.0) == 0.01
    assert rule.weight(sample(b"[]"), 9.0) == 0.01  # no label: the most common class
    assert rule.weight(sample(b"not json"), 9.0) == 9.0  # decode judges it later
    assert rule.weight({"__key__": "k"}, 9.0) == 9.0


def test_single_label_keeps_its_rule_even_beside_a_multilabel_field():
    weights = (0.25, 0.5)
    fields = (DEFAULT_FIELDS[0], DEFAULT_FIELDS[1], Field("tags", "multi_label", num_classes=2))
    rule = BalanceRule.build(weights, fields)
    assert rule.field is None
    assert rule.weight({"__key__": "k", "cls": b"1", "labels": b"[0]"}, 9.0) == 0.5
    assert BalanceRule.build(weights, DEFAULT_FIELDS).field is None
