"""KV cache events as the radix prefix cache produces them, on the engine thread (the publisher that
streams them, worker_svc/server/kv_events.py, takes them once per step).

The radix cache holds no recorder until someone subscribes (then every hook is one ``is None`` test).
Blocks are ``block_size`` tokens from the start of a sequence, hashed as sglang hashes them
(llmserve/kv_hash.py); the pool's page size stays 1, so a block may span several tree nodes and is
owned by the node holding its last token: stored when that node is inserted, removed when it is
evicted, cut with it when a split moves the token. Only full blocks are announced.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class BlocksStored:
    parent: int | None  # block hash of the block before the first one; None at the start of a sequence
    hashes: list[int]  # chained: hashes[i] is the parent of hashes[i + 1]
    tokens: list[list[int]]  # each block's tokens


@dataclass(slots=True)
class BlocksRemoved:
    hashes: list[int]


@dataclass(slots=True)
class CacheCleared:
    pass


KvEvent = BlocksStored | BlocksRemoved | CacheCleared


class KvEventRecorder:
    """Collects one step's events; ``take`` hands them over and starts afresh (engine thread only)."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("KV event block size must be positive")
        self.block_size = block_size
        self._events: list[KvEvent] = []

    def stored(self, parent: int | None, hashes: list[int], tokens: list[list[int]]) -> None:
        self._events.append(BlocksStored(parent, hashes, tokens))

    def removed(self, hashes: list[int]) -> None:
        self._events.append(BlocksRemoved(hashes))

    def cleared(self) -> None:
        self._events.append(CacheCleared())

    def take(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events
