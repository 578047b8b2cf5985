"""The model worker's grpc.aio server: the engine loop, the SglangScheduler servicer (servicer.py), the
router's multiplexed WorkerStream (worker_stream.py) and grpc.health.v1 (health.py) on one port; and a
thread that runs one (tests, tools)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health_pb2_grpc

from llmserve.grpc_server import add_service, grpc_address, listen
from llmserve.message_limits import message_size_options
from llmserve.security import HEALTH_METHODS, ServerSecurity
from worker_svc.engine.engine import Engine
from worker_svc.engine.engine_loop import EngineLoop
from worker_svc.server import worker_stream
from worker_svc.server.health import WorkerHealth
from worker_svc.server.servicer import SERVICE_NAME, SchedulerServicer, WorkerOptions

if TYPE_CHECKING:
    from llmserve.metrics import WorkerMetrics

log = structlog.get_logger(__name__)


class WorkerServer:
    """The engine loop plus a grpc.aio server with the scheduler and health services."""

    # With an internal token, every call needs it except the read-only probes a gateway makes to
    # discover and watch a worker. Generate, Abort, FlushCache, GetTokenizer ... need it, and so
    # does HealthCheck (it runs a generation on an idle worker); grpc.health.v1 stays open.
    OPEN_METHODS = HEALTH_METHODS | {f"/{SERVICE_NAME}/{m}" for m in ("GetModelInfo", "GetServerInfo", "GetLoads")}

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 0,
        options: WorkerOptions | None = None,
        engine_loop: EngineLoop | None = None,
        security: ServerSecurity = ServerSecurity(),
        metrics: WorkerMetrics | None = None,
    ) -> None:
        """``engine_loop``: a prebuilt loop over ``engine`` (a tensor-parallel leader's, with its
        keepalive tick, built with the same ``metrics``); by default a plain ``EngineLoop(engine)``.
        ``security``: TLS and the internal token callers must present (llmserve/security.py).
        ``metrics``: this worker's metric set (llmserve/metrics.py), served from ``start`` to ``stop``;
        None: no metrics."""
        self.security = security
        self.metrics = metrics
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        if options is None:
            options = WorkerOptions(served_model_name=Path(engine.config.model_path).name)
        self.options = options
        self.loop = engine_loop if engine_loop is not None else EngineLoop(engine, metrics=metrics)
        self.servicer = SchedulerServicer(self.loop, options)
        self.health: WorkerHealth | None = None
        self.server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return grpc_address(self.host, self.port if self.port is not None else self.requested_port)

    async def start(self) -> int:
        aio_loop = asyncio.get_running_loop()
        counting = [self.metrics.grpc.interceptor()] if self.metrics is not None else []
        self.server = grpc.aio.server(
            options=[*message_size_options(), ("grpc.so_reuseport", 0)],
            interceptors=[*counting, *self.security.interceptors(self.OPEN_METHODS, realm="worker")],
        )
        self.health = WorkerHealth(self.servicer.liveness)
        add_service(self.server, SERVICE_NAME, self.servicer.handlers())
        if self.options.worker_stream:
            grpc_metrics = self.metrics.grpc if self.metrics is not None else None
            stream = worker_stream.WorkerStreamServicer(self.servicer, grpc_metrics)
            add_service(self.server, worker_stream.SERVICE_NAME, stream.handlers())
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = listen(self.server, self.host, self.requested_port, self.security.tls)
        if self.metrics is not None:
            self.metrics.serve()
        health = self.health

        def on_engine_failure(exc: BaseException) -> None:
            def mark() -> None:
                asyncio.ensure_future(health.set_serving(False))

            with contextlib.suppress(RuntimeError):
                aio_loop.call_soon_threadsafe(mark)

        self.loop.on_failure(on_engine_failure)
        self.loop.start()
        await self.server.start()
        await health.set_serving(True)
        tls = self.security.tls
        log.info("worker serving", address=self.address, service=SERVICE_NAME, tls=tls is not None,
                 mtls=tls is not None and tls.mutual, internal_token=self.security.tokens is not None)
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING, refuse new requests, let in-flight calls finish for ``grace`` seconds (then
        they are cancelled, which aborts their engine requests), stop the engine thread."""
        log.info("worker shutting down", grace_s=grace)
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        self.loop.close_admission()
        if self.server is not None:
            await self.server.stop(grace)
        stopped = await asyncio.to_thread(self.loop.stop, True, 30.0)
        if self.metrics is not None:
            self.metrics.stop_serving()
        log.info("worker stopped", engine_thread_joined=stopped)

    async def wait_for_termination(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


class ServerThread:
    """Runs a :class:`WorkerServer` on its own event loop in a background thread (tests, tools)."""

    def __init__(self, server: WorkerServer) -> None:
        self.server = server
        self._aio_loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._aio_loop.run_forever, name="worker-grpc", daemon=True)

    def start(self, timeout: float = 60.0) -> int:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self.server.start(), self._aio_loop).result(timeout)

    @property
    def address(self) -> str:
        return self.server.address

    def stop(self, grace: float = 1.0, timeout: float = 60.0) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._aio_loop).result(timeout)
        finally:
            self._aio_loop.call_soon_threadsafe(self._aio_loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._aio_loop.close()
