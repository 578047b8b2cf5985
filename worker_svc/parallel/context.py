"""Tensor-parallel context: which rank this process is and how it talks to its peers.

Injectable and explicit. The default is "rank 0 of 1" so a model runs in a unit test without any
process group; multi-rank runs pass a context wrapping a real torch.distributed group.

Every collective of the model path goes through this object's methods, which hand it to the group's
``Communicator`` (parallel/communicator.py: the process group, or shared memory when every rank is on
this host), so an optional ``observer`` (parallel/collective_observer.py) sees each one with its issue,
wait and done times. Without one the only cost is an ``is None`` check. ``fault`` is the group's fault
state (parallel/fault.py), set by the heartbeat, watched by the shared-memory communicator's waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from worker_svc.parallel.collective_observer import (
    CollectiveObserver,
    CollectiveRecord,
    ObservedWork,
    WorkHandle,
    describe,
)
from worker_svc.parallel.communicator import Communicator, ProcessGroupCommunicator
from worker_svc.parallel.fault import GroupFault


class CompletedWork:
    """The handle of a collective that needed no peers (a single-rank context)."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None when size == 1
    store: dist.Store | None = None  # the rendezvous store (barriers, address exchange); None when size == 1
    # Sees every collective this rank performs; not part of the context's identity.
    observer: CollectiveObserver | None = field(default=None, compare=False)
    # How the collectives travel; None: the process group's own (set from ``group`` when given).
    comm: Communicator | None = field(default=None, compare=False)
    fault: GroupFault = field(default_factory=GroupFault, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} out of range for tp size {self.size}")
        if self.comm is None and self.group is not None:
            object.__setattr__(self, "comm", ProcessGroupCommunicator(self.group))

    @property
    def communicator(self) -> Communicator:
        if self.comm is None:
            raise RuntimeError("this TPContext has no communicator (single rank, or no process group)")
        return self.comm

    @property
    def comm_kind(self) -> str:
        """"shm", "gloo", "nccl", or "none" for a single rank."""
        return self.comm.kind if self.comm is not None else "none"

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def rendezvous(self) -> dist.Store:
        """The rendezvous store of a multi-rank context."""
        if self.store is None:
            raise RuntimeError("a single-rank TPContext has no rendezvous store")
        return self.store

    def shard_range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's even shard of ``total``; ``total`` must divide evenly."""
        if total % self.size:
            raise ValueError(f"dimension {total} does not divide evenly over tp size {self.size}")
        per_rank = total // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> WorkHandle | None:
        """Sum in place across ranks. With async_op returns a work handle (None when size == 1)."""
        if self.size == 1:
            return None
        if async_op:
            return self.all_reduce_start(tensor)
        comm = self.communicator
        if self.observer is None:
            comm.all_reduce(tensor)
            return None
        return self._observed("all_reduce", tensor, False, lambda: comm.all_reduce(tensor))

    def all_reduce_start(self, tensor: torch.Tensor) -> WorkHandle:
        """Start the in-place sum; ``handle.wait()`` completes it. ``tensor`` must not change in between."""
        if self.size == 1:
            return CompletedWork()
        comm = self.communicator
        if self.observer is None:
            return comm.all_reduce_start(tensor)
        work = self._observed("all_reduce", tensor, True, lambda: comm.all_reduce_start(tensor))
        assert work is not None
        return work

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Element-wise max in place across ranks (load-time use: quantization scales)."""
        if self.size == 1:
            return
        if self.observer is None:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
            return
        self._observed("all_reduce_max", tensor, False,
                       lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group))

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's shard along the last dimension, in rank order."""
        if self.size == 1:
            return tensor
        shard = tensor.contiguous()
        comm = self.communicator
        if self.observer is None:
            parts = comm.all_gather(shard)
        else:
            gathered: list[list[torch.Tensor]] = []
            self._observed("all_gather", shard, False, lambda: gathered.append(comm.all_gather(shard)))
            parts = gathered[0]
        return torch.cat(parts, dim=-1)  # [..., size * shard_last_dim]

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> WorkHandle | None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s (the leader's step message). With async_op
        returns a work handle (None when size == 1)."""
        if self.size == 1:
            return None
        comm = self.communicator

        def call() -> WorkHandle | None:
            if async_op:
                return comm.broadcast_start(tensor, src)
            comm.broadcast(tensor, src)
            return None

        if self.observer is None:
            return call()
        return self._observed("broadcast", tensor, async_op, call)

    def _observed(self, op: str, tensor: torch.Tensor, async_op: bool,
                  call: Callable[[], WorkHandle | None]) -> WorkHandle | None:
        """Run ``call`` and report it: at once when synchronous, at ``wait()`` through the wrapped handle
        when async."""
        observer = self.observer
        assert observer is not None
        issue_ns = time.perf_counter_ns()
        work = call()
        if async_op:
            assert work is not None
            return ObservedWork(work, observer, op, tensor, issue_ns)
        done_ns = time.perf_counter_ns()
        nbytes, shape, dtype = describe(tensor)
        observer.record(CollectiveRecord(op, nbytes, shape, dtype, False, issue_ns, issue_ns, done_ns))
        return None
