"""A tensor-parallel group's fault state, shared by everything that waits on the group's peers.

The heartbeat (parallel/heartbeat.py) sets it when a peer dies or hangs; a same-host communicator
(parallel/shm_communicator.py) listens, so that its waits end at once instead of at their deadline,
and checks it between wait slices. The first reason wins; listeners run once, on the setter's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class GroupFault:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._listeners: list[Callable[[str], None]] = []

    @property
    def reason(self) -> str | None:
        """Why the group failed; None while it is healthy."""
        return self._reason

    def set(self, reason: str) -> None:
        with self._lock:
            if self._reason is not None:
                return
            self._reason = reason
            listeners = list(self._listeners)
        for listener in listeners:
            listener(reason)

    def on_set(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` when the group fails (at once if it already has)."""
        with self._lock:
            reason = self._reason
            if reason is None:
                self._listeners.append(listener)
        if reason is not None:
            listener(reason)
