"""What every KV pool offers, whatever it stores per token (``MHAKVPool``: per-head K and V;
``MLAKVPool``: one latent). The attention backend built for a pool kind reads that pool's own layout."""

from __future__ import annotations

from typing import Protocol


class KVPool(Protocol):
    @property
    def size(self) -> int:
        """Usable token slots (slot 0, the padding slot, comes on top)."""

    def nbytes(self) -> int:
        """Bytes the pool's buffers take."""
