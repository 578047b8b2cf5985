"""A tensor-parallel model worker's rank > 0 (a follower): it replays the leader's steps (tp_leader.py)
and serves only grpc.health.v1, SERVING while its step loop runs; it never talks to a router.

A follower whose leader dies or hangs exits 1 within ``timeout_s`` (``os._exit``: its main thread may
sit in a collective); followers the leader started itself are also killed by the kernel when the
leader dies (parent-death signal, set by the launcher). Signalled (a compose "down" signals every rank
at once), it says NOT_SERVING and waits for the leader's STOP.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health_pb2_grpc

from llmserve.grpc_server import grpc_address, listen, stop_signal_event
from worker_svc.config.engine_config import EngineConfig
from worker_svc.config.tp_timeouts import TP_CONNECT_TIMEOUT_S, TP_SERVING_TIMEOUT_S
from worker_svc.executor.compute_priority import lower_compute_priority
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.executor.tp_runners import FollowerLoop, rank_config
from worker_svc.parallel.collective_observer import StepCollectives
from worker_svc.parallel.group import destroy_tp, init_tp, tp_barrier
from worker_svc.parallel.heartbeat import FollowerHeartbeat
from worker_svc.server.health import WorkerHealth
from worker_svc.server.launch import SECRET_KEY
from worker_svc.server.loader_thread import run_in_own_thread

if TYPE_CHECKING:
    from llmserve.metrics import FollowerMetrics

log = structlog.get_logger(__name__)


def _die(reason: str) -> None:
    log.error("tp follower exiting: group failed", reason=reason)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


async def _start_health_server(
    host: str, port: int, liveness: Callable[[], tuple[bool, str]]
) -> tuple[grpc.aio.Server, WorkerHealth, int]:
    """grpc.health.v1 alone on ``host:port`` (0: a free port), SERVING from the start; returns the
    server, its health service and the bound port."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health = WorkerHealth(liveness)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = listen(server, host, port)
    await server.start()
    await health.set_serving(True)
    return server, health, bound


async def serve_follower(
    config: EngineConfig,
    rank: int,
    size: int,
    init_addr: str,
    host: str,
    port: int,
    timeout_s: float = TP_SERVING_TIMEOUT_S,
    connect_timeout_s: float = TP_CONNECT_TIMEOUT_S,
    shutdown_grace_s: float = 5.0,
    on_listening: Callable[[int], None] | None = None,
    secret: bytes | None = None,
    comm: str = "auto",
    metrics: FollowerMetrics | None = None,
) -> int:
    """Rank ``rank`` > 0: replay the leader's steps until STOP, serving grpc.health.v1 on
    ``host:port`` (SERVING while the loop runs). Returns 0 after STOP; exits the process (code 1)
    when the leader dies or hangs. ``on_listening(port)`` runs once health is served. ``secret``:
    the group's heartbeat secret (``None``: read the one the leader published in the store).
    ``comm``: --tp-comm (parallel/group.py). ``metrics``: this rank's metric set (steps and their
    collectives), served while the rank serves; None: no metrics."""
    collectives = StepCollectives() if metrics is not None else None
    tp = await asyncio.to_thread(functools.partial(
        init_tp, rank, size, init_addr, config.device, timeout_s, connect_timeout_s, observer=collectives, comm=comm))
    group_secret: bytes = secret if secret is not None else await asyncio.to_thread(tp.rendezvous.get, SECRET_KEY)
    heartbeat = FollowerHeartbeat(tp, timeout_s, _die, group_secret)
    runner = await run_in_own_thread(ModelRunner, rank_config(config, rank), tp)  # see loader_thread.py
    await asyncio.to_thread(heartbeat.connect, connect_timeout_s)
    await asyncio.to_thread(tp_barrier, tp, "loaded", connect_timeout_s)

    aio_loop = asyncio.get_running_loop()
    done = asyncio.Event()
    result: dict[str, object] = {}
    follower = FollowerLoop(runner, tp, metrics.steps if metrics is not None else None, collectives)

    def run_loop() -> None:
        lower_compute_priority(config.compute_nice)  # a new thread: its OpenMP team starts at this priority
        try:
            result["steps"] = follower.run()
        except BaseException as exc:  # noqa: BLE001
            result["error"] = exc
        aio_loop.call_soon_threadsafe(done.set)

    thread = threading.Thread(target=run_loop, name=f"tp-follower-{rank}", daemon=True)
    thread.start()

    def liveness() -> tuple[bool, str]:
        return (thread.is_alive() and not done.is_set()), "follower loop"

    server, health, bound = await _start_health_server(host, port, liveness)
    if metrics is not None:
        metrics.serve()
    log.info("tp follower serving", tp_rank=rank, tp_size=size, tp_comm=tp.comm_kind,
             health_address=grpc_address(host, bound))
    if on_listening is not None:
        on_listening(bound)

    signalled = stop_signal_event()
    waiters = {asyncio.ensure_future(done.wait()), asyncio.ensure_future(signalled.wait())}
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    if not done.is_set():
        # Signalled (a compose "down" signals every rank at once): the leader drains and sends STOP.
        log.info("tp follower signalled; waiting for the leader's STOP", wait_s=shutdown_grace_s + timeout_s)
        await health.set_serving(False)
        try:
            await asyncio.wait_for(done.wait(), shutdown_grace_s + timeout_s)
        except asyncio.TimeoutError:
            _die("no STOP from the leader after a signal")
    for waiter in waiters:
        waiter.cancel()
    heartbeat.close()
    await server.stop(0.5)
    if metrics is not None:
        metrics.stop_serving()
    if "error" in result:
        _die(f"follower loop failed: {result['error']!r}")
    await asyncio.to_thread(destroy_tp, tp)
    log.info("tp follower stopped", tp_rank=rank, steps=result.get("steps"))
    return 0
