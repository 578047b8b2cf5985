"""The radix prefix cache as a data structure (worker_svc/kvcache/radix_cache.py): matches, inserts
and splits give back exactly the slots that were cached; eviction frees least-recently-used unlocked
leaves and never a locked (pinned) node; evictable + protected sizes add up to the slots the tree
holds; reset refuses while anything is pinned; and a seeded random workload keeps every slot in
exactly one place (free, or held by the tree, or owned by the caller)."""

from __future__ import annotations

import random

import pytest
import torch

from worker_svc.kvcache.allocator import KVSlotAllocator
from worker_svc.kvcache.radix_cache import RadixCache


def _cache(size: int = 64) -> tuple[RadixCache, KVSlotAllocator]:
    alloc = KVSlotAllocator(size)
    return RadixCache(alloc), alloc


def _put(cache: RadixCache, alloc: KVSlotAllocator, key: list[int]) -> torch.Tensor:
    """Insert ``key`` with fresh slots as a request would (its duplicates freed); returns the slots
    the tree now holds for ``key``."""
    slots = alloc.alloc(len(key))
    assert slots is not None
    present = cache.insert(key, slots)
    alloc.free(slots[:present])
    value, _ = cache.match_prefix(key)
    return value


def _assert_sizes(cache: RadixCache, alloc: KVSlotAllocator) -> None:
    nodes = cache.nodes()
    held = cache.held_slots().tolist()
    assert len(held) == len(set(held)) == cache.total_size()
    assert cache.evictable_size() == sum(len(n.key) for n in nodes if n.lock_ref == 0)
    assert cache.protected_size() == sum(len(n.key) for n in nodes if n.lock_ref > 0)
    assert all(n.value.numel() == len(n.key) > 0 for n in nodes)
    assert all(n.parent is not None and n.parent.children[n.key[0]] is n for n in nodes)
    assert all(n.parent.lock_ref >= n.lock_ref for n in nodes if n.parent is not cache.root)  # locks run to the root
    free = alloc.free_slots().tolist()
    assert not set(free) & set(held), "a slot is both free and held by the tree"


def test_match_and_insert_return_the_cached_slots_and_split_edges():
    cache, alloc = _cache()
    a = _put(cache, alloc, [1, 2, 3, 4, 5])
    assert len(cache.root.children) == 1 and cache.total_size() == 5
    # A partial match ends inside the edge: the node is split there and the head's slots come back.
    value, node = cache.match_prefix([1, 2, 3, 9])
    assert value.tolist() == a[:3].tolist() and node.key == [1, 2, 3]
    (tail,) = node.children.values()
    assert tail.key == [4, 5] and tail.value.tolist() == a[3:].tolist() and tail.parent is node
    # Inserting a branch reports the shared prefix as already present and adds only the new tokens.
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 7, 8], slots) == 3
    alloc.free(slots[:3])
    assert cache.total_size() == 7
    assert cache.match_prefix([1, 2, 3, 7, 8])[0].tolist() == a[:3].tolist() + slots[3:].tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[0].tolist() == a.tolist()  # longer than cached: the cached part
    assert cache.match_prefix([2, 3])[0].numel() == 0 and cache.match_prefix([])[1] is cache.root
    # A key that ends inside an edge splits it; nothing new is held.
    slots = alloc.alloc(2)
    assert cache.insert([1, 2], slots) == 2
    alloc.free(slots)
    assert cache.total_size() == 7
    assert sorted(len(n.key) for n in cache.nodes()) == [1, 2, 2, 2]  # [1,2] [3] [4,5] [7,8]
    _assert_sizes(cache, alloc)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], torch.tensor([5, 6]))


def test_cached_length_is_the_match_length_and_leaves_the_tree_alone():
    """What the admission planner asks: how much of a key is cached, mid-edge included, without splitting
    an edge or touching the LRU clock (match_prefix does both)."""
    cache, alloc = _cache()
    _put(cache, alloc, [1, 2, 3, 4, 5, 6])
    _put(cache, alloc, [1, 2, 3, 9])
    before = [(n.key, n.last_access) for n in cache.nodes()]
    assert cache.cached_length([1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.cached_length([1, 2, 3, 4, 8]) == 4  # mid-edge: [4, 5, 6]
    assert cache.cached_length([1, 2, 3, 9]) == 4
    assert cache.cached_length([7, 1]) == 0 and cache.cached_length([]) == 0
    assert [(n.key, n.last_access) for n in cache.nodes()] == before
    for key in ([1, 2, 3, 4, 8], [1, 2, 3, 4, 5, 6, 7], [1, 2, 9]):
        assert cache.cached_length(key) == cache.match_prefix(key)[0].numel()


def test_eviction_is_lru_over_leaves_and_climbs_to_parents():
    cache, alloc = _cache()
    _put(cache, alloc, [1, 2, 3, 4])
    _put(cache, alloc, [1, 2, 5, 6])
    _put(cache, alloc, [9, 9])
    cache.match_prefix([1, 2, 3, 4])  # most recent now; [1,2,5,6] is the oldest leaf
    assert cache.evict(1) == 2  # a whole leaf goes: [5, 6]
    assert cache.match_prefix([1, 2, 5, 6])[0].numel() == 2
    assert cache.match_prefix([1, 2, 3, 4])[0].numel() == 4
    assert cache.evict(2) == 2  # [9, 9] is older than [1, 2, 3, 4] (just touched)
    assert cache.match_prefix([9, 9])[0].numel() == 0
    # Evicting the last leaf under [1, 2] makes [1, 2] a leaf, evicted in the same call.
    assert cache.evict(4) == 4 and cache.total_size() == 0 and not cache.root.children
    assert alloc.available() == alloc.size
    assert cache.evict(10) == 0


def test_eviction_never_frees_a_locked_node():
    cache, alloc = _cache(32)
    pinned = _put(cache, alloc, list(range(10)))
    _put(cache, alloc, list(range(5)) + [50, 51, 52])  # shares [0..4] with the pinned path
    _put(cache, alloc, [70, 71, 72])
    _, node = cache.match_prefix(list(range(10)))
    cache.lock(node)
    assert cache.protected_size() == 10 and cache.evictable_size() == 6
    _assert_sizes(cache, alloc)
    assert cache.evict(100) == 6  # everything unlocked, nothing more
    assert cache.match_prefix(list(range(10)))[0].tolist() == pinned.tolist()
    assert not set(pinned.tolist()) & set(alloc.free_slots().tolist())
    assert cache.reset() is False and cache.total_size() == 10  # refused while pinned; nothing freed
    # A split of a locked edge keeps both halves locked.
    cache.match_prefix([0, 1, 2])
    assert all(n.lock_ref == 1 for n in cache.nodes())
    assert cache.evict(100) == 0
    cache.unlock(node)
    assert cache.evictable_size() == 10 and cache.protected_size() == 0
    assert cache.reset() is True and cache.total_size() == 0 and alloc.available() == alloc.size
    with pytest.raises(RuntimeError):
        cache.unlock(node)


def test_locks_are_counted_per_holder():
    cache, alloc = _cache()
    _put(cache, alloc, [1, 2, 3, 4])
    _, short = cache.match_prefix([1, 2])
    _, long = cache.match_prefix([1, 2, 3, 4])
    cache.lock(short)
    cache.lock(long)
    assert cache.protected_size() == 4
    cache.unlock(long)
    assert (cache.protected_size(), cache.evictable_size()) == (2, 2)
    assert cache.evict(10) == 2  # [3, 4] only: [1, 2] is still held
    cache.unlock(short)
    assert cache.evict(10) == 2 and alloc.available() == alloc.size


def test_random_workload_keeps_every_slot_in_one_place():
    """Requests match, lock, insert what they computed (freeing duplicates), unlock; eviction runs under
    pressure. After every operation free + tree + requests' own slots partition the pool."""
    rng = random.Random(3)
    cache, alloc = _cache(200)
    prefixes = [[rng.randrange(6) for _ in range(rng.randint(2, 12))] for _ in range(5)]
    live: list[tuple[list[int], object, torch.Tensor, int]] = []  # (key, node, own slots, matched length)
    for _ in range(400):
        if live and (rng.random() < 0.45 or len(live) > 6):
            key, node, own, matched = live.pop(rng.randrange(len(live)))
            present = cache.insert(key, torch.cat([cache.match_prefix(key[:matched])[0], own]))
            assert present >= matched
            alloc.free(own[: present - matched])  # duplicates of what the tree already had
            cache.unlock(node)
        else:
            key = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randint(1, 10))]
            value, node = cache.match_prefix(key)
            cache.lock(node)
            need = len(key) - value.numel()
            if alloc.available() < need:
                cache.evict(need - alloc.available())
            own = alloc.alloc(need)
            if own is None:
                cache.unlock(node)
                continue
            assert cache.match_prefix(key[: value.numel()])[0].tolist() == value.tolist(), "pinned prefix changed"
            live.append((key, node, own, value.numel()))
        _assert_sizes(cache, alloc)
        owned = [s for *_, own, _ in live for s in own.tolist()]
        everything = alloc.free_slots().tolist() + cache.held_slots().tolist() + owned
        assert sorted(everything) == list(range(1, alloc.size + 1))
    for key, node, own, matched in live:
        present = cache.insert(key, torch.cat([cache.match_prefix(key[:matched])[0], own]))
        alloc.free(own[: present - matched])
        cache.unlock(node)
    assert cache.protected_size() == 0 and cache.reset()
    assert alloc.available() == alloc.size
