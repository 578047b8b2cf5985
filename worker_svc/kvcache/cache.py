"""The KV cache as one bundle: the pool holding the cached keys and values, the slot allocator and the
request -> token table over it, and what a token costs. The runner builds it (kvcache/sizing.py) and
the scheduler does its accounting on it."""

from __future__ import annotations

from dataclasses import dataclass

from worker_svc.kvcache.allocator import KVSlotAllocator
from worker_svc.kvcache.pool import KVPool
from worker_svc.kvcache.req_to_token import ReqToTokenTable


@dataclass(frozen=True)
class KVCache:
    pool: KVPool
    allocator: KVSlotAllocator
    req_table: ReqToTokenTable
    bytes_per_token: int  # on this rank, every layer
    # What per-head K and V would take on this rank: MLA's saving is the ratio (equal for MHA).
    bytes_per_token_if_mha: int
