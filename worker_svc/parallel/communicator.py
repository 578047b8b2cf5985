"""How the ranks of a tensor-parallel group exchange tensors: the ``Communicator`` seam of ``TPContext``.

Two implementations: ``ProcessGroupCommunicator`` (torch.distributed: gloo on the CPU, NCCL on CUDA,
any hosts) and ``ShmCommunicator`` (parallel/shm_communicator.py: shared memory, every rank on one
host, CPU tensors). Both are split-phase where the overlap executor needs it: ``all_reduce_start``
returns a handle whose ``wait()`` completes the sum in place. A communicator is driven by one thread
at a time, and every rank issues the same collectives in the same order (as with a process group).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from worker_svc.parallel.collective_observer import WorkHandle


class Communicator(Protocol):
    @property
    def kind(self) -> str:
        """"shm", "gloo" or "nccl" (logged at start, shown in GetServerInfo)."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum in place across ranks."""
        ...

    def all_reduce_start(self, tensor: torch.Tensor) -> WorkHandle:
        """Start the in-place sum; ``tensor`` must not change until the handle's ``wait()`` returns."""
        ...

    def all_gather(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``shard`` (same shape and dtype on every rank), in rank order."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s."""
        ...

    def broadcast_start(self, tensor: torch.Tensor, src: int) -> WorkHandle: ...

    def close(self) -> None: ...


class ProcessGroupCommunicator:
    """torch.distributed collectives on one process group (its timeout bounds every wait)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._kind = group.name()  # the backend: "gloo" or "nccl"

    @property
    def kind(self) -> str:
        return self._kind

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def all_reduce_start(self, tensor: torch.Tensor) -> WorkHandle:
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        assert work is not None
        return work

    def all_gather(self, shard: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(shard) for _ in range(self.group.size())]
        dist.all_gather(parts, shard, group=self.group)
        return parts

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        dist.broadcast(tensor, group=self.group, group_src=src)  # src is a rank of this group

    def broadcast_start(self, tensor: torch.Tensor, src: int) -> WorkHandle:
        work = dist.broadcast(tensor, group=self.group, async_op=True, group_src=src)
        assert work is not None
        return work

    def close(self) -> None:
        pass  # the process group is destroyed by destroy_tp
