"""llmserve.v1.WorkerStream: many Generate calls on one stream (protos/llmserve/v1/worker_stream.proto).

The router opens one GenerateMany call per worker and carries all its requests on it. Each call it
opens runs SchedulerServicer.generate in a task of its own, exactly as a SglangScheduler.Generate
call does (same validation, statuses, logs and Abort by request_id); what differs is the transport:
the calls' responses go into one outbox that a single writer sends as one message, so an engine step
that produced a token for 64 requests costs one gRPC message instead of 64. The writer sends only
while the caller has granted credit (a call's first response excepted); what waits meanwhile goes out
in the next message, each call's consecutive chunks merged, so a caller that falls behind gets fewer,
larger messages rather than a backlog of stale ones.

A call that the caller cancels (or whose deadline passed: the caller cancels it) aborts its engine
requests; when the stream ends, every call still running on it is cancelled the same way. A worker
that is shutting down ends the stream once its last call has ended.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
import structlog
from smg_grpc_proto import sglang_scheduler_pb2 as spb

from llmserve.grpc_wire import InvalidRequest, tolerant
from llmserve.v1 import worker_stream_pb2 as wpb
from worker_svc.engine.engine_loop import LoopState
from worker_svc.server import convert as grpc_convert
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
        self.responded = False  # its first response is on its way
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
        # What the calls produced since the last message: responses by call (in order), and ends.
        self._responses: dict[int, list[spb.GenerateResponse]] = {}
        self._ends: dict[int, wpb.CallEnd] = {}
        self._credit = 0  # messages the caller will take (WorkerStreamRequest.credit)
        self._firsts: set[int] = set()  # calls whose first response waits: it goes out credit or not
        self._wake = asyncio.Event()
        self._reading = True
        self._refusal: str | None = None  # a request message that did not parse: the stream fails

    async def run(self, requests: AsyncIterator[wpb.WorkerStreamRequest | InvalidRequest]) -> None:
        reader = asyncio.ensure_future(self._read(requests))
        try:
            while True:
                # A first token is never held back (time to first token is what a client waits on); past
                # the caller's half-close no credit comes, so what is left goes out regardless.
                pending = self._responses or self._ends
                if pending and (self._credit > 0 or self._firsts or not self._reading):
                    self._credit -= 1
                    await self._context.write(self._take())
                    continue
                if self._refusal is not None:
                    await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, self._refusal)
                if not pending and not self._calls and (
                        not self._reading or self._servicer.loop.state is not LoopState.RUNNING):
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
                if message.credit:
                    self._credit += message.credit
                    self._wake.set()
        finally:
            self._reading = False
            self._wake.set()

    def _respond(self, call: _Call, response: spb.GenerateResponse) -> None:
        if not call.responded:
            call.responded = True
            self._firsts.add(call.number)
        self._responses.setdefault(call.number, []).append(response)
        self._wake.set()

    def _end(self, number: int, code: grpc.StatusCode, message: str = "") -> None:
        self._ends[number] = wpb.CallEnd(code=code.value[0], message=message)
        self._wake.set()

    def _take(self) -> wpb.WorkerStreamResponse:
        """Everything pending as one message: each call's chunks merged (its first apart), then its end."""
        items = []
        for number, responses in self._responses.items():
            # A first token stays a message of its own (what a client times as its first token).
            if number in self._firsts:
                responses = [responses[0], *grpc_convert.merge_chunks(responses[1:])]
            else:
                responses = grpc_convert.merge_chunks(responses)
            items += [wpb.CallItem(call=number, generate_response=r.SerializeToString()) for r in responses]
            end = self._ends.pop(number, None)
            if end is not None:
                items.append(wpb.CallItem(call=number, end=end))
        items += [wpb.CallItem(call=number, end=end) for number, end in self._ends.items()]
        self._responses, self._ends = {}, {}
        self._firsts.clear()
        return wpb.WorkerStreamResponse(items=items)

    def _open(self, item: wpb.CallOpen) -> None:
        if item.call in self._calls:  # the caller lost track: nothing it reads from here on is reliable
            self._refusal = f"call: {item.call} is already open on this stream"
            self._wake.set()
            return
        request = _parse_generate(item.generate_request)
        if isinstance(request, InvalidRequest):
            self._end(item.call, grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return
        call = self._calls[item.call] = _Call(item.call, self._servicer)
        call.task = asyncio.ensure_future(self._serve(call, request, item.client_request_id))
        # Not in _serve's finally: a task cancelled before it started never runs its body.
        call.task.add_done_callback(functools.partial(self._forget, call))

    def _forget(self, call: _Call, _task: asyncio.Task) -> None:
        del self._calls[call.number]
        call.done()
        self._wake.set()

    async def _serve(self, call: _Call, request: spb.GenerateRequest, client_id: str) -> None:
        started = time.perf_counter()
        code, message = grpc.StatusCode.OK, ""
        try:
            async for response in self._servicer.generate(request, "", client_id, call):
                self._respond(call, response)
        except GenerateRefused as exc:
            code, message = exc.code, exc.message
        except asyncio.CancelledError:  # counted as a call of its own would be
            timed_out = call.cancel_reason == "deadline"
            code = grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.CANCELLED
            message = call.end_reason()
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

