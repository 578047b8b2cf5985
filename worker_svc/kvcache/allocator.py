"""Token-slot allocator for the KV pool (page size 1).

Slot 0 is reserved as a padding target: padded gathers and writes of dummy tokens land there, so
real slots are never clobbered. Free slots are a queue of int64 chunks: alloc takes from the front,
free appends at the back, so each costs what it takes or returns, not the size of the pool. (One
tensor re-concatenated on every free copied the whole free list per finished request: 1 MiB on a
131k-slot pool.)
"""

from __future__ import annotations

from collections import deque

import torch


class KVSlotAllocator:
    def __init__(self, size: int, device: torch.device | str = "cpu", max_chunks: int = 4096) -> None:
        """``max_chunks``: past this many chunks the queue is merged into one (a copy of the free list,
        once per that many frees): alloc walks chunks one by one, and a long run of small frees should
        not make it slow."""
        if size <= 0:
            raise ValueError(f"KV pool size must be positive, got {size}")
        self.size = size
        self.device = torch.device(device)
        self.max_chunks = max_chunks
        self.clear()

    def clear(self) -> None:
        everything = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._chunks: deque[torch.Tensor] = deque([everything])
        self._available = self.size

    def available(self) -> int:
        return self._available

    def alloc(self, n: int) -> torch.Tensor | None:
        """Return n free slot indices, or None (allocating nothing) if fewer than n are free."""
        if n > self._available:
            return None
        taken: list[torch.Tensor] = []
        need = n
        while need:
            head = self._chunks[0]
            if head.numel() <= need:
                taken.append(self._chunks.popleft())
                need -= head.numel()
            else:
                taken.append(head[:need])
                self._chunks[0] = head[need:]
                need = 0
        self._available -= n
        if len(taken) == 1:
            return taken[0]
        if not taken:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(taken)

    def free(self, slots: torch.Tensor) -> None:
        if not slots.numel():
            return
        # A copy: the caller's tensor may be a view it goes on writing.
        self._chunks.append(slots.to(device=self.device, dtype=torch.int64, copy=True))
        self._available += slots.numel()
        if len(self._chunks) > self.max_chunks:
            self._chunks = deque([torch.cat(tuple(self._chunks))])

    def free_slots(self) -> torch.Tensor:
        """Every free slot (a copy, in the order alloc would hand them out): for checks and tests."""
        if not self._chunks:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(tuple(self._chunks))
