"""Block hashes of KV cache events (the SglangScheduler protocol's SubscribeKvEvents), as sglang
computes them (``mem_cache/utils.py``: ``get_hash_str``, ``hash_str_to_int64``).

A sequence is cut into blocks of ``block_size`` tokens from its first token; only full blocks count.
Block k's digest is SHA-256 over the digest of block k-1 (none for the first block) followed by its
tokens as 4-byte little-endian unsigned ints, so a block names its whole prefix, not just its own
tokens. On the wire a block is the first 8 bytes of its digest as a big-endian signed int64.

Shared by the worker (which publishes the hashes) and the router (which hashes a request's prompt the
same way to look it up in a worker's mirrored cache)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence


def iter_digests(tokens: Sequence[int], start: int, end: int, block_size: int, prior: bytes | None) -> Iterator[bytes]:
    """Digests of the blocks ``tokens[start:end]`` (``start`` and ``end`` multiples of ``block_size``),
    chained from ``prior``: the digest of the block just before ``start`` (None when ``start`` is 0).
    Lazy, so a lookup can stop at its first miss."""
    pack = struct.Struct(f"<{block_size}I").pack
    for i in range(start, end, block_size):
        h = hashlib.sha256(prior) if prior is not None else hashlib.sha256()
        h.update(pack(*tokens[i : i + block_size]))
        prior = h.digest()
        yield prior


def block_digests(tokens: Sequence[int], start: int, end: int, block_size: int, prior: bytes | None) -> list[bytes]:
    return list(iter_digests(tokens, start, end, block_size, prior))


def to_int64(digest: bytes) -> int:
    """A digest as the protocol's block_hash (sglang's hash_str_to_int64 of the hex digest)."""
    return int.from_bytes(digest[:8], "big", signed=True)


def iter_block_hashes(tokens: Sequence[int], block_size: int) -> Iterator[int]:
    """The block hashes of the full blocks of ``tokens``, first block first, computed as needed."""
    full = len(tokens) - len(tokens) % block_size
    return (to_int64(d) for d in iter_digests(tokens, 0, full, block_size, None))


def prefix_block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    return list(iter_block_hashes(tokens, block_size))
