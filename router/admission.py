"""Admission control at the router: a bounded number of calls in progress, in total and per client.

A call over a limit is refused at once with RESOURCE_EXHAUSTED naming the limit and its flag,
before it costs a tokenizer or worker round trip: queueing at the router would only hide overload
behind growing latency (the workers have their own bounded waiting queue behind this). The
per-client limit keys on the authenticated identity when auth is on; without auth every caller is
one anonymous client and only the total applies.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from router.validation import RouterError

ANONYMOUS = ""


class Admission:
    def __init__(self, max_total: int = 0, max_per_client: int = 0) -> None:
        """0 means no limit."""
        if max_total < 0 or max_per_client < 0:
            raise ValueError("admission limits must be >= 0 (0: no limit)")
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.in_progress = 0
        self._per_client: dict[str, int] = {}

    @contextmanager
    def admit(self, identity: str = ANONYMOUS) -> Iterator[None]:
        """Hold one slot for the block, or raise RouterError(RESOURCE_EXHAUSTED)."""
        if self.max_total and self.in_progress >= self.max_total:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"router is at its limit of {self.max_total} calls in progress "
                              f"(--max-concurrent-requests); retry later")
        held = self._per_client.get(identity, 0)
        if self.max_per_client and identity != ANONYMOUS and held >= self.max_per_client:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"client {identity!r} is at its limit of {self.max_per_client} calls in progress "
                              f"(--max-requests-per-client); retry later")
        self.in_progress += 1
        self._per_client[identity] = held + 1
        try:
            yield
        finally:
            self.in_progress -= 1
            left = self._per_client[identity] - 1
            if left:
                self._per_client[identity] = left
            else:
                del self._per_client[identity]
