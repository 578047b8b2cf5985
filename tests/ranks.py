"""Ranks as threads of the test process: collectives need every rank at once, and a thread per rank
needs no spawned process (real gloo groups on one rendezvous store; shared-memory communicators on
one segment)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


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
