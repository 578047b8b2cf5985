"""Tensor-parallel context: which rank this process is and how it talks to its peers.

Injectable and explicit. The default is "rank 0 of 1" so a model runs in a unit test without any
process group; multi-rank runs pass a context wrapping a real torch.distributed group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup, None when size == 1
    store: Any = None  # the rendezvous torch.distributed.Store (barriers, address exchange); None when size == 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} out of range for tp size {self.size}")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def shard_range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's even shard of ``total``; ``total`` must divide evenly."""
        if total % self.size:
            raise ValueError(f"dimension {total} does not divide evenly over tp size {self.size}")
        per_rank = total // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Any:
        """Sum in place across ranks. With async_op returns a work handle (None when size == 1)."""
        if self.size == 1:
            return None
        return dist.all_reduce(tensor, group=self.group, async_op=async_op)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Element-wise max in place across ranks (load-time use: quantization scales)."""
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's shard along the last dimension, in rank order."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)
