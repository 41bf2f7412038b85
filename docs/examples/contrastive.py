"""CLIP-style contrastive training on image-text shards, end to end through our loader.

A sketch of the data path, not a CLIP trainer: shards holding `{key}.jpg` + `{key}.txt`
(img2dataset's layout, no class) -> `LoaderConfig(fields=("image", "txt"))` -> batches of
uint8 images and a list of captions -> `CudaPrefetcher` (normalized images on the device,
captions passed through) -> a tiny image encoder, a toy text encoder (hashed bag of words
+ a linear layer) -> the symmetric InfoNCE loss. Runs on a CPU in seconds, here on
caption shards built from the README's quick-start sample (a list of `path,caption`,
built label-free with the caption as each sample's `txt`; any image-text tars, such as
img2dataset's, work the same):

    (cd data/sample && echo path,caption && for f in */*; do echo "$f,a photo of ${f%%/*}"; done) > data/sample/captions.csv
    .venv/bin/preprocess build-shards --input data/sample/captions.csv --output data/pairs --label none --fields caption:txt --image-size 64
    .venv/bin/python docs/examples/contrastive.py data/pairs --steps 20

A real run swaps the toy encoders for open_clip's, and the hashing for a tokenizer given
as a field transform (`Field("tokens", "text", source="txt", transform=Tokenize(77))`,
see docs/LOADER.md), so tokenizing happens in the loader's workers.
"""

from __future__ import annotations

import argparse
import re
import zlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import Batching, Crop, Workers
from pipeline.loader import LoaderConfig, build_loader
from pipeline.prefetch import CudaPrefetcher

VOCAB_BUCKETS = 4096  # hashed word ids; collisions only blur a toy encoder
EMBED_DIM = 64


def word_ids(caption: str) -> list[int]:
    """Hashed bag of words: lower-case words, each to one of VOCAB_BUCKETS ids (stable)."""
    words = re.findall(r"[a-z0-9]+", caption.lower()) or ["<empty>"]
    return [zlib.crc32(word.encode()) % VOCAB_BUCKETS for word in words]


class TextEncoder(nn.Module):
    """Mean of hashed word embeddings, then a linear projection."""

    def __init__(self, dim: int = EMBED_DIM) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB_BUCKETS, dim, mode="mean")
        self.project = nn.Linear(dim, dim)

    def forward(self, captions: Sequence[str]) -> torch.Tensor:
        ids = [word_ids(caption) for caption in captions]
        flat = torch.tensor([i for row in ids for i in row], device=self.project.weight.device)
        offsets = torch.tensor([0, *[len(row) for row in ids[:-1]]]).cumsum(0).to(flat.device)
        return self.project(self.bag(flat, offsets))


class ImageEncoder(nn.Module):
    """Two convolutions, global pooling, a projection."""

    def __init__(self, dim: int = EMBED_DIM) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.project = nn.Linear(64, dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.project(self.features(images))


def info_nce(image_emb: torch.Tensor, text_emb: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE: image i should match caption i among the batch's captions, and back."""
    image_emb = F.normalize(image_emb, dim=1)
    text_emb = F.normalize(text_emb, dim=1)
    logits = scale.exp() * image_emb @ text_emb.T
    targets = torch.arange(len(logits), device=logits.device)
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


def train(source: str, steps: int, batch_size: int, image_size: int, workers: int) -> list[float]:
    """`steps` contrastive steps on `source`; returns the loss of each step."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = LoaderConfig(
        source=source,
        fields=("image", "txt"),  # no "label": image-text shards hold no class
        batch=Batching(size=batch_size),
        crop=Crop(image_size=image_size),
        workers=Workers(count=workers, pin_memory=device.type == "cuda"),
        train=True,
    )
    loader = build_loader(config)
    batches = CudaPrefetcher(loader, device)
    image_encoder, text_encoder = ImageEncoder().to(device), TextEncoder().to(device)
    scale = nn.Parameter(torch.tensor(2.0, device=device))  # log temperature, learned as CLIP
    parameters = [*image_encoder.parameters(), *text_encoder.parameters(), scale]
    optimizer = torch.optim.AdamW(parameters, lr=3e-3, weight_decay=0.01)
    losses: list[float] = []
    epoch = 0
    while len(losses) < steps:
        loader.set_epoch(epoch)
        for images, captions in batches:
            loss = info_nce(image_encoder(images), text_encoder(captions), scale)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            print(f"step {len(losses)}: loss {losses[-1]:.4f}")
            if len(losses) == steps:
                break
        epoch += 1
    return losses


def main(argv: Sequence[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", help="image-text shards: a manifest, a directory or shard URLs")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20)")
    parser.add_argument("--batch-size", type=int, default=32, help="pairs per batch (default: 32)")
    parser.add_argument("--image-size", type=int, default=32, help="pixels (default: 32)")
    parser.add_argument("--workers", type=int, default=0, help="loader workers (default: 0)")
    args = parser.parse_args(argv)
    return train(args.source, args.steps, args.batch_size, args.image_size, args.workers)


if __name__ == "__main__":
    main()
