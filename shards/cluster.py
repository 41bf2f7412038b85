"""Start a local Ray or join a cluster (`start_ray`), and what the cluster offers: the one
start-up the offline build (`preprocess/`) and the loader's remote roles (`pipeline/`)
share, which may not import each other.

It lives in `shards/`, the floor both stand on, as the one module there that touches Ray,
and only inside its functions: importing `shards` still loads no Ray, so Ray workers and
quick tests stay light (tests/test_import_graph.py holds both rules).

The address is the caller's (`--ray-address`, `Workers.ray_address`) or `RAY_ADDRESS`,
as under `ray job submit`. Ray is imported inside the functions: importing it costs
seconds, and only a job that runs on Ray should pay them.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from shards.errors import ShardpipeError
from shards.flags import option
from shards.redact import redact_url

log = logging.getLogger(__name__)


class ClusterError(ShardpipeError, RuntimeError):
    """No Ray cluster answers at the address, or it cannot hold what was asked of it."""


def ray_address(address: str | None) -> str | None:
    """`address`, else `RAY_ADDRESS` (set under `ray job submit`), else None (a local Ray)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def ray_address_option(runs: str, otherwise: str, group: str) -> Any:
    """The `--ray-address` setting of a command whose `runs` may run on Ray (the build's
    shard tasks, the loader's worker roles): one spelling of the address and of its
    default, which `ray_address` reads, for both.

    Args:
        otherwise: what happens with neither the flag nor `RAY_ADDRESS`.
    """
    return option(
        None,
        f"the Ray cluster {runs}: ray://host:10001, host:6379 or auto; default: RAY_ADDRESS, "
        f"else {otherwise}",
        group,
    )


def start_ray(
    address: str | None,
    workers: int | None,
    flag: str = "--ray-address",
    logger: logging.Logger = log,
) -> None:
    """Start a local Ray, or join a cluster, as one `starting Ray` step with its duration.

    Ray's own start-up lines (INFO lines, the token-authentication notice) are held
    back; its warnings show again once it runs. Does nothing when Ray is up already.
    Call it from the main thread: Ray's processes die with the thread that started them.

    Args:
        workers: CPUs of a local Ray (default: this machine's).
        flag: how the caller's user names the address, for the error message.
        logger: where the step is logged (the caller's, so its command shows it).

    Raises:
        ClusterError: no Ray cluster answers at the address.
    """
    import ray

    if ray.is_initialized():
        return
    address = ray_address(address)
    where = redact_url(address) if address else f"local, {workers or os.cpu_count()} CPUs"
    logger.info("starting Ray (%s) ...", where)
    started = time.perf_counter()
    try:
        init_ray(address, workers)
    except ConnectionError as error:
        raise ClusterError(
            f"could not join the Ray cluster at {where}: {error}. Check {flag} "
            "(and RAY_ADDRESS), or leave both out to run on this machine."
        ) from error
    logging.getLogger("ray").setLevel(logging.WARNING)
    logger.info("Ray started in %.1f s", time.perf_counter() - started)


def init_ray(address: str | None, workers: int | None) -> None:
    import ray

    if address:
        ray.init(address=address, logging_level="ERROR")
    else:
        # "local": a Ray of our own, even on a machine where `ray start` ran;
        # plain ray.init() would join that cluster, then refuse num_cpus.
        ray.init(
            address="local",
            num_cpus=workers or os.cpu_count(),
            include_dashboard=False,
            logging_level="ERROR",
        )


def ray_slots() -> int:
    """Tasks Ray runs at once: the CPUs of the cluster (one task needs one)."""
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))
