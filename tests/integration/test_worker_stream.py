"""llmserve.v1.WorkerStream over real gRPC on 127.0.0.1: many Generate calls on one stream against the
in-process worker (tiny model, fp32, 512-token KV pool), through the router's client of it
(router/worker_stream.py) and as raw messages."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as spb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as spb_grpc
from smg_grpc_proto.generated import common_pb2

from llmserve.v1 import worker_stream_pb2 as wpb
from llmserve.v1 import worker_stream_pb2_grpc as wpb_grpc
from router.worker_stream import WorkerStream
from tests.integration.conftest import WORKER_ENGINE, launch_worker
from tests.prom import free_ports

POOL = WORKER_ENGINE["max_total_tokens"]
TIMEOUT = 60.0


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


def _request(ids: list[int], max_new: int = 12, rid: str = "", **sampling) -> spb.GenerateRequest:
    params = spb.SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=max_new, **sampling)
    return spb.GenerateRequest(request_id=rid, tokenized=spb.TokenizedInput(input_ids=ids), sampling_params=params,
                               stream=True)


def _run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def _read(call) -> dict[int, list[int]]:
    """Output ids by sample index, from the chunks; the completes must agree."""
    ids: dict[int, list[int]] = {}
    completes: dict[int, list[int]] = {}
    async for resp in call:
        kind = resp.WhichOneof("response")
        if kind == "chunk":
            ids.setdefault(resp.chunk.index, []).extend(resp.chunk.token_ids)
        elif kind == "complete":
            completes[resp.complete.index] = list(resp.complete.output_ids)
    assert completes == ids
    return ids


async def _wait_idle(stub: spb_grpc.SglangSchedulerStub, timeout: float = 15.0) -> spb.SchedulerLoad:
    """Until nothing runs or waits and every KV slot is free (the prefix cache flushed)."""
    deadline = time.monotonic() + timeout
    while True:
        await stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT)
        load = (await stub.GetLoads(spb.GetLoadsRequest(), timeout=TIMEOUT)).loads[0]
        if load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.num_used_tokens == 0:
            assert load.max_total_num_tokens == POOL
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"worker not idle after {timeout}s: {load}")
        await asyncio.sleep(0.02)


def test_the_worker_says_it_serves_the_stream(inproc_worker) -> None:
    async def scenario() -> None:
        async with grpc.aio.insecure_channel(inproc_worker.address) as channel:
            info = await spb_grpc.SglangSchedulerStub(channel).GetServerInfo(spb.GetServerInfoRequest())
            assert info.scheduler_info.fields["worker_stream"].bool_value is True

    _run(scenario())


def test_calls_on_one_stream_give_what_calls_of_their_own_give(inproc_worker) -> None:
    prompts = [_prompt(8 + 5 * i, seed=i) for i in range(6)]

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(inproc_worker.address) as channel:
            stub = spb_grpc.SglangSchedulerStub(channel)
            alone = [await _read(stub.Generate(_request(p, rid=f"alone-{i}"))) for i, p in enumerate(prompts)]
            two = await _read(stub.Generate(_request(prompts[0], rid="alone-n2", n=2)))
            stream = WorkerStream(channel, "test")
            try:
                calls = [stream.generate(_request(p, rid=f"streamed-{i}")) for i, p in enumerate(prompts)]
                calls.append(stream.generate(_request(prompts[0], rid="streamed-n2", n=2)))
                together = await asyncio.gather(*(_read(c) for c in calls))
            finally:
                await stream.close()
            assert together[:-1] == alone
            assert together[-1] == two and len(two) == 2
            assert all(len(ids[0]) == 12 for ids in together)
            await _wait_idle(stub)

    _run(scenario())


def test_a_step_of_several_calls_comes_in_one_message(inproc_worker) -> None:
    """The point of the stream: the outputs one engine step makes for several calls share a message."""

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(inproc_worker.address) as channel:
            rpc = wpb_grpc.WorkerStreamStub(channel).GenerateMany()
            opens = [wpb.CallOpen(call=i + 1, generate_request=_request(_prompt(6, i), max_new=16).SerializeToString())
                     for i in range(4)]
            await rpc.write(wpb.WorkerStreamRequest(open=opens, credit=1000))
            ended: dict[int, int] = {}
            widest = 0
            while len(ended) < 4:
                message = await rpc.read()
                calls = {item.call for item in message.items if item.WhichOneof("item") == "generate_response"}
                widest = max(widest, len(calls))
                ended.update((item.call, item.end.code) for item in message.items if item.WhichOneof("item") == "end")
            await rpc.done_writing()
            assert await rpc.read() is grpc.aio.EOF  # the worker ends the stream once the caller is done
            assert ended == {1: 0, 2: 0, 3: 0, 4: 0}
            assert widest >= 2, "no message carried more than one call's output"

    _run(scenario())


def test_a_bad_call_fails_alone_with_the_status_a_call_of_its_own_gets(inproc_worker) -> None:
    async def scenario() -> None:
        async with grpc.aio.insecure_channel(inproc_worker.address) as channel:
            stub = spb_grpc.SglangSchedulerStub(channel)
            rpc = wpb_grpc.WorkerStreamStub(channel).GenerateMany()
            good = _request(_prompt(6, 1), max_new=4)
            too_long = _request(_prompt(WORKER_ENGINE["context_length"] + 10, 2), max_new=4)
            opens = [
                wpb.CallOpen(call=1, generate_request=b"\xff\xff\xff"),  # does not parse
                wpb.CallOpen(call=2, generate_request=too_long.SerializeToString()),
                wpb.CallOpen(call=3, generate_request=good.SerializeToString()),
            ]
            await rpc.write(wpb.WorkerStreamRequest(open=opens, credit=1000))
            ends: dict[int, list[wpb.CallEnd]] = {}
            tokens = 0
            while len(ends) < 3:
                message = await rpc.read()
                for item in message.items:
                    if item.WhichOneof("item") == "end":
                        ends.setdefault(item.call, []).append(item.end)
                    else:
                        tokens += len(spb.GenerateResponse.FromString(item.generate_response).chunk.token_ids)
            rpc.cancel()
            assert ends[1][0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert ends[1][0].message.startswith("request: ")
            # What SglangScheduler.Generate answers for that prompt, word for word.
            with pytest.raises(grpc.aio.AioRpcError) as alone:
                await _read(stub.Generate(too_long))
            assert ends[2][0].code == alone.value.code().value[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert ends[2][0].message == alone.value.details()
            assert [e.code for e in ends[3]] == [0] and tokens == 4
            await _wait_idle(stub)

    _run(scenario())


def test_the_stream_does_not_log_under_the_request_that_opened_it(inproc_worker, monkeypatch) -> None:
    """The stream outlives the request whose call opened it: its reader and writer log without that
    request's ids."""
    import structlog

    from router import worker_stream

    seen: list[dict] = []
    write = worker_stream._Session._write

    async def spy(self) -> None:
        seen.append(structlog.contextvars.get_contextvars())
        await write(self)

    monkeypatch.setattr(worker_stream._Session, "_write", spy)

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(inproc_worker.address) as channel:
            stream = WorkerStream(channel, "test")
            structlog.contextvars.bind_contextvars(request_id="the-first-request")
            try:
                await _read(stream.generate(_request(_prompt(5, 9), max_new=2)))
            finally:
                structlog.contextvars.clear_contextvars()
                await stream.close()

    _run(scenario())
    assert seen == [{}]


@pytest.fixture(scope="module")
def slow_worker(worker_model, tmp_path_factory):
    """A worker process whose steps take 20 ms or more: a long generation is still running when a test
    ends it."""
    worker = launch_worker(worker_model, tmp_path_factory.mktemp("slow"), "--debug-step-delay", "0.02")
    yield worker
    worker.terminate()



def test_a_call_number_opened_twice_fails_the_stream(slow_worker) -> None:
    async def scenario() -> None:
        async with grpc.aio.insecure_channel(slow_worker.address) as channel:
            rpc = wpb_grpc.WorkerStreamStub(channel).GenerateMany()
            request = _request(_prompt(6, 1), max_new=200).SerializeToString()
            opens = [wpb.CallOpen(call=7, generate_request=request)] * 2
            await rpc.write(wpb.WorkerStreamRequest(open=opens, credit=10))
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                while await rpc.read() is not grpc.aio.EOF:
                    pass
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert failed.value.details() == "call: 7 is already open on this stream"
            await _wait_idle(spb_grpc.SglangSchedulerStub(channel))  # its first call was aborted

    _run(scenario())


def test_without_credit_the_worker_sends_first_tokens_only_and_then_merges_the_rest(slow_worker) -> None:
    """A caller that grants no credit gets each call's first token (never held back) and nothing more;
    what was made meanwhile comes in one message, each call's later tokens in one chunk."""

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(slow_worker.address) as channel:
            rpc = wpb_grpc.WorkerStreamStub(channel).GenerateMany()
            opens = [wpb.CallOpen(call=i, generate_request=_request(_prompt(6, i), max_new=8).SerializeToString())
                     for i in (1, 2)]
            await rpc.write(wpb.WorkerStreamRequest(open=opens))
            first: dict[int, list[int]] = {}
            messages = 0
            while len(first) < 2:
                messages += 1
                for item in (await asyncio.wait_for(rpc.read(), TIMEOUT)).items:
                    chunk = spb.GenerateResponse.FromString(item.generate_response).chunk
                    assert item.call not in first and chunk.completion_tokens == 1
                    first[item.call] = list(chunk.token_ids)
            read = asyncio.ensure_future(rpc.read())  # (cancelling a read would cancel the call)
            done, _ = await asyncio.wait([read], timeout=0.6)  # 7 steps of >= 20 ms: both calls end meanwhile
            assert not done
            # Those messages went out on credit not yet granted: it takes one more than them for the next.
            await rpc.write(wpb.WorkerStreamRequest(credit=messages))
            await asyncio.sleep(0.3)
            assert not read.done()
            await rpc.write(wpb.WorkerStreamRequest(credit=1))
            message = await asyncio.wait_for(read, TIMEOUT)
            kinds = [(item.call, item.WhichOneof("item")) for item in message.items]
            chunk_complete_end = ["generate_response", "generate_response", "end"]
            assert kinds == [(1, k) for k in chunk_complete_end] + [(2, k) for k in chunk_complete_end]
            rest = spb.GenerateResponse.FromString(message.items[0].generate_response).chunk
            complete = spb.GenerateResponse.FromString(message.items[1].generate_response).complete
            assert first[1] + list(rest.token_ids) == list(complete.output_ids) and len(rest.token_ids) == 7
            assert rest.completion_tokens == 8
            rpc.cancel()

    _run(scenario())


@pytest.mark.parametrize("how", ["cancel", "deadline", "stream closed"])
def test_a_call_that_ends_early_frees_what_it_held(slow_worker, how: str) -> None:
    async def scenario() -> None:
        async with grpc.aio.insecure_channel(slow_worker.address) as channel:
            stub = spb_grpc.SglangSchedulerStub(channel)
            stream = WorkerStream(channel, "test")
            timeout = 0.5 if how == "deadline" else None
            # More tokens than the tiny model makes in the test's time: it runs until ended.
            long = stream.generate(_request(_prompt(20, 7), max_new=200), timeout=timeout)
            other = stream.generate(_request(_prompt(9, 8), max_new=6))
            first = await anext(long.__aiter__())
            assert first.WhichOneof("response") == "chunk"
            if how == "cancel":
                assert long.cancel() and long.done() and not long.cancel()
            elif how == "stream closed":
                await stream.close()
            code = None
            try:
                while True:
                    await anext(long.__aiter__())
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            expected = {"cancel": grpc.StatusCode.CANCELLED, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
                        "stream closed": grpc.StatusCode.CANCELLED}[how]
            assert code == expected
            if how != "stream closed":  # the stream's other call is untouched
                assert len((await _read(other))[0]) == 6
                await stream.close()
            await _wait_idle(stub)

    _run(scenario())


def test_a_stream_to_a_worker_that_goes_away_fails_its_calls_unavailable(worker_model, worker_process_factory):
    worker = worker_process_factory(worker_model, "--debug-step-delay", "0.05")

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stream = WorkerStream(channel, "test")
            call = stream.generate(_request(_prompt(10, 3), max_new=200))
            assert (await anext(call.__aiter__())).WhichOneof("response") == "chunk"
            worker.proc.kill()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                while True:
                    await anext(call.__aiter__())
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            await stream.close()

    _run(scenario())


def test_a_worker_shutting_down_finishes_the_streams_calls_refuses_new_ones_and_ends_it(
        worker_model, worker_process_factory) -> None:
    worker = worker_process_factory(worker_model, "--debug-step-delay", "0.02", "--shutdown-grace", "20")

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stream = WorkerStream(channel, "test")
            running = stream.generate(_request(_prompt(10, 5), max_new=40))  # ~1 s of steps
            first = await anext(running.__aiter__())
            assert first.WhichOneof("response") == "chunk"
            started = time.monotonic()
            worker.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = stream.generate(_request(_prompt(6, 6), max_new=4))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _read(refused)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "is stopping" in info.value.details()
            ids = list(first.chunk.token_ids)
            async for response in running:  # the call in flight runs to its end...
                if response.WhichOneof("response") == "chunk":
                    ids += response.chunk.token_ids
                else:
                    assert list(response.complete.output_ids) == ids and len(ids) == 40
            # ...and then the worker ends the stream and exits, long before its 20 s grace.
            assert await asyncio.to_thread(worker.proc.wait, 15) == 0
            assert time.monotonic() - started < 10
            await stream.close()

    _run(scenario())


# ---- through the router ----------------------------------------------------------------------------


@pytest.mark.parametrize(("worker_flags", "router_flags", "streamed"), [
    ([], [], True),
    (["--disable-worker-stream"], [], False),  # a worker without it: the router finds out from GetServerInfo
    ([], ["--disable-worker-stream"], False),
], ids=["stream", "worker-without", "router-opts-out"])
def test_the_router_carries_its_requests_on_the_stream_where_it_can(
        model_factory, tmp_path, worker_flags: list[str], router_flags: list[str], streamed: bool) -> None:
    from router.client import RouterClient, collect
    from tests.integration.test_router import engine_flags, one_group_cluster
    from tests.prom import scrape_until
    from worker_svc.config.engine_config import EngineConfig
    from worker_svc.engine.engine import Engine
    from worker_svc.sampling import SamplingParams

    model = model_factory("tiny")
    (metrics_port,) = free_ports(1)
    prompts = [_prompt(5 + 3 * i, seed=40 + i) for i in range(8)]
    with one_group_cluster(model, tmp_path, worker_flags=[*engine_flags(), "--metrics-port", str(metrics_port),
                                                          *worker_flags],
                           router_flags=router_flags) as (_tokenizer, _worker, router):
        found = [r for r in router.log_records() if r.get("event") == "requests go on the worker stream"]
        assert bool(found) is streamed
        with RouterClient(router.address, timeout=TIMEOUT) as client:
            results = list(ThreadPoolExecutor(8).map(
                lambda p: collect(client.generate(p, max_new_tokens=10, temperature=0, ignore_eos=True))[0],
                prompts))
        samples = scrape_until("127.0.0.1", metrics_port,
                               lambda s: s.value("llmserve:grpc_requests_total", method="Generate", code="OK") >= 8)
    from tests.integration.test_router import ENGINE

    engine = Engine(EngineConfig(model_path=str(model), **ENGINE))
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in results] == [out.output_ids for out in engine.generate(prompts, params)]
    # Counted alike either way: a call on the stream is a Generate call in the worker's metrics.
    assert samples.value("llmserve:grpc_requests_total", method="Generate", code="OK") == 8
