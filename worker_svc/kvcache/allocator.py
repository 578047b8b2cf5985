"""Token-slot allocator for the KV pool (page size 1).

Slot 0 is reserved as a padding target: padded gathers and writes of dummy tokens land there, so
real slots are never clobbered. Free slots live in one int64 tensor so alloc/free are O(n) tensor ops.
"""

from __future__ import annotations

import torch


class KVSlotAllocator:
    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        if size <= 0:
            raise ValueError(f"KV pool size must be positive, got {size}")
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)

    def available(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        """Return n free slot indices, or None (allocating nothing) if fewer than n are free."""
        if n > self._free.numel():
            return None
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat((self._free, slots.to(self._free)))
