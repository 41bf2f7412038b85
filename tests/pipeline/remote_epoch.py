"""A driver for the remote-roles tests: one epoch under `Workers(placement="ray")`, printed
as JSON lines `[keys, sha256 of pixels and labels]`, one a batch.

Run as its own process (`python -m tests.pipeline.remote_epoch SOURCE ADDRESS`): a Ray
driver holds process-wide state, so the pytest process never becomes one. With
`--pause-after N --go FILE` it stops after N batches, prints `paused`, and goes on once
FILE exists (the test kills a node meanwhile). `--state-in FILE` resumes from a saved
`state_dict()`; `--stop-after N --state-out FILE` saves one after N batches and stops.
`--rank R --world-size W --uneven` reads one rank's share of an exactly-once epoch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from pipeline import Batching, Workers
from pipeline.config import Crop, Shuffle
from pipeline.loader import LoaderConfig, build_loader

REMOTE_ROLES = 2


def loader_config(
    source: str, workers: Workers, rank: int = 0, world_size: int = 1, uneven: bool = False
) -> LoaderConfig:
    """The loader both sides of a comparison read with (a train epoch: crops, flips);
    `uneven`: every sample exactly once across ranks (the world-size resume's contract)."""
    batch = Batching(size=8, epoch_rule="uneven", drop_last=False) if uneven else Batching(size=8)
    return LoaderConfig(
        source=source,
        split="train",
        batch=batch,
        crop=Crop(image_size=32),
        workers=workers,
        seed=11,
        shuffle=Shuffle(buffer=64, initial=16),
        with_keys=True,
        rank=rank,
        world_size=world_size,
    )


def batch_line(images, labels, keys) -> list:
    digest = hashlib.sha256(images.contiguous().numpy().tobytes() + labels.numpy().tobytes())
    return [list(keys), digest.hexdigest()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("address")
    parser.add_argument("--pause-after", type=int, default=0)
    parser.add_argument("--go", type=Path)
    parser.add_argument("--state-in", type=Path)
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument("--state-out", type=Path)
    parser.add_argument("--remote", type=int, default=REMOTE_ROLES)
    parser.add_argument("--count", type=int, default=0, help="local roles beside the remote")
    parser.add_argument("--resources", type=json.loads, help="each role's custom resources")
    parser.add_argument("--fallback", default="error")
    parser.add_argument("--wire", default="channel", help="Workers.ray_wire")
    parser.add_argument(
        "--refuse-channel", action="store_true", help="every channel connection fails here"
    )
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--uneven", action="store_true")
    args = parser.parse_args(argv)
    if args.refuse_channel:  # as a firewall between the nodes would
        import pipeline.remote

        def refused(address, token):
            raise pipeline.remote.ChannelError(f"cannot reach {address}: Connection refused")

        pipeline.remote.ChannelReceiver = refused
    workers = Workers(
        placement="ray",
        ray_address=args.address,
        count=args.count,
        remote=args.remote,
        pin_memory=False,
        ray_resources=args.resources,
        fallback=args.fallback,
        ray_wire=args.wire,
    )
    config = loader_config(args.source, workers, args.rank, args.world_size, args.uneven)
    loader = build_loader(config)
    if args.state_in:
        loader.load_state_dict(json.loads(args.state_in.read_text()))
    for index, (images, labels, keys) in enumerate(loader):
        print(json.dumps(batch_line(images, labels, keys)), flush=True)
        if index + 1 == args.stop_after:
            args.state_out.write_text(json.dumps(loader.state_dict()))
            break
        if index + 1 == args.pause_after:
            print("paused", flush=True)
            while not args.go.exists():
                time.sleep(0.1)
    # The roles' own counts (a restarted role's summed over its actors) beside the trainer's.
    counted = sum(worker["samples"] for worker in loader.stats.workers.values())
    placement = loader.config.workers.placement  # "local" once fallen back
    final = {"samples": loader.stats.samples, "role_samples": counted, "placement": placement}
    print(json.dumps(final), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
