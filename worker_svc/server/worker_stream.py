"""llmserve.v1.WorkerStream: many Generate calls on one stream (protos/llmserve/v1/worker_stream.proto).

The router opens one GenerateMany call per worker and carries all its requests on it. Each call it
opens runs SchedulerServicer.generate in a task of its own, exactly as a SglangScheduler.Generate
call does (same validation, statuses, logs and Abort by request_id); what differs is the transport:
the calls' responses go into one outbox that a single writer sends as one message, so an engine step
that produced a token for 64 requests costs one gRPC message instead of 64.

A call that the caller cancels (or whose deadline passed: the caller cancels it) aborts its engine
requests; when the stream ends, every call still running on it is cancelled the same way. A worker
that is shutting down ends the stream once its last call has ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
import structlog
from smg_grpc_proto import sglang_scheduler_pb2 as spb

from llmserve.grpc_wire import InvalidRequest, tolerant
from llmserve.v1 import worker_stream_pb2 as wpb
from worker_svc.engine.engine_loop import LoopState
from worker_svc.server.servicer import GenerateRefused, SchedulerServicer

if TYPE_CHECKING:
    from llmserve.metrics import GrpcMetrics

log = structlog.get_logger(__name__)

SERVICE_NAME = wpb.DESCRIPTOR.services_by_name["WorkerStream"].full_name
_parse_generate = tolerant(spb.GenerateRequest)


class _Call:
    """One call carried by the stream (the CallSide its generate() sees)."""

    def __init__(self, number: int, servicer: SchedulerServicer) -> None:
        self.number = number
        self._servicer = servicer
        self.cancel_reason: str | None = None  # set when the caller (or the stream's end) cancelled it
        self.task: asyncio.Task | None = None
        self._on_done: list[Callable[[], None]] = []

    def end_reason(self) -> str:
        if self.cancel_reason is not None and self._servicer.loop.state is LoopState.RUNNING:
            return self.cancel_reason
        return self._servicer.end_reason()

    def on_done(self, fn: Callable[[], None]) -> None:
        self._on_done.append(fn)

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        if self.task is not None:
            self.task.cancel()

    def done(self) -> None:
        callbacks, self._on_done = self._on_done, []
        for fn in callbacks:
            fn()


class _Session:
    """One GenerateMany call: its calls, and the outbox their responses go through."""

    def __init__(self, servicer: SchedulerServicer, context: grpc.aio.ServicerContext,
                 metrics: GrpcMetrics | None) -> None:
        self._servicer = servicer
        self._context = context
        self._metrics = metrics
        self._calls: dict[int, _Call] = {}
        self._outbox: list[wpb.CallItem] = []
        self._wake = asyncio.Event()
        self._reading = True
        self._refusal: str | None = None  # a request message that did not parse: the stream fails

    async def run(self, requests: AsyncIterator[wpb.WorkerStreamRequest | InvalidRequest]) -> None:
        reader = asyncio.ensure_future(self._read(requests))
        try:
            while True:
                if self._outbox:
                    items, self._outbox = self._outbox, []
                    await self._context.write(wpb.WorkerStreamResponse(items=items))
                    continue
                if self._refusal is not None:
                    await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, self._refusal)
                if not self._calls and (not self._reading or self._servicer.loop.state is not LoopState.RUNNING):
                    return  # the caller is done, or this worker is stopping
                self._wake.clear()
                await self._wake.wait()
                # Let the other outputs of the engine step that woke us join this message.
                await asyncio.sleep(0)
        finally:
            reader.cancel()
            calls = list(self._calls.values())
            for call in calls:
                call.cancel("caller gone")
            tasks = [c.task for c in calls if c.task is not None]
            if tasks:
                await asyncio.wait(tasks)

    async def _read(self, requests: AsyncIterator[wpb.WorkerStreamRequest | InvalidRequest]) -> None:
        try:
            async for message in requests:
                if isinstance(message, InvalidRequest):
                    self._refusal = message.message
                    return
                for item in message.open:
                    self._open(item)
                for cancel in message.cancel:
                    call = self._calls.get(cancel.call)
                    if call is not None:
                        call.cancel(cancel.reason or "client cancel")
        finally:
            self._reading = False
            self._wake.set()

    def _emit(self, item: wpb.CallItem) -> None:
        self._outbox.append(item)
        self._wake.set()

    def _end(self, number: int, code: grpc.StatusCode, message: str = "") -> None:
        self._emit(wpb.CallItem(call=number, end=wpb.CallEnd(code=code.value[0], message=message)))

    def _open(self, item: wpb.CallOpen) -> None:
        if item.call in self._calls:
            self._end(item.call, grpc.StatusCode.INVALID_ARGUMENT, f"call: {item.call} is already open on this stream")
            return
        request = _parse_generate(item.generate_request)
        if isinstance(request, InvalidRequest):
            self._end(item.call, grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return
        call = self._calls[item.call] = _Call(item.call, self._servicer)
        call.task = asyncio.ensure_future(self._serve(call, request, item.client_request_id))
        # Not in _serve's finally: a task cancelled before it started never runs its body.
        call.task.add_done_callback(lambda _, call=call: self._forget(call))

    def _forget(self, call: _Call) -> None:
        del self._calls[call.number]
        call.done()
        self._wake.set()

    async def _serve(self, call: _Call, request: spb.GenerateRequest, client_id: str) -> None:
        started = time.perf_counter()
        code, message = grpc.StatusCode.OK, ""
        try:
            async for response in self._servicer.generate(request, "", client_id, call):
                self._emit(wpb.CallItem(call=call.number, generate_response=response.SerializeToString()))
        except GenerateRefused as exc:
            code, message = exc.code, exc.message
        except asyncio.CancelledError:
            code, message = grpc.StatusCode.CANCELLED, call.end_reason()
        except Exception as exc:  # noqa: BLE001 - a fault fails its own call, never the stream's others
            log.exception("generate call failed")
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"
        if self._metrics is not None:
            self._metrics.record("Generate", code.name, time.perf_counter() - started)
        if call.cancel_reason is None:  # the caller knows how a call it cancelled ended
            self._end(call.number, code, message)


class WorkerStreamServicer:
    def __init__(self, servicer: SchedulerServicer, metrics: GrpcMetrics | None = None) -> None:
        self._servicer = servicer
        self._metrics = metrics

    async def GenerateMany(self, requests, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        await _Session(self._servicer, context, self._metrics).run(requests)

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {"GenerateMany": grpc.stream_stream_rpc_method_handler(
            self.GenerateMany, request_deserializer=tolerant(wpb.WorkerStreamRequest),
            response_serializer=wpb.WorkerStreamResponse.SerializeToString)}


def add_worker_stream_servicer(servicer: WorkerStreamServicer, server: grpc.aio.Server) -> None:
    handlers = servicer.handlers()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
