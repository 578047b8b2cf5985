"""Create and tear down the tensor-parallel process group of one worker rank.

``init_tp(rank, size, "host:port", device)`` rendezvous over TCP with a bounded timeout and returns a
``TPContext`` holding an explicit group object; the backend follows the device (gloo on the CPU, NCCL on
CUDA). The only global state is torch.distributed's own default group, which ``destroy_tp`` removes.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from worker_svc.tp import TPContext

DEFAULT_TIMEOUT_S = 600.0


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
    rank: int, size: int, init_addr: str, device: str | torch.device = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S
) -> TPContext:
    """Join the ``size``-rank group whose rank 0 listens on ``init_addr`` ("host:port").

    Every collective (and the rendezvous itself) fails after ``timeout_s`` instead of hanging forever.
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
    dist.init_process_group(
        backend,
        init_method=f"tcp://{init_addr}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    return TPContext(rank=rank, size=size, group=dist.group.WORLD)


def destroy_tp(tp: TPContext) -> None:
    """Release the process group (no-op for a single rank or when already destroyed)."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
