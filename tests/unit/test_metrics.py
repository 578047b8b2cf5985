"""llmserve/metrics.py: each service's metric set on its own registry (every series it exports is in
docs/metrics.md, with the type given there), the HTTP endpoint on host:port and its stop, the gRPC
interceptor's status codes on a real grpc.aio server, the request and step observations; and the
engine loop's metrics on a real tiny engine (exact token counts, the health probe left out, cached
prompt tokens of a repeated prompt)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from llmserve.metrics import (
    FollowerMetrics,
    GrpcMetrics,
    MetricsConfig,
    MetricsServer,
    RouterMetrics,
    TokenizerMetrics,
    WorkerMetrics,
)
from tests.prom import Samples, scrape
from worker_svc.parallel.collective_observer import CollectiveRecord, StepCollectives

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _samples(metrics) -> Samples:
    return Samples(generate_latest(metrics.registry).decode())


def _documented() -> dict[str, str]:
    """{metric name: type} from the tables of docs/metrics.md."""
    rows = re.findall(r"^\| `(llmserve:[a-z0-9_:]+)` \| (counter|gauge|histogram) \|", DOCS.read_text(), re.M)
    return dict(rows)


@pytest.mark.parametrize("cls, expected", [
    (WorkerMetrics, {"llmserve:num_requests_running", "llmserve:num_requests_waiting", "llmserve:kv_cache_usage_perc",
                     "llmserve:prefix_cache_tokens", "llmserve:prompt_tokens_total", "llmserve:generation_tokens_total",
                     "llmserve:prompt_tokens_cached_total", "llmserve:request_success_total",
                     "llmserve:time_to_first_token_seconds", "llmserve:time_per_output_token_seconds",
                     "llmserve:e2e_request_latency_seconds", "llmserve:request_queue_time_seconds",
                     "llmserve:prefix_cache_queries_total", "llmserve:prefix_cache_hits_total",
                     "llmserve:engine_step_duration_seconds", "llmserve:step_collective_seconds",
                     "llmserve:collectives_total", "llmserve:collective_seconds_total",
                     "llmserve:grpc_requests_total", "llmserve:grpc_request_duration_seconds"}),
    (FollowerMetrics, {"llmserve:engine_step_duration_seconds", "llmserve:step_collective_seconds",
                       "llmserve:collectives_total", "llmserve:collective_seconds_total"}),
    (RouterMetrics, {"llmserve:num_requests_running", "llmserve:prompt_tokens_total",
                     "llmserve:generation_tokens_total", "llmserve:prompt_tokens_cached_total",
                     "llmserve:request_success_total", "llmserve:time_to_first_token_seconds",
                     "llmserve:time_per_output_token_seconds", "llmserve:e2e_request_latency_seconds",
                     "llmserve:router_retries_total", "llmserve:grpc_requests_total",
                     "llmserve:grpc_request_duration_seconds"}),
    (TokenizerMetrics, {"llmserve:grpc_requests_total", "llmserve:grpc_request_duration_seconds"}),
])
def test_each_metric_set_exports_its_documented_series(cls, expected) -> None:
    metrics = cls.create()
    families = {m.name: m.type for m in metrics.registry.collect()}
    # prometheus_client names a counter's family without "_total"; the exposition has it.
    exported = {name + "_total" if kind == "counter" else name: kind for name, kind in families.items()}
    assert set(exported) == expected
    documented = _documented()
    for name, kind in exported.items():
        assert documented.get(name) == kind, f"{name} ({kind}) is not in docs/metrics.md as a {kind}"


def test_two_sets_share_no_series() -> None:
    a, b = WorkerMetrics.create(), WorkerMetrics.create()
    a.requests.generation_tokens.inc(5)
    assert _samples(a).value("llmserve:generation_tokens_total") == 5
    assert _samples(b).value("llmserve:generation_tokens_total") == 0


def test_metrics_config_rejects_a_bad_port() -> None:
    with pytest.raises(ValueError, match="metrics port"):
        MetricsConfig(port=70000)


def test_request_observations() -> None:
    metrics = RouterMetrics.create()
    requests = metrics.requests
    requests.finished("length", e2e_s=1.0, ttft_s=0.2, first_to_last_s=0.8, output_tokens=5)
    requests.finished("abort", e2e_s=0.5, ttft_s=None, first_to_last_s=None, output_tokens=0)
    requests.finished("stop", e2e_s=0.3, ttft_s=0.3, first_to_last_s=0.0, output_tokens=1)  # one token: no TPOT
    s = _samples(metrics)
    assert s.value("llmserve:request_success_total", finished_reason="length") == 1
    assert s.value("llmserve:request_success_total", finished_reason="abort") == 1
    assert s.value("llmserve:request_success_total", finished_reason="stop") == 1
    assert s.count("llmserve:e2e_request_latency_seconds") == 3
    assert s.sum("llmserve:e2e_request_latency_seconds") == pytest.approx(1.8)
    assert s.count("llmserve:time_to_first_token_seconds") == 2
    assert s.count("llmserve:time_per_output_token_seconds") == 1
    assert s.sum("llmserve:time_per_output_token_seconds") == pytest.approx(0.2)  # 0.8 s over 4 later tokens


def _record(op: str, blocked_ns: int, async_op: bool = False) -> CollectiveRecord:
    import torch

    return CollectiveRecord(op, 64, (16,), torch.float32, async_op, issue_ns=0, wait_ns=1000 - blocked_ns,
                            done_ns=1000)


def test_step_collectives_sum_per_op_and_start_over_on_take() -> None:
    sums = StepCollectives()
    sums.record(_record("all_reduce", 300))
    sums.record(_record("all_reduce", 200, async_op=True))
    sums.record(_record("broadcast", 100))
    assert sums.take() == {"all_reduce": (2, 500), "broadcast": (1, 100)}
    assert sums.take() == {}

    metrics = FollowerMetrics.create()
    metrics.steps.step(0.01, {"all_reduce": (2, 500), "broadcast": (1, 100)})
    metrics.steps.step(0.02, {})
    metrics.steps.step(0.03)  # a single rank: no collectives observed
    s = _samples(metrics)
    assert s.count("llmserve:engine_step_duration_seconds") == 3
    assert s.sum("llmserve:engine_step_duration_seconds") == pytest.approx(0.06)
    assert s.count("llmserve:step_collective_seconds") == 2
    assert s.sum("llmserve:step_collective_seconds") == pytest.approx(600e-9)
    assert s.value("llmserve:collectives_total", op="all_reduce") == 2
    assert s.value("llmserve:collective_seconds_total", op="broadcast") == pytest.approx(100e-9)


def test_http_endpoint_serves_the_registry_and_stops() -> None:
    metrics = TokenizerMetrics.create(MetricsConfig("127.0.0.1", 0))
    metrics.grpc.record("Encode", "OK", 0.01)
    port = metrics.serve()
    assert port > 0 and metrics.serve() == port  # once
    s = scrape("127.0.0.1", port)
    assert s.value("llmserve:grpc_requests_total", method="Encode", code="OK") == 1
    assert s.types["llmserve:grpc_request_duration_seconds"] == "histogram"
    assert not any(name.startswith(("process_", "python_")) for name in s.types)  # not the global registry
    metrics.stop_serving()
    metrics.stop_serving()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_http_endpoint_on_a_taken_port_is_a_clear_oserror() -> None:
    first = MetricsServer(MetricsConfig("127.0.0.1", 0), RouterMetrics.create().registry)
    port = first.start()
    try:
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            MetricsServer(MetricsConfig("127.0.0.1", port), RouterMetrics.create().registry).start()
    finally:
        first.stop()


# ---- the gRPC interceptor on a real server -----------------------------------------------------------


class _Health(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 whose request's ``service`` picks how the call ends."""

    async def Check(self, request, context):  # noqa: N802
        if request.service == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "service: invalid")
        if request.service == "not-found":
            context.set_code(grpc.StatusCode.NOT_FOUND)
            return health_pb2.HealthCheckResponse()
        if request.service == "raise":
            raise RuntimeError("handler bug")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def Watch(self, request, context):  # noqa: N802
        if request.service == "exhausted":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many")
        for _ in range(3 if request.service == "short" else 1000):
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
            await asyncio.sleep(0.01)


def test_grpc_interceptor_counts_calls_by_method_and_final_code() -> None:
    registry = CollectorRegistry()
    metrics = GrpcMetrics(registry)

    def seen(method: str, code: str) -> float:
        return registry.get_sample_value("llmserve:grpc_requests_total", {"method": method, "code": code}) or 0.0

    async def run() -> None:
        server = grpc.aio.server(interceptors=[metrics.interceptor()])
        health_pb2_grpc.add_HealthServicer_to_server(_Health(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                for service, code in (("invalid", grpc.StatusCode.INVALID_ARGUMENT),
                                      ("not-found", grpc.StatusCode.NOT_FOUND), ("raise", grpc.StatusCode.UNKNOWN)):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                    assert err.value.code() == code
                assert len([r async for r in stub.Watch(health_pb2.HealthCheckRequest(service="short"))]) == 3
                with pytest.raises(grpc.aio.AioRpcError):
                    async for _ in stub.Watch(health_pb2.HealthCheckRequest(service="exhausted")):
                        pass
                call = stub.Watch(health_pb2.HealthCheckRequest())
                await call.read()
                call.cancel()
                with pytest.raises(grpc.aio.AioRpcError):
                    async for _ in stub.Watch(health_pb2.HealthCheckRequest(), timeout=0.2):
                        pass
            deadline = time.monotonic() + 5  # the server sees the cancellations a moment later
            while seen("Watch", "CANCELLED") + seen("Watch", "DEADLINE_EXCEEDED") < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        finally:
            await server.stop(0)

    asyncio.run(run())
    s = Samples(generate_latest(registry).decode())
    calls = s.labelled("llmserve:grpc_requests_total")
    counts = {f"{dict(ls)['code']} {dict(ls)['method']}": v for ls, v in calls.items()}
    assert counts == {"OK Check": 2, "INVALID_ARGUMENT Check": 1, "NOT_FOUND Check": 1, "UNKNOWN Check": 1,
                      "OK Watch": 1, "RESOURCE_EXHAUSTED Watch": 1, "CANCELLED Watch": 1,
                      "DEADLINE_EXCEEDED Watch": 1}
    assert s.count("llmserve:grpc_request_duration_seconds", method="Check") == 5
    assert s.count("llmserve:grpc_request_duration_seconds", method="Watch") == 4
    assert s.sum("llmserve:grpc_request_duration_seconds", method="Watch") > 0.2  # the deadline's stream ran 0.2 s


# ---- the engine loop on a real engine ----------------------------------------------------------------


def test_engine_loop_metrics_count_requests_exactly(tiny_model) -> None:
    from worker_svc.config.engine_config import EngineConfig
    from worker_svc.engine.engine import Engine
    from worker_svc.engine.engine_loop import EngineLoop
    from worker_svc.sampling import SamplingParams

    engine = Engine(EngineConfig(model_path=str(tiny_model), dtype="float32", max_total_tokens=512,
                                 max_running_requests=4, chunked_prefill_size=64, max_prefill_tokens=128,
                                 context_length=256))
    metrics = WorkerMetrics.create()
    loop = EngineLoop(engine, metrics=metrics)
    loop.start()
    done = threading.Event()
    finished: list = []
    lock = threading.Lock()

    def sink(item) -> None:
        if getattr(item, "finished", True):
            with lock:
                finished.append(item)
                if len(finished) == want:
                    done.set()

    prompt = [(5 * j + 3) % 200 for j in range(40)]
    try:
        want = 2
        loop.submit(prompt, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True), "a", sink)
        loop.submit([1], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True), "probe", sink,
                    observe=False)
        assert done.wait(30)
        done.clear()
        want = 3  # the same prompt again: all but its last token come from the prefix cache
        loop.submit(prompt, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True), "b", sink)
        assert done.wait(30)
        s = _samples(metrics)
    finally:
        loop.stop()
    assert s.value("llmserve:prompt_tokens_total") == 80
    assert s.value("llmserve:generation_tokens_total") == 10
    assert s.value("llmserve:prefix_cache_queries_total") == 80
    assert s.value("llmserve:prefix_cache_hits_total") == 39
    assert s.value("llmserve:prompt_tokens_cached_total") == 39
    assert s.value("llmserve:request_success_total", finished_reason="length") == 2
    for histogram in ("llmserve:time_to_first_token_seconds", "llmserve:time_per_output_token_seconds",
                      "llmserve:e2e_request_latency_seconds", "llmserve:request_queue_time_seconds"):
        assert s.count(histogram) == 2, histogram
        assert s.sum(histogram) >= 0
    assert s.sum("llmserve:e2e_request_latency_seconds") > 0
    steps = s.count("llmserve:engine_step_duration_seconds")
    assert steps >= 6 and s.sum("llmserve:engine_step_duration_seconds") > 0  # the probe's steps count too
    assert s.count("llmserve:step_collective_seconds") == 0  # one rank: no collectives
    assert s.value("llmserve:num_requests_running") == 0 and s.value("llmserve:num_requests_waiting") == 0
    assert s.value("llmserve:prefix_cache_tokens") > 40  # both prompts' KV stays cached
    assert s.value("llmserve:kv_cache_usage_perc") == 0  # ... but evictable: not in use
