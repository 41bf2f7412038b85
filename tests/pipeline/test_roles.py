"""One role's batches come from `iter_role_batches` wherever it runs: called in this
process, role by role, without a DataLoader (nothing of `get_worker_info`), the roles'
batches taken round robin are a 3-worker DataLoader epoch, keys and pixels; and a role
started from its delivered count (`RoleTask.delivered`, what a restarted actor gets)
continues exactly where it stopped."""

from __future__ import annotations

import itertools

import torch

from pipeline import Workers
from pipeline.plan import roles_consumed
from pipeline.roles import RoleTask, iter_role_batches
from tests.pipeline.conftest import loader_for

ROLES = 3


def local_batches(loader) -> list:
    return [(list(keys), images.contiguous(), labels) for images, labels, keys in loader]


def role_batches(loader, role: int, delivered: int = 0) -> list:
    task = RoleTask(role, ROLES, 0, (), delivered)  # epoch 0, as a fresh loader reads
    out = []
    for values, _, keys, _ in iter_role_batches(loader.dataset.source, task):
        images, labels = values
        out.append((list(keys), images.contiguous(), labels))
    return out


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        ka == kb and torch.equal(ia, ib) and torch.equal(la, lb)
        for (ka, ia, la), (kb, ib, lb) in zip(a, b, strict=True)
    )


def test_roles_run_in_this_process_make_the_dataloader_epoch(shard_dir):
    loader = loader_for(shard_dir, workers=Workers(count=ROLES))
    expected = local_batches(loader)
    roles = [role_batches(loader, role) for role in range(ROLES)]
    merged = [b for group in itertools.zip_longest(*roles) for b in group if b is not None]
    assert len(expected) > 2 * ROLES and same(merged, expected)


def test_a_role_restarted_from_its_delivered_count_continues_it(shard_dir):
    loader = loader_for(shard_dir, workers=Workers(count=ROLES))
    whole = role_batches(loader, 1)
    assert same(role_batches(loader, 1, delivered=2), whole[2:])
    # A resume after 7 batches of the epoch: role 1 had delivered its first 2.
    assert roles_consumed(7, ROLES)[1] == 2
