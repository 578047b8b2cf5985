"""KV events of the radix prefix cache (worker_svc/kvcache/kv_events.py, radix_cache.py): an insert
records exactly the blocks it completes, an eviction exactly the blocks it frees, a reset one clear;
block hashes are sglang's SHA-256 chain (llmserve/kv_hash.py); a mirror fed only by the events equals
the tree's blocks through a random workload of inserts, splits, evictions, resets and restarts of the
recorder."""

from __future__ import annotations

import hashlib
import random

import torch

from llmserve.kv_hash import prefix_block_hashes
from worker_svc.kvcache.allocator import KVSlotAllocator
from worker_svc.kvcache.kv_events import BlocksRemoved, BlocksStored, CacheCleared
from worker_svc.kvcache.radix_cache import RadixCache

B = 4


def _sglang_hashes(tokens: list[int], block_size: int) -> list[int]:
    """sglang's get_hash_str / hash_str_to_int64 (mem_cache/utils.py), written out independently."""
    out, prior = [], None
    for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[i : i + block_size]:
            h.update(t.to_bytes(4, byteorder="little", signed=False))
        prior = h.hexdigest()
        value = int(prior[:16], 16)
        out.append(value - 2**64 if value >= 2**63 else value)
    return out


def _cache(size: int = 512) -> tuple[RadixCache, KVSlotAllocator]:
    alloc = KVSlotAllocator(size)
    return RadixCache(alloc), alloc


def _put(cache: RadixCache, alloc: KVSlotAllocator, key: list[int]) -> None:
    slots = alloc.alloc(len(key))
    assert slots is not None
    present = cache.insert(key, slots)
    alloc.free(slots[:present])


def test_block_hashes_are_sglangs_chain():
    tokens = [5, 1, 2**32 - 1, 0, 77, 9, 9, 9, 3, 1, 4]
    assert prefix_block_hashes(tokens, 4) == _sglang_hashes(tokens, 4)
    assert prefix_block_hashes(tokens, 1) == _sglang_hashes(tokens, 1)
    # A block names its prefix: the same four tokens after a different first block hash differently.
    assert prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] != prefix_block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)[1]


def test_insert_records_the_full_blocks_it_completes():
    cache, alloc = _cache()
    events = cache.start_events(B)
    assert [type(e) for e in events.take()] == [CacheCleared]  # the empty tree as it stands
    a = list(range(100, 110))  # 10 tokens: blocks [0,4) and [4,8); the last two tokens are no block
    _put(cache, alloc, a)
    (stored,) = events.take()
    assert isinstance(stored, BlocksStored)
    assert stored.parent is None and stored.hashes == prefix_block_hashes(a, B) and len(stored.hashes) == 2
    assert stored.tokens == [a[0:4], a[4:8]]

    # A branch at token 6 splits the edge (no event) and completes block [4,8) of its own path and
    # [8,12): the first is a new block although it shares tokens 4 and 5 with a's.
    b = a[:6] + [1, 2, 3, 4, 5, 6]
    _put(cache, alloc, b)
    (stored,) = events.take()
    assert stored.parent == prefix_block_hashes(a, B)[0]
    assert stored.hashes == prefix_block_hashes(b, B)[1:] and stored.tokens == [b[4:8], b[8:12]]

    # Extending a's path by 2 tokens completes a's block [8,12), whose first half was already on a's edge.
    c = a + [7, 7]
    _put(cache, alloc, c)
    (stored,) = events.take()
    assert stored.parent == prefix_block_hashes(a, B)[1] and stored.hashes == prefix_block_hashes(c, B)[2:]
    # Nothing new: no event.
    _put(cache, alloc, a[:7])
    assert events.take() == []


def test_eviction_removes_exactly_what_it_frees_and_reset_clears_once():
    cache, alloc = _cache()
    events = cache.start_events(B)
    a, b = list(range(12)), list(range(8)) + [50, 51, 52, 53, 54]
    _put(cache, alloc, a)
    _put(cache, alloc, b)
    stored = {h for e in events.take() if isinstance(e, BlocksStored) for h in e.hashes}
    assert stored == set(prefix_block_hashes(a, B)) | set(prefix_block_hashes(b, B))
    # Evict one leaf (b, least recently used after touching a): exactly b's own block goes.
    cache.match_prefix(a)
    cache.evict(1)
    (removed,) = events.take()
    assert isinstance(removed, BlocksRemoved) and removed.hashes == prefix_block_hashes(b, B)[2:]
    # A locked prefix is never evicted, so never announced as removed.
    _, node = cache.match_prefix(a[:6])
    cache.lock(node)
    cache.evict(100)
    (removed,) = events.take()
    assert sorted(removed.hashes) == sorted(prefix_block_hashes(a, B)[1:])  # [0,4) ends on the locked node
    cache.unlock(node)
    assert cache.reset()
    assert [type(e) for e in events.take()] == [CacheCleared]
    assert cache.total_size() == 0


def test_split_by_a_match_keeps_each_block_with_the_node_holding_its_last_token():
    cache, alloc = _cache()
    events = cache.start_events(B)
    a = list(range(20))
    _put(cache, alloc, a)
    events.take()
    _, head = cache.match_prefix(a[:9] + [99])  # splits the edge after token 9
    assert head.digests is not None and len(head.digests) == 2  # blocks ending at 4 and 8
    (tail,) = head.children.values()
    assert tail.depth == 9 and len(tail.digests) == 3  # blocks ending at 12, 16, 20
    cache.evict(1)  # the tail leaf
    (removed,) = events.take()
    assert removed.hashes == prefix_block_hashes(a, B)[2:]


def test_no_recorder_no_digests_and_a_late_start_records_the_whole_tree_parents_first():
    cache, alloc = _cache()
    seqs = [list(range(10)), list(range(6)) + [40, 41, 42, 43], [9] * 13, list(range(10)) + [1, 2, 3]]
    for s in seqs:
        _put(cache, alloc, s)
    assert cache.events is None and all(n.digests is None for n in cache.nodes())
    events = cache.start_events(B)
    got = events.take()
    assert isinstance(got[0], CacheCleared)
    seen: set[int] = set()
    for e in got[1:]:
        assert isinstance(e, BlocksStored)
        assert e.parent is None or e.parent in seen  # parents first
        seen.update(e.hashes)
    assert seen == {h for s in seqs for h in prefix_block_hashes(s, B)}
    cache.stop_events()
    assert cache.events is None and all(n.digests is None for n in cache.nodes())


def _tree_blocks(cache: RadixCache, block_size: int) -> set[int]:
    """The event blocks the tree holds, from its paths (every node is on a root-to-leaf path)."""
    out: set[int] = set()
    stack = [(c, list(c.key)) for c in cache.root.children.values()]
    while stack:
        node, path = stack.pop()
        if not node.children:
            out.update(prefix_block_hashes(path, block_size))
        stack.extend((c, path + c.key) for c in node.children.values())
    return out


def test_a_mirror_fed_by_the_events_tracks_the_tree_through_a_random_workload():
    rng = random.Random(7)
    cache, alloc = _cache(size=300)
    events = cache.start_events(B)
    mirror: dict[int, int | None] = {}

    def apply() -> None:
        for e in events.take() if cache.events is not None else []:
            if isinstance(e, CacheCleared):
                mirror.clear()
            elif isinstance(e, BlocksRemoved):
                for h in e.hashes:
                    del mirror[h]  # only blocks it announced
            else:
                parent = e.parent
                assert parent is None or parent in mirror
                for h, tokens in zip(e.hashes, e.tokens, strict=True):
                    assert h not in mirror and len(tokens) == B
                    mirror[h] = parent
                    parent = h

    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    locked = []
    peak = restarts = 0
    for step in range(400):
        op = rng.random()
        if op < 0.5:
            key = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
            if cache.evictable_size() + alloc.available() >= len(key):
                if alloc.available() < len(key):
                    cache.evict(len(key) - alloc.available())
                _put(cache, alloc, key)
        elif op < 0.65:
            _, node = cache.match_prefix(rng.choice(prefixes)[: rng.randrange(1, 30)])
            if node is not cache.root and rng.random() < 0.5:
                cache.lock(node)
                locked.append(node)
        elif op < 0.8 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.93:
            cache.evict(rng.randrange(1, 40))
        elif op < 0.96 and not locked:
            assert cache.reset()
        elif cache.events is not None:  # the last subscriber went: stop, and later start afresh
            apply()
            cache.stop_events()
            mirror.clear()
        else:
            events = cache.start_events(B)
            restarts += 1
        apply()
        if cache.events is not None:
            assert set(mirror) == _tree_blocks(cache, B), f"step {step}"
            peak = max(peak, len(mirror))
    assert peak > 30 and restarts > 3  # the workload did fill the tree and restart the recorder
    assert torch.unique(cache.held_slots()).numel() == cache.total_size()
