"""Create and tear down the tensor-parallel process group of one worker rank.

``init_tp(rank, size, "host:port", device)`` rendezvous over TCP with a bounded timeout and returns a
``TPContext`` holding an explicit group object; the backend follows the device (gloo on the CPU, NCCL on
CUDA). The only global state is torch.distributed's own default group, which ``destroy_tp`` removes.

Two timeouts: ``connect_timeout_s`` bounds the rendezvous and ``tp_barrier`` (ranks start and load
their shards at different speeds), ``timeout_s`` bounds every collective afterwards, so a serving
worker can keep it short (a dead or hung peer is an error within that bound, not a hang).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from worker_svc.tp import TPContext

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 300.0


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
    timeout_s: float = DEFAULT_TIMEOUT_S,
    connect_timeout_s: float | None = None,
) -> TPContext:
    """Join the ``size``-rank group whose rank 0 listens on ``init_addr`` ("host:port").

    The rendezvous waits up to ``connect_timeout_s`` (default: the larger of ``timeout_s`` and
    DEFAULT_CONNECT_TIMEOUT_S) for every rank; every collective then fails after ``timeout_s``.
    """
    if size == 1:
        return TPContext()
    if not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} out of range for tp size {size}")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process")
    host, _, port = init_addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"init address must be host:port, got {init_addr!r}")
    backend = backend_for(device)
    kwargs = {}
    if backend == "nccl":
        dev = rank_device(device, rank)
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev
    connect = timedelta(seconds=connect_timeout_s or max(timeout_s, DEFAULT_CONNECT_TIMEOUT_S))
    store = dist.TCPStore(
        host.strip("[]"), int(port), world_size=size, is_master=rank == 0, timeout=connect, wait_for_workers=False
    )
    # Every rank has arrived before the group (whose own timeout may be short) connects.
    _store_barrier(store, "join", rank, size, connect)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s), **kwargs
    )
    return TPContext(rank=rank, size=size, group=dist.group.WORLD, store=store)


def _store_barrier(store, name: str, rank: int, size: int, timeout: timedelta) -> None:
    store.set(f"llmserve/{name}/{rank}", "1")
    store.wait([f"llmserve/{name}/{r}" for r in range(size)], timeout)


def tp_barrier(tp: TPContext, name: str, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
    """Wait (through the rendezvous store, not a collective) until every rank reached ``name``; used
    after loading, which takes longer than the collective timeout may allow. ``name`` must be unique."""
    if tp.size > 1:
        _store_barrier(tp.store, name, tp.rank, tp.size, timedelta(seconds=timeout_s))


def destroy_tp(tp: TPContext) -> None:
    """Release the process group (no-op for a single rank or when already destroyed)."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
