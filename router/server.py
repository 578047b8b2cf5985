"""The public `llmserve.v1.Router` service (grpc.aio), with grpc.health.v1 and server reflection.

One Generate / Chat call, end to end:

    validate (model, sampling, prompt)          INVALID_ARGUMENT, field named
    Encode on the tokenizer service             (Chat: through the chat template)
    check the prompt fits the context           RESOURCE_EXHAUSTED
    pick a worker group (WorkerPool.pick)       UNAVAILABLE when none is healthy
    SglangScheduler.Generate(stream=True) ----> chunks of token ids, one Complete per index
      per index: ids -> DetokenizeStream -> text delta -> StopStringMatcher -> response
      a stop string matched: finish the index, Abort it on the worker
    the worker fails before the first response was sent: mark the group, retry on another one
    the worker fails later: finish the open indexes with reason "abort" and a message
    the worker sends nothing for --stream-timeout s: as a failure (it is hung), cancel the call, Abort it
    the client cancels / its deadline passes: Abort on the worker, read its call to the end it then
      makes (cancelled only if it is still open after ABANDONED_CALL_GRACE_S)

Admission (router/admission.py) and the request caps (router/limits.py) come first, before any
allocation or round trip. The client's request_id is only a label (logs, responses): each attempt
on a worker runs under an engine id the router mints, so no client can reach another's request.

Details in router/README.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto import sglang_scheduler_pb2 as spb

from llmserve.grpc_server import (
    CLIENT_REQUEST_ID_HEADER,
    REQUEST_ID_HEADER,
    ServiceHealth,
    add_service,
    grpc_address,
    listen,
    metadata_value,
    stop_signal_event,
    write_port_file,
)
from llmserve.grpc_wire import InvalidRequest, tolerant
from llmserve.logging import get_logger, request_context
from llmserve.message_limits import message_size_options
from llmserve.metrics import RouterMetrics
from llmserve.security import HEALTH_METHODS, ChannelSecurity, ServerSecurity, current_identity
from llmserve.v1 import router_pb2 as pb
from llmserve.v1 import tokenizer_pb2 as tpb
from llmserve.v1 import tokenizer_pb2_grpc as tpb_grpc
from llmserve.worker_protocol import sample_label
from router.admission import ANONYMOUS, Admission
from router.background import BackgroundCalls
from router.detok import DetokenizeError, Detokenizer, LocalDetokenizer, LocalVocabulary, StreamDetokenizer
from router.limits import RequestLimits, check_messages, check_sampling_limits, validate_model_name, validate_request_id
from router.stops import StopStringMatcher
from router.validation import (
    ModelFacts,
    RouterError,
    check_fits,
    invalid,
    validate_model,
    validate_sampling,
    validate_token_ids,
)
from router.workers import CHANNEL_OPTIONS, NoHealthyGroup, PoolOptions, WorkerGroup, WorkerPool

log = get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Router"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
# Worker errors that say the request itself is wrong: returned as they are, never retried.
_CLIENT_ERRORS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
})
# Detokenize calls with more ids than this decode on a worker thread (4096 ids: ~0.4 ms of decode).
_INLINE_DECODE_IDS = 4096
_SEED_MASK = (1 << 53) - 1  # the worker takes the seed through a protobuf Struct (a double)


@dataclass(frozen=True)
class RouterOptions:
    tokenizer: str
    workers: Sequence[str]
    policy: str = "least_load"
    probe_interval: float = 1.0
    health_every: int = 5
    probe_timeout: float = 5.0
    prefix_tokens: int = 32
    served_model_name: str | None = None
    tokenizer_timeout: float = 30.0
    limits: RequestLimits = RequestLimits()
    max_concurrent_requests: int = 256  # Router RPCs in progress at once; 0: no limit
    max_requests_per_client: int = 0  # per authenticated identity; 0: no limit
    # A worker stream that yields nothing for this long is treated as a hung worker.
    stream_timeout: float = 60.0
    # TLS and the internal token on the channels to the tokenizer service and the workers.
    internal_security: ChannelSecurity = ChannelSecurity()
    log_prompts: bool = False  # prompt text in the logs (off: only counts and ids are logged)
    # Where generated ids become text: in this process with the tokenizer service's tokenizer
    # (fetched once), or on the tokenizer service (a DetokenizeStream call per request).
    detokenize: Literal["router", "service"] = "router"
    # Carry each worker's requests on one llmserve.v1.WorkerStream when it serves one (a step's tokens
    # in one message, router/worker_stream.py); off: one SglangScheduler.Generate call per request.
    worker_stream: bool = True


# ---- one request ---------------------------------------------------------------------------------

# The router's calls on a request's behalf (Encode, the worker stream) end this long before the client's
# deadline, so the router's own DEADLINE_EXCEEDED reaches the client while grpc still has the call open:
# a status sent after the deadline fails, and grpc.aio leaks the failed batch (grpc/grpc#43360; in a
# router serving short deadlines that was ~0.3 kB per request, for good).
DEADLINE_MARGIN_S = 0.02

# How long an abandoned worker call (the client cancelled, a stop string, a failure here) may take to end
# after the worker's Abort before the router cancels it (see _Run._drain).
ABANDONED_CALL_GRACE_S = 5.0
ABORT_AGAIN_S = 0.5


def call_timeout(context: grpc.aio.ServicerContext, cap: float | None = None) -> float | None:
    """The timeout for a call made on behalf of the client's call: its deadline less the margin (0 once
    that has passed), at most `cap`; None when neither bounds it."""
    left = context.time_remaining()
    if left is not None:
        left = max(left - DEADLINE_MARGIN_S, 0.0)
    if cap is None:
        return left
    return cap if left is None else min(left, cap)


@dataclass
class _Plan:
    """A validated, tokenized request, ready to send to a worker group."""

    request_id: str  # the client's label; never sent to a worker as an engine id
    prompt_ids: list[int]
    worker_request: spb.GenerateRequest
    n: int
    max_new_tokens: int | None
    min_new_tokens: int
    stops: tuple[str, ...]
    include_stop: bool
    skip_special_tokens: bool
    stop_ids: frozenset[int]
    logprobs: bool
    top_logprobs: int
    context: grpc.aio.ServicerContext
    received: float  # monotonic time the call reached the router: TTFT and E2E count tokenizing too

    def remaining(self) -> float | None:
        """Time left for calls made on this request's behalf (see `call_timeout`)."""
        return call_timeout(self.context)


class _RetryElsewhere(Exception):
    """The group failed before anything was sent to the client."""


class _Interrupted(Exception):
    """The worker stream went quiet past --stream-timeout, or the router is shutting down."""


@dataclass
class _Seq:
    index: int
    matcher: StopStringMatcher
    ids: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # a stop token kept from the detokenizer for now
    finished: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0


def _token_logprobs(olp: spb.OutputLogProbs, start: int, count: int, top: bool) -> list[pb.TokenLogprob]:
    out = []
    for k in range(start, min(start + count, len(olp.token_ids))):
        entry = pb.TokenLogprob(token_id=olp.token_ids[k], logprob=olp.token_logprobs[k])
        if top and k < len(olp.top_logprobs):
            row = olp.top_logprobs[k]
            entry.top_logprobs.extend(
                pb.TopLogprob(token_id=t, logprob=v) for v, t in zip(row.values, row.token_ids, strict=True))
        out.append(entry)
    return out


class _Run:
    """One attempt of a request on one worker group."""

    def __init__(self, router: RouterServicer, group: WorkerGroup, plan: _Plan):
        self.router = router
        self.group = group
        self.plan = plan
        # Unique per attempt: the worker files the call (and Abort finds it) under this id alone.
        self.engine_id = f"rt-{uuid.uuid4().hex}"
        self.worker_request = spb.GenerateRequest()
        self.worker_request.CopyFrom(plan.worker_request)
        self.worker_request.request_id = self.engine_id
        self._idle: asyncio.Timeout | None = None  # see _arm
        self._armed = False
        self.interrupt_reason: str | None = None
        self.seqs = [_Seq(i, StopStringMatcher(plan.stops, plan.include_stop)) for i in range(plan.n)]
        self.detok = router.detokenizer(plan)
        self.first_response_at: float | None = None
        self._messages: AsyncIterator[spb.GenerateResponse] | None = None  # the worker call's, see _relay
        self._read: asyncio.Future[spb.GenerateResponse | None] | None = None  # the latest read of it

    def _usage(self, s: _Seq) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=s.prompt_tokens or len(self.plan.prompt_ids),
            completion_tokens=len(s.ids),
            cached_tokens=s.cached_tokens,
        )

    def _response(
        self, s: _Seq, text: str, ids: list[int], logprobs: list[pb.TokenLogprob], finish: pb.Finish | None = None
    ) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(
            index=s.index, text=text, token_ids=ids, logprobs=logprobs, request_id=self.plan.request_id
        )
        if finish is not None:
            resp.finish.CopyFrom(finish)
        return resp

    def _abort_sample(self, s: _Seq, reason: str) -> None:
        # The worker files sample i of an n > 1 call under its sample label (and Abort takes either).
        engine_id = self.engine_id if self.plan.n == 1 else sample_label(self.engine_id, s.index)
        self.router.pool.abort(self.group, engine_id, reason)

    def interrupt(self, reason: str) -> None:
        """End the attempt now (router shutdown): the open sequences finish with reason "abort"."""
        self.interrupt_reason = reason
        if self._armed and self._idle is not None and not self._idle.expired():
            self._arm()

    # The idle timeout runs only while the attempt waits on the worker: time spent on the
    # tokenizer or on the client's side of the stream is not the worker's silence.
    def _arm(self) -> None:
        assert self._idle is not None, "armed only inside the relay's timeout block"
        loop = asyncio.get_running_loop()
        when = loop.time() if self.interrupt_reason else loop.time() + self.router.options.stream_timeout
        self._idle.reschedule(when)
        self._armed = True

    def _disarm(self) -> None:
        self._armed = False
        if self._idle is not None and not self._idle.expired():  # expired: the TimeoutError is on its way
            self._idle.reschedule(None)

    async def _feed(self, s: _Seq, ids: list[int], final: bool, drop_last: int | None = None) -> str:
        """Detokenize the sequence's next ids, keeping back a trailing stop token until the worker
        says whether it ended the sequence (its text is not output unless asked)."""
        plan = self.plan
        pending = s.held + ids
        s.held = []
        if final:
            if drop_last is not None and pending and pending[-1] == drop_last:
                pending.pop()
        elif pending and pending[-1] in plan.stop_ids and len(s.ids) + len(ids) >= plan.min_new_tokens:
            s.held = [pending.pop()]
        return await self.detok.push(s.index, pending, final=final)

    def _match(self, s: _Seq, text: str):
        if len(s.ids) < self.plan.min_new_tokens:  # stop conditions are off until min_new_tokens
            return text, None
        return s.matcher.push(text)

    async def _on_chunk(self, s: _Seq, chunk: spb.GenerateStreamChunk) -> pb.GenerateResponse | None:
        if s.finished:
            return None  # ids the worker produced before our Abort reached it
        plan = self.plan
        ids = list(chunk.token_ids)
        s.prompt_tokens, s.cached_tokens = chunk.prompt_tokens, chunk.cached_tokens
        lps = _token_logprobs(chunk.output_logprobs, 0, len(ids), plan.top_logprobs > 0) if plan.logprobs else []
        text = await self._feed(s, ids, final=False)
        s.ids += ids
        out, match = self._match(s, text)
        if match is None:
            return self._response(s, out, ids, lps)
        s.finished = True
        self._abort_sample(s, "stop string matched")
        log.debug("stop string matched", index=s.index, stop=match.stop)
        finish = pb.Finish(reason="stop", stop_str=match.stop, usage=self._usage(s))
        return self._response(s, match.text, ids, lps, finish)

    async def _on_complete(self, s: _Seq, c: spb.GenerateComplete) -> pb.GenerateResponse | None:
        if s.finished:
            return None
        plan = self.plan
        s.prompt_tokens, s.cached_tokens = c.prompt_tokens, c.cached_tokens
        # Ids the chunks did not carry (a worker that does not stream): send them now.
        extra = list(c.output_ids[len(s.ids) :])
        lps = (
            _token_logprobs(c.output_logprobs, len(s.ids), len(extra), plan.top_logprobs > 0)
            if plan.logprobs and extra
            else []
        )
        which = c.WhichOneof("matched_stop")
        stop_token = c.matched_token_id if which == "matched_token_id" else None
        drop = stop_token if c.finish_reason == "stop" and not plan.include_stop else None
        text = await self._feed(s, extra, final=True, drop_last=drop)
        s.ids += extra
        out, match = self._match(s, text)
        s.finished = True
        if match is not None:
            finish = pb.Finish(reason="stop", stop_str=match.stop, usage=self._usage(s))
            return self._response(s, match.text, extra, lps, finish)
        out += s.matcher.flush()
        finish = pb.Finish(reason=c.finish_reason or "stop", usage=self._usage(s))
        if stop_token is not None:
            finish.stop_token_id = stop_token
        elif which == "matched_stop_str":
            finish.stop_str = c.matched_stop_str
        if finish.reason == "abort":
            finish.message = f"aborted by worker group {self.group.index}"
        return self._response(s, out, extra, lps, finish)

    def _abort_all(self, message: str) -> list[pb.GenerateResponse]:
        out = []
        for s in self.seqs:
            if not s.finished:
                s.finished = True
                out.append(
                    self._response(s, "", [], [], pb.Finish(reason="abort", message=message, usage=self._usage(s)))
                )
        return out

    async def stream(self) -> AsyncIterator[pb.GenerateResponse]:
        g, plan = self.group, self.plan
        router = self.router
        metadata = ((REQUEST_ID_HEADER, self.engine_id), (CLIENT_REQUEST_ID_HEADER, plan.request_id))
        g.in_flight += 1
        router.runs.add(self)
        call = g.generate(self.worker_request, metadata, plan.remaining(), plan.request_id)
        sent = False  # anything yielded to the client yet
        clean = False
        abort_on_worker = False
        worker_silent = False
        try:
            try:
                async for resp in self._relay(call):
                    sent = True
                    yield resp
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code in _CLIENT_ERRORS:
                    raise RouterError(code, exc.details() or code.name) from None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise RouterError(code, "deadline exceeded while generating") from None
                reason = f"worker group {g.index} failed: {code.name}: {exc.details()}"
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    router.pool.report_failure(g, reason)
                if not sent:
                    raise _RetryElsewhere(reason) from None
                log.error("worker group failed mid-stream", group=g.index, error=reason)
                for resp in self._abort_all(reason):
                    yield resp
            except _WorkerStreamEnded as exc:
                reason = f"worker group {g.index}: {exc}"
                if not sent:
                    raise _RetryElsewhere(reason) from None
                for resp in self._abort_all(reason):
                    yield resp
            except DetokenizeError as exc:
                if not sent:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
                log.error("detokenization failed mid-stream", error=str(exc))
                for resp in self._abort_all(str(exc)):
                    yield resp
            except _Interrupted as exc:
                reason = str(exc)
                abort_on_worker = True
                if self.interrupt_reason is None:  # the worker went silent: treat it as hung
                    worker_silent = True
                    router.pool.report_failure(g, reason)
                    if not sent:
                        raise _RetryElsewhere(reason) from None
                log.warning("generation interrupted", group=g.index, reason=reason)
                for resp in self._abort_all(reason):
                    yield resp
            clean = True
        finally:
            g.in_flight -= 1
            router.runs.discard(self)
            if not call.done():
                abort_on_worker |= not clean
                if worker_silent:
                    call.cancel()  # a hung worker would not end it
                else:
                    # Ended by the worker (on the Abort below, or it was ending anyway), the call leaves
                    # nothing behind in either process; a cancelled one leaks (see _drain).
                    router.background.spawn(self._drain(call, abort_again=abort_on_worker))
            if abort_on_worker:
                # The worker aborts the call's unfinished engine requests and ends the call.
                router.pool.abort(g, self.engine_id, "cancelled")
            if clean:
                await self.detok.close()
            else:
                self.detok.abandon()

    async def _relay(self, call) -> AsyncIterator[pb.GenerateResponse]:
        """The worker's messages turned into client responses, until every sequence finished.
        Raises _Interrupted when a read waits past --stream-timeout or the run is interrupted."""
        plan = self.plan
        messages = self._messages = call.__aiter__()
        try:
            async with asyncio.timeout(None) as self._idle:
                while True:
                    self._arm()
                    try:
                        # Read in a task of its own: the client's cancel and the idle timeout cancel only
                        # the wait; the read ends with the call (see _drain and router/background.py).
                        self._read = self.router.background.spawn(anext(messages, None))
                        msg = await asyncio.shield(self._read)
                    finally:
                        self._disarm()
                    if msg is None:
                        break
                    kind = msg.WhichOneof("response")
                    if kind == "chunk":
                        index = msg.chunk.index
                    elif kind == "complete":
                        index = msg.complete.index
                    else:
                        continue
                    if index >= plan.n:
                        log.warning("worker sent an index out of range", index=index, n=plan.n)
                        continue
                    s = self.seqs[index]
                    resp = await (
                        self._on_chunk(s, msg.chunk) if kind == "chunk" else self._on_complete(s, msg.complete)
                    )
                    if resp is None:
                        continue
                    if self.first_response_at is None:
                        self.first_response_at = time.monotonic()
                    yield resp
                    if all(s.finished for s in self.seqs):
                        return
        except TimeoutError:
            timeout = self.router.options.stream_timeout
            raise _Interrupted(
                self.interrupt_reason
                or f"worker group {self.group.index} sent nothing for {timeout:g} s (--stream-timeout)"
            ) from None
        finally:
            self._idle = None
        if not all(s.finished for s in self.seqs):
            raise _WorkerStreamEnded("the worker ended the stream before every sequence finished")

    async def _drain(self, call, abort_again: bool) -> None:
        """Read an abandoned worker call to its end (one step or two after the worker's Abort). A server
        stream that its server ends leaves nothing behind; one the client cancels leaves ~0.1-0.6 kB of
        native heap in the worker and ~0.1-0.2 kB here, for good (grpc/grpc#43360;
        `benchmarks/grpc_cancel_leak.py 20000 stream_stopped stream_call_cancel`). An Abort can reach the
        worker before its Generate call has started (it then finds nothing), so a call still open
        ABORT_AGAIN_S later is aborted again, and one still open after ABANDONED_CALL_GRACE_S cancelled."""
        loop = asyncio.get_running_loop()
        cancel_late = loop.call_later(ABANDONED_CALL_GRACE_S, call.cancel)
        again = loop.call_later(ABORT_AGAIN_S, self.router.pool.abort, self.group, self.engine_id,
                                "cancelled") if abort_again else None
        try:
            if self._read is not None and await self._read is None:
                return
            if self._messages is not None:
                while await anext(self._messages, None) is not None:
                    pass
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            cancel_late.cancel()
            if again is not None:
                again.cancel()


class _WorkerStreamEnded(Exception):
    pass


# ---- the servicer --------------------------------------------------------------------------------


class RouterServicer:
    """Implements llmserve.v1.Router (registered through `handlers()`, see llmserve/grpc_wire.py)."""

    def __init__(self, options: RouterOptions, health_servicer: ServiceHealth | None = None,
                 metrics: RouterMetrics | None = None):
        self.options = options
        self.health = health_servicer
        self.metrics = metrics
        self.tok_channel = options.internal_security.aio_channel(options.tokenizer, CHANNEL_OPTIONS)
        self.tok_stub = tpb_grpc.TokenizerStub(self.tok_channel)
        self.tok_health = health_pb2_grpc.HealthStub(self.tok_channel)
        self.tok_info: tpb.GetInfoResponse | None = None
        # The tokenizer, here, for --detokenize router; None until fetched or when the service has
        # no GetTokenizerJson (then detokenization falls back to the service).
        self.vocab: LocalVocabulary | None = None
        self._local_detok = options.detokenize == "router"
        self.tok_healthy = False
        self.tok_reason = "not probed yet"
        self.pool = WorkerPool(
            options.workers,
            PoolOptions(
                policy=options.policy,
                probe_interval=options.probe_interval,
                health_every=options.health_every,
                probe_timeout=options.probe_timeout,
                prefix_tokens=options.prefix_tokens,
                worker_stream=options.worker_stream,
            ),
            on_change=self._update_health,
            security=options.internal_security,
        )
        self._task: asyncio.Task | None = None
        self._serving: bool | None = None
        self.admission = Admission(options.max_concurrent_requests, options.max_requests_per_client)
        self.runs: set[_Run] = set()  # attempts streaming from a worker now
        self.background = BackgroundCalls()  # calls and reads left to finish by cancelled requests
        self.stopping = False
        if metrics is not None:
            metrics.running.set_function(lambda: len(self.runs))

    def interrupt_all(self, reason: str) -> None:
        for run in list(self.runs):
            run.interrupt(reason)

    # ---- readiness -------------------------------------------------------------------------------

    def start(self) -> None:
        self.pool.start()
        self._task = asyncio.ensure_future(self._tokenizer_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.pool.close()
        await self.background.wait(self.options.probe_timeout)
        await self.tok_channel.close()

    async def _tokenizer_loop(self) -> None:
        while True:
            await self.probe_tokenizer()
            await asyncio.sleep(self.options.probe_interval)

    async def probe_tokenizer(self) -> None:
        timeout = self.options.probe_timeout
        try:
            # Back after being down or not serving: it may be another deployment, so read it again.
            reconnect = not self.tok_healthy and self.tok_info is not None
            if self.tok_info is None or reconnect:
                info = await self.tok_stub.GetInfo(tpb.GetInfoRequest(), timeout=timeout)
                if self.tok_info is not None and info != self.tok_info:
                    log.warning("the tokenizer service is back with other facts", vocab_size=info.vocab_size)
                self.tok_info = info
            if self._local_detok and (self.vocab is None or reconnect):
                await self._fetch_tokenizer(timeout)
            resp = await self.tok_health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            ok, reason = resp.status == _SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.aio.AioRpcError as exc:
            ok, reason = False, f"{exc.code().name}: {exc.details()}"
        if ok != self.tok_healthy:
            (log.info if ok else log.warning)(
                "tokenizer service " + ("serving" if ok else "not serving"),
                address=self.options.tokenizer,
                reason=reason,
            )
        self.tok_healthy, self.tok_reason = ok, reason
        self._update_health()

    async def _fetch_tokenizer(self, timeout: float) -> None:
        try:
            resp = await self.tok_stub.GetTokenizerJson(tpb.GetTokenizerJsonRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._local_detok, self.vocab = False, None
            log.warning("the tokenizer service has no GetTokenizerJson: detokenizing there, one call per request",
                        address=self.options.tokenizer)
            return
        if self.vocab is not None and resp.sha256 == self.vocab.sha256:
            return  # the same tokenizer
        try:
            vocab = await asyncio.to_thread(LocalVocabulary.from_response, resp)
        except Exception as exc:  # a tokenizer.json this `tokenizers` cannot read: the service can
            self._local_detok, self.vocab = False, None
            log.error("cannot load the tokenizer service's tokenizer here: detokenizing there", error=str(exc))
            return
        if self.vocab is not None:  # requests under way keep the one they started with
            log.warning("the tokenizer service is back with another tokenizer", tokenizer_sha256=resp.sha256)
        self.vocab = vocab
        log.info("detokenizing in the router", tokenizer_sha256=resp.sha256, vocab_size=resp.vocab_size)

    def detokenizer(self, plan: _Plan) -> Detokenizer:
        if self.vocab is not None:
            return LocalDetokenizer(self.vocab, plan.skip_special_tokens)
        return StreamDetokenizer(
            self.tok_stub, self.background, plan.request_id, plan.skip_special_tokens,
            timeout=plan.remaining(), close_timeout=self.options.tokenizer_timeout,
        )

    def facts(self) -> ModelFacts | None:
        info = self.pool.model_info()
        limit = self.pool.context_limit()
        if info is None or limit is None or self.tok_info is None:
            return None
        return ModelFacts(
            name=self.options.served_model_name or info.served_model_name or Path(info.model_path).name or "default",
            vocab_size=info.vocab_size or self.tok_info.vocab_size,
            context_limit=limit,
            eos_token_ids=tuple(info.eos_token_ids) or tuple(self.tok_info.eos_token_ids),
        )

    def ready(self) -> tuple[bool, str]:
        if self.tok_info is None or not self.tok_healthy:
            return False, f"tokenizer service {self.options.tokenizer} not serving ({self.tok_reason})"
        if self._local_detok and self.vocab is None:
            return False, f"the tokenizer of {self.options.tokenizer} not fetched yet (--detokenize router)"
        if self.facts() is None:
            return False, "no worker group has answered GetModelInfo yet"
        if not self.pool.num_serving:
            return False, "no healthy worker group"
        return True, "ok"

    def _update_health(self) -> None:
        ok, reason = self.ready()
        if ok == self._serving or self.health is None:
            return
        self._serving = ok
        (log.info if ok else log.warning)("router " + ("serving" if ok else "not serving"), reason=reason)
        asyncio.ensure_future(self.health.set_serving(ok))

    def _require_facts(self) -> ModelFacts:
        facts = self.facts()
        if facts is None:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"router not ready: {self.ready()[1]}")
        return facts

    # ---- tokenizer calls -------------------------------------------------------------------------

    async def _encode(
        self, req: tpb.EncodeRequest, request_id: str, context, field_prefix: str | None = None
    ) -> tpb.EncodeResponse:
        timeout = call_timeout(context, self.options.tokenizer_timeout)
        try:
            return await self.background.shielded(
                self.tok_stub.Encode(req, timeout=timeout, metadata=((REQUEST_ID_HEADER, request_id),))
            )
        except grpc.aio.AioRpcError as exc:
            raise self._tokenizer_error(exc, field_prefix) from None

    @staticmethod
    def _tokenizer_error(exc: grpc.aio.AioRpcError, field_prefix: str | None) -> RouterError:
        """Map a tokenizer-service error; `field_prefix` renames its "chat." fields (Chat's are
        top-level `messages`)."""
        code, details = exc.code(), exc.details() or ""
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            if field_prefix is not None and details.startswith("chat."):
                details = field_prefix + details.removeprefix("chat.")
            return RouterError(code, details)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RouterError(code, "deadline exceeded while tokenizing")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # e.g. over the message size: not retryable
            prompt_field = "messages" if field_prefix == "" else "text"
            return RouterError(code, f"{prompt_field}: too large for the tokenizer service ({details})", prompt_field)
        return RouterError(grpc.StatusCode.UNAVAILABLE, f"tokenizer service: {code.name}: {details}")

    # ---- request planning ------------------------------------------------------------------------

    def _request_id(self, body_id: str, context) -> str:
        """The client's label for the call (validated: it goes into metadata and log lines)."""
        limits = self.options.limits
        validate_request_id(body_id, limits)
        header_id = metadata_value(context, REQUEST_ID_HEADER)
        validate_request_id(header_id, limits, REQUEST_ID_HEADER)
        return body_id or header_id or uuid.uuid4().hex

    def _plan(
        self, request_id: str, prompt_ids: list[int], sp: pb.SamplingParams, facts: ModelFacts, context, received: float
    ) -> _Plan:
        wsp = spb.SamplingParams(
            temperature=sp.temperature if sp.HasField("temperature") else 1.0,
            top_p=sp.top_p or 1.0,
            top_k=sp.top_k if sp.top_k > 0 else -1,
            min_p=sp.min_p,
            frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty,
            repetition_penalty=sp.repetition_penalty or 1.0,
            stop_token_ids=sp.stop_token_ids,
            skip_special_tokens=sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True,
            n=sp.n if sp.HasField("n") else 1,
            min_new_tokens=sp.min_new_tokens,
            ignore_eos=sp.ignore_eos,
            no_stop_trim=sp.include_stop_str_in_output,
        )
        if sp.HasField("max_new_tokens"):
            wsp.max_new_tokens = sp.max_new_tokens
        if sp.HasField("seed"):
            wsp.custom_params.CopyFrom(struct_pb2.Struct())
            wsp.custom_params.update({"seed": sp.seed & _SEED_MASK})
        want_logprobs = sp.logprobs or sp.top_logprobs > 0
        # The prompt text stays here: the worker needs only the ids (and would log it in tracebacks).
        worker_request = spb.GenerateRequest(
            tokenized=spb.TokenizedInput(input_ids=prompt_ids),
            sampling_params=wsp,
            return_logprob=want_logprobs,
            top_logprobs_num=sp.top_logprobs,
            stream=True,
        )
        stop_ids = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop_ids.update(facts.eos_token_ids)
        return _Plan(
            request_id=request_id,
            prompt_ids=prompt_ids,
            worker_request=worker_request,
            n=sp.n if sp.HasField("n") else 1,
            max_new_tokens=sp.max_new_tokens if sp.HasField("max_new_tokens") else None,
            min_new_tokens=sp.min_new_tokens,
            stops=tuple(sp.stop),
            include_stop=sp.include_stop_str_in_output,
            skip_special_tokens=wsp.skip_special_tokens,
            stop_ids=frozenset(stop_ids),
            logprobs=want_logprobs,
            top_logprobs=sp.top_logprobs,
            context=context,
            received=received,
        )

    def _check_limits(self, model: str, sp: pb.SamplingParams) -> None:
        limits = self.options.limits
        validate_model_name(model, limits)
        check_sampling_limits(sp.n, sp.stop, sp.stop_token_ids, limits)

    async def _plan_generate(self, request: pb.GenerateRequest, request_id: str, context, received: float) -> _Plan:
        sp = request.sampling_params
        self._check_limits(request.model, sp)
        facts = self._require_facts()
        validate_model(request.model, facts)
        which = request.WhichOneof("prompt")
        if which is None:
            raise invalid("prompt", "set `text` or `token_ids`")
        validate_sampling(sp, facts)
        if which == "text":
            if not request.text:
                raise invalid("text", "the prompt must not be empty")
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            enc = await self._encode(
                tpb.EncodeRequest(text=request.text, add_special_tokens=add_special), request_id, context
            )
            ids, text = list(enc.token_ids), request.text
            if not ids:
                raise invalid("text", "the prompt encodes to no tokens")
            field_name = "text"
        else:
            ids, text = list(request.token_ids.ids), ""
            if not ids:
                raise invalid("token_ids.ids", "the prompt must not be empty")
            validate_token_ids(ids, facts, "token_ids.ids")
            field_name = "token_ids"
        check_fits(len(ids), sp, facts, field_name)
        if self.options.log_prompts:
            log.info("prompt", text=text, token_ids=ids if not text else None)
        return self._plan(request_id, ids, sp, facts, context, received)

    async def _plan_chat(self, request: pb.ChatRequest, request_id: str, context, received: float) -> _Plan:
        sp = request.sampling_params
        self._check_limits(request.model, sp)
        check_messages(len(request.messages), self.options.limits)
        facts = self._require_facts()
        validate_model(request.model, facts)
        if not request.messages:
            raise invalid("messages", "the conversation must not be empty")
        for i, m in enumerate(request.messages):
            if not m.role:
                raise invalid(f"messages[{i}].role", "must not be empty")
        validate_sampling(sp, facts)
        if self.tok_info is not None and not self.tok_info.has_chat_template:
            raise RouterError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "messages: this model's tokenizer has no chat template (use Generate)",
                "messages",
            )
        add_gen = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        conv = tpb.Conversation(messages=request.messages, add_generation_prompt=add_gen)
        enc = await self._encode(tpb.EncodeRequest(chat=conv), request_id, context, field_prefix="")
        ids = list(enc.token_ids)
        if not ids:
            raise invalid("messages", "the conversation renders to no tokens")
        check_fits(len(ids), sp, facts, "messages")
        if self.options.log_prompts:
            log.info("prompt", text=enc.prompt_text)
        return self._plan(request_id, ids, sp, facts, context, received)

    # ---- streaming -------------------------------------------------------------------------------

    async def _stream(self, plan: _Plan) -> AsyncIterator[pb.GenerateResponse]:
        tried: set[int] = set()
        failures: list[str] = []
        while True:
            try:
                group = self.pool.pick(plan.prompt_ids, tried)
            except NoHealthyGroup as exc:
                detail = f"; this request failed on: {' | '.join(failures)}" if failures else ""
                raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{exc}{detail}") from None
            tried.add(group.index)
            log.info(
                "generate routed", group=group.index, prompt_tokens=len(plan.prompt_ids), n=plan.n, attempt=len(tried)
            )
            run = _Run(self, group, plan)
            finishes: list[pb.Finish] = []
            try:
                async for resp in run.stream():
                    if resp.HasField("finish"):
                        finishes.append(resp.finish)
                    yield resp
            except _RetryElsewhere as exc:
                failures.append(str(exc))
                log.warning("worker group failed before the first token; retrying elsewhere", error=str(exc))
                if self.metrics is not None:
                    self.metrics.retries.inc()
                continue
            first = run.first_response_at
            now = time.monotonic()
            log.info(
                "generate finished",
                group=group.index,
                finish_reasons=[f.reason for f in finishes],
                completion_tokens=sum(f.usage.completion_tokens for f in finishes),
                duration_s=round(now - plan.received, 4),
                ttft_s=round(first - plan.received, 4) if first else None,
            )
            if self.metrics is not None:
                self._observe(plan, finishes, first, now)
            return

    def _observe(self, plan: _Plan, finishes: list[pb.Finish], first: float | None, now: float) -> None:
        """A finished Generate/Chat call: tokens and finish reasons per sequence (from usage), its
        latencies once (TPOT over its longest sequence)."""
        assert self.metrics is not None
        requests = self.metrics.requests
        for f in finishes:
            requests.success.labels(f.reason or "stop").inc()
            requests.prompt_tokens.inc(f.usage.prompt_tokens)
            requests.generation_tokens.inc(f.usage.completion_tokens)
            requests.cached_prompt_tokens.inc(f.usage.cached_tokens)
        longest = max((f.usage.completion_tokens for f in finishes), default=0)
        requests.e2e.observe(now - plan.received)
        if first is not None:
            requests.ttft.observe(first - plan.received)
            if longest >= 2:
                requests.tpot.observe((now - first) / (longest - 1))

    def _identity(self, context) -> str:
        # Set by the auth interceptor (llmserve/security.py) from the client's token; None without auth.
        return current_identity() or ANONYMOUS

    @staticmethod
    async def _end_with(context, exc: RouterError) -> None:
        """End the call with the error's status. Past the client's deadline grpc has closed the call (the
        client has its own DEADLINE_EXCEEDED): a status sent then fails and leaks its batch (see
        DEADLINE_MARGIN_S), so the handler just ends."""
        if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and context.time_remaining() == 0:
            log.info("deadline passed", error=exc.message)
            raise asyncio.CancelledError
        log.info("rejected", code=exc.code.name, error=exc.message)
        await context.abort(exc.code, exc.message)

    async def _serve_stream(self, planner, request, context, rpc: str) -> AsyncIterator[pb.GenerateResponse]:
        received = time.monotonic()
        if isinstance(request, InvalidRequest):
            log.info("rejected", rpc=rpc, code="INVALID_ARGUMENT", error=request.message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            request_id = self._request_id(request.request_id, context)
        except RouterError as exc:
            log.info("rejected", rpc=rpc, code=exc.code.name, error=exc.message)
            await context.abort(exc.code, exc.message)
        with request_context(request_id, rpc=rpc):
            try:
                with self.admission.admit(self._identity(context)):
                    plan = await planner(request, request_id, context, received)
                    async for resp in self._stream(plan):
                        yield resp
            except RouterError as exc:
                await self._end_with(context, exc)
            except asyncio.CancelledError:
                log.info("cancelled by the client or its deadline")
                raise

    # grpc.aio tells streaming handlers by inspect.isasyncgenfunction: these must yield themselves.
    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        async for resp in self._serve_stream(self._plan_generate, request, context, "Generate"):
            yield resp

    async def Chat(self, request, context) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        async for resp in self._serve_stream(self._plan_chat, request, context, "Chat"):
            yield resp

    # ---- unary RPCs ------------------------------------------------------------------------------

    async def _unary(self, request, context, rpc: str, body):
        if isinstance(request, InvalidRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            request_id = self._request_id("", context)
        except RouterError as exc:
            await context.abort(exc.code, exc.message)
        with request_context(request_id, rpc=rpc):
            try:
                validate_model_name(getattr(request, "model", ""), self.options.limits)
                with self.admission.admit(self._identity(context)):
                    return await body(request, request_id)
            except RouterError as exc:
                await self._end_with(context, exc)

    async def Tokenize(self, request, context):  # noqa: N802
        async def body(request: pb.TokenizeRequest, request_id: str) -> pb.TokenizeResponse:
            facts = self._require_facts()
            validate_model(request.model, facts)
            which = request.WhichOneof("input")
            if which == "text":
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                enc = await self._encode(
                    tpb.EncodeRequest(text=request.text, add_special_tokens=add_special), request_id, context
                )
            elif which == "chat":
                enc = await self._encode(tpb.EncodeRequest(chat=request.chat), request_id, context)
            else:
                raise invalid("input", "set `text` or `chat`")
            return pb.TokenizeResponse(token_ids=enc.token_ids, prompt_text=enc.prompt_text)

        return await self._unary(request, context, "Tokenize", body)

    async def Detokenize(self, request, context):  # noqa: N802
        async def body(request: pb.DetokenizeRequest, request_id: str) -> pb.DetokenizeResponse:
            facts = self._require_facts()
            validate_model(request.model, facts)
            validate_token_ids(request.token_ids, facts, "token_ids")
            if self.vocab is not None:  # --detokenize router: no hop to the tokenizer service
                return pb.DetokenizeResponse(text=await self._decode_here(request))
            try:
                resp = await self.background.shielded(self.tok_stub.Decode(
                    tpb.DecodeRequest(token_ids=request.token_ids, skip_special_tokens=request.skip_special_tokens),
                    timeout=self.options.tokenizer_timeout,
                    metadata=((REQUEST_ID_HEADER, request_id),),
                ))
            except grpc.aio.AioRpcError as exc:
                raise self._tokenizer_error(exc, None) from None
            return pb.DetokenizeResponse(text=resp.text)

        return await self._unary(request, context, "Detokenize", body)

    async def _decode_here(self, request: pb.DetokenizeRequest) -> str:
        vocab = self.vocab
        assert vocab is not None
        ids = request.token_ids
        problem = vocab.out_of_range(ids)
        if problem is not None:
            raise invalid("token_ids", problem)
        if len(ids) <= _INLINE_DECODE_IDS:
            return vocab.decode(ids, request.skip_special_tokens)
        # A long one off the event loop, so it does not stall every stream this router relays.
        return await asyncio.to_thread(vocab.decode, ids, request.skip_special_tokens)

    async def GetModelInfo(self, request, context):  # noqa: N802
        async def body(request: pb.GetModelInfoRequest, request_id: str) -> pb.GetModelInfoResponse:
            facts = self._require_facts()
            validate_model(request.model, facts)
            tok = self.tok_info
            assert tok is not None  # _require_facts: the tokenizer answered GetInfo
            resp = pb.GetModelInfoResponse(
                model=facts.name,
                vocab_size=facts.vocab_size,
                context_length=facts.context_limit,
                eos_token_ids=facts.eos_token_ids,
                has_chat_template=tok.has_chat_template,
                num_worker_groups=len(self.pool.groups),
            )
            if tok.HasField("bos_token_id"):
                resp.bos_token_id = tok.bos_token_id
            return resp

        return await self._unary(request, context, "GetModelInfo", body)

    async def ListWorkers(self, request, context):  # noqa: N802
        async def body(request: pb.ListWorkersRequest, request_id: str) -> pb.ListWorkersResponse:
            return pb.ListWorkersResponse(groups=[g.to_proto() for g in self.pool.groups])

        return await self._unary(request, context, "ListWorkers", body)

    # ---- registration ----------------------------------------------------------------------------

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """Method handlers whose deserializers turn unparseable requests (e.g. invalid UTF-8 in a
        string field) into INVALID_ARGUMENT instead of grpcio's UNKNOWN (llmserve/grpc_wire.py)."""

        def stream(fn, req, resp):
            return grpc.unary_stream_rpc_method_handler(
                fn, request_deserializer=tolerant(req), response_serializer=resp.SerializeToString
            )

        def unary(fn, req, resp):
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=tolerant(req), response_serializer=resp.SerializeToString
            )

        return {
            "Generate": stream(self.Generate, pb.GenerateRequest, pb.GenerateResponse),
            "Chat": stream(self.Chat, pb.ChatRequest, pb.GenerateResponse),
            "Tokenize": unary(self.Tokenize, pb.TokenizeRequest, pb.TokenizeResponse),
            "Detokenize": unary(self.Detokenize, pb.DetokenizeRequest, pb.DetokenizeResponse),
            "GetModelInfo": unary(self.GetModelInfo, pb.GetModelInfoRequest, pb.GetModelInfoResponse),
            "ListWorkers": unary(self.ListWorkers, pb.ListWorkersRequest, pb.ListWorkersResponse),
        }


# ---- server lifecycle ----------------------------------------------------------------------------


# After the grace period, how long the aborted streams get to send their final messages.
_FINAL_MESSAGES_S = 1.0


def _backstop_rpcs(options: RouterOptions) -> int | None:
    """grpc's own cap, far above admission control's (whose refusals say which limit was hit):
    it bounds what the process holds if calls arrive faster than the servicer refuses them."""
    if not options.max_concurrent_requests:
        return None
    return 4 * options.max_concurrent_requests + 64


@dataclass
class RunningRouter:
    server: grpc.aio.Server
    port: int
    servicer: RouterServicer
    health: ServiceHealth

    async def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING, refuse new calls, let in-flight ones finish for `grace` seconds; streams still
        running then end with finish reason "abort" (and are aborted on the workers), a moment later
        anything left is cancelled; close the channels. A second call does nothing."""
        if self.servicer.stopping:
            return
        self.servicer.stopping = True
        await self.health.enter_graceful_shutdown()
        grace = 0.0 if grace is None else grace
        stopped = asyncio.ensure_future(self.server.stop(grace + _FINAL_MESSAGES_S))
        deadline = time.monotonic() + grace
        while self.servicer.admission.in_progress and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.servicer.runs:
            log.info("router shutdown: aborting streams still running", streams=len(self.servicer.runs))
            self.servicer.interrupt_all("the router is shutting down")
        await stopped
        await self.servicer.close()
        if self.servicer.metrics is not None:
            self.servicer.metrics.stop_serving()


# With client tokens on, only health stays open (reflection too needs a token); ListWorkers shows
# internal addresses, so it needs a token with the admin role.
_OPEN_METHODS = HEALTH_METHODS
_ADMIN_METHODS = frozenset({f"/{SERVICE_NAME}/ListWorkers"})


async def start_router(
    options: RouterOptions, host: str = "127.0.0.1", port: int = 0, security: ServerSecurity = ServerSecurity(),
    metrics: RouterMetrics | None = None,
) -> RunningRouter:
    """`security`: TLS of the public port and the client tokens it accepts (llmserve/security.py).
    `metrics`: the router's metric set (llmserve/metrics.py), served until `stop`; None: no metrics."""
    counting = [metrics.grpc.interceptor()] if metrics is not None else []
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),  # a second router on the same port fails instead of sharing it
            *message_size_options(),  # the same bound on every service and channel
        ],
        maximum_concurrent_rpcs=_backstop_rpcs(options),
        interceptors=[*counting, *security.interceptors(_OPEN_METHODS, _ADMIN_METHODS, realm="router")],
    )
    health_servicer = ServiceHealth(SERVICE_NAME)
    await health_servicer.set_serving(False)
    servicer = RouterServicer(options, health_servicer, metrics)
    add_service(server, SERVICE_NAME, servicer.handlers())
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME), server)
    bound = listen(server, host, port, security.tls)
    if metrics is not None:
        metrics.serve()
    await server.start()
    servicer.start()
    return RunningRouter(server, bound, servicer, health_servicer)


async def _serve(
    options: RouterOptions, host: str, port: int, port_file: str | None, grace: float, security: ServerSecurity,
    metrics: RouterMetrics | None,
) -> int:
    running = await start_router(options, host, port, security, metrics)
    internal = options.internal_security
    log.info(
        "router listening",
        address=grpc_address(host, running.port),
        tokenizer=options.tokenizer,
        workers=list(options.workers),
        policy=options.policy,
        tls=security.tls is not None,
        mtls=security.tls is not None and security.tls.mutual,
        auth=security.tokens is not None,
        internal_tls=internal.tls is not None,
        internal_token=internal.token is not None,
    )
    if port_file:
        write_port_file(port_file, running.port)
    await stop_signal_event().wait()
    log.info("router stopping", grace_s=grace)
    await running.stop(grace)
    return 0


def serve(
    options: RouterOptions,
    host: str = "127.0.0.1",
    port: int = 0,
    port_file: str | None = None,
    grace: float = 5.0,
    security: ServerSecurity = ServerSecurity(),
    metrics: RouterMetrics | None = None,
) -> int:
    """Serve until SIGINT or SIGTERM, then stop gracefully and return 0."""
    return asyncio.run(_serve(options, host, port, port_file, grace, security, metrics))
