"""Radix prefix cache (sglang's RadixAttention): a radix tree over token ids whose nodes hold the KV
slots of their edge's tokens, shared across requests.

- ``match_prefix(tokens)``: the slots of the longest cached prefix and the node it ends at (a node is
  split where the match ends inside its edge).
- ``insert(tokens, slots)``: adds what the tree lacks and returns how many leading tokens it already
  held; the caller still owns (and frees) its own slots for that part, the tree owns the rest.
- ``lock(node)`` / ``unlock(node)``: reference counts along the path to the root. A locked node (a
  running request's prefix) is *protected*; unlocked nodes are *evictable*.
- ``evict(n)``: frees least-recently-used unlocked leaves back to the allocator, parents becoming
  leaves in turn, until ``n`` slots are free or nothing evictable is left.

The tree owns the slots it holds: a slot is free in the allocator, held by the tree, or owned by one
running request, never two of these. Page size 1: a node's edge may be cut at any token.

KV events (``start_events`` / ``stop_events``, kvcache/kv_events.py): while a recorder is installed,
an inserted node records the blocks it completes (stored), an evicted leaf the blocks it held
(removed) and ``reset`` a clear; without one the hooks cost an ``is None`` test.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from llmserve.kv_hash import block_digests, to_int64
from worker_svc.kvcache.allocator import KVSlotAllocator
from worker_svc.kvcache.kv_events import KvEventRecorder


@dataclass(eq=False)
class RadixNode:
    key: list[int]  # the edge's tokens (from the parent to this node)
    value: torch.Tensor  # [len(key)] int64 KV slots of those tokens
    parent: RadixNode | None
    children: dict[int, RadixNode] = field(default_factory=dict)  # by first token of the child's edge
    lock_ref: int = 0
    last_access: int = 0  # a tick of the tree's clock: LRU order without wall-clock ties
    depth: int = 0  # tokens on the path above this node's edge
    # With KV events on: digests of the event blocks whose last token is on this edge, in order.
    digests: list[bytes] | None = None


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    def __init__(self, allocator: KVSlotAllocator) -> None:
        self.allocator = allocator
        self._clock = itertools.count(1)
        self._empty = torch.empty(0, dtype=torch.int64, device=allocator.device)
        self.root = RadixNode(key=[], value=self._empty, parent=None, lock_ref=1)  # never evicted
        self._evictable = 0
        self._protected = 0
        self.events: KvEventRecorder | None = None

    # ---- sizes -----------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes: what ``evict`` can free."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens held by locked nodes (prefixes of running requests)."""
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---- lookups and updates ---------------------------------------------------------------------

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, RadixNode]:
        """Slots of the longest cached prefix of ``key`` and the node where it ends (the root when
        nothing matches). Touches the path (LRU)."""
        node, values = self.root, []
        tick = next(self._clock)
        node.last_access = tick
        while key:
            child = node.children.get(key[0])
            if child is None:
                break
            common = _common_len(child.key, key)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = tick
            values.append(child.value)
            node, key = child, key[common:]
        value = torch.cat(values) if values else self._empty
        return value, node

    def cached_length(self, key: list[int]) -> int:
        """How many leading tokens of ``key`` are cached, without touching the tree (no split, no LRU
        update): an estimate for planning, ``match_prefix`` is what admission uses."""
        node, length = self.root, 0
        while key:
            child = node.children.get(key[0])
            if child is None:
                break
            common = _common_len(child.key, key)
            length += common
            if common < len(child.key):
                break
            node, key = child, key[common:]
        return length

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Cache ``value`` (one slot per token of ``key``); returns the length of the prefix that was
        already cached. The tree takes ownership of ``value[returned:]`` only."""
        if len(key) != value.numel():
            raise ValueError(f"insert of {len(key)} tokens with {value.numel()} slots")
        full, events = key, self.events
        node, present = self.root, 0
        prior: bytes | None = None  # with events: digest of the last block on the path so far
        tick = next(self._clock)
        node.last_access = tick
        while key:
            child = node.children.get(key[0])
            if child is None:
                leaf = RadixNode(key=list(key), value=value.clone(), parent=node, last_access=tick, depth=present)
                node.children[key[0]] = leaf
                self._evictable += len(key)
                if events is not None:
                    self._record_stored(events, leaf, full, prior)
                break
            common = _common_len(child.key, key)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = tick
            if events is not None and child.digests:
                prior = child.digests[-1]
            present += common
            node, key, value = child, key[common:], value[common:]
        return present

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut ``child``'s edge after ``at`` tokens: a new node takes the head (and child's lock
        count: every lock through child passes through it), child keeps the tail below it."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        head = RadixNode(key=child.key[:at], value=child.value[:at], parent=parent,
                         lock_ref=child.lock_ref, last_access=child.last_access, depth=child.depth)
        if self.events is not None and child.digests is not None:  # the blocks ending on the head go with it
            size = self.events.block_size
            n = (child.depth + at) // size - child.depth // size
            head.digests, child.digests = child.digests[:n], child.digests[n:]
        else:
            child.digests = None
        child.key, child.value, child.parent = child.key[at:], child.value[at:], head
        child.depth += at
        head.children[child.key[0]] = child
        parent.children[head.key[0]] = head
        return head

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors (a running request holds its prefix)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            assert node.parent is not None
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, least recently used first (fewer
        when less is evictable); returns the number freed."""
        return self._evict(num_tokens, self.events)

    def _evict(self, num_tokens: int, events: KvEventRecorder | None) -> int:
        if num_tokens <= 0 or self._evictable == 0:
            return 0
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed, doomed = 0, []
        removed: list[int] = []
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            doomed.append(leaf.value)
            if events is not None and leaf.digests:
                removed += [to_int64(d) for d in leaf.digests]
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        if doomed:
            self.allocator.free(torch.cat(doomed))
        if removed:
            assert events is not None
            events.removed(removed)
        return freed

    def reset(self) -> bool:
        """Free every cached slot and empty the tree; refused (False, nothing freed) while any node is
        locked, i.e. while a request uses the cache."""
        if self._protected:
            return False
        self._evict(self._evictable, None)  # one clear instead of a removal per block
        assert not self.root.children and self._evictable == 0
        if self.events is not None:
            self.events.cleared()
        return True

    # ---- KV events -------------------------------------------------------------------------------

    def _record_stored(self, events: KvEventRecorder, node: RadixNode, path: list[int], prior: bytes | None) -> None:
        """Hash the blocks that end on ``node``'s edge (``path`` holds the tokens from the root at least
        to the edge's end; ``prior`` is the digest of the block before them) and record them."""
        size = events.block_size
        start, end = node.depth, node.depth + len(node.key)
        first, last = (start // size) * size, (end // size) * size
        node.digests = block_digests(path, first, last, size, prior) if last > first else []
        if node.digests:
            events.stored(None if prior is None else to_int64(prior), [to_int64(d) for d in node.digests],
                          [path[i : i + size] for i in range(first, last, size)])

    def start_events(self, block_size: int) -> KvEventRecorder:
        """Install a recorder and record the tree as it stands: a clear, then every block, parents
        first. Engine thread only."""
        events = KvEventRecorder(block_size)
        self.events = events
        events.cleared()
        path: list[int] = []  # tokens from the root to the node being entered
        stack: list[tuple[RadixNode, bytes | None, bool]] = [(c, None, False) for c in self.root.children.values()]
        while stack:
            node, prior, leaving = stack.pop()
            if leaving:
                del path[node.depth :]
                continue
            node.depth = len(path)
            path.extend(node.key)
            self._record_stored(events, node, path, prior)
            stack.append((node, None, True))
            last = node.digests[-1] if node.digests else prior
            stack.extend((c, last, False) for c in node.children.values())
        return events

    def stop_events(self) -> None:
        """Remove the recorder and forget the digests (``start_events`` recomputes them)."""
        self.events = None
        for node in self.nodes():
            node.digests = None

    # ---- inspection ------------------------------------------------------------------------------

    def _leaves(self) -> list[RadixNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                leaves.append(node)
        return leaves

    def nodes(self) -> list[RadixNode]:
        """Every node but the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def held_slots(self) -> torch.Tensor:
        """Every slot the tree owns (for invariant checks)."""
        values = [node.value for node in self.nodes()]
        return torch.cat(values) if values else self._empty
