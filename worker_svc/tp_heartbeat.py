"""Liveness side channel between a tensor-parallel leader and its followers: one TCP connection per
follower, one byte each way every ``interval_s``.

Collectives cannot tell "slow" from "dead" before the process group's timeout, and an idle follower is
blocked in a broadcast anyway. This channel can: a rank that dies closes its socket (the kernel does
it even on SIGKILL), so the peer sees EOF at once; a rank that hangs (stopped, swapped out, deadlocked
with its threads) stops sending, which the peer notices after ``timeout_s``. Either side then calls its
``on_fault(reason)`` once. The leader publishes its listening address in the rendezvous store.

Bytes: ``h`` heartbeat; ``b`` bye (the leader is shutting down cleanly: STOP follows or was sent);
``a`` abort (the leader gave up on the group: followers exit). The follower opens with its rank.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable

import structlog

from worker_svc.tp import TPContext

log = structlog.get_logger(__name__)

ADDRESS_KEY = "llmserve/heartbeat"
HEARTBEAT, BYE, ABORT = b"h", b"b", b"a"


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class LeaderHeartbeat:
    """Rank 0's side: accepts a connection from every follower and watches each."""

    def __init__(
        self,
        tp: TPContext,
        advertise_host: str,
        timeout_s: float,
        on_fault: Callable[[str], None],
        interval_s: float | None = None,
    ) -> None:
        self.tp = tp
        self.timeout_s = timeout_s
        self.interval_s = interval_s or max(0.2, timeout_s / 5)
        self._on_fault = on_fault
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._last_seen: dict[int, float] = {}
        self._all_connected = threading.Event()
        self._closing = False
        self.fault: str | None = None
        loopback = advertise_host in ("127.0.0.1", "localhost", "::1")
        family = socket.AF_INET6 if ":" in advertise_host.strip("[]") else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((advertise_host.strip("[]") if loopback else "", 0))
        self._listener.listen(tp.size)
        port = self._listener.getsockname()[1]
        tp.store.set(ADDRESS_KEY, f"{advertise_host}:{port}")
        self._threads = [
            threading.Thread(target=self._accept, name="tp-hb-accept", daemon=True),
            threading.Thread(target=self._monitor, name="tp-hb-monitor", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def wait_connected(self, timeout_s: float) -> None:
        if not self._all_connected.wait(timeout_s):
            raise TimeoutError(f"tp followers did not open their heartbeat within {timeout_s:.0f}s")

    def _accept(self) -> None:
        while len(self._conns) < self.tp.size - 1:
            try:
                sock, _ = self._listener.accept()
                rank = struct.unpack("!I", sock.recv(4, socket.MSG_WAITALL))[0]
            except (OSError, struct.error):
                if self._closing:
                    return
                continue
            with self._lock:
                self._conns[rank] = sock
                self._last_seen[rank] = time.monotonic()
            threading.Thread(target=self._read, args=(rank, sock), name=f"tp-hb-rank{rank}", daemon=True).start()
            log.info("tp follower heartbeat connected", tp_rank=rank)
        self._all_connected.set()

    def _read(self, rank: int, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(64)
            except OSError:
                data = b""
            if not data:
                if not self._closing:
                    self._fault(f"tp rank {rank} closed its heartbeat connection (process exited or was killed)")
                return
            self._last_seen[rank] = time.monotonic()

    def _monitor(self) -> None:
        while not self._closing and self.fault is None:
            with self._lock:
                conns = dict(self._conns)
            now = time.monotonic()
            for rank, sock in conns.items():
                _send(sock, HEARTBEAT)
                silent = now - self._last_seen.get(rank, now)
                if silent > self.timeout_s:
                    self._fault(f"no heartbeat from tp rank {rank} for {silent:.1f}s (hung?)")
                    return
            time.sleep(self.interval_s)

    def _fault(self, reason: str) -> None:
        with self._lock:
            if self.fault is not None or self._closing:
                return
            self.fault = reason
        log.error("tensor-parallel group failed", reason=reason)
        self._shutdown(ABORT)
        self._on_fault(reason)

    def close(self, clean: bool = True) -> None:
        """Tell every follower goodbye (``clean``: STOP was sent) or to abort, then close."""
        with self._lock:
            if self._closing:
                return
        self._shutdown(BYE if clean else ABORT)

    def _shutdown(self, last: bytes) -> None:
        with self._lock:
            self._closing = True
            conns = list(self._conns.values())
        for sock in conns:
            _send(sock, last)
            _close(sock)
        _close(self._listener)


class FollowerHeartbeat:
    """A follower's side: connects to the leader, answers and watches its heartbeat."""

    def __init__(
        self, tp: TPContext, timeout_s: float, on_fault: Callable[[str], None], interval_s: float | None = None
    ) -> None:
        self.tp = tp
        self.timeout_s = timeout_s
        self.interval_s = interval_s or max(0.2, timeout_s / 5)
        self._on_fault = on_fault
        self._sock: socket.socket | None = None
        self._last_seen = time.monotonic()
        self._bye_at: float | None = None
        self._closing = False
        self._fired = False

    def connect(self, timeout_s: float) -> None:
        """Read the leader's address from the store (waits for it) and connect."""
        address = self.tp.store.get(ADDRESS_KEY).decode()
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        sock.settimeout(None)
        sock.sendall(struct.pack("!I", self.tp.rank))
        self._sock = sock
        self._last_seen = time.monotonic()
        threading.Thread(target=self._read, name="tp-hb-read", daemon=True).start()
        threading.Thread(target=self._monitor, name="tp-hb-monitor", daemon=True).start()

    @property
    def bye_received(self) -> bool:
        return self._bye_at is not None

    def _read(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(64)
            except OSError:
                data = b""
            if not data:
                if self._bye_at is None:
                    self._fault("the tp leader closed the heartbeat connection (leader exited or was killed)")
                return
            self._last_seen = time.monotonic()
            if ABORT in data:
                self._fault("the tp leader aborted the group")
                return
            if BYE in data and self._bye_at is None:
                self._bye_at = time.monotonic()

    def _monitor(self) -> None:
        assert self._sock is not None
        while not self._closing and not self._fired:
            now = time.monotonic()
            if self._bye_at is not None:
                if now - self._bye_at > self.timeout_s:
                    self._fault(f"the follower loop did not end within {self.timeout_s:.0f}s of the leader's goodbye")
                    return
            else:
                _send(self._sock, HEARTBEAT)
                if now - self._last_seen > self.timeout_s:
                    self._fault(f"no heartbeat from the tp leader for {now - self._last_seen:.1f}s (hung?)")
                    return
            time.sleep(self.interval_s)

    def _fault(self, reason: str) -> None:
        if self._closing or self._fired:
            return
        self._fired = True
        self._on_fault(reason)

    def close(self) -> None:
        self._closing = True
        if self._sock is not None:
            _close(self._sock)
