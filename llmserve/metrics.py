"""Prometheus metrics of every llmserve service (docs/metrics.md lists them all).

Each service instance builds its own metric set on its own ``CollectorRegistry`` (``RouterMetrics``,
``WorkerMetrics``, ``FollowerMetrics``, ``TokenizerMetrics``: ``.create(config)``), passes it down to
what updates it, and serves that registry as text at ``http://HOST:PORT/metrics`` (``MetricsServer``:
prometheus_client's HTTP server on this registry, stopped with the service). No global registry: two
services in one process (the tests) never share a series.

Names are ``llmserve:`` followed by vLLM's name where vLLM has one (``llmserve:num_requests_running``,
``llmserve:time_to_first_token_seconds``, ...). Updates are cheap: counters and histograms take plain
numbers, gauges are read when scraped; with metrics off (``--metrics-port 0``, the default) no metric
set exists and the services skip every update behind one ``is None`` check.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server

from llmserve.grpc_server import is_loopback
from llmserve.logging import get_logger

log = get_logger(__name__)

PREFIX = "llmserve:"

# vLLM's buckets (vllm/v1/metrics/loggers.py), with finer low ends: CPU decode steps take milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0)
COLLECTIVE_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                      0.05, 0.1, 0.25, 0.5, 1.0)
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
               60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class MetricsConfig:
    """Where a service serves /metrics. ``port`` 0 binds a free port (in-process use; the command
    lines take ``--metrics-port 0`` as "no metrics" and build no metric set at all)."""

    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"metrics port must be in [0, 65535], got {self.port}")


class MetricsServer:
    """/metrics of one registry over HTTP on host:port (prometheus_client's threaded WSGI server)."""

    def __init__(self, config: MetricsConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.registry = registry
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def start(self) -> int:
        """Bind and serve in a daemon thread; returns the bound port. OSError when it cannot bind."""
        host = self.config.host.strip("[]") or "0.0.0.0"
        try:
            self._httpd, self._thread = start_http_server(self.config.port, addr=host, registry=self.registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {self.config.host}:{self.config.port}: {exc.strerror or exc}") \
                from None
        self.port = int(self._httpd.server_port)
        if not is_loopback(host):
            log.warning("serving metrics without TLS or auth on a non-loopback address", host=host, port=self.port)
        log.info("metrics serving", address=f"http://{self.config.host}:{self.port}/metrics")
        return self.port

    def stop(self) -> None:
        """Stop serving and close the socket. Idempotent."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(5.0)


class _ServedMetrics:
    """What every service's metric set has: its registry and where it is served."""

    def __init__(self, config: MetricsConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.registry = registry
        self.server: MetricsServer | None = None

    def serve(self) -> int:
        """Start /metrics (once); returns the bound port."""
        if self.server is None:
            self.server = MetricsServer(self.config, self.registry)
            self.server.start()
        assert self.server.port is not None
        return self.server.port

    def stop_serving(self) -> None:
        if self.server is not None:
            self.server.stop()


# ---- gRPC calls, every service ----------------------------------------------------------------------


class GrpcMetrics:
    """Calls by method and final status code, and how long they took (a stream: until it ended)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(f"{PREFIX}grpc_requests_total", "gRPC calls handled, by method and status code",
                                ["method", "code"], registry=registry)
        self.duration = Histogram(f"{PREFIX}grpc_request_duration_seconds",
                                  "gRPC call duration from the handler's start to its end, by method",
                                  ["method"], buckets=RPC_BUCKETS, registry=registry)

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """A server interceptor that counts every call; put it first so refusals of the others count."""
        return _GrpcMetricsInterceptor(self)

    def record(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(method, code).inc()
        self.duration.labels(method).observe(seconds)


def _final_code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    """The status a call ended with: an abort's or set_code's, CANCELLED/DEADLINE_EXCEEDED when it was
    cancelled, UNKNOWN for an exception the handler let escape, else OK."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        left = context.time_remaining()
        return "DEADLINE_EXCEEDED" if left is not None and left <= 0 else "CANCELLED"
    code = context.code()
    if code is not None:
        return code.name if isinstance(code, grpc.StatusCode) else str(code)
    if exc is not None and not isinstance(exc, grpc.aio.AbortError):
        return "UNKNOWN"
    return "OK"


def _counted(inner: Callable[..., Any], method: str, metrics: GrpcMetrics) -> Callable[..., Any] | None:
    """``inner`` (an async handler's behaviour) wrapped to record the call; None for a kind this cannot
    wrap without changing how grpc.aio runs it (sync handlers), which then go uncounted."""
    if inspect.isasyncgenfunction(inner):  # streaming responses: one more hop per message, only with metrics on
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            error: BaseException | None = None
            try:
                async with contextlib.aclosing(inner(request, context)) as responses:
                    async for response in responses:
                        yield response
            except BaseException as exc:
                error = exc
                raise
            finally:
                metrics.record(method, _final_code(context, error), time.perf_counter() - start)

        return stream
    if inspect.iscoroutinefunction(inner):
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            error: BaseException | None = None
            try:
                return await inner(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                metrics.record(method, _final_code(context, error), time.perf_counter() - start)

        return unary
    return None


class _GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: GrpcMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            inner = getattr(handler, kind)
            if inner is not None:
                wrapped = _counted(inner, method, self._metrics)
                return handler if wrapped is None else handler._replace(**{kind: wrapped})
        return handler


# ---- generation requests: the router and the worker ------------------------------------------------


class RequestMetrics:
    """vLLM's request-level series, as the router or the worker sees its requests."""

    def __init__(self, registry: CollectorRegistry, who: str) -> None:
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens_total", f"Prompt tokens of requests ({who})",
                                     registry=registry)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens_total", f"Generated tokens ({who})",
                                         registry=registry)
        self.cached_prompt_tokens = Counter(f"{PREFIX}prompt_tokens_cached_total",
                                            f"Prompt tokens found in the prefix cache, as usage reports them ({who})",
                                            registry=registry)
        self.success = Counter(f"{PREFIX}request_success_total", f"Finished requests by finish reason ({who})",
                               ["finished_reason"], registry=registry)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", f"Time to the first token ({who})",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram(f"{PREFIX}time_per_output_token_seconds",
                              f"Mean time per output token after the first, one observation per request with "
                              f"two or more tokens ({who})", buckets=TPOT_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", f"Request latency, arrival to finish ({who})",
                             buckets=REQUEST_BUCKETS, registry=registry)
        # Bound once: the labels a request can finish with (no label lookup per request).
        self._reasons = {reason: self.success.labels(reason) for reason in ("stop", "length", "abort", "error")}

    def finished(self, reason: str, e2e_s: float, ttft_s: float | None, first_to_last_s: float | None,
                 output_tokens: int) -> None:
        """One finished request (a sample): its finish reason and latencies. ``first_to_last_s``: first
        token to finish, for TPOT over its ``output_tokens - 1`` later tokens."""
        child = self._reasons.get(reason)
        (child if child is not None else self.success.labels(reason)).inc()
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if first_to_last_s is not None and output_tokens >= 2:
            self.tpot.observe(first_to_last_s / (output_tokens - 1))


class _Load(Protocol):
    """What the worker's load snapshot gives the gauges (worker_svc.engine.engine_loop.LoadSnapshot)."""

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def token_usage(self) -> float: ...

    @property
    def cached_tokens(self) -> int: ...


class StepMetrics:
    """A model rank's steps: their time, and the collectives inside them (tensor parallelism)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.step_time = Histogram(f"{PREFIX}engine_step_duration_seconds",
                                   "One engine step (leader: schedule, broadcast, forward, sample; "
                                   "follower: the forward)", buckets=STEP_BUCKETS, registry=registry)
        self.step_collective_time = Histogram(
            f"{PREFIX}step_collective_seconds",
            "Time blocked in tensor-parallel collectives (all-reduce, all-gather, step broadcast) in one step",
            buckets=COLLECTIVE_BUCKETS, registry=registry)
        self.collectives = Counter(f"{PREFIX}collectives_total", "Tensor-parallel collectives in steps, by op",
                                   ["op"], registry=registry)
        self.collective_time = Counter(f"{PREFIX}collective_seconds_total",
                                       "Time blocked in tensor-parallel collectives in steps, by op",
                                       ["op"], registry=registry)

    def step(self, seconds: float, collectives: Mapping[str, tuple[int, int]] | None = None) -> None:
        """One step of ``seconds``; ``collectives``: {op: (count, blocked ns)} inside it (None: no TP)."""
        self.step_time.observe(seconds)
        if collectives is None:
            return
        total_ns = 0
        for op, (count, ns) in collectives.items():
            self.collectives.labels(op).inc(count)
            self.collective_time.labels(op).inc(ns / 1e9)
            total_ns += ns
        self.step_collective_time.observe(total_ns / 1e9)


class WorkerMetrics(_ServedMetrics):
    """A worker's rank 0: its gRPC calls, its engine requests (samples; the idle health probe is not
    one), queue and cache state, and its steps."""

    def __init__(self, config: MetricsConfig, registry: CollectorRegistry) -> None:
        super().__init__(config, registry)
        self.grpc = GrpcMetrics(registry)
        self.requests = RequestMetrics(registry, "worker engine requests")
        self.queue_time = Histogram(f"{PREFIX}request_queue_time_seconds",
                                    "Time a request waited before its first admission to a step",
                                    buckets=REQUEST_BUCKETS, registry=registry)
        self.cache_queries = Counter(f"{PREFIX}prefix_cache_queries_total",
                                     "Prompt tokens looked up in the radix prefix cache", registry=registry)
        self.cache_hits = Counter(f"{PREFIX}prefix_cache_hits_total",
                                  "Prompt tokens found in the radix prefix cache", registry=registry)
        self.steps = StepMetrics(registry)
        self.running = Gauge(f"{PREFIX}num_requests_running", "Requests in the running batch", registry=registry)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "Requests waiting to be admitted", registry=registry)
        self.kv_usage = Gauge(f"{PREFIX}kv_cache_usage_perc",
                              "Share of the KV pool in use by requests, 0 to 1 (cached but evictable slots are free)",
                              registry=registry)
        self.cache_tokens = Gauge(f"{PREFIX}prefix_cache_tokens", "KV slots held by the radix prefix cache",
                                  registry=registry)

    @classmethod
    def create(cls, config: MetricsConfig = MetricsConfig()) -> WorkerMetrics:
        return cls(config, CollectorRegistry())

    def watch_load(self, load: Callable[[], _Load]) -> None:
        """Read the gauges from ``load()`` (the engine's last step) when scraped: no cost per step."""
        self.running.set_function(lambda: load().running)
        self.waiting.set_function(lambda: load().waiting)
        self.kv_usage.set_function(lambda: load().token_usage)
        self.cache_tokens.set_function(lambda: load().cached_tokens)

    def prefill_done(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's prompt is computed (its first token came out)."""
        self.requests.prompt_tokens.inc(prompt_tokens)
        self.cache_queries.inc(prompt_tokens)
        if cached_tokens:
            self.cache_hits.inc(cached_tokens)


class FollowerMetrics(_ServedMetrics):
    """A tensor-parallel follower (rank > 0): its steps and their collectives."""

    def __init__(self, config: MetricsConfig, registry: CollectorRegistry) -> None:
        super().__init__(config, registry)
        self.steps = StepMetrics(registry)

    @classmethod
    def create(cls, config: MetricsConfig = MetricsConfig()) -> FollowerMetrics:
        return cls(config, CollectorRegistry())


class RouterMetrics(_ServedMetrics):
    """The router: its gRPC calls and the generation requests it streams (Generate, Chat)."""

    def __init__(self, config: MetricsConfig, registry: CollectorRegistry) -> None:
        super().__init__(config, registry)
        self.grpc = GrpcMetrics(registry)
        self.requests = RequestMetrics(registry, "router, per Generate/Chat sequence; latencies per call")
        self.running = Gauge(f"{PREFIX}num_requests_running", "Generation calls streaming from a worker now",
                             registry=registry)
        self.retries = Counter(f"{PREFIX}router_retries_total",
                               "Attempts re-routed to another worker group after a failure before the first token",
                               registry=registry)

    @classmethod
    def create(cls, config: MetricsConfig = MetricsConfig()) -> RouterMetrics:
        return cls(config, CollectorRegistry())


class TokenizerMetrics(_ServedMetrics):
    """The tokenizer service: its calls by method (count, status code, latency)."""

    def __init__(self, config: MetricsConfig, registry: CollectorRegistry) -> None:
        super().__init__(config, registry)
        self.grpc = GrpcMetrics(registry)

    @classmethod
    def create(cls, config: MetricsConfig = MetricsConfig()) -> TokenizerMetrics:
        return cls(config, CollectorRegistry())
