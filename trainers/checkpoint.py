"""Checkpoints: atomic writes, a `latest` pointer written last, and safe loading.

A checkpoint holds only tensors and plain Python values, so it loads with
`torch.load(weights_only=True)`: a file that tries to run code (a pickle
`__reduce__`) is refused, never executed. Each file is written under a
temporary name, fsynced and renamed (`shards.storage.write.atomic_path`); only then does
`latest` move. A run killed at any moment leaves either the previous
checkpoint or the new one, complete, under a final name.
"""

from __future__ import annotations

import logging
import pickle
import random
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shards.errors import DataError
from shards.storage.write import atomic_path, atomic_write_bytes, is_temp_name

log = logging.getLogger("trainers")

CHECKPOINT_DIR = "checkpoints"
LATEST_NAME = "latest"
FORMAT_NAME = "shardpipe-checkpoint"
FORMAT_VERSION = 1
NAME_PATTERN = re.compile(r"step-(\d{9})\.pt")


class CheckpointError(DataError, RuntimeError):
    """A checkpoint that cannot be used: corrupt, unsafe, or from an incompatible run."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}.pt"


def save_checkpoint(run_dir: str | Path, state: dict[str, Any], step: int, keep: int) -> Path:
    """Write `state` as the checkpoint of `step`, then point `latest` at it; prune old ones.

    Returns:
        The checkpoint path.
    """
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(step)
    with atomic_path(final) as tmp:
        torch.save(state, tmp)
    # The pointer moves only once the checkpoint is durable under its final name.
    atomic_write_bytes(directory / LATEST_NAME, final.name.encode("ascii") + b"\n")
    prune_checkpoints(directory, keep, final.name)
    return final


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (final names only; temporary files ignored), oldest first."""
    if not directory.is_dir():
        return []
    found = [
        p
        for p in directory.iterdir()
        if NAME_PATTERN.fullmatch(p.name) and not is_temp_name(p.name)
    ]
    return sorted(found)


def prune_checkpoints(directory: Path, keep: int, current: str) -> None:
    for old in list_checkpoints(directory)[:-keep]:
        if old.name != current:
            old.unlink(missing_ok=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names; without a pointer, the newest complete file; else None."""
    directory = checkpoint_dir(run_dir)
    pointer = directory / LATEST_NAME
    if pointer.exists():
        name = pointer.read_text("ascii", errors="replace").strip()
        if not NAME_PATTERN.fullmatch(name):
            raise CheckpointError(f"{pointer} holds {name!r}, not a checkpoint name")
        path = directory / name
        if not path.exists():
            raise CheckpointError(
                f"{pointer} names {name}, which does not exist; pass --resume with one of "
                f"{[p.name for p in list_checkpoints(directory)]}"
            )
        return path
    found = list_checkpoints(directory)
    if found:
        # Killed between the first rename and the first pointer write: the file is complete.
        log.warning(
            "no %s pointer in %s; using the newest checkpoint %s",
            LATEST_NAME,
            directory,
            found[-1].name,
        )
        return found[-1]
    return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint with `weights_only=True` (tensors and plain values only).

    Raises:
        CheckpointError: the file is truncated or corrupt, holds objects that are
            not allowed (code would have run on load), or is not our format.
    """
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} was refused: it contains objects that weights_only loading does not allow "
            f"({unpickler_reason(exc)}). Never load it with weights_only=False unless you "
            "made it yourself."
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as exc:
        raise CheckpointError(
            f"{path} is not a readable checkpoint (truncated or corrupt: {exc}); "
            "resume from an earlier one with --resume PATH"
        ) from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a {FORMAT_NAME} file")
    if state.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint version {state.get('version')}; this code reads {FORMAT_VERSION}"
        )
    return state


def unpickler_reason(error: pickle.UnpicklingError) -> str:
    """The line of torch's long message that names the refused global."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported global" in line or "WeightsUnpickler" in line]
    return (named or lines or ["unpickling refused"])[0]


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch and CUDA generator states as tensors and plain values."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
