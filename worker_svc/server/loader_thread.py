"""Load the model in a thread of its own that exits afterwards, so the engine thread is the only thread
with an OpenMP team while the worker serves.

Every thread that runs a parallel region gets its own team of OpenMP worker threads, which lives as long as
the thread does. With GNU OpenMP (torch's CPU wheels), once the process has more OpenMP threads than CPUs the
workers stop spinning between regions and sleep at once ("throttled" spinning), so each of a decode step's
~250 parallel regions wakes its workers through a futex. Loading in ``asyncio.to_thread`` left such a team in
the event loop's executor thread for the life of the process: on the 2-vCPU host a bs16 decode step took
43 ms in the engine thread against 27 ms in a process whose only team was the engine thread's, and a
16-row AMX linear 190 us against 43 us (docs/benchmarks.md, "Serving against vLLM-CPU"). A thread that
exits frees its team.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


async def run_in_own_thread(fn: Callable[..., _T], *args: Any, name: str = "model-loader") -> _T:
    """``fn(*args)`` in a new thread that exits when it returns; its result, or what it raised."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    result = await done
    # The thread has returned from fn and is exiting: wait for it here (no executor thread for this), so its
    # OpenMP team is released before serving starts.
    thread.join()
    return result
