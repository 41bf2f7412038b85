"""Whether each split has shards enough for the DataLoader workers of other readers.

timm's `create_loader`, webdataset and open_clip give each DataLoader worker whole
shards: a split of one shard keeps one worker busy and leaves the others nothing (timm's
loader then waits forever for them). Our loader splits shards by sample and is not
affected. `build-shards` and `info` print this line when a split is that small.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

# The DataLoader workers a training run commonly starts (timm's and open_clip's
# defaults are 4; 8 on a typical GPU node): a split with fewer shards starves some.
CLIENT_WORKERS = 8


def few_shards_line(shards: Mapping[str, tuple[int, int]]) -> str | None:
    """One line naming the splits with fewer shards than `CLIENT_WORKERS`, and the
    `--shard-size` that gives each of them that many; None when every split has them.

    Args:
        shards: `{split: (samples, shards)}`.
    """
    few = {name: pair for name, pair in shards.items() if 0 < pair[1] < CLIENT_WORKERS}
    if not few:
        return None
    named = ", ".join(
        f"{name} {count} shard{'s' * (count != 1)}" for name, (_, count) in few.items()
    )
    size = max(1, min(math.floor(samples / CLIENT_WORKERS) for samples, _ in few.values()))
    return (
        f"few shards: {named}; timm's create_loader, webdataset and open_clip give each "
        f"DataLoader worker whole shards, so workers past a split's shard count get none "
        f"(timm's loader then waits forever); for {CLIENT_WORKERS} workers rebuild with "
        f"--shard-size {size} (our loader splits shards by sample: any worker count works)"
    )
