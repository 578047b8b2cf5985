"""The router's end of llmserve.v1.WorkerStream (protos/llmserve/v1/worker_stream.proto): all of its
Generate calls to one worker on one GenerateMany stream.

Through per-request SglangScheduler.Generate streams, an engine step that makes a token for 64
requests is 64 gRPC messages for the worker to write and the router to read, each waking both event
loops; on the stream the worker sends them as one message. A call on the stream reads like a
SglangScheduler.Generate call (WorkerCall below): its responses, then the end, or an AioRpcError
with the status the worker ended it with. Its deadline is kept here: when it passes the call fails
with DEADLINE_EXCEEDED and the worker is told to cancel it. When the stream breaks, every call on it
fails with the stream's status (UNAVAILABLE when the worker went away), and the next call opens a new
stream. The worker sends on credit (CREDIT messages ahead, one more for each message read here), so a
router that falls behind gets larger messages rather than a backlog of stale ones.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as spb

from llmserve.logging import get_logger
from llmserve.v1 import worker_stream_pb2 as wpb
from llmserve.v1 import worker_stream_pb2_grpc as wpb_grpc

log = get_logger(__name__)

# One message of opened calls stays under this (the channel's limit is 64 MiB; a prompt is far less).
_MAX_BATCH_BYTES = 8 << 20
# Response messages the worker may have on the way at once (WorkerStreamRequest.credit); what its calls
# make beyond that waits there and is merged (a call's first response excepted). Four steps' worth: the
# router keeps up with a busy worker without merging, and one that falls behind is at most four behind.
CREDIT = 4
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_END = object()


class WorkerCall(Protocol):
    """A Generate call to a worker as the router reads it: grpc.aio's call of SglangScheduler.Generate,
    or a StreamedCall."""

    def __aiter__(self) -> AsyncIterator[spb.GenerateResponse]: ...

    def done(self) -> bool: ...

    def cancel(self) -> bool: ...


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class StreamedCall:
    """One Generate call carried on a WorkerStream."""

    def __init__(self, session: _Session, number: int, timeout: float | None) -> None:
        self._session = session
        self.number = number
        self._items: asyncio.Queue = asyncio.Queue()
        self._done = False
        self._error: grpc.aio.AioRpcError | None = None
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(timeout, self._expire) if timeout is not None else None

    def __aiter__(self) -> StreamedCall:
        return self

    async def __anext__(self) -> spb.GenerateResponse:
        item = await self._items.get()
        if item is not _END:
            return item
        self._items.put_nowait(_END)  # every later read ends the same way
        if self._error is not None:
            raise self._error
        raise StopAsyncIteration

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        """Cancel the call here and on the worker (which aborts its engine requests)."""
        return self._stop(grpc.StatusCode.CANCELLED, "Locally cancelled by application!", "client cancel")

    def _expire(self) -> None:
        self._stop(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "deadline")

    def _stop(self, code: grpc.StatusCode, details: str, reason: str) -> bool:
        if self._done:
            return False
        self._session.cancel(self.number, reason)
        self.fail(_error(code, details))
        return True

    def deliver(self, item: wpb.CallItem) -> None:
        """An item the worker sent for this call."""
        if self._done:
            return
        if item.WhichOneof("item") == "generate_response":
            self._items.put_nowait(spb.GenerateResponse.FromString(item.generate_response))
            return
        code = _CODES.get(item.end.code, grpc.StatusCode.UNKNOWN)
        self._finish(None if code is grpc.StatusCode.OK else _error(code, item.end.message))

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if not self._done:
            self._finish(error)

    def _finish(self, error: grpc.aio.AioRpcError | None) -> None:
        self._done = True
        self._error = error
        if self._deadline is not None:
            self._deadline.cancel()
        self._session.forget(self.number)
        self._items.put_nowait(_END)


class _Session:
    """One GenerateMany call and the calls open on it."""

    def __init__(self, stub: wpb_grpc.WorkerStreamStub, name: str) -> None:
        self.name = name
        self._rpc = stub.GenerateMany()
        self._calls: dict[int, StreamedCall] = {}
        self._opens: list[wpb.CallOpen] = []
        self._cancels: list[wpb.CallCancel] = []
        self._credit = CREDIT  # to grant with the next message
        self._wake = asyncio.Event()
        self.closed = False
        self.unsupported = False
        # Opened on some request's behalf, but no request's: its tasks run without that request's log bindings.
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read(), context=contextvars.Context())
        self._writer = loop.create_task(self._write(), context=contextvars.Context())

    def open(self, number: int, request: spb.GenerateRequest, client_request_id: str,
             timeout: float | None) -> StreamedCall:
        call = self._calls[number] = StreamedCall(self, number, timeout)
        self._opens.append(wpb.CallOpen(call=number, generate_request=request.SerializeToString(),
                                        client_request_id=client_request_id))
        self._wake.set()
        return call

    def cancel(self, number: int, reason: str) -> None:
        if not self.closed:
            self._cancels.append(wpb.CallCancel(call=number, reason=reason))
            self._wake.set()

    def forget(self, number: int) -> None:
        self._calls.pop(number, None)

    async def _write(self) -> None:
        try:
            while True:
                if not self._opens and not self._cancels and not self._credit:
                    self._wake.clear()
                    # No extra turn of the loop before writing: calls opened in the same turn are already
                    # queued ahead of this wake-up, and later ones join while this write is on the way.
                    # (A yield here cost a pass through the ready queue: the open's hop to the worker, p50
                    # 1.02 -> 0.92 ms and p90 5.0 -> 3.4 ms in benchmarks/router_overhead.sh's split rounds.)
                    await self._wake.wait()
                    continue
                message = wpb.WorkerStreamRequest(cancel=self._cancels, credit=self._credit)
                self._cancels, self._credit = [], 0
                size = 0
                taken = 0
                for item in self._opens:
                    size += item.ByteSize()
                    if taken and size > _MAX_BATCH_BYTES:
                        break
                    taken += 1
                message.open.extend(self._opens[:taken])
                del self._opens[:taken]
                await self._rpc.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass  # the stream broke: the reader fails the calls

    async def _read(self) -> None:
        error = _error(grpc.StatusCode.UNAVAILABLE, f"worker {self.name} ended the WorkerStream")
        try:
            async for message in self._rpc:
                for item in message.items:
                    call = self._calls.get(item.call)
                    if call is not None:
                        call.deliver(item)
                # The relays this message woke run before the next credit goes out: a router that is
                # behind takes larger messages, not a backlog.
                await asyncio.sleep(0)
                self._credit += 1
                self._wake.set()
        except grpc.aio.AioRpcError as exc:
            error = exc
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:  # a worker without it (replaced, say)
                self.unsupported = True
                error = _error(grpc.StatusCode.UNAVAILABLE, f"worker {self.name} does not serve WorkerStream")
        except asyncio.CancelledError:
            error = _error(grpc.StatusCode.CANCELLED, "the router is closing its WorkerStream")
            raise
        finally:
            self.closed = True
            self._writer.cancel()
            for call in list(self._calls.values()):
                call.fail(error)
            if error.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
                log.warning("worker stream failed", worker=self.name, code=error.code().name, error=error.details())

    async def close(self) -> None:
        self._rpc.cancel()
        for task in (self._reader, self._writer):
            task.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)


class WorkerStream:
    """The router's WorkerStream to one worker: opened on the first call, and again after it broke."""

    def __init__(self, channel: grpc.aio.Channel, name: str) -> None:
        self._stub = wpb_grpc.WorkerStreamStub(channel)
        self._name = name
        self._session: _Session | None = None
        self._numbers = itertools.count(1)

    @property
    def usable(self) -> bool:
        """False once the worker answered that it does not serve WorkerStream."""
        return self._session is None or not self._session.unsupported

    def generate(self, request: spb.GenerateRequest, client_request_id: str = "",
                 timeout: float | None = None) -> StreamedCall:
        """Start a Generate call; ``timeout``: seconds until its deadline (None: none)."""
        if self._session is None or self._session.closed:
            self._session = _Session(self._stub, self._name)
        return self._session.open(next(self._numbers), request, client_request_id, timeout)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
