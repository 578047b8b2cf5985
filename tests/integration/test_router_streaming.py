"""The router's streaming path end to end against scripted fake workers (tests/router_fakes.py):
text equals the tokenizer's decode across chunk boundaries, stop strings and stop tokens, logprobs,
retries before the first token and the abort finish after it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from llmserve.metrics import RouterMetrics
from router import server as router_server
from router.server import ABANDONED_CALL_GRACE_S, DEADLINE_MARGIN_S
from tests.router_fakes import FakeWorker, WatchedTokenizer, fake_cluster
from tokenizer_svc.tokenizer import ModelTokenizer


def _pieces(tok: ModelTokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _run(coro_fn: Callable) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 60))


# Both places generated ids become text: in the router (default) and on the tokenizer service.
DETOKENIZE = pytest.mark.parametrize("detokenize", ["router", "service"])


@DETOKENIZE
def test_text_equals_decode_and_stop_string_across_multi_token_chunks(
    tok_dir: Path, tok: ModelTokenizer, detokenize: str
) -> None:
    text = "The quick brown fox jumps over the lazy dog. Then it sleeps."
    ids = _pieces(tok, text)
    chunks = [ids[i:i + 3] for i in range(0, len(ids), 3)]  # several tokens per chunk

    async def scenario() -> None:
        worker = FakeWorker([chunks])
        async with fake_cluster(tok_dir, [worker], detokenize=detokenize) as (client, _):
            full = (await client.complete("hi", max_new_tokens=100))[0]
            assert full.text == tok.decode(ids) == text and full.token_ids == ids
            assert full.finish.reason == "length" and full.finish.completion_tokens == len(ids)
            # "lazy dog." spans token boundaries; the text stops right before it.
            stopped = (await client.complete("hi", max_new_tokens=100, stop=["zzz", "lazy dog."],
                                             request_id="stop-req"))[0]
            assert stopped.text == "The quick brown fox jumps over the "
            assert stopped.finish.reason == "stop" and stopped.finish.stop_str == "lazy dog."
            assert stopped.finish.completion_tokens == len(stopped.token_ids) < len(ids)
            assert tok.decode(stopped.token_ids).startswith(stopped.text + "lazy dog.")
            included = (
                await client.complete("hi", max_new_tokens=100, stop=["lazy dog."], include_stop_str_in_output=True)
            )[0]
            assert included.text == "The quick brown fox jumps over the lazy dog."
            # The worker is told to stop generating, under the engine id the router minted (the
            # client's id is only a label: no client can name another client's request).
            engine_id = worker.requests[1].request_id
            for _ in range(100):
                if engine_id in worker.aborts:
                    break
                await asyncio.sleep(0.01)
            assert engine_id.startswith("rt-") and engine_id in worker.aborts
            assert worker.metadata[1].get("x-request-id") == engine_id
            assert worker.metadata[1].get("x-client-request-id") == "stop-req"
            assert list(worker.requests[1].sampling_params.stop) == []  # stop strings stay in the router

    _run(scenario)


@DETOKENIZE
def test_n2_stop_string_aborts_only_that_sample(tok_dir: Path, tok: ModelTokenizer, detokenize: str) -> None:
    a = _pieces(tok, "one two three four five six seven")
    b = _pieces(tok, "alpha beta gamma delta epsilon")

    async def scenario() -> None:
        worker = FakeWorker([[[t] for t in a], [[t] for t in b]])
        async with fake_cluster(tok_dir, [worker], detokenize=detokenize) as (client, _):
            out = await client.complete("hi", n=2, stop=["three"], request_id="nreq", max_new_tokens=50)
            assert out[0].text == "one two " and out[0].finish.stop_str == "three"
            assert out[1].text == "alpha beta gamma delta epsilon" and out[1].finish.reason == "length"
            engine_id = worker.requests[-1].request_id
            assert f"{engine_id}-n0" in worker.aborts and engine_id not in worker.aborts

    _run(scenario)


def test_stop_token_text_is_cut_unless_included(tok_dir: Path, tok: ModelTokenizer) -> None:
    ids = _pieces(tok, "hello world")
    stop_id = _pieces(tok, " again")[0]

    async def scenario() -> None:
        worker = FakeWorker([[[t] for t in ids + [stop_id]]], finish="stop", matched=stop_id)
        async with fake_cluster(tok_dir, [worker]) as (client, _):
            cut = (await client.complete("hi", stop_token_ids=[stop_id], max_new_tokens=20))[0]
            assert cut.text == "hello world" and cut.token_ids[-1] == stop_id
            assert cut.finish.reason == "stop" and cut.finish.stop_token_id == stop_id
            kept = (
                await client.complete(
                    "hi", stop_token_ids=[stop_id], include_stop_str_in_output=True, max_new_tokens=20
                )
            )[0]
            assert kept.text == tok.decode(ids + [stop_id])

    _run(scenario)


def test_logprobs_are_mapped(tok_dir: Path, tok: ModelTokenizer) -> None:
    ids = _pieces(tok, "abc def")

    async def scenario() -> None:
        async with fake_cluster(tok_dir, [FakeWorker([[ids]])]) as (client, _):
            c = (await client.complete("hi", max_new_tokens=10, top_logprobs=2))[0]
            assert [lp.token_id for lp in c.logprobs] == ids
            assert all(lp.logprob == -0.5 and [t.token_id for t in lp.top] == [lp.token_id, 0] for lp in c.logprobs)

    _run(scenario)


def test_failure_before_first_token_is_retried_elsewhere(tok_dir: Path, tok: ModelTokenizer) -> None:
    ids = _pieces(tok, "retried fine")

    async def scenario() -> None:
        bad, good = FakeWorker([[ids]], fail="first"), FakeWorker([[ids]])
        async with fake_cluster(tok_dir, [bad, good]) as (client, router):
            texts = [(await client.complete("hi", max_new_tokens=10))[0].text for _ in range(4)]
            assert texts == ["retried fine"] * 4
            # Round robin sent some to the failing group (its probes pass, so it keeps coming back):
            # each of those was retried on the other group, and no client saw an error.
            assert len(bad.requests) >= 1 and len(good.requests) == 4

    _run(scenario)


def test_failure_mid_stream_finishes_with_abort(tok_dir: Path, tok: ModelTokenizer) -> None:
    ids = _pieces(tok, "one two three four five six")

    async def scenario() -> None:
        async with fake_cluster(tok_dir, [FakeWorker([[[t] for t in ids]], fail="mid")]) as (client, _):
            deltas = [d async for d in client.generate("hi", max_new_tokens=20)]
            assert deltas[-1].finish.reason == "abort" and "INTERNAL" in deltas[-1].finish.message
            assert list(sum((d.token_ids for d in deltas), ())) == ids[:2]

    _run(scenario)


def test_no_group_left_is_unavailable(tok_dir: Path, tok: ModelTokenizer) -> None:
    async def scenario() -> None:
        workers = [FakeWorker([[[1]]], fail="first"), FakeWorker([[[1]]], fail="first")]
        async with fake_cluster(tok_dir, workers) as (client, _):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.complete("hi", max_new_tokens=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "scripted failure" in e.value.details()

    _run(scenario)


async def _until(predicate: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_a_cancelled_request_lets_its_tokenizer_calls_finish(tok_dir: Path, tok: ModelTokenizer) -> None:
    """grpc.aio leaks native memory for every call cancelled with a batch in flight (grpc/grpc#43360;
    0.5 kB per cancelled request in the router before this): a client's cancel must not cancel the
    router's tokenizer calls. The Encode in flight is answered, the DetokenizeStream half-closed."""
    ids = _pieces(tok, "one two three four five six seven eight nine ten")

    async def scenario() -> None:
        worker = FakeWorker([[[t] for t in ids]], step_s=0.05)
        watched = WatchedTokenizer(tok_dir, encode_delay_s=0.3)
        async with fake_cluster(tok_dir, [worker], tokenizer_servicer=watched, detokenize="service") as (client, _):
            # Cancelled while its Encode is in flight: the Encode still completes, and the request
            # goes no further (no worker call).
            task = asyncio.ensure_future(client.complete("hi", max_new_tokens=50))
            await asyncio.sleep(0.1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await _until(lambda: watched.encodes)
            assert watched.encodes == ["done"]
            await asyncio.sleep(0.3)
            assert worker.requests == []

            # Cancelled mid-stream: the router half-closes its DetokenizeStream instead of cancelling it.
            watched.encode_delay_s = 0.0
            stream = client.generate("hi", max_new_tokens=50)
            async for delta in stream:
                if delta.token_ids:
                    break
            await stream.aclose()  # type: ignore[attr-defined]
            await _until(lambda: watched.streams)
            assert watched.streams == ["done"]

    _run(scenario)


def test_a_cancel_mid_stream_aborts_on_the_worker_and_reads_its_call_to_the_end(
    tok_dir: Path, tok: ModelTokenizer
) -> None:
    """grpc.aio leaks a read's batch when the task awaiting it is cancelled (grpc/grpc#43360): a client
    cancelling while the router waited on its worker stream left ~0.3 kB in the router each time
    (benchmarks/router_rss_ab.py with kind cancel_mid). Each read runs in a task of its own, which the
    client's cancel (it cancels the handler's task) does not reach. Cancelling the worker call leaks a
    little on both sides too (benchmarks/grpc_cancel_leak.py stream_call_cancel against stream_stopped):
    the router sends Abort instead and reads the call to the end the worker then gives it."""
    ids = _pieces(tok, "one two three four five six seven eight nine ten")

    async def scenario() -> None:
        worker = FakeWorker([[[t] for t in ids]], step_s=0.2)
        async with fake_cluster(tok_dir, [worker]) as (client, router):
            background = router.servicer.background
            reads: list[asyncio.Future] = []
            spawn = background.spawn

            def recording_spawn(call):  # a spy: the real spawn runs
                task = spawn(call)
                if type(call).__name__ == "anext_awaitable":
                    reads.append(task)
                return task

            background.spawn = recording_spawn  # type: ignore[method-assign]
            stream = client.generate("hi", max_new_tokens=50)
            async for delta in stream:
                if delta.token_ids:
                    break
            await _until(lambda: reads and not reads[-1].done())  # the router waits on the worker's next step
            await stream.aclose()  # type: ignore[attr-defined]
            await _until(lambda: worker.endings and not router.servicer.runs and len(background) == 0)
            # The read in flight at the cancel got the worker's next message; the call ended there, on the
            # Abort, well before its 10 steps.
            assert len(reads) >= 2
            assert all(not r.cancelled() and r.result() is not None for r in reads)
            assert worker.endings == ["done"]
            assert len(worker.requests) == 1 and worker.aborts == [worker.requests[0].request_id]

    _run(scenario)


def test_a_worker_call_is_read_to_its_end_when_a_stop_string_finishes_the_request(
    tok_dir: Path, tok: ModelTokenizer
) -> None:
    """A stop string finishes the request on the router: the sample is aborted on the worker, which then
    ends its call; the router reads it to that end instead of cancelling it (a cancel leaks, above)."""
    ids = _pieces(tok, "one two three four five six seven eight nine ten")

    async def scenario() -> None:
        worker = FakeWorker([[[t] for t in ids]], step_s=0.05)
        async with fake_cluster(tok_dir, [worker]) as (client, router):
            (out,) = await client.complete("hi", max_new_tokens=50, stop=["three"])
            assert out.finish.reason == "stop"
            await _until(lambda: worker.endings and len(router.servicer.background) == 0)
            assert worker.endings == ["done"]
            assert worker.aborts == [worker.requests[0].request_id]

    _run(scenario)


async def _cancel_once_the_worker_is_called(client, router) -> float:
    """Start a request, cancel it as soon as the router has called the worker; -> when it was cancelled."""
    task = asyncio.ensure_future(client.complete("hi", max_new_tokens=60))
    await _until(lambda: router.servicer.runs)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return time.monotonic()


def test_an_abort_that_reaches_the_worker_before_its_call_is_sent_again(tok_dir: Path, tok: ModelTokenizer) -> None:
    """The client cancels before the worker's Generate has started, so the router's Abort finds nothing
    there: the router aborts again ABORT_AGAIN_S later, and the call ends on that, long before its
    script (50 steps of 0.2 s) would end it or the router's grace would cancel it."""
    ids = _pieces(tok, "one two three four five")

    async def scenario() -> None:
        worker = FakeWorker([[[ids[i % len(ids)]] for i in range(50)]], step_s=0.2, start_s=0.3)
        async with fake_cluster(tok_dir, [worker]) as (client, router):
            start = await _cancel_once_the_worker_is_called(client, router)
            await _until(lambda: worker.endings and len(router.servicer.background) == 0, timeout_s=4.0)
            assert time.monotonic() - start < ABANDONED_CALL_GRACE_S - 1
            assert worker.endings == ["done"]
            (engine_id,) = worker.missed_aborts
            assert worker.aborts == [engine_id]

    _run(scenario)


def test_a_worker_call_still_open_after_the_grace_is_cancelled(
    tok_dir: Path, tok: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both Aborts reach the worker before its Generate has started (ABORT_AGAIN_S shortened below the
    worker's start), so nothing ends the call there: the router cancels it ABANDONED_CALL_GRACE_S after
    the client's cancel rather than reading a stream nobody wants to its end."""
    monkeypatch.setattr(router_server, "ABORT_AGAIN_S", 0.05)
    monkeypatch.setattr(router_server, "ABANDONED_CALL_GRACE_S", 0.6)
    ids = _pieces(tok, "one two three four five")

    async def scenario() -> None:
        worker = FakeWorker([[[ids[i % len(ids)]] for i in range(50)]], step_s=0.2, start_s=0.3)
        async with fake_cluster(tok_dir, [worker]) as (client, router):
            start = await _cancel_once_the_worker_is_called(client, router)
            await _until(lambda: worker.endings and len(router.servicer.background) == 0, timeout_s=4.0)
            assert 0.5 < time.monotonic() - start < 2.0
            assert worker.endings == ["cancelled"]
            assert len(worker.missed_aborts) == 2 and worker.aborts == []

    _run(scenario)


@pytest.mark.parametrize("export", [True, False])
def test_the_router_detokenizes_itself_unless_the_service_cannot_export(
    tok_dir: Path, tok: ModelTokenizer, export: bool
) -> None:
    """--detokenize router (the default): the tokenizer is fetched once and no token costs a
    DetokenizeStream round trip; a tokenizer service without GetTokenizerJson is still served, through
    its DetokenizeStream, with the same text."""
    ids = _pieces(tok, "Grüße, 世界! one two three")

    async def scenario() -> None:
        worker = FakeWorker([[[t] for t in ids]])
        watched = WatchedTokenizer(tok_dir, export=export)
        async with fake_cluster(tok_dir, [worker], tokenizer_servicer=watched) as (client, router):
            for _ in range(2):
                out = (await client.complete("hi", max_new_tokens=50))[0]
                assert out.text == tok.decode(ids)
            assert watched.exports == 1  # fetched once (or refused once), not per request
            assert (router.servicer.vocab is not None) == export
            await _until(lambda: len(watched.streams) == (0 if export else 2))
            await asyncio.sleep(0.1)
            assert watched.streams == ([] if export else ["done", "done"])

    _run(scenario)


def test_streams_in_flight_outlive_the_tokenizer_service(tok_dir: Path, tok: ModelTokenizer) -> None:
    """Detokenizing in the router, a stream needs the tokenizer service only for its Encode: the
    service going away mid-stream no longer ends every stream in flight with "abort"."""
    ids = _pieces(tok, "one two three four five six seven eight nine ten")

    async def scenario() -> None:
        worker = FakeWorker([[[t] for t in ids]], step_s=0.05)
        watched = WatchedTokenizer(tok_dir)
        async with fake_cluster(tok_dir, [worker], tokenizer_servicer=watched) as (client, _):
            stream = client.generate("hi", max_new_tokens=50)
            deltas = []
            async for delta in stream:
                deltas.append(delta)
                if len(deltas) == 2:
                    assert watched.server is not None
                    await watched.server.stop(0)
            assert "".join(d.text for d in deltas) == tok.decode(ids)
            assert deltas[-1].finish.reason == "length"

    _run(scenario)


class _WideVocabWorker(FakeWorker):
    """A model whose vocabulary is wider than its tokenizer's (padded embeddings, as many are)."""

    async def GetModelInfo(self, request, context):  # noqa: N802
        info = await super().GetModelInfo(request, context)
        info.vocab_size = 4096
        return info


@DETOKENIZE
def test_unary_detokenize_in_either_place(tok_dir: Path, tok: ModelTokenizer, detokenize: str) -> None:
    """Router.Detokenize decodes in the router when it holds the tokenizer, with the service's text and
    the service's range check (an id the model has but the tokenizer lacks is INVALID_ARGUMENT on
    token_ids), a long input included."""
    from llmserve.v1 import router_pb2 as pb

    ids = _pieces(tok, "Grüße, 世界! one two three")
    long_ids = ids * (5000 // len(ids) + 1)  # past the router's inline-decode bound

    async def scenario() -> None:
        watched = WatchedTokenizer(tok_dir)
        async with fake_cluster(tok_dir, [_WideVocabWorker([[ids]])], tokenizer_servicer=watched,
                                detokenize=detokenize) as (client, _):
            for some in (ids, long_ids):
                for skip in (False, True):
                    resp = await client.stub.Detokenize(
                        pb.DetokenizeRequest(token_ids=some, skip_special_tokens=skip), timeout=10)
                    assert resp.text == tok.decode(some, skip)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.stub.Detokenize(pb.DetokenizeRequest(token_ids=[ids[0], tok.vocab_size]), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("token_ids: ")
            assert f"id {tok.vocab_size} at position 1" in err.value.details()
            assert watched.decodes == (0 if detokenize == "router" else 5)

    _run(scenario)


def test_a_tokenizer_service_back_with_another_tokenizer_is_read_again(
    tok_dir: Path, tok: ModelTokenizer, model_factory
) -> None:
    """The router holds the tokenizer service's tokenizer: when the service comes back after being
    down, the router reads it again (GetInfo and GetTokenizerJson) and detokenizes with the new one."""
    other_dir = model_factory("small")
    other = ModelTokenizer.from_dir(other_dir)
    # Ids both vocabularies have, that they decode differently (merges learned on different text).
    ids = [i for i in range(tok.vocab_size) if tok.decode([i]) != other.decode([i])][:8]
    assert len(ids) == 8

    async def scenario() -> None:
        first = WatchedTokenizer(tok_dir)
        async with fake_cluster(tok_dir, [FakeWorker([[ids]])], tokenizer_servicer=first) as (client, router):
            assert (await client.complete("hi", max_new_tokens=50))[0].text == tok.decode(ids)
            old_sha = router.servicer.vocab.sha256
            port = int(router.servicer.options.tokenizer.rpartition(":")[2])
            assert first.server is not None
            await first.server.stop(0)
            await _until(lambda: not router.servicer.tok_healthy)
            second = WatchedTokenizer(other_dir)
            server = grpc.aio.server()
            from grpc_health.v1 import health_pb2_grpc

            from llmserve.grpc_server import ServiceHealth
            from llmserve.v1 import tokenizer_pb2_grpc as tpb_grpc
            from tokenizer_svc.server import SERVICE_NAME

            tpb_grpc.add_TokenizerServicer_to_server(second, server)
            health = ServiceHealth(SERVICE_NAME)
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            assert server.add_insecure_port(f"127.0.0.1:{port}") == port
            await server.start()
            await health.set_serving(True)
            try:
                await _until(lambda: router.servicer.vocab is not None and router.servicer.vocab.sha256 != old_sha)
                assert second.exports == 1
                assert router.servicer.tok_info.vocab_size == other.vocab_size
                assert (await client.complete("hi", max_new_tokens=50))[0].text == other.decode(ids)
            finally:
                await server.stop(0)

    _run(scenario)


def test_ttft_and_e2e_count_the_time_spent_tokenizing(tok_dir: Path, tok: ModelTokenizer) -> None:
    """The router's TTFT and E2E start when the call arrives, not once the prompt is tokenized (they
    used to start after Encode, so a slow tokenizer service never showed in the router's latencies)."""
    ids = _pieces(tok, "one two three")
    delay_s = 0.3

    async def scenario() -> None:
        metrics = RouterMetrics.create()
        watched = WatchedTokenizer(tok_dir, encode_delay_s=delay_s)
        async with fake_cluster(tok_dir, [FakeWorker([[ids]], step_s=0.0)], tokenizer_servicer=watched,
                                metrics=metrics) as (client, _):
            await client.complete("hi", max_new_tokens=50)
        value = metrics.registry.get_sample_value
        assert value("llmserve:time_to_first_token_seconds_count") == 1
        assert value("llmserve:time_to_first_token_seconds_sum") >= delay_s
        assert value("llmserve:e2e_request_latency_seconds_sum") >= delay_s

    _run(scenario)


def test_the_worker_call_ends_before_the_clients_deadline(tok_dir: Path, tok: ModelTokenizer) -> None:
    """The router's calls for a request carry the client's deadline less DEADLINE_MARGIN_S, so the router's
    DEADLINE_EXCEEDED reaches the client while grpc still has the call open: a status sent after the
    deadline fails, and grpc.aio leaks the failed batch (grpc/grpc#43360: ~0.3 kB per request before)."""
    ids = _pieces(tok, "one two three")

    async def scenario() -> None:
        worker = FakeWorker([[ids]], step_s=0.0)
        async with fake_cluster(tok_dir, [worker]) as (client, _):
            await client.complete("hi", max_new_tokens=50, timeout=0.9)
        (left,) = worker.time_remaining
        # The worker sees 0.9 s less the hops and the margin (timeouts under 1 s travel with ms precision).
        assert DEADLINE_MARGIN_S >= 0.01
        assert left is not None and 0.5 < left < 0.9 - 0.01

    _run(scenario)
