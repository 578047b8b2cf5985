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
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from worker_svc.kvcache.allocator import KVSlotAllocator


@dataclass(eq=False)
class RadixNode:
    key: list[int]  # the edge's tokens (from the parent to this node)
    value: torch.Tensor  # [len(key)] int64 KV slots of those tokens
    parent: RadixNode | None
    children: dict[int, RadixNode] = field(default_factory=dict)  # by first token of the child's edge
    lock_ref: int = 0
    last_access: int = 0  # a tick of the tree's clock: LRU order without wall-clock ties


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

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Cache ``value`` (one slot per token of ``key``); returns the length of the prefix that was
        already cached. The tree takes ownership of ``value[returned:]`` only."""
        if len(key) != value.numel():
            raise ValueError(f"insert of {len(key)} tokens with {value.numel()} slots")
        node, present = self.root, 0
        tick = next(self._clock)
        node.last_access = tick
        while key:
            child = node.children.get(key[0])
            if child is None:
                leaf = RadixNode(key=list(key), value=value.clone(), parent=node, last_access=tick)
                node.children[key[0]] = leaf
                self._evictable += len(key)
                break
            common = _common_len(child.key, key)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = tick
            present += common
            node, key, value = child, key[common:], value[common:]
        return present

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut ``child``'s edge after ``at`` tokens: a new node takes the head (and child's lock
        count: every lock through child passes through it), child keeps the tail below it."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        head = RadixNode(key=child.key[:at], value=child.value[:at], parent=parent,
                         lock_ref=child.lock_ref, last_access=child.last_access)
        child.key, child.value, child.parent = child.key[at:], child.value[at:], head
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
        if num_tokens <= 0 or self._evictable == 0:
            return 0
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed, doomed = 0, []
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            doomed.append(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        if doomed:
            self.allocator.free(torch.cat(doomed))
        return freed

    def reset(self) -> bool:
        """Free every cached slot and empty the tree; refused (False, nothing freed) while any node is
        locked, i.e. while a request uses the cache."""
        if self._protected:
            return False
        self.evict(self._evictable)
        assert not self.root.children and self._evictable == 0
        return True

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
