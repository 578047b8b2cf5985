"""Request -> token-slot table: row r lists, in position order, the KV slots of request slot r."""

from __future__ import annotations

import torch


class ReqToTokenTable:
    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        # +1 column so a padded gather of `max_context_len` tokens never indexes out of bounds.
        self.table = torch.zeros(max_requests, max_context_len + 1, dtype=torch.int64, device=device)
        self._free_rows = list(range(max_requests))

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self.table[row].zero_()
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Row ``row`` gets ``slots`` at positions ``start ..``: an extend's new tokens."""
        self.table[row, start : start + slots.numel()] = slots

    def write_last(self, rows: torch.Tensor, seq_lens: list[int], slots: torch.Tensor) -> None:
        """Each of ``rows`` gets its slot at position ``seq_len - 1``: a decode step's one new token per
        request, in one indexed write."""
        lens = torch.tensor(seq_lens, device=self.table.device)
        self.table[rows, lens - 1] = slots

    def slots(self, row: int, length: int) -> torch.Tensor:
        return self.table[row, :length]
