"""Collectives over shared memory for a tensor-parallel group whose ranks all run on this host.

gloo pays >= 1.1 ms per collective on loopback TCP whatever the size; a decode step makes ~2 per
layer. Here the ranks map one segment (``/dev/shm``, mode 0600, a random per-launch name, unlinked as
soon as every rank has mapped it, so nothing is left behind whatever happens later) and exchange
through it (worker_svc/kernels/csrc/shm_comm.cpp has the protocol): a post copies this rank's data into
its slot and raises its flag, a finish waits for the peers' flags and reduces or copies.

Waits never hang: the C++ side waits in slices of ``SLICE_NS`` (spin, yield, then a futex sleep, so
an idle follower does not burn a core), and between slices this side checks the group's fault state
(set by the heartbeat: a dead or stopped peer) and the collective deadline (``--tp-timeout``). Either
poisons the segment, which ends the peers' waits at once, and raises ``CollectiveFailed``, which the
TP runners turn into the group's failure (requests end UNAVAILABLE).
"""

from __future__ import annotations

import collections
import os
import re
import secrets
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

from worker_svc.kernels import cpu_ext
from worker_svc.parallel.fault import GroupFault

SHM_DIR = Path("/dev/shm")
NAME_PATTERN = re.compile(r"llmserve-tp-[0-9a-f]{32}")
DEFAULT_SLOT_BYTES = 4 << 20  # per rank and phase: messages above it go in chunks
TWO_SHOT_BYTES = 256 << 10  # from here on: reduce-scatter + all-gather instead of one-shot
SLICE_NS = 20_000_000
MAX_RANKS = 16
REDUCIBLE = (torch.float32, torch.bfloat16, torch.float16)

_OK, _TIMEOUT_FIRST, _TIMEOUT_SECOND, _POISONED = 0, 1, 2, 3
ISA_CODES = {"auto": 0, "avx2": 1, "avx512": 2}


class CollectiveFailed(RuntimeError):
    """A shared-memory collective could not complete: a peer died or hung, or the deadline passed."""


def available() -> str | None:
    """None when this host can run the shared-memory communicator, else why not."""
    if not SHM_DIR.is_dir():
        return f"{SHM_DIR} does not exist"
    if cpu_ext.load() is None:
        return "the llmserve CPU kernels are not available on this host (see cpu_ext.unavailable in the log)"
    return None


def segment_bytes(size: int, slot_bytes: int) -> int:
    return int(_ops().shm_header_bytes()) + 2 * size * slot_bytes


def create_segment(size: int, slot_bytes: int) -> tuple[str, torch.Tensor]:
    """Rank 0: a new segment (name, mapping), initialised; the caller unlinks it once all have mapped it."""
    name = f"llmserve-tp-{secrets.token_hex(16)}"
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, segment_bytes(size, slot_bytes))
    finally:
        os.close(fd)
    try:
        segment = _map(path, size, slot_bytes)
        _ops().shm_init(segment)
    except BaseException:
        unlink_segment(name)
        raise
    return name, segment


def attach_segment(name: str, size: int, slot_bytes: int) -> torch.Tensor:
    """Ranks 1..: map the segment rank 0 created (its name comes through the rendezvous store)."""
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"not an llmserve shared-memory segment name: {name!r}")
    path = SHM_DIR / name
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{path} must belong to this user with mode 0600")
    return _map(path, size, slot_bytes)


def segment_names() -> set[str]:
    """The llmserve segments in /dev/shm now (a running group has none: they are unlinked at start)."""
    return {path.name for path in SHM_DIR.glob("llmserve-tp-*")}


def unlink_segment(name: str) -> None:
    (SHM_DIR / name).unlink(missing_ok=True)


def _map(path: Path, size: int, slot_bytes: int) -> torch.Tensor:
    nbytes = segment_bytes(size, slot_bytes)
    if path.stat().st_size < nbytes:
        raise ValueError(f"{path} holds {path.stat().st_size} bytes, expected {nbytes}")
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def _ops():  # noqa: ANN202 - torch.ops namespaces are untyped
    ops = cpu_ext.load()
    if ops is None:
        raise RuntimeError("the llmserve CPU kernels are not available on this host")
    return ops


class _ShmWork:
    """A split-phase collective: posted at start, completed by the first ``wait()``."""

    def __init__(self, finish: Callable[[], None] | None) -> None:
        self._finish = finish

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Completes the collective (bounded by the communicator's deadline, not ``timeout``)."""
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


class ShmCommunicator:
    """One rank's side of the group's segment. ``timeout_s`` bounds every collective; ``fault`` is the
    group's fault state (set by the heartbeat); ``isa`` forces the reduction kernels' instruction
    set ("auto", "avx2", "avx512")."""

    def __init__(self, segment: torch.Tensor, rank: int, size: int, slot_bytes: int, fault: GroupFault,
                 timeout_s: float, isa: str = "auto", two_shot_bytes: int = TWO_SHOT_BYTES) -> None:
        if not 1 <= size <= MAX_RANKS or not 0 <= rank < size:
            raise ValueError(f"shm communicator: rank {rank} of {size} (at most {MAX_RANKS} ranks)")
        self._ops = _ops()
        self._segment = segment
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.fault = fault
        self.timeout_s = timeout_s
        self._isa = ISA_CODES[isa]
        self._two_shot_bytes = two_shot_bytes
        self._seq = 0
        self._pending: collections.deque[_ShmWork] = collections.deque()
        fault.on_set(lambda reason: self.poison())

    @property
    def kind(self) -> str:
        return "shm"

    # ---- collectives -----------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.all_reduce_start(tensor).wait()

    def all_reduce_start(self, tensor: torch.Tensor) -> _ShmWork:
        if tensor.dtype not in REDUCIBLE:
            raise TypeError(f"shm all-reduce sums float32, bfloat16 or float16, not {tensor.dtype}")
        flat = tensor.contiguous().view(-1)  # the tensor itself when contiguous
        nbytes = flat.numel() * flat.element_size()
        if nbytes > self.slot_bytes:  # in chunks, at once (the overlap path sends smaller messages)
            self._drain()
            per = self.slot_bytes // flat.element_size()
            for start in range(0, flat.numel(), per):
                part = flat[start:start + per]
                self._reduce_finish(part, self._post(part))
            self._write_back(tensor, flat)
            return _ShmWork(None)
        seq = self._post(flat)

        def finish() -> None:
            self._reduce_finish(flat, seq)
            self._write_back(tensor, flat)

        return self._track(_ShmWork(finish))

    def all_gather(self, shard: torch.Tensor) -> list[torch.Tensor]:
        self._drain()
        flat = shard.contiguous().view(-1)
        out = torch.empty((self.size, flat.numel()), dtype=shard.dtype)  # [size, numel]
        per = max(1, self.slot_bytes // flat.element_size())
        for start in range(0, max(1, flat.numel()), per):
            part = flat[start:start + per]
            seq = self._post(part)
            whole = part.numel() == flat.numel()
            gathered = out if whole else torch.empty((self.size, part.numel()), dtype=shard.dtype)

            def finish(ns: int, gathered: torch.Tensor = gathered, seq: int = seq) -> int:
                return int(self._ops.shm_all_gather_finish(
                    self._segment, gathered, self.rank, self.size, seq, self.slot_bytes, ns))

            self._until(finish, "all-gather", seq)
            if not whole:
                out[:, start:start + part.numel()].copy_(gathered)
        return [row.view(shard.shape) for row in out.unbind(0)]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.broadcast_start(tensor, src).wait()

    def broadcast_start(self, tensor: torch.Tensor, src: int) -> _ShmWork:
        flat = tensor.contiguous().view(-1)  # the tensor itself when contiguous
        if flat.numel() * flat.element_size() > self.slot_bytes:
            raise ValueError(f"shm broadcast: {flat.numel() * flat.element_size()} bytes over the slot size")
        seq = self._post(flat if self.rank == src else flat[:0])

        def finish() -> None:
            self._until(lambda ns: self._ops.shm_broadcast_finish(
                self._segment, flat, self.rank, src, self.size, seq, self.slot_bytes, ns), "broadcast", seq)
            self._write_back(tensor, flat)

        return self._track(_ShmWork(finish))

    # ---- failure ---------------------------------------------------------------------------------

    def poison(self) -> None:
        """Make every rank's current and later waits on this segment fail at once."""
        if self._segment.numel():  # not after close()
            self._ops.shm_poison(self._segment, self.size, self.slot_bytes)

    @property
    def poisoned(self) -> bool:
        return bool(self._ops.shm_poisoned(self._segment, self.size, self.slot_bytes))

    def close(self) -> None:
        """Unmap (after the last collective); the segment file was unlinked at start-up already."""
        self._pending.clear()
        self._segment = torch.empty(0, dtype=torch.uint8)

    # ---- internals -------------------------------------------------------------------------------

    def _track(self, work: _ShmWork) -> _ShmWork:
        self._pending.append(work)
        return work

    def _drain(self) -> None:
        while self._pending:
            self._pending.popleft().wait()

    def _post(self, flat: torch.Tensor) -> int:
        # A third collective in flight would wait for this rank's own first one: finish it first.
        while self._pending and self._pending[0].is_completed():
            self._pending.popleft()
        while len(self._pending) >= 2:
            self._pending.popleft().wait()
        self._seq += 1
        seq = self._seq
        self._until(lambda ns: self._ops.shm_post(
            self._segment, flat, self.rank, self.size, seq, self.slot_bytes, ns), "post", seq)
        return seq

    def _reduce_finish(self, flat: torch.Tensor, seq: int) -> None:
        two_shot = flat.numel() * flat.element_size() >= self._two_shot_bytes and self.size > 1
        stage = 0

        def step(ns: int) -> int:
            nonlocal stage
            status = int(self._ops.shm_all_reduce_finish(self._segment, flat, self.rank, self.size, seq,
                                                         self.slot_bytes, stage, two_shot, ns, self._isa))
            if status == _TIMEOUT_SECOND:
                stage = 1
            return status

        self._until(step, "all-reduce", seq)

    @staticmethod
    def _write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))

    def _until(self, attempt: Callable[[int], int], what: str, seq: int) -> None:
        """Call ``attempt(slice_ns)`` until it succeeds; CollectiveFailed on a fault or past the deadline."""
        status = int(attempt(SLICE_NS))
        if status == _OK:
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            if status == _POISONED or self.fault.reason is not None:
                raise CollectiveFailed(f"shm {what} #{seq} on tp rank {self.rank}: the group failed "
                                       f"({self.fault.reason or 'a peer rank gave up on it'})")
            if time.monotonic() >= deadline:
                self.poison()
                raise CollectiveFailed(f"shm {what} #{seq} on tp rank {self.rank}: no peer progress for "
                                       f"{self.timeout_s:g} s (--tp-timeout)")
            status = int(attempt(SLICE_NS))
            if status == _OK:
                return
