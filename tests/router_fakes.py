"""Scripted fake workers for the router's tests: in-process grpc.aio SglangScheduler servers whose
streams are fixed in advance, behind a real router and a real tokenizer service, which makes
retries, mid-stream failures and per-sample aborts deterministic."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import sglang_scheduler_pb2 as spb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as spb_grpc

from llmserve.grpc_server import ServiceHealth
from llmserve.metrics import RouterMetrics
from llmserve.v1 import tokenizer_pb2_grpc as tpb_grpc
from llmserve.worker_protocol import sample_label
from router.client import AsyncRouterClient
from router.server import RouterOptions, start_router
from tokenizer_svc.server import SERVICE_NAME as TOKENIZER_SERVICE
from tokenizer_svc.server import TokenizerServicer
from tokenizer_svc.server import start_server as start_tokenizer
from tokenizer_svc.tokenizer import ModelTokenizer

TIMEOUT = 20.0


# ---- streaming against scripted workers ----------------------------------------------------------


class FakeWorker(spb_grpc.SglangSchedulerServicer):
    """Streams `script[i]` (chunks of ids) for sample i, then a Complete; `fail` makes Generate fail
    with UNAVAILABLE before anything ("first") or with INTERNAL after two chunks ("mid"). `start_s`:
    how long a Generate call takes to start; an Abort that arrives before then finds nothing (as a real
    worker's does) and is only recorded in `missed_aborts`."""

    def __init__(self, script: list[list[list[int]]], finish: str = "length", matched: int | None = None,
                 fail: str | None = None, step_s: float = 0.005, start_s: float = 0.0):
        self.script, self.finish, self.matched, self.fail, self.step_s = script, finish, matched, fail, step_s
        self.start_s = start_s
        self.started: set[str] = set()
        self.missed_aborts: list[str] = []
        self.requests: list[spb.GenerateRequest] = []
        self.metadata: list[dict] = []
        self.time_remaining: list[float | None] = []  # the deadline each Generate call arrived with
        self.aborts: list[str] = []
        self.endings: list[str] = []  # per Generate call: "done" (it returned) or "cancelled" (by the client)

    async def GetModelInfo(self, request, context):  # noqa: N802
        return spb.GetModelInfoResponse(served_model_name="fake", vocab_size=512, max_context_length=256,
                                        max_req_input_len=255, eos_token_ids=[508])

    async def GetLoads(self, request, context):  # noqa: N802
        return spb.GetLoadsResponse(loads=[spb.SchedulerLoad(max_total_num_tokens=1000)])

    async def HealthCheck(self, request, context):  # noqa: N802
        return spb.HealthCheckResponse(healthy=True, message="ok")

    async def Abort(self, request, context):  # noqa: N802
        if self.start_s and request.request_id not in self.started:
            self.missed_aborts.append(request.request_id)
            return spb.AbortResponse(success=False, message="no such request")
        self.aborts.append(request.request_id)
        return spb.AbortResponse(success=True)

    async def Generate(self, request, context) -> AsyncIterator[spb.GenerateResponse]:  # noqa: N802
        try:
            async for response in self._generate(request, context):
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            self.endings.append("cancelled")
            raise
        self.endings.append("done")

    async def _generate(self, request, context) -> AsyncIterator[spb.GenerateResponse]:
        if self.start_s:
            await asyncio.sleep(self.start_s)
        self.started.add(request.request_id)
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        self.time_remaining.append(context.time_remaining())
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
                engine_id = rid if n == 1 else sample_label(rid, i)
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
            if all(done):  # as a real worker: the call ends with its last sample
                return
            await asyncio.sleep(self.step_s)


class WatchedTokenizer(TokenizerServicer):
    """The real tokenizer servicer, with Encode slowed by `encode_delay_s`, recording how each Encode
    and DetokenizeStream call ended: "done" (answered / the client half-closed) or "cancelled", and
    counting Decode and GetTokenizerJson calls."""

    def __init__(self, tok_dir: Path, encode_delay_s: float = 0.0, export: bool = True):
        super().__init__(ModelTokenizer.from_dir(tok_dir))
        self.encode_delay_s = encode_delay_s
        self.export = export  # False: GetTokenizerJson is UNIMPLEMENTED, as on a service that predates it
        self.encodes: list[str] = []
        self.streams: list[str] = []
        self.exports = 0
        self.decodes = 0
        self.server: grpc.aio.Server | None = None

    async def Decode(self, request, context):  # noqa: N802
        self.decodes += 1
        return await super().Decode(request, context)

    async def GetTokenizerJson(self, request, context):  # noqa: N802
        self.exports += 1
        if not self.export:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        return await super().GetTokenizerJson(request, context)

    async def Encode(self, request, context):  # noqa: N802
        try:
            await asyncio.sleep(self.encode_delay_s)
            response = await super().Encode(request, context)
        except asyncio.CancelledError:
            self.encodes.append("cancelled")
            raise
        self.encodes.append("done")
        return response

    async def DetokenizeStream(self, request_iterator, context):  # noqa: N802
        try:
            async for resp in super().DetokenizeStream(request_iterator, context):
                yield resp
        except asyncio.CancelledError:
            self.streams.append("cancelled")
            raise
        self.streams.append("done")


async def _start_watched_tokenizer(servicer: TokenizerServicer) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    tpb_grpc.add_TokenizerServicer_to_server(servicer, server)
    health = ServiceHealth(TOKENIZER_SERVICE)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set_serving(True)
    if isinstance(servicer, WatchedTokenizer):
        servicer.server = server  # a test may stop the service mid-stream
    return server, port


@contextlib.asynccontextmanager
async def fake_cluster(tok_dir: Path, workers: list[FakeWorker], policy: str = "round_robin",
                       tokenizer_servicer: TokenizerServicer | None = None, metrics: RouterMetrics | None = None,
                       **options):
    """`tokenizer_servicer`: serve the tokenizer with this servicer (e.g. a WatchedTokenizer);
    `metrics`: the router's metric set."""
    if tokenizer_servicer is None:
        tokenizer = await start_tokenizer(tok_dir, "127.0.0.1", 0)
        tok_server, tok_port = tokenizer.server, tokenizer.port
    else:
        tok_server, tok_port = await _start_watched_tokenizer(tokenizer_servicer)
    servers, addrs = [], []
    for w in workers:
        server = grpc.aio.server()
        spb_grpc.add_SglangSchedulerServicer_to_server(w, server)
        addrs.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    router = await start_router(RouterOptions(tokenizer=f"127.0.0.1:{tok_port}", workers=addrs, policy=policy,
                                              probe_interval=0.1, **options), metrics=metrics)
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
        await tok_server.stop(0)

