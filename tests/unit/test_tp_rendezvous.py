"""F5: the TP rendezvous store and the heartbeat listener bind only to the init address's interface,
and the heartbeat handshake admits only peers holding the group's secret (real sockets on loopback,
real TCPStores; no process group needed)."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest

from tests.procfs import is_loopback, listening_sockets
from worker_svc.parallel.context import TPContext
from worker_svc.parallel.group import free_port, open_store
from worker_svc.parallel.heartbeat import (
    MAC_LEN,
    MAGIC,
    NONCE_LEN,
    FollowerHeartbeat,
    HandshakeRefused,
    LeaderHeartbeat,
    new_secret,
)

TIMEOUT = timedelta(seconds=10)
SECRET = b"s" * 32


def _own_listeners(port: int) -> list[tuple[str, int]]:
    import os

    return [a for a in listening_sockets(os.getpid()) if a[1] == port]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_rendezvous_store_listens_on_the_init_host_only(host):
    port = free_port()
    master = open_store(host, port, 2, True, TIMEOUT)
    listeners = _own_listeners(port)
    assert listeners and all(addr == "127.0.0.1" for addr, _ in listeners), listeners  # not 0.0.0.0 / ::
    client = open_store(host, port, 2, False, TIMEOUT)
    client.set("k", "v")
    assert master.get("k") == b"v"
    other = _non_loopback_address()
    if other is not None:  # this host's other interface does not answer on the store's port
        with pytest.raises(OSError):
            socket.create_connection((other, port), timeout=2).close()


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.fixture
def leader_group():
    """A leader heartbeat for a 2-rank group over a real store; yields (leader, follower_ctx, faults)."""
    port = free_port()
    master = open_store("127.0.0.1", port, 2, True, TIMEOUT)
    client = open_store("127.0.0.1", port, 2, False, TIMEOUT)
    faults: list[str] = []
    leader = LeaderHeartbeat(TPContext(rank=0, size=2, store=master), "127.0.0.1", 5.0, faults.append, SECRET)
    yield leader, TPContext(rank=1, size=2, store=client), faults
    leader.close(clean=False)


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes, rank: int) -> bytes:
    return hmac.new(secret, role + first + second + struct.pack("!I", rank), hashlib.sha256).digest()


def _leader_port(ctx: TPContext) -> int:
    return int(ctx.store.get("llmserve/heartbeat").decode().rpartition(":")[2])


def test_heartbeat_listener_is_on_the_init_host_only(leader_group):
    _, follower_ctx, _ = leader_group
    port = _leader_port(follower_ctx)
    listeners = _own_listeners(port)
    assert listeners and all(is_loopback(addr) for addr, _ in listeners), listeners


def test_heartbeat_connection_with_a_wrong_secret_is_refused(leader_group):
    leader, follower_ctx, faults = leader_group
    port = _leader_port(follower_ctx)

    # A raw client that speaks the protocol but signs with another secret: the leader hangs up.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        hello = sock.recv(len(MAGIC) + NONCE_LEN, socket.MSG_WAITALL)
        assert hello.startswith(MAGIC)
        mine = b"n" * NONCE_LEN
        sock.sendall(struct.pack("!I", 1) + mine + _mac(b"w" * 32, b"follower", hello[len(MAGIC):], mine, 1))
        assert sock.recv(MAC_LEN) == b""  # closed, no proof sent

    # The real follower class with the wrong secret: refused, and it says so.
    with pytest.raises(HandshakeRefused, match="refused"):
        FollowerHeartbeat(follower_ctx, 5.0, faults.append, b"w" * 32).connect(5)
    with pytest.raises(TimeoutError):
        leader.wait_connected(0.3)  # neither counted as rank 1

    # The right secret gets in, and the slot is then taken and the listener gone.
    follower = FollowerHeartbeat(follower_ctx, 5.0, faults.append, SECRET)
    follower.connect(5)
    leader.wait_connected(5)
    assert faults == [] and leader.fault is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    follower.close()


def test_silent_connection_does_not_hold_up_the_real_follower(leader_group):
    leader, follower_ctx, faults = leader_group
    port = _leader_port(follower_ctx)
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # connects, never answers
        start = time.monotonic()
        follower = FollowerHeartbeat(follower_ctx, 5.0, faults.append, SECRET)
        follower.connect(5)
        leader.wait_connected(5)
        assert time.monotonic() - start < 3.0
    follower.close()


def test_follower_refuses_a_leader_without_the_secret():
    """Mutual: a listener posing as the leader (another secret) is refused by the follower."""
    port = free_port()
    master = open_store("127.0.0.1", port, 2, True, TIMEOUT)
    impostor = socket.socket()
    impostor.bind(("127.0.0.1", 0))
    impostor.listen(1)
    master.set("llmserve/heartbeat", f"127.0.0.1:{impostor.getsockname()[1]}")

    def pose() -> None:
        conn, _ = impostor.accept()
        with conn:
            nonce = b"x" * NONCE_LEN
            conn.sendall(MAGIC + nonce)
            reply = conn.recv(4 + NONCE_LEN + MAC_LEN, socket.MSG_WAITALL)
            conn.sendall(_mac(b"w" * 32, b"leader", reply[4:4 + NONCE_LEN], nonce, 1))
            conn.recv(1)

    thread = threading.Thread(target=pose, daemon=True)
    thread.start()
    follower = FollowerHeartbeat(TPContext(rank=1, size=2, store=master), 5.0, lambda _: None, SECRET)
    with pytest.raises(HandshakeRefused, match="another group secret"):
        follower.connect(5)
    impostor.close()


def test_secrets_are_random_and_long_enough():
    assert len(new_secret()) == 32 and new_secret() != new_secret()
    with pytest.raises(ValueError, match="at least 16 bytes"):
        LeaderHeartbeat(TPContext(rank=0, size=2, store=object()), "127.0.0.1", 5.0, lambda _: None, b"short")
