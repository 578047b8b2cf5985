"""The router's parts, fast: stop-string matching, the UTF-8 locator, routing policies, validation, and
the streaming path end to end against scripted fake workers (in-process grpc.aio servers with the
real tokenizer service), which makes retries, mid-stream failures and per-sample aborts
deterministic. The real cluster is in test_router.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto import sglang_scheduler_pb2 as spb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as spb_grpc

from llmserve.v1 import router_pb2 as pb
from router.client import AsyncRouterClient
from router.server import RouterOptions, start_router
from router.stops import StopStringMatcher
from router.validation import ModelFacts, RouterError, check_fits, validate_sampling
from llmserve.grpc_wire import InvalidRequest, find_invalid_utf8, tolerant
from router.workers import NOT_SERVING, SERVING, PoolOptions, WorkerPool
from tokenizer_svc.server import start_server as start_tokenizer
from tokenizer_svc.tokenizer import ModelTokenizer

TIMEOUT = 20.0

# ---- stop strings --------------------------------------------------------------------------------


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < (best[0] + len(best[1]), -len(best[1]))):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s) if include else i], s


def _stream(chunks: list[str], stops: list[str], include: bool) -> tuple[str, str | None, list[str]]:
    m = StopStringMatcher(stops, include)
    out: list[str] = []
    for c in chunks:
        text, match = m.push(c)
        out.append(text)
        if match is not None:
            out.append(match.text)
            return "".join(out), match.stop, out
    out.append(m.flush())
    return "".join(out), None, out


def test_stop_string_spanning_deltas() -> None:
    text, stop, pieces = _stream(["Hello wo", "rl", "d. Bye"], ["world."], include=False)
    assert (text, stop) == ("Hello ", "world.")
    assert pieces[:2] == ["Hello ", ""]  # "wo", then "world" held back
    assert _stream(["Hello wo", "rl", "d. Bye"], ["world."], include=True)[:2] == ("Hello world.", "world.")
    # Held text that turns out not to be a stop string is released, in order.
    assert _stream(["abc <", "en", "x> def"], ["<end>"], False)[:2] == ("abc <enx> def", None)
    # The stop that completes first wins, as it would token by token.
    assert _stream(["xabcd"], ["abcd", "bc"], False)[:2] == ("xa", "bc")


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc<>é", max_size=40),
       cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
       stops=st.lists(st.text(alphabet="abc<>é", min_size=1, max_size=4), min_size=1, max_size=3),
       include=st.booleans())
def test_stop_matcher_equals_whole_text_search(text: str, cuts: list[int], stops: list[str], include: bool) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    got_text, got_stop, _ = _stream(chunks, stops, include)
    assert (got_text, got_stop) == _reference(text, stops, include)


# ---- wire ----------------------------------------------------------------------------------------


def test_invalid_utf8_is_located_not_raised() -> None:
    good = pb.ChatRequest(messages=[{"role": "user", "content": "ok"}, {"role": "user", "content": "zz"}],
                          sampling_params=pb.SamplingParams(stop=["a", "yy"])).SerializeToString()
    assert find_invalid_utf8(pb.ChatRequest.DESCRIPTOR, good) is None
    bad = good.replace(b"zz", b"\xc3(")
    assert find_invalid_utf8(pb.ChatRequest.DESCRIPTOR, bad) == "messages[1].content"
    parsed = tolerant(pb.ChatRequest)(good.replace(b"yy", b"\xff\xfe"))
    assert isinstance(parsed, InvalidRequest) and parsed.message.startswith("sampling_params.stop[1]:")
    assert isinstance(tolerant(pb.ChatRequest)(b"\xff\xff\xff"), InvalidRequest)  # garbage: still no raise


# ---- validation ----------------------------------------------------------------------------------

FACTS = ModelFacts(name="m", vocab_size=512, context_limit=256, eos_token_ids=(508,))


@pytest.mark.parametrize("params, field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(frequency_penalty=3.0), "frequency_penalty"),
    (dict(stop_token_ids=[1, 512]), "stop_token_ids[1]"),
    (dict(stop=["ok", ""]), "stop[1]"),
    (dict(max_new_tokens=257), "max_new_tokens"),
    (dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens"),
    (dict(top_logprobs=21), "top_logprobs"),
])
def test_sampling_validation_names_the_field(params: dict, field: str) -> None:
    with pytest.raises(RouterError) as e:
        validate_sampling(pb.SamplingParams(**params), FACTS)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and f"sampling_params.{field}" in e.value.message


def test_sampling_validation_accepts_proto3_zeros_and_bounds() -> None:
    validate_sampling(pb.SamplingParams(), FACTS)  # all zeros: defaults
    validate_sampling(pb.SamplingParams(temperature=0, top_p=1.0, top_k=-1, max_new_tokens=256), FACTS)
    check_fits(255, pb.SamplingParams(), FACTS, "text")
    with pytest.raises(RouterError) as e:
        check_fits(256, pb.SamplingParams(), FACTS, "text")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.message.startswith("text:")
    with pytest.raises(RouterError) as e:
        check_fits(200, pb.SamplingParams(max_new_tokens=100), FACTS, "text")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_new_tokens" in e.value.message


# ---- policies ------------------------------------------------------------------------------------


def test_policies() -> None:
    async def scenario() -> None:
        addrs = [f"127.0.0.1:{p}" for p in (1, 2, 3)]
        pools = {name: WorkerPool(addrs, PoolOptions(policy=name)) for name in ("least_load", "round_robin", "prefix")}
        for pool in pools.values():
            for g in pool.groups:
                g.health = SERVING
        rr = pools["round_robin"]
        assert [rr.pick([1]).index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
        ll = pools["least_load"]
        ll.groups[0].in_flight, ll.groups[1].in_flight, ll.groups[2].in_flight = 3, 1, 2
        assert {ll.pick([1]).index for _ in range(5)} == {1}
        # A reported load counts, corrected by what this router started since the report.
        ll.groups[1].load = spb.SchedulerLoad(num_running_reqs=5)
        ll.groups[1].in_flight_at_report = 1
        assert ll.pick([1]).index == 2
        px = pools["prefix"]
        prompts = [[7, i, i * 3] for i in range(60)]
        first = {tuple(p): px.pick(p).index for p in prompts}
        assert len(set(first.values())) == 3  # spreads
        assert all(px.pick(p).index == first[tuple(p)] for p in prompts)  # sticky
        px.groups[1].health = NOT_SERVING
        moved = {tuple(p): px.pick(p).index for p in prompts}
        assert all(moved[k] == v for k, v in first.items() if v != 1)  # only group 1's prefixes move
        assert 1 not in moved.values()
        assert rr.pick([1], exclude={0, 1}).index == 2
        for pool in pools.values():
            await pool.close()

    asyncio.run(scenario())


# ---- streaming against scripted workers ----------------------------------------------------------


class FakeWorker(spb_grpc.SglangSchedulerServicer):
    """Streams `script[i]` (chunks of ids) for sample i, then a Complete; `fail` makes Generate fail
    with UNAVAILABLE before anything ("first") or with INTERNAL after two chunks ("mid")."""

    def __init__(self, script: list[list[list[int]]], finish: str = "length", matched: int | None = None,
                 fail: str | None = None, step_s: float = 0.005):
        self.script, self.finish, self.matched, self.fail, self.step_s = script, finish, matched, fail, step_s
        self.requests: list[spb.GenerateRequest] = []
        self.metadata: list[dict] = []
        self.aborts: list[str] = []

    async def GetModelInfo(self, request, context):  # noqa: N802
        return spb.GetModelInfoResponse(served_model_name="fake", vocab_size=512, max_context_length=256,
                                        max_req_input_len=255, eos_token_ids=[508])

    async def GetLoads(self, request, context):  # noqa: N802
        return spb.GetLoadsResponse(loads=[spb.SchedulerLoad(max_total_num_tokens=1000)])

    async def HealthCheck(self, request, context):  # noqa: N802
        return spb.HealthCheckResponse(healthy=True, message="ok")

    async def Abort(self, request, context):  # noqa: N802
        self.aborts.append(request.request_id)
        return spb.AbortResponse(success=True)

    async def Generate(self, request, context) -> AsyncIterator[spb.GenerateResponse]:  # noqa: N802
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        rid = request.request_id
        if self.fail == "first":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted failure")
        n = request.sampling_params.n or 1
        out: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        steps = max(len(s) for s in self.script)
        for step in range(steps):
            if self.fail == "mid" and step == 2:
                await context.abort(grpc.StatusCode.INTERNAL, "scripted mid-stream failure")
            for i in range(n):
                engine_id = rid if n == 1 else f"{rid}-n{i}"
                if done[i]:
                    continue
                if engine_id in self.aborts or rid in self.aborts:
                    done[i] = True
                    yield spb.GenerateResponse(request_id=rid, complete=spb.GenerateComplete(
                        output_ids=out[i], finish_reason="abort", index=i, prompt_tokens=3,
                        completion_tokens=len(out[i])))
                    continue
                chunks = self.script[i]
                if step < len(chunks):
                    ids = chunks[step]
                    out[i] += ids
                    chunk = spb.GenerateStreamChunk(token_ids=ids, index=i, prompt_tokens=3,
                                                    completion_tokens=len(out[i]))
                    if request.return_logprob:
                        chunk.output_logprobs.CopyFrom(spb.OutputLogProbs(
                            token_ids=ids, token_logprobs=[-0.5] * len(ids),
                            top_logprobs=[spb.TopLogProbs(values=[-0.5, -1.0], token_ids=[t, 0]) for t in ids]))
                    yield spb.GenerateResponse(request_id=rid, chunk=chunk)
                if step == len(chunks) - 1:
                    done[i] = True
                    complete = spb.GenerateComplete(output_ids=out[i], finish_reason=self.finish, index=i,
                                                    prompt_tokens=3, completion_tokens=len(out[i]))
                    if self.matched is not None:
                        complete.matched_token_id = self.matched
                    yield spb.GenerateResponse(request_id=rid, complete=complete)
            await asyncio.sleep(self.step_s)


@pytest.fixture(scope="module")
def tok_dir(model_factory) -> Path:
    return model_factory("tiny")


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(tok_dir)


@contextlib.asynccontextmanager
async def fake_cluster(tok_dir: Path, workers: list[FakeWorker], policy: str = "round_robin", **options):
    tokenizer = await start_tokenizer(tok_dir, "127.0.0.1", 0)
    servers, addrs = [], []
    for w in workers:
        server = grpc.aio.server()
        spb_grpc.add_SglangSchedulerServicer_to_server(w, server)
        addrs.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    router = await start_router(RouterOptions(tokenizer=f"127.0.0.1:{tokenizer.port}", workers=addrs, policy=policy,
                                              probe_interval=0.1, **options))
    client = AsyncRouterClient(f"127.0.0.1:{router.port}", timeout=TIMEOUT)
    try:
        for _ in range(200):
            if await client.health() == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.02)
        yield client, router
    finally:
        await client.close()
        await router.stop(0)
        for s in servers:
            await s.stop(0)
        await tokenizer.stop(0)


def _pieces(tok: ModelTokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _run(coro_fn: Callable) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 60))


def test_text_equals_decode_and_stop_string_across_multi_token_chunks(tok_dir: Path, tok: ModelTokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog. Then it sleeps."
    ids = _pieces(tok, text)
    chunks = [ids[i:i + 3] for i in range(0, len(ids), 3)]  # several tokens per chunk

    async def scenario() -> None:
        worker = FakeWorker([chunks])
        async with fake_cluster(tok_dir, [worker]) as (client, _):
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
            included = (await client.complete("hi", max_new_tokens=100, stop=["lazy dog."], include_stop_str_in_output=True))[0]
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


def test_n2_stop_string_aborts_only_that_sample(tok_dir: Path, tok: ModelTokenizer) -> None:
    a = _pieces(tok, "one two three four five six seven")
    b = _pieces(tok, "alpha beta gamma delta epsilon")

    async def scenario() -> None:
        worker = FakeWorker([[[t] for t in a], [[t] for t in b]])
        async with fake_cluster(tok_dir, [worker]) as (client, _):
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
            kept = (await client.complete("hi", stop_token_ids=[stop_id], include_stop_str_in_output=True,
                                          max_new_tokens=20))[0]
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
