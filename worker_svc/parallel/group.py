"""Create and tear down the tensor-parallel process group of one worker rank.

``init_tp(rank, size, "host:port", device)`` rendezvous over TCP with a bounded timeout and returns a
``TPContext`` holding an explicit group object; the backend follows the device (gloo on the CPU, NCCL on
CUDA). The only global state is torch.distributed's own default group, which ``destroy_tp`` removes.

Two timeouts: ``connect_timeout_s`` bounds the rendezvous and ``tp_barrier`` (ranks start and load
their shards at different speeds), ``timeout_s`` bounds every collective afterwards, so a serving
worker can keep it short (a dead or hung peer is an error within that bound, not a hang).

The rendezvous store is torch's TCPStore, which has no authentication. torch's own master socket
(libuv) listens on every interface whatever host it is given, so rank 0 binds the socket itself, to
the init address's interface only (loopback for single-machine TP), and hands it to the store.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from worker_svc.config.tp_timeouts import TP_CONNECT_TIMEOUT_S, TP_UNWATCHED_TIMEOUT_S
from worker_svc.parallel.collective_observer import CollectiveObserver
from worker_svc.parallel.context import TPContext


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """``cuda`` without an index means one GPU per rank (cuda:rank); anything else is kept."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return dev


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_tp(
    rank: int,
    size: int,
    init_addr: str,
    device: str | torch.device = "cpu",
    timeout_s: float = TP_UNWATCHED_TIMEOUT_S,
    connect_timeout_s: float | None = None,
    observer: CollectiveObserver | None = None,
) -> TPContext:
    """Join the ``size``-rank group whose rank 0 listens on ``init_addr`` ("host:port").

    The rendezvous waits up to ``connect_timeout_s`` (default: the larger of ``timeout_s`` and
    TP_CONNECT_TIMEOUT_S) for every rank; every collective then fails after ``timeout_s``.
    ``observer`` sees this rank's collectives (parallel/collective_observer.py).
    """
    if size == 1:
        return TPContext(observer=observer)
    if not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} out of range for tp size {size}")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process")
    host, _, port = init_addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"init address must be host:port, got {init_addr!r}")
    backend = backend_for(device)
    device_id = None
    if backend == "nccl":
        device_id = rank_device(device, rank)
        torch.cuda.set_device(device_id)
    connect = timedelta(seconds=connect_timeout_s or max(timeout_s, TP_CONNECT_TIMEOUT_S))
    store = open_store(host, int(port), size, rank == 0, connect)
    # Every rank has arrived before the group (whose own timeout may be short) connects.
    _store_barrier(store, "join", rank, size, connect)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s), device_id=device_id
    )
    return TPContext(rank=rank, size=size, group=dist.group.WORLD, store=store, observer=observer)


def bind_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """(family, sockaddr) to bind for ``host`` (a literal or a name, e.g. a compose service resolving to
    this container): that interface only, never the wildcard."""
    host = host.strip("[]")
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve the tp init host {host!r}: {exc}") from exc
    return family, sockaddr


def bound_listener(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on ``host``'s interface (port 0: any free port)."""
    family, sockaddr = bind_address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for the tp rendezvous: {exc}") from exc
    return sock


def open_store(host: str, port: int, size: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous TCPStore. The master listens on ``host``'s interface only: it binds the socket
    here and passes it in (``master_listen_fd``), the store then owns and closes it."""
    if not is_master:
        return dist.TCPStore(host.strip("[]"), port, world_size=size, is_master=False, timeout=timeout)
    sock = bound_listener(host, port, max(16, 2 * size))
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return dist.TCPStore(host.strip("[]"), port, world_size=size, is_master=True, timeout=timeout,
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):  # the store took it and closed it already
            os.close(fd)
        raise


def _store_barrier(store, name: str, rank: int, size: int, timeout: timedelta) -> None:
    store.set(f"llmserve/{name}/{rank}", "1")
    store.wait([f"llmserve/{name}/{r}" for r in range(size)], timeout)


def tp_barrier(tp: TPContext, name: str, timeout_s: float = TP_CONNECT_TIMEOUT_S) -> None:
    """Wait (through the rendezvous store, not a collective) until every rank reached ``name``; used
    after loading, which takes longer than the collective timeout may allow. ``name`` must be unique."""
    if tp.size > 1:
        _store_barrier(tp.rendezvous, name, tp.rank, tp.size, timedelta(seconds=timeout_s))


def destroy_tp(tp: TPContext) -> None:
    """Release the process group (no-op for a single rank or when already destroyed)."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
