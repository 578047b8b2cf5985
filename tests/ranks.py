"""Ranks as threads of the test process: collectives need every rank at once, and a thread per rank
needs no spawned process (real gloo groups on one rendezvous store; shared-memory communicators on
one segment)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from worker_svc.parallel import shm_communicator as shm
from worker_svc.parallel.fault import GroupFault
from worker_svc.parallel.group import free_port, open_store

TIMEOUT = timedelta(seconds=60)


def on_ranks(size: int, fn: Callable[[int], Any]) -> list[Any]:
    """fn(rank) on one thread per rank; re-raises a rank's error."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with torch.inference_mode():  # thread-local, like the runner's
                results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def gloo_groups(size: int, prefix: str) -> list[tuple[dist.Store, dist.ProcessGroup]]:
    """(store, gloo group) of each rank, all on one rendezvous store; `prefix` keeps a test's keys apart."""
    port = free_port()

    def join(rank: int) -> tuple[dist.Store, dist.ProcessGroup]:
        store = open_store("127.0.0.1", port, size, rank == 0, TIMEOUT)
        return store, dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, TIMEOUT)

    return on_ranks(size, join)


def shm_communicators(size: int, slot_bytes: int = shm.DEFAULT_SLOT_BYTES, timeout_s: float = 60.0,
                      **options: Any) -> list[shm.ShmCommunicator]:
    """Each rank's communicator on one new segment (its own mapping each, the file already unlinked);
    `options`: ShmCommunicator's isa / two_shot_bytes."""
    name, first = shm.create_segment(size, slot_bytes)
    try:
        segments = [first] + [shm.attach_segment(name, size, slot_bytes) for _ in range(1, size)]
    finally:
        shm.unlink_segment(name)
    return [shm.ShmCommunicator(segment, rank, size, slot_bytes, GroupFault(), timeout_s, **options)
            for rank, segment in enumerate(segments)]
