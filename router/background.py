"""Calls, and reads of a stream, that a cancelled request leaves to finish in their own task.

grpc.aio leaks the native op array of a batch whose awaiting task is cancelled while the batch is
in flight (grpc/grpc#43360, open in grpcio 1.85): a unary call cancelled mid-flight leaves about
0.8 kB of native heap behind for good, a stream read about as much (benchmarks/grpc_cancel_leak.py).
A client that cancels its request cancels the router's handler task, so the handler awaits its short
tokenizer calls (Encode, Decode, one DetokenizeStream step) and each read of the worker's Generate
stream in a task spawned here: the handler stops waiting at once, and the call or read completes in
its own task (bounded by its deadline). The worker stream is then read to its end in one more task
(router/server.py `_Run._drain`): the worker ends it on the router's Abort, which leaves nothing
behind on either side, where cancelling the call leaks a little in both processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundCalls:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def spawn(self, call: Awaitable[T]) -> asyncio.Future[T]:
        """Run `call` to its end in its own task, whoever stops waiting for it."""
        task = asyncio.ensure_future(call)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    async def shielded(self, call: Awaitable[T]) -> T:
        """Await `call`; cancelling the awaiting task does not cancel the call."""
        return await asyncio.shield(self.spawn(call))

    def _done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # mark it retrieved: a cancelled request's call may fail with nobody awaiting it

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout: float) -> None:
        """Let the calls in flight finish (at shutdown), for at most `timeout` seconds."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
