"""The router under hostile or faulty conditions (review findings F1, F2, F4, F7, F8, F10, F11,
F13, F17, F19 of docs/reliability.md), against scripted fake workers and the real tokenizer
service: fast and deterministic. Each test names the finding it guards."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as spb

from llmserve.v1 import router_pb2 as pb
from router.client import generate_request
from tests.integration.test_router_streaming import _run
from tests.router_fakes import FakeWorker, fake_cluster
from tokenizer_svc.tokenizer import ModelTokenizer

TIMEOUT = 20.0


def _script(tok: ModelTokenizer, text: str = "one two three four five six seven eight nine ten") -> list[list[int]]:
    return [[t] for t in tok.encode(text, add_special_tokens=False)]


class HangingWorker(FakeWorker):
    """Streams `chunks_before_hang` chunks, then sends nothing for an hour (a SIGSTOPped worker)."""

    def __init__(self, script, chunks_before_hang: int) -> None:
        super().__init__(script)
        self.chunks_before_hang = chunks_before_hang

    async def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        for ids in self.script[0][: self.chunks_before_hang]:
            yield spb.GenerateResponse(request_id=request.request_id,
                                       chunk=spb.GenerateStreamChunk(token_ids=ids, index=0, prompt_tokens=3))
        await asyncio.sleep(3600)


async def _status(call) -> tuple[grpc.StatusCode, str, float]:
    start = time.monotonic()
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or "", time.monotonic() - start
    return grpc.StatusCode.OK, "", time.monotonic() - start


def test_huge_n_is_refused_before_anything_is_allocated(tok_dir: Path, tok: ModelTokenizer) -> None:
    """F1: n = 2^31-1 OOM-killed the router (per-sample state built before the worker said no)."""

    async def scenario() -> None:
        worker = FakeWorker([_script(tok)])
        async with fake_cluster(tok_dir, [worker]) as (client, _):
            for n in (2**31 - 1, 10**6, 65):
                req = generate_request("hi", max_new_tokens=4, n=n)
                code, details, seconds = await _status(client.stub.Generate(req, timeout=5))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("sampling_params.n:")
                assert "--max-n" in details and seconds < 0.5
            assert worker.requests == []  # refused at the edge
            (ok,) = await client.complete("hi", max_new_tokens=4, n=1)
            assert ok.finish.reason in ("length", "stop")

    _run(scenario)


@pytest.mark.parametrize("bad_id", ["a\nb", "tab\there", "nul\x00", "del\x7f", "caf\u00e9", "x" * 257])
def test_request_id_that_is_not_printable_ascii_is_refused(tok_dir: Path, tok: ModelTokenizer, bad_id: str) -> None:
    """F2: such an id, copied into x-request-id metadata, hung the call until the client's deadline."""

    async def scenario() -> None:
        async with fake_cluster(tok_dir, [FakeWorker([_script(tok)])]) as (client, _):
            for rpc in (client.stub.Generate, client.stub.Chat):
                req = (generate_request("hi", max_new_tokens=2, request_id=bad_id) if rpc is client.stub.Generate
                       else pb.ChatRequest(request_id=bad_id, messages=[{"role": "user", "content": "hi"}]))
                code, details, seconds = await _status(rpc(req, timeout=10))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id:"), details
                assert seconds < 2 and len(details) < 200
            (ok,) = await client.complete("hi", max_new_tokens=2, request_id="fine-id_1:2")
            assert ok.request_id == "fine-id_1:2"

    _run(scenario)


def test_long_request_id_in_metadata_is_refused(tok_dir: Path, tok: ModelTokenizer) -> None:
    async def scenario() -> None:
        async with fake_cluster(tok_dir, [FakeWorker([_script(tok)])]) as (client, _):
            call = client.stub.Generate(generate_request("hi", max_new_tokens=2), timeout=10,
                                        metadata=(("x-request-id", "m" * 5000),))
            code, details, _ = await _status(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("x-request-id:")

    _run(scenario)


def test_clients_reusing_an_id_cannot_abort_each_other(tok_dir: Path, tok: ModelTokenizer) -> None:
    """F4: the router's Abort after one client's stop string killed another client's request that
    used the same request_id. Engine ids are now minted per attempt."""

    async def scenario() -> None:
        worker = FakeWorker([_script(tok)], step_s=0.02)
        async with fake_cluster(tok_dir, [worker]) as (client, _):
            stopper = client.complete("hi", max_new_tokens=50, stop=["three"], request_id="shared")
            victim = client.complete("hi", max_new_tokens=50, request_id="shared")
            (stopped,), (survived,) = await asyncio.gather(stopper, victim)
            assert stopped.finish.reason == "stop" and survived.finish.reason == "length"
            assert survived.text.endswith("ten") and stopped.request_id == survived.request_id == "shared"
            engine_ids = [r.request_id for r in worker.requests]
            assert len(set(engine_ids)) == 2 and "shared" not in engine_ids
            await asyncio.sleep(0.1)
            assert worker.aborts and set(worker.aborts) <= {engine_ids[0], engine_ids[1]}
            assert len(set(worker.aborts)) == 1  # only the stopped call's attempt

    _run(scenario)


def test_stop_strings_are_capped(tok_dir: Path, tok: ModelTokenizer) -> None:
    """F7: 10^6 stop strings (matched on the router's event loop per delta) stalled everyone."""

    async def scenario() -> None:
        async with fake_cluster(tok_dir, [FakeWorker([_script(tok)])]) as (client, _):
            cases = [(["s"] * 17, "sampling_params.stop:"), (["x" * 257], "sampling_params.stop[0]:"),
                     (["a"] * 1_000_000, "sampling_params.stop:")]
            for stops, field in cases:
                code, details, seconds = await _status(client.stub.Generate(
                    generate_request("hi", max_new_tokens=2, stop=stops), timeout=10))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
                assert seconds < 2
            (ok,) = await client.complete("hi", max_new_tokens=50, stop=[f"z{i}" * 64 for i in range(15)] + ["three"])
            assert ok.finish.reason == "stop" and ok.finish.stop_str == "three"

    _run(scenario)


def test_long_client_strings_are_refused_without_being_echoed(tok_dir: Path, tok: ModelTokenizer) -> None:
    """F13: a 1 MB model name came back as a metadata-size error and a 1 MB log line."""

    async def scenario() -> None:
        async with fake_cluster(tok_dir, [FakeWorker([_script(tok)])]) as (client, _):
            for rpc, req in ((client.stub.Generate, generate_request("hi", model="m" * 1_000_000)),
                             (client.stub.Tokenize, pb.TokenizeRequest(text="hi", model="m" * 1_000_000))):
                try:
                    call = rpc(req, timeout=10)
                    code, details, _ = await _status(call) if rpc is client.stub.Generate else (None, "", 0)
                    if code is None:
                        await call
                        code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    code, details = exc.code(), exc.details()
                assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("model: at most 256"), details
                assert len(details) < 200
            code, details, _ = await _status(client.stub.Generate(generate_request("hi", model="gpt-" + "9" * 5000)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) < 200

    _run(scenario)


def test_hung_worker_stream_ends_within_stream_timeout(tok_dir: Path, tok: ModelTokenizer) -> None:
    """F10: streams on a SIGSTOPped worker stalled ~50 s with no abort. Mid-stream silence ends the
    stream with finish "abort" within --stream-timeout and Aborts the engine request."""

    async def scenario() -> None:
        worker = HangingWorker([_script(tok)], chunks_before_hang=2)
        async with fake_cluster(tok_dir, [worker], stream_timeout=0.5) as (client, router):
            start = time.monotonic()
            (c,) = await client.complete("hi", max_new_tokens=50)
            assert time.monotonic() - start < 0.5 + 1.0
            assert c.finish.reason == "abort" and "--stream-timeout" in c.finish.message and len(c.token_ids) == 2
            await asyncio.sleep(0.1)
            assert worker.aborts == [worker.requests[0].request_id]
            assert not router.servicer.runs

    _run(scenario)


def test_worker_silent_before_the_first_token_is_retried_elsewhere(tok_dir: Path, tok: ModelTokenizer) -> None:
    async def scenario() -> None:
        hung, healthy = HangingWorker([_script(tok)], chunks_before_hang=0), FakeWorker([_script(tok)])
        async with fake_cluster(tok_dir, [hung, healthy], stream_timeout=0.5) as (client, _):
            (c,) = await client.complete("hi", max_new_tokens=50)
            assert c.finish.reason == "length" and c.text.endswith("ten")
            assert len(hung.requests) == 1 and len(healthy.requests) == 1

    _run(scenario)


def test_admission_cap_refuses_the_excess_at_once(tok_dir: Path, tok: ModelTokenizer) -> None:
    """F11: no admission control anywhere; queues grew without bound."""

    async def scenario() -> None:
        worker = FakeWorker([_script(tok)], step_s=0.05)
        async with fake_cluster(tok_dir, [worker], max_concurrent_requests=2) as (client, router):
            running = [asyncio.ensure_future(client.complete("hi", max_new_tokens=50)) for _ in range(2)]
            while router.servicer.admission.in_progress < 2:
                await asyncio.sleep(0.005)
            code, details, seconds = await _status(client.stub.Generate(generate_request("hi"), timeout=10))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-concurrent-requests" in details
            assert seconds < 0.1
            for done in await asyncio.gather(*running):
                assert done[0].finish.reason == "length"
            assert router.servicer.admission.in_progress == 0
            (again,) = await client.complete("hi", max_new_tokens=2)
            assert again.finish.reason == "length"

    _run(scenario)


def test_shutdown_past_grace_ends_streams_with_finish_abort(tok_dir: Path, tok: ModelTokenizer) -> None:
    """F17: past --shutdown-grace streams ended with UNAVAILABLE "Cancelling all calls" instead of
    the proto's finish{reason: "abort"}."""

    async def scenario() -> None:
        worker = FakeWorker([_script(tok) * 20], step_s=0.02)
        async with fake_cluster(tok_dir, [worker]) as (client, router):
            stream = asyncio.ensure_future(client.complete("hi", max_new_tokens=250))
            while not router.servicer.runs:
                await asyncio.sleep(0.005)
            start = time.monotonic()
            await router.stop(0.3)
            (c,) = await stream  # no status error
            assert c.finish.reason == "abort" and "shutting down" in c.finish.message
            assert 0.25 < time.monotonic() - start < 2.0 and 0 < len(c.token_ids) < 200
            assert worker.aborts == [worker.requests[0].request_id]

    _run(scenario)


def test_zero_n_and_max_new_tokens_are_invalid_as_documented(tok_dir: Path, tok: ModelTokenizer) -> None:
    """F19: docs/router.md said n 0 means 1 and max_new_tokens 0 generates nothing."""
    docs = (Path(__file__).parents[2] / "docs" / "router.md").read_text()
    assert "`n` 0\n   means 1" not in docs and "NOT_FOUND (router.proto" not in docs

    async def scenario() -> None:
        async with fake_cluster(tok_dir, [FakeWorker([_script(tok)])]) as (client, _):
            for kwargs, field in (({"n": 0}, "sampling_params.n:"),
                                  ({"max_new_tokens": 0}, "sampling_params.max_new_tokens:")):
                code, details, _ = await _status(client.stub.Generate(generate_request("hi", **kwargs), timeout=5))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field)

    _run(scenario)


def test_prompt_text_is_not_sent_to_workers(tok_dir: Path, tok: ModelTokenizer) -> None:
    """The worker needs only ids; the text ended up in worker tracebacks (F9)."""

    async def scenario() -> None:
        worker = FakeWorker([_script(tok)])
        async with fake_cluster(tok_dir, [worker]) as (client, _):
            await client.complete("a secret prompt", max_new_tokens=2)
            assert worker.requests[0].tokenized.original_text == ""
            assert list(worker.requests[0].tokenized.input_ids)

    _run(scenario)


def test_unavailable_messages_do_not_name_internal_addresses(tok_dir: Path, tok: ModelTokenizer) -> None:
    """F15: UNAVAILABLE listed every group's host:port to any client."""

    async def scenario() -> None:
        async with fake_cluster(tok_dir, [FakeWorker([_script(tok)], fail="first")]) as (client, _):
            code, details, _ = await _status(client.stub.Generate(generate_request("hi", max_new_tokens=2), timeout=10))
            assert code == grpc.StatusCode.UNAVAILABLE and "no healthy worker group" in details
            assert "127.0.0.1" not in details and "ipv4" not in details, details

    _run(scenario)
