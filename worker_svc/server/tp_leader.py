"""A tensor-parallel model worker's rank 0 (the leader): it serves gRPC (app.py) over an engine whose
runner broadcasts every step to ranks 1.. (the followers, tp_follower.py), which replay it.

Start-up, on every rank: ``init_tp`` (rendezvous through the store at ``--dist-init-addr``, patient:
``connect_timeout_s``), the heartbeat channel (worker_svc/parallel/heartbeat.py), load this rank's
shard, a store barrier ("loaded"), then serve. From there every collective is bounded by ``timeout_s``;
an idle leader sends a keepalive header every ``timeout_s / 3`` so idle followers never hit it.
Single-machine mode: the leader starts the followers itself and pipes them the group's secret
(launch.py).

Faults: a follower that dies is seen at once (EOF on its heartbeat socket, or the gloo error in the
current collective), one that hangs within ``timeout_s`` (missing heartbeats; the collective timeout
is the backstop). The leader then fails its EngineLoop (in-flight calls end UNAVAILABLE, both health
services say NOT_SERVING, new calls get UNAVAILABLE) and tells the other followers to abort. A broken
group cannot heal (the ranks are out of step), so the leader does not linger as a zombie: after
``fault_exit_delay_s`` (``--tp-fault-exit-delay``; the router sees NOT_SERVING meanwhile) it shuts
down and exits 1, and whatever supervises it (``llmserve serve``, a compose restart policy, a
Kubernetes pod) restarts the whole group on the same port. ``inf`` keeps the old behaviour: stay up
NOT_SERVING until signalled, then exit 1 (for a watchdog that acts on health). Clean shutdown
(SIGTERM to the leader): drain, STOP to the followers, goodbye on the heartbeat, every rank exits 0.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from worker_svc.config.engine_config import EngineConfig
from worker_svc.config.tp_timeouts import TP_CONNECT_TIMEOUT_S, TP_SERVING_TIMEOUT_S
from worker_svc.engine.engine import Engine
from worker_svc.engine.engine_loop import EngineLoop
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.executor.tp_runners import LeaderRunner, TPGroupFailed, rank_config
from worker_svc.parallel.context import TPContext
from worker_svc.parallel.group import destroy_tp, init_tp, tp_barrier
from worker_svc.parallel.heartbeat import LeaderHeartbeat, new_secret
from worker_svc.server.launch import SECRET_KEY

if TYPE_CHECKING:
    from llmserve.metrics import WorkerMetrics
    from worker_svc.engine.step_trace import StepTrace
    from worker_svc.parallel.collective_observer import StepCollectives

log = structlog.get_logger(__name__)


def _host_of(init_addr: str) -> str:
    return init_addr.rpartition(":")[0]


@dataclass
class TPLeader:
    """Rank 0: the process group, the heartbeat, the engine over a ``LeaderRunner`` and (single-machine
    mode) the follower processes it started."""

    tp: TPContext
    engine: Engine
    runner: LeaderRunner  # the engine's runner, as what it is here: the step broadcaster
    heartbeat: LeaderHeartbeat
    timeout_s: float
    children: list[subprocess.Popen] = field(default_factory=list)
    loop: EngineLoop | None = None
    fault: str | None = None
    collectives: StepCollectives | None = None  # this rank's collectives, for the metrics

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        size: int,
        init_addr: str,
        timeout_s: float = TP_SERVING_TIMEOUT_S,
        connect_timeout_s: float = TP_CONNECT_TIMEOUT_S,
        children: Sequence[subprocess.Popen] = (),
        secret: bytes | None = None,
        comm: str = "auto",
        collectives: StepCollectives | None = None,
    ) -> TPLeader:
        """Join as rank 0, load the shard, wait until every follower loaded and opened its heartbeat.
        ``children`` are follower processes this leader started (waited for at shutdown). ``secret``:
        the group's heartbeat secret; ``None`` makes one and publishes it in the rendezvous store.
        ``comm``: --tp-comm (parallel/group.py). ``collectives``: observes this rank's collectives (the
        metrics' collective time per step; None: unobserved, no cost)."""
        children = list(children)
        tp = init_tp(0, size, init_addr, config.device, timeout_s, connect_timeout_s, observer=collectives, comm=comm)
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
            tp.rendezvous.set(SECRET_KEY, secret)  # type: ignore[arg-type]  # Store.set takes bytes too
        heartbeat = LeaderHeartbeat(tp, _host_of(init_addr), timeout_s, on_fault, secret)
        try:
            config = rank_config(config, 0)
            runner = LeaderRunner(ModelRunner(config, tp), tp)
            engine = Engine(config, runner=runner)
            tp_barrier(tp, "loaded", connect_timeout_s)
            heartbeat.wait_connected(connect_timeout_s)
        except BaseException:
            heartbeat.close(clean=False)
            raise
        leader = cls(tp=tp, engine=engine, runner=runner, heartbeat=heartbeat, timeout_s=timeout_s, children=children,
                     collectives=collectives)
        holder.append(leader)
        if heartbeat.fault is not None:  # a follower died between connecting and now
            leader._on_fault(heartbeat.fault)
        log.info("tp leader ready", tp_size=size, tp_comm=tp.comm_kind, tp_timeout_s=timeout_s,
                 children=[c.pid for c in children])
        return leader

    def engine_loop(self, before_step: Callable[[], None] | None = None,
                    metrics: WorkerMetrics | None = None, step_trace: StepTrace | None = None) -> EngineLoop:
        """The leader's EngineLoop: keepalives while idle; failed when the group breaks. ``before_step``,
        ``metrics`` and ``step_trace`` are EngineLoop's (used when the loop is first built)."""
        if self.loop is None:
            self.loop = EngineLoop(
                self.engine, idle_tick=self.runner.keepalive, idle_interval_s=self.timeout_s / 3,
                before_step=before_step, metrics=metrics, collectives=self.collectives, step_trace=step_trace,
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
        loop = self.loop
        clean = not self.failed and (loop is None or not loop.thread_alive)
        if clean:
            try:
                self.heartbeat.stopping()
                self.runner.stop_followers()
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
