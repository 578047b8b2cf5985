"""The model worker's ``sglang.grpc.scheduler.SglangScheduler`` servicer (the server around it, with
grpc.health.v1: worker_svc/server/app.py).

A thin servicer on grpc.aio. Each Generate call converts its request (convert.py), submits one
engine request per sample to the :class:`~worker_svc.engine.engine_loop.EngineLoop` and relays the step
outputs that the engine thread pushes onto the call's asyncio queue. ``generate`` is that call apart
from its transport: SglangScheduler.Generate runs it for one gRPC call, and the router's WorkerStream
(worker_stream.py) for each of the calls it carries. When the call ends for any
reason (client cancel, deadline, the consumer going away, an error) every engine request it still
has in flight is aborted, so KV slots are freed.

Engine request ids are the worker's own, one per sample per call; a caller's request_id is only a
label that Abort goes by (worker_svc/server/calls.py). Requests that do not parse (invalid UTF-8 in a
string field, garbage) are INVALID_ARGUMENT naming the field (llmserve/grpc_wire.py).

Status codes: INVALID_ARGUMENT for parameters that can never be served or a message that does not
parse (the message starts with the field's name), RESOURCE_EXHAUSTED for a prompt that can never fit
or a full waiting queue (``max_queued_requests``), UNAVAILABLE when the engine is stopping, has
failed or has made no progress within ``step_stall_timeout_s``, INTERNAL when a request's forward
step failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib.metadata
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import grpc
import structlog
from google.protobuf import message_factory
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from llmserve.grpc_server import CLIENT_REQUEST_ID_HEADER, REQUEST_ID_HEADER, metadata_value
from llmserve.grpc_wire import InvalidRequest, tolerant
from worker_svc.engine.engine_loop import EngineLoop, EngineUnavailable, LoopState
from worker_svc.engine.request import RequestError, StepOutput
from worker_svc.sampling import SamplingParams
from worker_svc.server import convert as grpc_convert
from worker_svc.server.calls import CallRegistry
from worker_svc.server.kv_events import CursorOutOfRange, KvEventPublisher, KvEventsOptions, SubscriberDropped

log = structlog.get_logger(__name__)

_SERVICE = pb.DESCRIPTOR.services_by_name["SglangScheduler"]
SERVICE_NAME = _SERVICE.full_name
_GIB = float(1 << 30)
_DEADLINE_SLACK_S = 0.25


def _version() -> str:
    try:
        return f"llmserve-{importlib.metadata.version('llmserve')}"
    except importlib.metadata.PackageNotFoundError:
        return "llmserve-unknown"


VERSION = _version()


@dataclass(frozen=True)
class WorkerOptions:
    served_model_name: str = ""
    # GetModelInfo's model_path/tokenizer_path. Empty by default: a gateway that gets a path it
    # cannot open on its own host tries to fetch it from a model hub (DESIGN.md section 2).
    advertised_model_path: str = ""
    health_probe_timeout_s: float = 20.0
    # With work pending, no completed step for this long (a step that runs on, or an engine thread
    # stuck outside a step) makes the worker unhealthy (--step-stall-timeout).
    step_stall_timeout_s: float = 120.0
    # At most this many engine requests (samples) wait beyond the running slots
    # (max_running_requests); a Generate that would exceed it is RESOURCE_EXHAUSTED at once
    # (--max-queued-requests).
    max_queued_requests: int = 1024
    kv_events: KvEventsOptions = KvEventsOptions()  # SubscribeKvEvents (worker_svc/server/kv_events.py)
    # Serve llmserve.v1.WorkerStream beside SglangScheduler (worker_svc/server/worker_stream.py), and say
    # so in GetServerInfo; off (--disable-worker-stream): the router makes one Generate call per request.
    worker_stream: bool = True


class GenerateRefused(Exception):
    """How a Generate call fails: the status its caller gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class CallSide(Protocol):
    """What a Generate call needs from the transport carrying it."""

    def end_reason(self) -> str:
        """Why the call ended before its samples did (logged with the aborted engine requests)."""
        ...

    def on_done(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the transport's call is over, however it ended."""
        ...


class _RpcSide:
    """A SglangScheduler.Generate call's side: its gRPC context."""

    def __init__(self, servicer: SchedulerServicer, context: grpc.aio.ServicerContext) -> None:
        self._servicer = servicer
        self._context = context

    def end_reason(self) -> str:
        return self._servicer.end_reason(self._context.time_remaining())

    def on_done(self, fn: Callable[[], None]) -> None:
        # grpc-stubs type the callback as a class no function matches (its ServicerContext is generic).
        self._context.add_done_callback(lambda _: fn())  # type: ignore[arg-type]


def _sink(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, tag: Any) -> Callable[[Any], None]:
    """A sink for the engine thread: hands (tag, item) to ``queue`` on the server's event loop."""

    def put(item: Any) -> None:
        try:  # noqa: SIM105 - per token: cheaper than contextlib.suppress
            loop.call_soon_threadsafe(queue.put_nowait, (tag, item))
        except RuntimeError:  # the event loop is closed: the call is long gone
            pass

    return put


def _refuse_invalid_unary(fn: Callable) -> Callable:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, InvalidRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await fn(request, context)

    return handle


def _refuse_invalid_stream(fn: Callable) -> Callable:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, InvalidRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        result = fn(request, context)
        if not hasattr(result, "__aiter__"):  # a coroutine that only aborts (an unsupported method)
            await result
            return
        async with contextlib.aclosing(result) as responses:
            async for response in responses:
                yield response

    return handle


class SchedulerServicer(pb_grpc.SglangSchedulerServicer):
    def __init__(self, loop: EngineLoop, options: WorkerOptions) -> None:
        self.loop = loop
        self.options = options
        self.engine = loop.engine
        self.runner = loop.engine.runner
        self.model_config = self.runner.model_config
        self.max_seq_len = min(self.runner.context_len, self.runner.kv.allocator.size)
        self.start_time = time.time()
        self._start_mono = time.monotonic()
        self.last_receive_time = 0.0
        self.calls = CallRegistry()  # Generate calls in flight, by the ids their callers gave them
        self._probe: asyncio.Future | None = None
        self._tokenizer_bundle: tuple[bytes, str] | None = None
        # KV events exist only with the radix cache (there is nothing to announce without it).
        self.kv_events = KvEventPublisher(loop, options.kv_events) if self.engine.scheduler.cache is not None else None

    # ---- health ----------------------------------------------------------------------------------

    def liveness(self) -> tuple[bool, str]:
        """Cheap check: the engine thread runs and no step is stuck."""
        loop = self.loop
        if not loop.healthy:
            detail = f": {loop.error!r}" if loop.error is not None else ""
            return False, f"engine loop is {loop.state.value}{detail}"
        stalled, limit = loop.stalled_for(), self.options.step_stall_timeout_s
        if stalled is not None and stalled > limit:
            where = "in a step" if loop.step_started_at is not None else "outside a step"
            return False, (f"engine made no progress for {stalled:.1f}s with work pending (stuck {where}; "
                           f"--step-stall-timeout {limit:g})")
        return True, "ok"

    async def check_health(self) -> tuple[bool, str]:
        """Liveness, then (when idle) a one-token generation through the whole engine."""
        ok, message = self.liveness()
        if not ok:
            return ok, message
        if self.loop.busy():  # and, per liveness, making progress
            return True, "ok (busy)"
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._run_probe())
        return await asyncio.shield(self._probe)

    async def _run_probe(self) -> tuple[bool, str]:
        aio_loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rid = self.calls.mint("health-probe")
        token = self.model_config.bos_token_id or 0
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            self.loop.submit([token], params, rid, _sink(aio_loop, queue, None), observe=False)  # not traffic
        except (EngineUnavailable, RequestError) as exc:
            return False, f"health probe not accepted: {exc}"
        deadline = aio_loop.time() + self.options.health_probe_timeout_s
        try:
            while True:
                _, item = await asyncio.wait_for(queue.get(), max(0.0, deadline - aio_loop.time()))
                if isinstance(item, EngineUnavailable):
                    return False, str(item)
                if item.finished:
                    if item.error:
                        return False, f"health probe failed: {item.error}"
                    return True, "ok"
        except asyncio.TimeoutError:
            self.loop.abort(rid)
            return False, f"health probe got no token within {self.options.health_probe_timeout_s:.0f}s"

    async def HealthCheck(self, request, context):  # noqa: N802
        healthy, message = await self.check_health()
        if not healthy:
            log.warning("health check failed", reason=message)
        return pb.HealthCheckResponse(healthy=healthy, message=message)

    # ---- generate --------------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        side = _RpcSide(self, context)
        try:
            async for response in self.generate(request, metadata_value(context, REQUEST_ID_HEADER),
                                                metadata_value(context, CLIENT_REQUEST_ID_HEADER), side):
                yield response
        except GenerateRefused as exc:
            await context.abort(exc.code, exc.message)

    async def generate(self, request: pb.GenerateRequest, header_id: str, client_id: str,
                       side: CallSide) -> AsyncIterator[pb.GenerateResponse]:
        """One Generate call, whatever carries it (a SglangScheduler call, or one call of a WorkerStream:
        worker_svc/server/worker_stream.py). Yields its responses; raises GenerateRefused for the status
        it fails with. Run it in a task of its own (it binds the call's ids to the task's log context)."""
        request_id = request.request_id or header_id or f"gen-{uuid.uuid4().hex}"
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        if header_id and header_id != request_id:
            structlog.contextvars.bind_contextvars(x_request_id=header_id)
        if client_id:  # the router's label for the client's call
            structlog.contextvars.bind_contextvars(client_request_id=client_id[:256])
        self.last_receive_time = time.time()
        received = time.monotonic()
        log.debug(  # the message itself: a renderer formats it only when debug lines are kept
            "generate request",
            sampling_params=request.sampling_params,
            return_logprob=request.return_logprob,
            top_logprobs_num=request.top_logprobs_num,
            stream=request.stream,
        )

        ok, reason = self.liveness()
        if not ok or self.loop.state is not LoopState.RUNNING:
            why = reason if not ok else "shutting down"
            raise GenerateRefused(grpc.StatusCode.UNAVAILABLE, f"worker is not serving: {why}")
        try:
            spec = grpc_convert.generate_spec(
                request, max_seq_len=self.max_seq_len, max_n=self.engine.config.max_running_requests
            )
            self.loop.validate(spec.prompt_ids, spec.params[0])
        except RequestError as exc:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.resource else grpc.StatusCode.INVALID_ARGUMENT
            message = grpc_convert.error_message(exc)
            log.info("request rejected", code=code.name, field=exc.field, error=message)
            raise GenerateRefused(code, message) from None

        refusal = self._queue_refusal(spec.n)
        if refusal is not None:
            log.info("request rejected", code="RESOURCE_EXHAUSTED", field="max_queued_requests", error=refusal)
            raise GenerateRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)

        aio_loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        call = self.calls.open(request_id, spec.n, received)
        ending = "call ended early"  # why samples still running when the call ends are aborted
        try:
            try:
                for state, params in zip(call.states, spec.params, strict=True):
                    self.loop.submit(spec.prompt_ids, params, state.rid, _sink(aio_loop, queue, state.index))
                    call.submitted += 1
            except (RequestError, EngineUnavailable) as exc:
                ending = "not accepted"
                if isinstance(exc, RequestError):
                    code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.resource else grpc.StatusCode.INVALID_ARGUMENT
                    raise GenerateRefused(code, grpc_convert.error_message(exc)) from None
                raise GenerateRefused(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            log.info(
                "generate accepted",
                prompt_tokens=len(spec.prompt_ids),
                n=spec.n,
                stream=spec.stream,
                max_new_tokens=spec.params[0].max_new_tokens,
                temperature=spec.params[0].temperature,
                return_logprob=spec.params[0].return_logprob,
            )
            # Belt and braces: the finally below covers cancellation inside this coroutine; the done
            # callback covers a consumer that stops iterating while we sit at a yield.
            # The callback runs outside this task: it logs with the call's bindings (request ids).
            bindings = contextvars.copy_context()
            side.on_done(lambda: bindings.run(call.end_early, self.loop, side.end_reason()))
            with_logprobs = spec.params[0].return_logprob
            remaining = spec.n
            while remaining:
                index, item = await queue.get()
                if isinstance(item, EngineUnavailable):
                    ending = "engine unavailable"
                    log.error("request failed: engine unavailable", error=str(item))
                    raise GenerateRefused(grpc.StatusCode.UNAVAILABLE, str(item))
                out: StepOutput = item
                state = call.states[index]
                state.add(out)
                if out.finished:
                    call.finished(state, out, self._engine_abort_reason())
                if out.error:
                    ending = f"sample {index} failed"
                    log.error("request failed", index=index, rid=state.rid, error=out.error)
                    raise GenerateRefused(grpc.StatusCode.INTERNAL, out.error)
                if out.new_token_ids and call.first_token_at is None:
                    call.first_token_at = time.monotonic()
                    log.debug("first token", ttft_s=round(call.first_token_at - received, 4))
                if spec.stream and out.new_token_ids:
                    yield grpc_convert.chunk_response(request_id, index, out, with_logprobs)
                if out.finished:
                    remaining -= 1
                    yield grpc_convert.complete_response(request_id, state, with_logprobs)
        except (asyncio.CancelledError, GeneratorExit):
            ending = side.end_reason()
            log.info("generate cancelled", reason=ending)
            raise
        finally:
            call.end_early(self.loop, ending)
            self.calls.close(call)

    def _queue_refusal(self, n: int) -> str | None:
        """Why a call adding ``n`` engine requests would overflow the waiting queue, or None. Calls
        are submitted on this event loop only, so the check and the submits do not interleave."""
        limit = self.options.max_queued_requests
        slots = self.engine.config.max_running_requests
        in_flight = self.loop.in_flight_count()
        if in_flight + n <= slots + limit:
            return None
        return (f"worker queue full: {in_flight} requests in flight for {slots} running slots, and with this "
                f"request's {n} more than {limit} would wait (--max-queued-requests {limit}); retry later or on "
                "another worker")

    def end_reason(self, time_remaining: float | None = None) -> str:
        """Why a call ended before its samples did: the worker stopping, the deadline (``time_remaining``:
        of the call's deadline, if it has one), or the client."""
        if self.loop.state is not LoopState.RUNNING:
            return "worker shutdown"
        # The client's own deadline timer fires a little before the server's copy of the deadline.
        if time_remaining is not None and time_remaining < _DEADLINE_SLACK_S:
            return "deadline"
        return "client cancel"

    def _engine_abort_reason(self) -> str:
        """Why the engine aborted a sample nobody asked it to abort."""
        return "worker shutdown" if self.loop.state is not LoopState.RUNNING else "engine abort"

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:  # noqa: N802
        request_id = request.request_id
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        aborted = self.calls.abort(self.loop, request_id, "abort rpc", request.reason or None)
        log.info("abort", reason=request.reason or None, aborted=aborted)
        if not aborted:
            shown = request_id if len(request_id) <= 64 else request_id[:64] + "..."
            return pb.AbortResponse(success=False, message=f"no request {shown!r} in flight")
        return pb.AbortResponse(success=True, message=f"aborted {aborted} engine request(s)")

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """SglangScheduler's method handlers with tolerant request deserializers: a request that
        does not parse is INVALID_ARGUMENT naming the field instead of grpcio's UNKNOWN."""
        handlers = {}
        for method in _SERVICE.methods:
            assert not method.client_streaming
            request_cls = message_factory.GetMessageClass(method.input_type)
            response_cls = message_factory.GetMessageClass(method.output_type)
            fn = getattr(self, method.name)
            if method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                    _refuse_invalid_stream(fn), request_deserializer=tolerant(request_cls),
                    response_serializer=response_cls.SerializeToString)
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    _refuse_invalid_unary(fn), request_deserializer=tolerant(request_cls),
                    response_serializer=response_cls.SerializeToString)
        return handlers

    # ---- info ------------------------------------------------------------------------------------

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:  # noqa: N802
        cfg = self.model_config
        return pb.GetModelInfoResponse(
            model_path=self.options.advertised_model_path,
            tokenizer_path=self.options.advertised_model_path,
            is_generation=True,
            preferred_sampling_params="",
            weight_version="default",
            served_model_name=self.options.served_model_name,
            max_context_length=self.runner.context_len,
            vocab_size=cfg.vocab_size,
            supports_vision=False,
            model_type=cfg.model_type,
            eos_token_ids=list(cfg.eos_token_ids),
            pad_token_id=int(cfg.raw.get("pad_token_id") or 0),
            bos_token_id=int(cfg.bos_token_id or 0),
            max_req_input_len=self.max_seq_len - 1,
            architectures=list(cfg.raw.get("architectures") or [cfg.architecture]),
        )

    @property
    def tp_size(self) -> int:
        return self.runner.tp.size

    def server_args(self) -> dict[str, Any]:
        args = asdict(self.engine.config)
        # The path is this host's; a gateway reads server_args too (its worker labels), so it is
        # only reported when asked for, as in GetModelInfo.
        args["model_path"] = self.options.advertised_model_path
        args.update(
            served_model_name=self.options.served_model_name,
            tp_size=self.tp_size,
            tp_comm=self.runner.tp.comm_kind,
            dp_size=1,
            pp_size=1,
            page_size=1,
            context_length=self.runner.context_len,
        )
        return args

    def scheduler_info(self) -> dict[str, Any]:
        runner = self.runner
        weight_bytes = runner.weight_nbytes  # measured once at load, after packing/quantization
        return {
            "max_total_num_tokens": runner.kv.allocator.size,
            "max_running_requests": self.engine.config.max_running_requests,
            "max_req_input_len": self.max_seq_len - 1,
            "context_length": runner.context_len,
            "chunked_prefill_size": self.engine.config.chunked_prefill_size,
            "max_prefill_tokens": self.engine.config.max_prefill_tokens,
            "kv_bytes_per_token": runner.kv.bytes_per_token,
            "kv_bytes_per_token_if_mha": runner.kv.bytes_per_token_if_mha,
            "kv_cache_bytes": runner.kv.pool.nbytes(),
            "weight_bytes": weight_bytes,
            "dtype": str(runner.dtype).removeprefix("torch."),
            "device": str(runner.device),
            "architecture": self.model_config.architecture,
            "tp_size": self.tp_size,
            "tp_comm": self.runner.tp.comm_kind,
            "kernels": runner.kernels.describe(),
            "torch_compile": runner.torch_compile,
            "fused_layers": runner.fused_layers_state,
            "page_size": 1,
            "radix_cache": self.engine.scheduler.cache is not None,
            "radix_cache_tokens": self.loop.load().cached_tokens,  # as of the last step
            "worker_stream": self.options.worker_stream,
        }

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:  # noqa: N802
        return pb.GetServerInfoResponse(
            server_args=grpc_convert.to_struct(self.server_args()),
            scheduler_info=grpc_convert.to_struct(self.scheduler_info()),
            active_requests=self.loop.load().in_flight,
            is_paused=False,
            last_receive_timestamp=self.last_receive_time,
            uptime_seconds=time.monotonic() - self._start_mono,
            sglang_version=VERSION,
            server_type="grpc",
            start_time=grpc_convert.timestamp(self.start_time),
            max_total_num_tokens=self.runner.kv.allocator.size,
        )

    async def GetLoads(self, request: pb.GetLoadsRequest, context) -> pb.GetLoadsResponse:  # noqa: N802
        snap = self.loop.load()
        include = set(request.include) or {"core"}
        every = "all" in include
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=snap.running,
            num_waiting_reqs=snap.waiting,
            num_total_reqs=max(snap.in_flight, snap.running + snap.waiting),
            num_used_tokens=snap.used_tokens,
            max_total_num_tokens=snap.total_tokens,
            token_usage=snap.token_usage,
            gen_throughput=snap.gen_throughput,
            cache_hit_rate=snap.cache_hit_rate,
            utilization=snap.running / snap.max_running_requests if snap.max_running_requests else 0.0,
            max_running_requests=snap.max_running_requests,
            num_waiting_uncached_tokens=snap.waiting_prompt_tokens,
        )
        if every or "memory" in include:
            info = self.scheduler_info()
            load.memory.CopyFrom(
                pb.MemoryMetrics(
                    weight_gb=info["weight_bytes"] / _GIB,
                    kv_cache_gb=info["kv_cache_bytes"] / _GIB,
                    graph_gb=0.0,
                    token_capacity=snap.total_tokens,
                )
            )
        if every or "queues" in include:
            load.queues.CopyFrom(pb.QueueMetrics(waiting=snap.waiting, retracted=snap.retracted_waiting))
        loads = [load] if not request.HasField("dp_rank") or request.dp_rank == 0 else []
        return pb.GetLoadsResponse(
            timestamp=grpc_convert.iso_now(),
            version=VERSION,
            dp_rank_count=1,
            loads=loads,
            aggregate=pb.AggregateMetrics(
                total_running_reqs=snap.running,
                total_waiting_reqs=snap.waiting,
                total_reqs=load.num_total_reqs,
                avg_token_usage=snap.token_usage,
                avg_throughput=snap.gen_throughput,
                avg_utilization=load.utilization,
            ),
        )

    async def GetTokenizer(self, request, context) -> AsyncIterator[common_pb2.GetTokenizerChunk]:  # noqa: N802
        if self._tokenizer_bundle is None:
            model_dir = self.engine.config.model_path
            self._tokenizer_bundle = await asyncio.to_thread(grpc_convert.tokenizer_bundle, model_dir)
        data, sha256 = self._tokenizer_bundle
        log.info("sending tokenizer bundle", bytes=len(data), sha256=sha256)
        for chunk in grpc_convert.tokenizer_chunks(data, sha256):
            yield chunk

    async def SubscribeKvEvents(  # noqa: N802
        self, request: common_pb2.SubscribeKvEventsRequest, context
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The radix cache's block events and the engine's load (worker_svc/server/kv_events.py)."""
        structlog.contextvars.clear_contextvars()
        if self.kv_events is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV cache events are not published: the radix "
                                "cache is disabled (--disable-radix-cache)")
        assert self.kv_events is not None
        try:
            sub = self.kv_events.subscribe(request.start_sequence_number, request.load_records_before_first_batch)
        except CursorOutOfRange as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"start_sequence_number: {exc}")
        except EngineUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker is not serving: {exc}")
        try:
            await context.send_initial_metadata(())  # a subscriber learns at once that the stream is up
            async for batch in self.kv_events.stream(sub):
                yield batch
        except SubscriberDropped as exc:
            code = grpc.StatusCode.DATA_LOSS if exc.data_loss else grpc.StatusCode.UNAVAILABLE
            await context.abort(code, str(exc))
        finally:
            self.kv_events.unsubscribe(sub)

    # ---- not supported ---------------------------------------------------------------------------

    async def Embed(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Embed is not supported: this is a generation model")

    async def FlushCache(self, request, context):  # noqa: N802
        """Empty the radix prefix cache (sglang's rule: only while no request runs or waits, else
        success=False saying why); UNAVAILABLE when the engine does not run."""
        try:
            future = self.loop.flush_cache()
        except EngineUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cache not flushed: {exc}")
        limit = self.options.step_stall_timeout_s
        try:
            success, message = await asyncio.wait_for(asyncio.wrap_future(future), limit)
        except asyncio.TimeoutError:
            future.cancel()
            success, message = False, f"cache not flushed: the engine did not get to it within {limit:g}s"
        log.info("flush cache", success=success, message=message)
        return common_pb2.FlushCacheResponse(success=success, message=message)

    async def StartProfile(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not supported")

    async def StopProfile(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not supported")

    async def LoadLoRAAdapter(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "LoRA adapters are not supported")

    async def UnloadLoRAAdapter(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "LoRA adapters are not supported")

    async def ListLoadedLoRAAdapters(self, request, context):  # noqa: N802
        return pb.ListLoadedLoRAAdaptersResponse()
