"""Watching the collectives a ``TPContext`` performs: one ``CollectiveRecord`` per collective.

``TPContext(observer=...)`` hands every collective it runs to the observer once it is done. Three
host-side timestamps (``time.perf_counter_ns``) say when it was issued, when the caller started
waiting for it and when that wait returned. A synchronous call waits at once (issue == wait). An
``async_op=True`` call returns an ``ObservedWork`` whose ``wait()`` supplies the last two, so the
record shows how much of the collective was hidden behind the caller's own work (wait - issue) and
how long the caller still blocked (done - wait). A handle that is never waited for is never recorded.

On CUDA (NCCL) these are host times: a collective that "returns" has been queued on the stream, not
finished; GPU-side timing would need CUDA events. On the CPU (gloo) the host times are the real ones.

``CollectiveRecorder`` is the ready-made observer: a list of records and a per-op summary
(bench-one-batch --profile-collectives prints it).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch


@dataclass(frozen=True)
class CollectiveRecord:
    """One finished collective as this rank saw it. ``nbytes`` and ``shape`` describe this rank's
    tensor: the one reduced in place, the shard it contributes to a gather, the broadcast buffer."""

    op: str  # "all_reduce", "all_reduce_max", "all_gather", "broadcast"
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    async_op: bool
    issue_ns: int
    wait_ns: int
    done_ns: int

    @property
    def span_ns(self) -> int:
        """Issue to done: the collective's whole life as the host saw it."""
        return self.done_ns - self.issue_ns

    @property
    def blocked_ns(self) -> int:
        """How long the caller waited for it (the whole span for a synchronous call)."""
        return self.done_ns - self.wait_ns


class CollectiveObserver(Protocol):
    """Receives each collective once it is done (on the thread that finished it)."""

    def record(self, record: CollectiveRecord) -> None: ...


class WorkHandle(Protocol):
    """What ``torch.distributed`` returns for ``async_op=True`` (its ``Work``), as far as we use it."""

    def wait(self, timeout: timedelta = ...) -> bool: ...

    def is_completed(self) -> bool: ...


# torch's Work.wait default: 0 means "the process group's own timeout".
_PROCESS_GROUP_TIMEOUT = timedelta(0)


def describe(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    """(bytes, shape, dtype) of a tensor taking part in a collective."""
    return tensor.numel() * tensor.element_size(), tuple(tensor.shape), tensor.dtype


class ObservedWork:
    """An async collective's handle: ``wait()`` waits on the real handle, then records the collective
    (once, however often it is waited for)."""

    def __init__(self, work: WorkHandle, observer: CollectiveObserver, op: str, tensor: torch.Tensor,
                 issue_ns: int) -> None:
        self._work = work
        self._observer = observer
        self._op = op
        self._described = describe(tensor)
        self._issue_ns = issue_ns
        self._recorded = False

    def wait(self, timeout: timedelta = _PROCESS_GROUP_TIMEOUT) -> bool:
        wait_ns = time.perf_counter_ns()
        result = self._work.wait(timeout)
        done_ns = time.perf_counter_ns()
        if not self._recorded:
            self._recorded = True
            nbytes, shape, dtype = self._described
            self._observer.record(CollectiveRecord(self._op, nbytes, shape, dtype, True, self._issue_ns, wait_ns,
                                                   done_ns))
        return result

    def is_completed(self) -> bool:
        return self._work.is_completed()


@dataclass(frozen=True)
class OpSummary:
    """The collectives of one op: how many, how many bytes, and their time (issue to done)."""

    count: int
    nbytes: int
    total_ns: int
    blocked_ns: int  # the part the caller spent waiting (equals total_ns when all are synchronous)

    @property
    def mean_ns(self) -> float:
        return self.total_ns / self.count if self.count else 0.0


class CollectiveRecorder:
    """A ``CollectiveObserver`` that keeps every record (thread-safe: a tensor-parallel leader's
    keepalive and its steps may come from different threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[CollectiveRecord] = []

    def record(self, record: CollectiveRecord) -> None:
        with self._lock:
            self._records.append(record)

    @property
    def records(self) -> list[CollectiveRecord]:
        """A copy, in the order the collectives finished."""
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def summary(self) -> dict[str, OpSummary]:
        """{op: OpSummary}, ops in the order they first finished."""
        grouped: dict[str, list[CollectiveRecord]] = {}
        for rec in self.records:
            grouped.setdefault(rec.op, []).append(rec)
        return {
            op: OpSummary(
                count=len(recs),
                nbytes=sum(r.nbytes for r in recs),
                total_ns=sum(r.span_ns for r in recs),
                blocked_ns=sum(r.blocked_ns for r in recs),
            )
            for op, recs in grouped.items()
        }


class StepCollectives:
    """A ``CollectiveObserver`` that only sums: per op, how many collectives and how long the caller was
    blocked in them (``blocked_ns``: under two-batch overlap the part hidden behind compute does not
    count). ``take()`` returns the sums since the last ``take()`` and starts new ones, so a caller that
    takes at the start and at the end of a step gets that step's collectives (the serving metrics)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[str, list[int]] = {}

    def record(self, record: CollectiveRecord) -> None:
        with self._lock:
            entry = self._sums.get(record.op)
            if entry is None:
                self._sums[record.op] = [1, record.blocked_ns]
            else:
                entry[0] += 1
                entry[1] += record.blocked_ns

    def take(self) -> dict[str, tuple[int, int]]:
        """{op: (count, blocked ns)} since the last take."""
        with self._lock:
            sums, self._sums = self._sums, {}
        return {op: (count, ns) for op, (count, ns) in sums.items()}
