"""The examples in docs/examples run as documented, on data the tests make."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shards.tar import TarShardWriter

REPO = Path(__file__).resolve().parents[1]
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 190, 40),
    "blue": (40, 60, 220),
    "yellow": (230, 220, 40),
    "purple": (140, 40, 170),
    "orange": (240, 140, 20),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def image_text_shards(tmp_path_factory) -> str:
    """img2dataset-style shards: jpg + txt + json, no class; the caption names the colour."""
    root = tmp_path_factory.mktemp("image-text")
    rng = np.random.default_rng(0)
    names = list(COLOURS)
    for shard in range(2):
        with open(root / f"pairs-{shard:06d}.tar", "wb") as stream:
            writer = TarShardWriter(stream)
            for i in range(48):
                name = names[(shard * 48 + i) % len(names)]
                pixels = np.clip(
                    np.array(COLOURS[name]) + rng.integers(-25, 26, (32, 32, 3)), 0, 255
                )
                encoded = io.BytesIO()
                Image.fromarray(pixels.astype(np.uint8)).save(encoded, "JPEG")
                writer.write(
                    {
                        "__key__": f"p{shard}_{i:03d}",
                        "jpg": encoded.getvalue(),
                        "txt": f"a photo of something {name}".encode(),
                        "json": json.dumps({"width": 32, "height": 32}).encode(),
                    }
                )
            writer.close()
    return str(root / "pairs-{000000..000001}.tar")


@pytest.mark.timeout(120)
def test_contrastive_example_loss_falls_on_label_free_shards(image_text_shards, capsys):
    contrastive = load_example("contrastive")
    losses = contrastive.main([image_text_shards, "--steps", "24", "--batch-size", "16"])
    assert len(losses) == 24  # 96 pairs in batches of 16: it runs over epoch ends
    assert all(np.isfinite(losses))
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.5, losses
    assert "step 24: loss" in capsys.readouterr().out
