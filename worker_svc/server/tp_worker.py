"""A tensor-parallel model worker: rank 0 (the leader) serves gRPC, ranks 1.. (followers) replay its steps.

Start-up, on every rank: ``init_tp`` (rendezvous through the store at ``--dist-init-addr``, patient:
``connect_timeout_s``), the heartbeat channel (tp_heartbeat.py), load this rank's shard, a store
barrier ("loaded"), then serve. From there every collective is bounded by ``timeout_s``; an idle leader
sends a keepalive header every ``timeout_s / 3`` so idle followers never hit it.

Faults: a follower that dies is seen at once (EOF on its heartbeat socket, or the gloo error in the
current collective), one that hangs within ``timeout_s`` (missing heartbeats; the collective timeout
is the backstop). The leader then fails its EngineLoop (in-flight calls end UNAVAILABLE, both health
services say NOT_SERVING, new calls get UNAVAILABLE) and tells the other followers to abort. A broken
group cannot heal (the ranks are out of step), so the leader does not linger as a zombie: after
``fault_exit_delay_s`` (``--tp-fault-exit-delay``; the router sees NOT_SERVING meanwhile) it shuts
down and exits 1, and whatever supervises it (``llmserve serve``, a compose restart policy, a
Kubernetes pod) restarts the whole group on the same port. ``inf`` keeps the old behaviour: stay up
NOT_SERVING until signalled, then exit 1 (for a watchdog that acts on health). A follower whose
leader dies or hangs exits 1 within ``timeout_s`` (``os._exit``: its main thread may sit in a
collective); followers the leader started itself are also killed by the kernel when the leader dies
(parent-death signal, set by the launcher). Clean shutdown (SIGTERM to the leader): drain, STOP to
the followers, goodbye on the heartbeat, every rank exits 0.

Group secret: the heartbeat handshake proves that a peer holds the group's secret (tp_heartbeat.py).
In single-machine mode the leader makes a random one and hands it to the followers it starts
through an inherited pipe (not argv, not the environment: neither ``ps`` nor /proc shows it). With one
process per rank every rank reads it from ``--tp-secret-file``; without one the leader makes it and
publishes it through the rendezvous store, which only keeps out peers that cannot reach the store (a warning says so).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from worker_svc.config.engine_config import EngineConfig
from worker_svc.engine.engine import Engine
from worker_svc.engine.engine_loop import EngineLoop
from worker_svc.executor.tp_runners import TPGroupFailed
from worker_svc.parallel.context import TPContext
from worker_svc.parallel.heartbeat import FollowerHeartbeat, LeaderHeartbeat, new_secret

log = structlog.get_logger(__name__)

DEFAULT_TP_TIMEOUT_S = 15.0
DEFAULT_CONNECT_TIMEOUT_S = 300.0
SECRET_KEY = "llmserve/heartbeat-secret"
# A single-machine leader hands each follower the secret through an inherited pipe; only the pipe's
# fd number is in the follower's environment (argv and /proc/PID/environ never hold the secret).
SECRET_FD_ENV = "LLMSERVE_TP_SECRET_FD"


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    from worker_svc.parallel.group import rank_device

    device = str(rank_device(config.device, rank))
    return config if device == config.device else dataclasses.replace(config, device=device)


def _host_of(init_addr: str) -> str:
    return init_addr.rpartition(":")[0]


# ---- leader ---------------------------------------------------------------------------------------


@dataclass
class TPLeader:
    """Rank 0: the process group, the heartbeat, the engine over a ``LeaderRunner`` and (single-machine
    mode) the follower processes it started."""

    tp: TPContext
    engine: Engine
    heartbeat: LeaderHeartbeat
    timeout_s: float
    children: list[subprocess.Popen] = field(default_factory=list)
    loop: EngineLoop | None = None
    fault: str | None = None

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        size: int,
        init_addr: str,
        timeout_s: float = DEFAULT_TP_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        children: Sequence[subprocess.Popen] = (),
        secret: bytes | None = None,
    ) -> TPLeader:
        """Join as rank 0, load the shard, wait until every follower loaded and opened its heartbeat.
        ``children`` are follower processes this leader started (waited for at shutdown). ``secret``:
        the group's heartbeat secret; ``None`` makes one and publishes it in the rendezvous store."""
        from worker_svc.executor.model_runner import ModelRunner
        from worker_svc.executor.tp_runners import LeaderRunner
        from worker_svc.parallel.group import init_tp, tp_barrier

        children = list(children)
        tp = init_tp(0, size, init_addr, config.device, timeout_s, connect_timeout_s)
        holder: list[TPLeader] = []

        def on_fault(reason: str) -> None:
            if holder:
                holder[0]._on_fault(reason)

        if secret is None:
            log.warning(
                "no --tp-secret-file: the heartbeat secret goes through the rendezvous store, so "
                "anyone who can reach the store can join the group"
            )
            secret = new_secret()
            tp.store.set(SECRET_KEY, secret)
        heartbeat = LeaderHeartbeat(tp, _host_of(init_addr), timeout_s, on_fault, secret)
        try:
            config = _rank_config(config, 0)
            runner = LeaderRunner(ModelRunner(config, tp), tp)
            engine = Engine(config, runner=runner)
            tp_barrier(tp, "loaded", connect_timeout_s)
            heartbeat.wait_connected(connect_timeout_s)
        except BaseException:
            heartbeat.close(clean=False)
            raise
        leader = cls(tp=tp, engine=engine, heartbeat=heartbeat, timeout_s=timeout_s, children=children)
        holder.append(leader)
        if heartbeat.fault is not None:  # a follower died between connecting and now
            leader._on_fault(heartbeat.fault)
        log.info("tp leader ready", tp_size=size, tp_timeout_s=timeout_s, children=[c.pid for c in children])
        return leader

    def engine_loop(self) -> EngineLoop:
        """The leader's EngineLoop: keepalives while idle; failed when the group breaks."""
        if self.loop is None:
            self.loop = EngineLoop(
                self.engine, idle_tick=self.engine.runner.keepalive, idle_interval_s=self.timeout_s / 3
            )
            if self.fault is not None:
                self.loop.fail(TPGroupFailed(self.fault))
        return self.loop

    def _on_fault(self, reason: str) -> None:
        if self.fault is None:
            self.fault = reason
        if self.loop is not None:
            self.loop.fail(TPGroupFailed(reason))

    @property
    def failed(self) -> bool:
        return self.fault is not None or (self.loop is not None and self.loop.error is not None)

    async def wait_failed(self, poll_s: float = 0.1) -> str:
        """Returns why, once the group has broken (a peer died or hung, or a step failed on a rank)."""
        while not self.failed:
            await asyncio.sleep(poll_s)
        return self.fault or repr(self.loop.error if self.loop is not None else None)

    def shutdown(self, join_timeout_s: float = 30.0) -> int:
        """After the server stopped: STOP the followers (when the group is intact), close the heartbeat,
        wait for child processes. Returns the exit code: 0 clean, 1 when the group had failed."""
        from worker_svc.parallel.group import destroy_tp

        loop = self.loop
        clean = not self.failed and (loop is None or not loop.thread_alive)
        if clean:
            try:
                self.heartbeat.stopping()
                self.engine.runner.stop_followers()
            except Exception as exc:  # noqa: BLE001 - a peer died during shutdown
                log.error("could not stop the tp followers", error=repr(exc))
                clean = False
        self.heartbeat.close(clean=clean)
        if clean:
            destroy_tp(self.tp)
        code = 0 if clean else 1
        for child in self.children:
            try:
                child_code = child.wait(self.timeout_s + 5.0)
            except subprocess.TimeoutExpired:
                log.error("tp follower did not exit; killing it", pid=child.pid)
                child.kill()
                child_code = child.wait(10.0)
            if child_code != 0:
                code = 1
        log.info("tp leader shut down", clean=clean, exit_code=code, fault=self.fault)
        return code


def spawn_follower_processes(
    size: int,
    init_addr: str,
    base_argv: Sequence[str],
    secret: bytes,
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> list[subprocess.Popen]:
    """Single-machine mode: start ranks 1..size-1 as ``llmserve worker`` child processes (health on an
    OS-chosen port). ``base_argv`` is the engine and logging flags every rank shares; ``secret`` goes
    through a pipe each child inherits (SECRET_FD_ENV names its fd), never argv or the environment.
    ``env``/``preexec_fn``: the launcher's (e.g. a parent-death signal, so no follower outlives this
    process)."""
    children = []
    try:
        for rank in range(1, size):
            cmd = [
                sys.executable,
                "-m",
                "llmserve.cli",
                "worker",
                *base_argv,
                "--tp-size",
                str(size),
                "--tp-rank",
                str(rank),
                "--dist-init-addr",
                init_addr,
                "--host",
                host,
                "--port",
                "0",
            ]
            read_end, write_end = os.pipe()
            try:
                os.write(write_end, secret)  # 32 bytes: far below the pipe's buffer, never blocks
                os.close(write_end)
                child_env = {**(os.environ if env is None else env), SECRET_FD_ENV: str(read_end)}
                children.append(subprocess.Popen(cmd, env=child_env, pass_fds=(read_end,), preexec_fn=preexec_fn))
            finally:
                os.close(read_end)
    except BaseException:
        for child in children:
            child.kill()
            child.wait()
        raise
    log.info("tp followers started", pids=[c.pid for c in children], init_addr=init_addr)
    return children


# ---- follower -------------------------------------------------------------------------------------


def _die(reason: str) -> None:
    log.error("tp follower exiting: group failed", reason=reason)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


async def serve_follower(
    config: EngineConfig,
    rank: int,
    size: int,
    init_addr: str,
    host: str,
    port: int,
    timeout_s: float = DEFAULT_TP_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    shutdown_grace_s: float = 5.0,
    on_listening=None,
    secret: bytes | None = None,
) -> int:
    """Rank ``rank`` > 0: replay the leader's steps until STOP, serving grpc.health.v1 on
    ``host:port`` (SERVING while the loop runs). Returns 0 after STOP; exits the process (code 1)
    when the leader dies or hangs. ``on_listening(port)`` runs once health is served. ``secret``:
    the group's heartbeat secret (``None``: read the one the leader published in the store)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from llmserve.grpc_listen import grpc_address, listen
    from worker_svc.executor.model_runner import ModelRunner
    from worker_svc.executor.tp_runners import FollowerLoop
    from worker_svc.parallel.group import destroy_tp, init_tp, tp_barrier
    from worker_svc.server.app import WorkerHealth

    tp = await asyncio.to_thread(init_tp, rank, size, init_addr, config.device, timeout_s, connect_timeout_s)
    if secret is None:
        secret = await asyncio.to_thread(tp.store.get, SECRET_KEY)
    heartbeat = FollowerHeartbeat(tp, timeout_s, _die, secret)
    runner = await asyncio.to_thread(ModelRunner, _rank_config(config, rank), tp)
    await asyncio.to_thread(heartbeat.connect, connect_timeout_s)
    await asyncio.to_thread(tp_barrier, tp, "loaded", connect_timeout_s)

    aio_loop = asyncio.get_running_loop()
    done = asyncio.Event()
    result: dict[str, object] = {}
    follower = FollowerLoop(runner, tp)

    def run_loop() -> None:
        try:
            result["steps"] = follower.run()
        except BaseException as exc:  # noqa: BLE001
            result["error"] = exc
        aio_loop.call_soon_threadsafe(done.set)

    thread = threading.Thread(target=run_loop, name=f"tp-follower-{rank}", daemon=True)
    thread.start()

    def liveness() -> tuple[bool, str]:
        return (thread.is_alive() and not done.is_set()), "follower loop"

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health = WorkerHealth(liveness)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = listen(server, host, port)
    await server.start()
    await health.set_all(health_pb2.HealthCheckResponse.SERVING)
    log.info("tp follower serving", tp_rank=rank, tp_size=size, health_address=grpc_address(host, bound))
    if on_listening is not None:
        on_listening(bound)

    signalled = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aio_loop.add_signal_handler(sig, signalled.set)
    waiters = {asyncio.ensure_future(done.wait()), asyncio.ensure_future(signalled.wait())}
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    if not done.is_set():
        # Signalled (a compose "down" signals every rank at once): the leader drains and sends STOP.
        log.info("tp follower signalled; waiting for the leader's STOP", wait_s=shutdown_grace_s + timeout_s)
        await health.set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            await asyncio.wait_for(done.wait(), shutdown_grace_s + timeout_s)
        except asyncio.TimeoutError:
            _die("no STOP from the leader after a signal")
    for waiter in waiters:
        waiter.cancel()
    heartbeat.close()
    await server.stop(0.5)
    if "error" in result:
        _die(f"follower loop failed: {result['error']!r}")
    await asyncio.to_thread(destroy_tp, tp)
    log.info("tp follower stopped", tp_rank=rank, steps=result.get("steps"))
    return 0
