"""The worker's side of the reliability review (shared/reviews/reliability.md) over real gRPC on
127.0.0.1: request-id reuse (F3, F4), malformed messages (F14), abort accounting in the log (F18),
health of a wedged engine and the stall flag (F20), the bounded waiting queue (F11) and RSS under
traffic (F12, slow). Tiny model, the same engine settings as test_worker_server.py."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from tests.integration.conftest import worker_engine_config
from tests.integration.test_worker_server import TIMEOUT, _collect, _prompt, _request
from tests.procfs import rss_mb
from worker_svc.engine.engine import Engine
from worker_svc.server.app import ServerThread, WorkerServer
from worker_svc.server.servicer import SERVICE_NAME, WorkerOptions

GENERATE = f"/{SERVICE_NAME}/Generate"
ABORT = f"/{SERVICE_NAME}/Abort"


@contextmanager
def _serving(
    worker_model, options: WorkerOptions | None = None, **engine
) -> Iterator[tuple[WorkerServer, grpc.Channel]]:
    server = WorkerServer(
        Engine(worker_engine_config(worker_model, **engine)),
        host="127.0.0.1",
        port=0,
        options=options or WorkerOptions(served_model_name="tiny-test"),
    )
    thread = ServerThread(server)
    thread.start()
    try:
        with grpc.insecure_channel(thread.address) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
            yield server, ch
    finally:
        thread.stop(grace=0.5)


@pytest.fixture(scope="module")
def worker(worker_model) -> Iterator[tuple[WorkerServer, grpc.Channel]]:
    with _serving(worker_model) as served:
        yield served


@pytest.fixture(scope="module")
def stub(worker) -> pb_grpc.SglangSchedulerStub:
    return pb_grpc.SglangSchedulerStub(worker[1])


@pytest.fixture
def slow_steps(worker, monkeypatch) -> None:
    """Every engine step takes at least 5 ms, so a generation is surely in flight when a test
    cancels it, however fast the machine."""
    scheduler = worker[0].loop.scheduler
    step = scheduler.step

    def slow_step():
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(scheduler, "step", slow_step)


def _gate_forward(server: WorkerServer) -> threading.Event:
    """Hold every forward step until the returned event is set (a wedged device, for the test)."""
    runner = server.loop.engine.runner
    forward = runner.forward
    gate = threading.Event()

    def gated(step):
        gate.wait(30)
        return forward(step)

    runner.forward = gated
    return gate


def _wait_idle(server: WorkerServer, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while server.loop.in_flight() or server.loop.busy():
        assert time.monotonic() < deadline, f"worker not idle: {server.loop.in_flight()}"
        time.sleep(0.01)


def _wait_in_flight(server: WorkerServer, count: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while len(server.loop.in_flight()) < count:
        assert time.monotonic() < deadline, f"only {server.loop.in_flight()} in flight"
        time.sleep(0.005)


# ---- F3: cancel + resubmit of the same id ----------------------------------------------------------


def test_cancel_then_immediate_resubmit_of_the_same_request_id_always_succeeds(worker, stub, slow_steps):
    server, _ = worker
    prompt = _prompt(8, seed=1)
    failures = []
    for i in range(200):
        call = stub.Generate(_request(prompt, rid="race", stream=True, max_new=200), timeout=TIMEOUT)
        try:
            assert next(call).WhichOneof("response") == "chunk"  # accepted and generating
        except grpc.RpcError as exc:
            failures.append((i, exc.code(), exc.details()))
        call.cancel()
    _, (done,) = _collect(stub, _request(prompt, rid="race", max_new=4))
    assert failures == []
    assert done.finish_reason == "length" and done.completion_tokens == 4
    _wait_idle(server)
    assert len(server.servicer.calls) == 0  # nothing filed under "race" is left behind


# ---- F4: ids shared between calls ------------------------------------------------------------------


def test_abort_of_an_unknown_request_id_is_a_clean_false(stub):
    for rid in ("never-sent", "", "x" * 10_000):
        response = stub.Abort(pb.AbortRequest(request_id=rid, reason="test"), timeout=TIMEOUT)
        assert not response.success and "no request" in response.message


def test_calls_sharing_a_request_id_get_their_own_engine_requests(worker, stub, slow_steps):
    server, _ = worker
    prompt = _prompt(8, seed=2)
    first = stub.Generate(_request(prompt, rid="shared", stream=True, max_new=200), timeout=TIMEOUT)
    next(first)
    second = stub.Generate(_request(prompt, rid="shared", stream=True, max_new=30), timeout=TIMEOUT)
    next(second)
    engine_ids = server.loop.in_flight()
    assert len(set(engine_ids)) == 2 and all(rid.startswith("shared") for rid in engine_ids)
    # The engine ids are the worker's own: Abort takes the callers' ids only, so knowing or
    # guessing an engine id reaches nothing.
    for rid in engine_ids:
        assert not stub.Abort(pb.AbortRequest(request_id=rid), timeout=TIMEOUT).success
    first.cancel()  # ending one call leaves the other's engine request alone
    (done,) = [r.complete for r in second if r.WhichOneof("response") == "complete"]
    assert done.finish_reason == "length" and done.completion_tokens == 30
    _wait_idle(server)
    assert len(server.servicer.calls) == 0


def test_abort_by_request_id_reaches_every_call_filed_under_it(worker, stub, slow_steps):
    """Documented: request ids are the caller's namespace (the router mints unique ones per
    attempt); Abort(id) aborts every call in flight under that id, and a sample's own id
    (``<id>-n<index>``) aborts that sample only."""
    server, _ = worker
    prompt = _prompt(8, seed=3)
    calls = [
        stub.Generate(_request(prompt, rid="both", stream=True, max_new=200, n=2), timeout=TIMEOUT) for _ in range(2)
    ]
    for call in calls:
        next(call)
    ones = stub.Abort(pb.AbortRequest(request_id="both-n1", reason="stop string"), timeout=TIMEOUT)
    assert ones.success and "aborted 2 engine request(s)" in ones.message  # sample 1 of each call
    rest = stub.Abort(pb.AbortRequest(request_id="both", reason="test"), timeout=TIMEOUT)
    assert rest.success and "aborted 2 engine request(s)" in rest.message  # the samples 0 left
    for call in calls:
        completes = [r.complete for r in call if r.WhichOneof("response") == "complete"]
        assert sorted(c.index for c in completes) == [0, 1]
        assert all(c.finish_reason == "abort" for c in completes)
    _wait_idle(server)
    assert not stub.Abort(pb.AbortRequest(request_id="both"), timeout=TIMEOUT).success


# ---- F14: malformed messages -----------------------------------------------------------------------


def _bad_utf8(message: bytes, good: bytes) -> bytes:
    assert message.count(good) == 1
    return message.replace(good, b"\xff\xfe" + good[2:])


@pytest.mark.parametrize(
    "method, data, field",
    [
        (GENERATE, _bad_utf8(_request([1, 2, 3], rid="rid-abcd").SerializeToString(), b"rid-abcd"), "request_id"),
        (
            GENERATE,
            _bad_utf8(
                pb.GenerateRequest(
                    request_id="r", tokenized=pb.TokenizedInput(original_text="text-abcd", input_ids=[1, 2])
                ).SerializeToString(),
                b"text-abcd",
            ),
            "tokenized.original_text",
        ),
        (GENERATE, b"\xff\xff\xff\xff", "request: malformed GenerateRequest"),
        (GENERATE, _request([1, 2, 3]).SerializeToString()[:-3], "request: malformed GenerateRequest"),
        (ABORT, _bad_utf8(pb.AbortRequest(request_id="rid-abcd").SerializeToString(), b"rid-abcd"), "request_id"),
        (ABORT, b"\x0a\xff\xff", "request: malformed AbortRequest"),
    ],
    ids=[
        "generate-request_id",
        "generate-original_text",
        "generate-garbage",
        "generate-truncated",
        "abort-request_id",
        "abort-garbage",
    ],
)
def test_malformed_request_is_invalid_argument_naming_the_field(worker, stub, method, data, field):
    channel = worker[1]
    if method == GENERATE:
        call = channel.unary_stream(
            method, request_serializer=lambda b: b, response_deserializer=pb.GenerateResponse.FromString
        )
        run = lambda: list(call(data, timeout=TIMEOUT))  # noqa: E731
    else:
        call = channel.unary_unary(
            method, request_serializer=lambda b: b, response_deserializer=pb.AbortResponse.FromString
        )
        run = lambda: call(data, timeout=TIMEOUT)  # noqa: E731
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        run()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(field), err.value.details()
    assert time.monotonic() - started < 2
    _, (done,) = _collect(stub, _request(_prompt(4, seed=4), max_new=2))  # and the worker is fine
    assert done.completion_tokens == 2


# ---- F18: abort accounting in the log --------------------------------------------------------------


def _end_by_cancel(stub, request):
    call = stub.Generate(request, timeout=TIMEOUT)
    next(call)
    call.cancel()


def _end_by_deadline(stub, request):
    with pytest.raises(grpc.RpcError) as err:
        for _ in stub.Generate(request, timeout=0.5):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def _end_by_abort_rpc(stub, request):
    call = stub.Generate(request, timeout=TIMEOUT)
    next(call)
    assert stub.Abort(
        pb.AbortRequest(request_id=request.request_id, reason="stop string matched"), timeout=TIMEOUT
    ).success
    list(call)


@pytest.mark.parametrize(
    "end, reason",
    [(_end_by_cancel, "client cancel"), (_end_by_deadline, "deadline"), (_end_by_abort_rpc, "abort rpc")],
    ids=["cancel", "deadline", "abort-rpc"],
)
def test_an_aborted_sample_logs_one_finished_line_and_one_aborting_line(worker, stub, slow_steps, end, reason):
    server, _ = worker
    rid = f"logged-{reason.replace(' ', '-')}"
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        end(stub, _request(_prompt(8, seed=5), rid=rid, stream=True, max_new=200, n=2))
        _wait_idle(server)
        deadline = time.monotonic() + 5
        while len(server.servicer.calls) and time.monotonic() < deadline:  # the call's cleanup ran
            time.sleep(0.01)
    mine = [e for e in logs if e.get("request_id") == rid]
    finished = [e for e in mine if e["event"] == "generate finished"]
    assert sorted(e["index"] for e in finished) == [0, 1], finished
    assert all(e["finish_reason"] == "abort" and e["reason"] == reason for e in finished), finished
    assert all(0 <= e["completion_tokens"] < 200 for e in finished)
    aborting = [e for e in mine if e["event"] == "aborting engine request"]
    assert sorted(e["index"] for e in aborting) == [0, 1], aborting


def test_a_normal_finish_logs_one_finished_line_per_sample_and_no_abort(stub):
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        _collect(stub, _request(_prompt(4, seed=6), rid="plain", max_new=3, n=2))
    mine = [e for e in logs if e.get("request_id") == "plain"]
    finished = [e for e in mine if e["event"] == "generate finished"]
    assert sorted(e["index"] for e in finished) == [0, 1]
    assert all(e["finish_reason"] == "length" for e in finished)
    assert not [e for e in mine if e["event"] == "aborting engine request"]


# ---- F20: health of a busy engine ------------------------------------------------------------------


def test_busy_engine_that_makes_no_progress_is_unhealthy_within_the_stall_timeout(worker_model):
    """The engine thread is wedged outside a forward step (here: delivering outputs) while work
    waits. 'Busy' is healthy only while steps complete."""
    with _serving(worker_model, WorkerOptions(step_stall_timeout_s=0.5)) as (server, ch):
        stub = pb_grpc.SglangSchedulerStub(ch)
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT).healthy
        loop = server.loop
        dispatch = loop._dispatch
        release = threading.Event()

        def wedged_dispatch(outputs):
            release.wait(30)
            dispatch(outputs)

        loop._dispatch = wedged_dispatch
        try:
            call = stub.Generate(_request(_prompt(8, seed=7), stream=True, max_new=50), timeout=TIMEOUT)
            _wait_in_flight(server, 1)
            started = time.monotonic()
            while (response := stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT)).healthy:
                assert time.monotonic() - started < 5, response.message
                time.sleep(0.05)
            assert "progress" in response.message and "--step-stall-timeout" in response.message
            health = health_pb2_grpc.HealthStub(ch)
            status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            loop._dispatch = dispatch
            release.set()
        assert [r.complete for r in call if r.WhichOneof("response") == "complete"][0].completion_tokens == 50
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT).healthy  # recovered


def test_busy_engine_that_makes_progress_stays_healthy(worker_model):
    """Steps of 0.05 s against a 1 s stall timeout; the first request after a long idle spell is not
    mistaken for a stall either."""
    with _serving(worker_model, WorkerOptions(step_stall_timeout_s=1.0)) as (server, ch):
        stub = pb_grpc.SglangSchedulerStub(ch)
        runner = server.loop.engine.runner
        forward = runner.forward

        def slow_forward(step):
            time.sleep(0.05)
            return forward(step)

        runner.forward = slow_forward
        time.sleep(1.2)  # idle for longer than the stall timeout
        call = stub.Generate(_request(_prompt(8, seed=8), stream=True, max_new=20), timeout=TIMEOUT)
        _wait_in_flight(server, 1)
        answers = []
        while server.loop.in_flight():
            answers.append(stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT))
            time.sleep(0.1)
        list(call)
        assert answers and all(a.healthy for a in answers), [a.message for a in answers]
        assert any(a.message == "ok (busy)" for a in answers)


def test_worker_command_step_stall_timeout_flag(worker_model, worker_process_factory):
    """`--step-stall-timeout 1` with 2.5 s forward steps: the worker reports the stall while a
    request is in flight (it was a hard-coded 120 s)."""
    worker = worker_process_factory(worker_model, "--step-stall-timeout", "1", "--debug-step-delay", "2.5")
    with grpc.insecure_channel(worker.address) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(_request(_prompt(8, seed=9), stream=True, max_new=3), timeout=TIMEOUT)
        time.sleep(1.5)
        response = stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT)
        call.cancel()
    assert not response.healthy and "--step-stall-timeout 1" in response.message, response.message


def test_worker_flags_reach_the_worker_options(worker_model):
    import argparse

    from llmserve.commands.worker import register, worker_options

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        ["worker", "--model", str(worker_model), "--step-stall-timeout", "7.5", "--max-queued-requests", "3"]
    )
    options = worker_options(args)
    assert (options.step_stall_timeout_s, options.max_queued_requests) == (7.5, 3)
    defaults = worker_options(parser.parse_args(["worker", "--model", str(worker_model)]))
    assert defaults.step_stall_timeout_s == 120.0 and defaults.max_queued_requests >= 1024
    assert (
        parser.parse_args(
            ["worker", "--model", str(worker_model), "--malloc-mmap-threshold", "4194304"]
        ).malloc_mmap_threshold
        == 4 << 20
    )
    for policy in ("keep", "glibc"):
        assert parser.parse_args(["worker", "--model", str(worker_model), "--malloc-mmap-threshold", policy]
                                 ).malloc_mmap_threshold == policy
    for bad in (["--step-stall-timeout", "0"], ["--max-queued-requests", "-1"], ["--malloc-mmap-threshold", "-1"],
                ["--malloc-mmap-threshold", "0"], ["--malloc-mmap-threshold", str((32 << 20) + 1)],
                ["--malloc-mmap-threshold", "trim"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["worker", "--model", str(worker_model), *bad])


# ---- F11: the bounded waiting queue ----------------------------------------------------------------


def test_generate_past_the_queue_limit_is_resource_exhausted_at_once(worker_model):
    """2 running slots + 1 queued: a call that would make 4 engine requests is refused."""
    options = WorkerOptions(served_model_name="tiny-test", max_queued_requests=1)
    with _serving(worker_model, options, max_running_requests=2) as (server, ch):
        stub = pb_grpc.SglangSchedulerStub(ch)
        gate = _gate_forward(server)
        try:
            prompt = _prompt(6, seed=10)
            running = stub.Generate(_request(prompt, rid="q-running", max_new=4, n=2), timeout=TIMEOUT)
            queued = stub.Generate(_request(prompt, rid="q-waiting", max_new=4), timeout=TIMEOUT)
            _wait_in_flight(server, 3)
            for n in (1, 2):
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    _collect(stub, _request(prompt, rid=f"q-refused-{n}", max_new=4, n=n))
                assert time.monotonic() - started < 1
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "--max-queued-requests 1" in err.value.details(), err.value.details()
        finally:
            gate.set()
        assert [r.complete.finish_reason for r in running] == ["length", "length"]
        assert [r.complete.finish_reason for r in queued] == ["length"]
        _wait_idle(server)
        _, completes = _collect(stub, _request(prompt, rid="q-later", max_new=4, n=2))  # room again
        assert [c.finish_reason for c in completes] == ["length", "length"]


# ---- F12: RSS under traffic through gRPC ---------------------------------------------------------


def worker_rss_under_mixed_prompts(
    worker_process_factory, model, *flags: str, rounds: int = 15, warm_up: int = 5
) -> tuple[float, float, float]:
    """RSS (MB) of a `llmserve worker` when idle, after ``warm_up`` rounds and after ``rounds`` more;
    a round is 32 concurrent streams whose prompts are 8-1900 tokens long, so each step's
    temporaries have a new size."""
    worker = worker_process_factory(
        model,
        *flags,
        max_running_requests=32,
        max_total_tokens=65536,
        context_length=2048,
        chunked_prefill_size=1024,
        max_prefill_tokens=4096,
    )
    rng = random.Random(12)
    with grpc.insecure_channel(worker.address) as ch, ThreadPoolExecutor(max_workers=32) as pool:
        stub = pb_grpc.SglangSchedulerStub(ch)

        def one(length: int) -> None:
            _collect(stub, _request(_prompt(length, seed=length), stream=True, max_new=16))

        def round_() -> None:
            list(pool.map(one, [rng.randrange(8, 1900) for _ in range(32)]))

        one(8)
        idle = rss_mb(worker.proc.pid)
        for _ in range(warm_up):
            round_()
        warm = rss_mb(worker.proc.pid)
        for _ in range(rounds):
            round_()
        return idle, warm, rss_mb(worker.proc.pid)


@pytest.mark.slow
def test_worker_rss_levels_off_under_every_heap_policy(worker_model, worker_process_factory):
    """F12: RSS rises with traffic of changing shapes to a plateau and then stays, under each native-heap
    policy of `--malloc-mmap-threshold` (worker_svc/executor/native_memory.py): keep (the default since
    2026-12-06), glibc and a fixed threshold. When F12 was found glibc's policy rose 2.5x (its
    self-raising mmap threshold kept freed temporaries in the heap) and the fixed threshold kept it near
    idle. Since then the prefix cache is on by default and keeps past prompts' KV pages and tree nodes (up
    to the pool's size, by design): on this workload glibc's policy rose 12-17% from idle and the fixed
    threshold 10-12% in three runs (2026-12-04; ~6% for both with --disable-radix-cache), so what is
    asserted is the plateau and a bound far below F12's growth, not a ratio between the policies. After the
    warm-up, 15 or 30 more rounds added 1-5% under each policy (2026-12-06, two runs of each; the prefix
    cache's pages still filling): the bound is 8%."""
    for flags in ((), ("--malloc-mmap-threshold", "glibc"), ("--malloc-mmap-threshold", "4194304")):
        idle, warm, after = worker_rss_under_mixed_prompts(worker_process_factory, worker_model, *flags)
        print(f"{flags or 'default'}: idle {idle:.0f}, warm {warm:.0f}, after {after:.0f} MB")
        assert after - warm < 0.08 * warm, f"{flags}: RSS kept growing after warm-up: {warm:.0f} -> {after:.0f} MB"
        assert after < 1.3 * idle, f"{flags}: RSS rose from {idle:.0f} to {after:.0f} MB"
