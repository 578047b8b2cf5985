"""Create and tear down the tensor-parallel process group of one worker rank.

``init_tp(rank, size, "host:port", device)`` rendezvous over TCP with a bounded timeout and returns a
``TPContext`` holding an explicit group object; the backend follows the device (gloo on the CPU, NCCL on
CUDA). The only global state is torch.distributed's own default group, which ``destroy_tp`` removes.

Two timeouts: ``connect_timeout_s`` bounds the rendezvous and ``tp_barrier`` (ranks start and load
their shards at different speeds), ``timeout_s`` bounds every collective afterwards, so a serving
worker can keep it short (a dead or hung peer is an error within that bound, not a hang).

The collectives travel through the group's communicator (``comm``, ``--tp-comm``): "auto" takes shared
memory (parallel/shm_communicator.py) when every rank runs on this host and the CPU kernels load, and
the process group otherwise; "shm" insists on shared memory; "gloo" keeps the process group. CUDA
groups always use NCCL. The choice is logged and shown in GetServerInfo.

The rendezvous store is torch's TCPStore, which has no authentication. torch's own master socket
(libuv) listens on every interface whatever host it is given, so rank 0 binds the socket itself, to
the init address's interface only (loopback for single-machine TP), and hands it to the store.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from worker_svc.config.tp_comm import TP_COMM_CHOICES
from worker_svc.config.tp_timeouts import TP_CONNECT_TIMEOUT_S, TP_UNWATCHED_TIMEOUT_S
from worker_svc.parallel import shm_communicator
from worker_svc.parallel.collective_observer import CollectiveObserver
from worker_svc.parallel.communicator import Communicator
from worker_svc.parallel.context import TPContext
from worker_svc.parallel.fault import GroupFault

log = structlog.get_logger(__name__)


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
    comm: str = "auto",
    shm_slot_bytes: int = shm_communicator.DEFAULT_SLOT_BYTES,
) -> TPContext:
    """Join the ``size``-rank group whose rank 0 listens on ``init_addr`` ("host:port").

    The rendezvous waits up to ``connect_timeout_s`` (default: the larger of ``timeout_s`` and
    TP_CONNECT_TIMEOUT_S) for every rank; every collective then fails after ``timeout_s``.
    ``observer`` sees this rank's collectives (parallel/collective_observer.py). ``comm``: "auto",
    "shm" or "gloo" (see the module docstring).
    """
    if comm not in TP_COMM_CHOICES:
        raise ValueError(f"tp comm must be one of {', '.join(TP_COMM_CHOICES)}, got {comm!r}")
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
    fault = GroupFault()
    chosen: Communicator | None = None
    if backend == "nccl":
        if comm == "shm":
            raise ValueError("--tp-comm shm is for CPU groups; CUDA groups use NCCL")
    elif comm != "gloo":
        chosen = _shm_communicator(comm == "shm", rank, size, store, fault, timeout_s, shm_slot_bytes, connect)
    tp = TPContext(rank=rank, size=size, group=dist.group.WORLD, store=store, observer=observer, comm=chosen,
                   fault=fault)
    log.info("tp group ready", tp_rank=rank, tp_size=size, tp_comm=tp.comm_kind)
    return tp


def host_identity() -> str:
    """Equal on two ranks exactly when they share this host's /dev/shm (same boot, same mount: two
    containers on one machine have different ones)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        info = os.stat(shm_communicator.SHM_DIR)
    except OSError as exc:
        return f"unknown:{socket.gethostname()}:{os.getpid()}:{exc.errno}"
    return f"{boot}:{info.st_dev}:{info.st_ino}"


def _shm_communicator(required: bool, rank: int, size: int, store: dist.Store, fault: GroupFault,
                      timeout_s: float, slot_bytes: int, connect: timedelta) -> Communicator | None:
    """The shared-memory communicator when every rank can use it (each says so through the store),
    else None (the process group), or an error when ``required``."""
    reason = shm_communicator.available()
    store.set(f"llmserve/shm/host/{rank}", host_identity())
    hosts = {store.get(f"llmserve/shm/host/{r}") for r in range(size)}
    if reason is None and len(hosts) > 1:
        reason = "the ranks are not all on this host"
    store.set(f"llmserve/shm/verdict/{rank}", reason or "")
    verdicts = [store.get(f"llmserve/shm/verdict/{r}").decode() for r in range(size)]
    refusal = next((f"rank {r}: {v}" for r, v in enumerate(verdicts) if v), None)
    if refusal is not None:
        if required:
            raise RuntimeError(f"--tp-comm shm: shared memory cannot be used ({refusal})")
        log.info("tp comm: using the process group", reason=refusal)
        return None
    name = ""
    try:
        if rank == 0:
            name, segment = shm_communicator.create_segment(size, slot_bytes)
            store.set("llmserve/shm/name", name)
        else:
            name = store.get("llmserve/shm/name").decode()
            segment = shm_communicator.attach_segment(name, size, slot_bytes)
        _store_barrier(store, "shm-mapped", rank, size, connect)
    finally:
        # Mapped by every rank (or failed): the name is no longer needed, so nothing can be left behind.
        if name:
            shm_communicator.unlink_segment(name)
    return shm_communicator.ShmCommunicator(segment, rank, size, slot_bytes, fault, timeout_s)


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
    """Release the communicator and the process group (no-op for a single rank or when already destroyed)."""
    if tp.comm is not None:
        tp.comm.close()
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
