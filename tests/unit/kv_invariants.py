"""KV slot invariants of a scheduler, with or without the radix prefix cache: every slot of the pool is
in exactly one place (free in the allocator, held by the cache, or owned by one live request), each
live request's row starts with the cache's own slots for its prefix, and the cache's locks are exactly
the live requests' prefixes. Read-only: nothing here touches the cache's LRU clock or splits a node."""

from __future__ import annotations

from worker_svc.engine.engine import Engine
from worker_svc.kvcache.radix_cache import RadixCache, RadixNode


def cached_slots(cache: RadixCache, key: list[int]) -> list[int]:
    """The slots the cache holds for the longest cached prefix of ``key``, without touching it."""
    node, out = cache.root, []
    while key:
        child = node.children.get(key[0])
        if child is None:
            break
        common = 0
        while common < min(len(child.key), len(key)) and child.key[common] == key[common]:
            common += 1
        out += child.value[:common].tolist()
        if common < len(child.key):
            break
        node, key = child, key[common:]
    return out


def _path(cache: RadixCache, node: RadixNode) -> list[RadixNode]:
    path = []
    while node is not cache.root:
        path.append(node)
        assert node.parent is not None
        node = node.parent
    return path


def assert_kv_consistent(engine: Engine) -> None:
    sched = engine.scheduler
    alloc, table, cache = engine.runner.kv.allocator, engine.runner.kv.req_table, sched.cache
    live = list(sched.running) + ([sched.chunked] if sched.chunked is not None else [])
    rows = [r.req_row for r in live]
    assert None not in rows
    assert len(set(rows)) == len(rows), f"request row handed out twice: {rows}"
    assert not set(rows) & set(table._free_rows), "a live request's row is also on the free list"
    assert len(rows) + table.available() == table.max_requests
    assert all(r.req_row is None and r.num_cached == 0 and r.cache_node is None for r in sched.waiting), (
        "waiting requests hold no KV")
    owned: list[int] = []
    locks: dict[int, int] = {}
    for r in live:
        assert r.req_row is not None
        slots = table.slots(r.req_row, r.num_cached).tolist()
        assert len(slots) == r.num_cached and all(s > 0 for s in slots), f"{r.rid} has an unrecorded slot"
        if cache is None:
            assert r.prefix_len == 0 and r.cache_node is None
            owned += slots
            continue
        assert r.cache_node is not None and 0 <= r.prefix_len <= r.num_cached
        assert cached_slots(cache, r.fill_ids[: r.prefix_len]) == slots[: r.prefix_len], (
            f"{r.rid}'s row does not start with the cache's slots for its prefix")
        assert sum(len(n.key) for n in _path(cache, r.cache_node)) == r.prefix_len
        for node in _path(cache, r.cache_node):
            locks[id(node)] = locks.get(id(node), 0) + 1
        owned += slots[r.prefix_len :]
    held = cache.held_slots().tolist() if cache is not None else []
    everything = alloc.free_slots().tolist() + held + owned
    assert sorted(everything) == list(range(1, alloc.size + 1)), "slots leaked or owned twice"
    if cache is not None:
        nodes = cache.nodes()
        assert all(n.lock_ref == locks.get(id(n), 0) for n in nodes), "cache locks are not the live prefixes"
        assert cache.protected_size() == sum(len(n.key) for n in nodes if n.lock_ref)
        assert cache.evictable_size() == sum(len(n.key) for n in nodes if not n.lock_ref)
        assert alloc.available() + cache.total_size() + len(owned) == alloc.size


def assert_all_released(engine: Engine) -> None:
    """Idle: nothing is locked, every slot is free or cached; after FlushCache the pool is whole."""
    sched = engine.scheduler
    assert not sched.has_work()
    assert_kv_consistent(engine)
    kv = engine.runner.kv
    assert kv.req_table.available() == engine.config.max_running_requests
    if sched.cache is not None:
        assert sched.cache.protected_size() == 0
        assert kv.allocator.available() + sched.cache.evictable_size() == kv.allocator.size
    ok, message = engine.flush_cache()
    assert ok, message
    assert kv.allocator.available() == kv.allocator.size
    assert sorted(kv.allocator.free_slots().tolist()) == list(range(1, kv.allocator.size + 1))
