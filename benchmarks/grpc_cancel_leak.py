"""grpc.aio's native-memory leak per cancelled call (grpc/grpc#43360), by how the call is awaited.

A bare grpc.aio server in a child process (a 5 ms unary method and a 20-message stream) and a client
here that starts calls and ends them early 0-10 ms in, 16 at a time. Printed per mode: the client's
and the server's anonymous RSS growth per call after a warm-up.

    .venv/bin/python benchmarks/grpc_cancel_leak.py [CALLS [MODE ...]]      # default 20000 per mode, all modes

Modes: `unary_direct` awaits the call in the task that is cancelled (what a cancelled handler does
to its Encode call); `unary_shielded` awaits it through asyncio.shield of its own task (what
router/background.py does); `stream_direct` reads a server stream in the cancelled task;
`stream_call_cancel` cancels the call itself (`call.cancel()`) while another task reads it;
`stream_deadline` gives the call a 0-10 ms deadline instead; `stream_shielded` reads each message
through asyncio.shield of its own task, and the cancelled task cancels the call (what the router does
with a worker's Generate call); `stream_stopped` asks the server to end the stream (a unary `Stop`
naming it, as the router's Abort does) and reads it to its normal end; `stream_complete` cancels
nothing (the baseline: what a call that runs to its end leaves).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

MODES = ("unary_direct", "unary_shielded", "stream_direct", "stream_call_cancel", "stream_deadline", "stream_shielded",
         "stream_stopped", "stream_complete")


def anonymous_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _unary(request: bytes, context) -> bytes:
    await asyncio.sleep(0.005)
    return b"x" * 64


class _Streams:
    """The server's streams by the request bytes that name them, so that `Stop` can end one early."""

    def __init__(self) -> None:
        self.stops: dict[bytes, asyncio.Event] = {}

    async def stream(self, request: bytes, context):
        stop = self.stops.setdefault(request, asyncio.Event())
        try:
            for _ in range(20):
                if stop.is_set():
                    return
                await asyncio.sleep(0.002)
                yield b"y" * 32
        finally:
            self.stops.pop(request, None)

    async def stop(self, request: bytes, context) -> bytes:
        if request in self.stops:
            self.stops[request].set()
        return b""


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def _drain(call) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
        async for _ in call:
            pass


async def serve(port_file: str) -> None:
    server = grpc.aio.server()
    streams = _Streams()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.Probe", {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.unary_stream_rpc_method_handler(streams.stream),
        "Stop": grpc.unary_unary_rpc_method_handler(streams.stop),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(port_file).write_text(str(port))
    await server.wait_for_termination()


async def measure(mode: str, calls: int, port: int, server_pid: int) -> str:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary, stream = channel.unary_unary("/probe.Probe/Unary"), channel.unary_stream("/probe.Probe/Stream")
        stop = channel.unary_unary("/probe.Probe/Stop")
        background: set[asyncio.Future[bytes]] = set()

        async def stream_shielded() -> None:
            call = stream(b"a", timeout=5)
            messages = call.__aiter__()
            try:
                while True:
                    read = asyncio.ensure_future(anext(messages, None))
                    background.add(read)
                    read.add_done_callback(_retrieved)
                    read.add_done_callback(background.discard)
                    if await asyncio.shield(read) is None:
                        return
            finally:
                call.cancel()

        async def one() -> None:
            if mode == "stream_shielded":
                await stream_shielded()
            elif mode == "unary_direct":
                await unary(b"a", timeout=5)
            elif mode == "unary_shielded":
                task = asyncio.ensure_future(unary(b"a", timeout=5))
                background.add(task)
                task.add_done_callback(background.discard)
                await asyncio.shield(task)
            else:
                async for _ in stream(b"a", timeout=5):
                    pass

        async def cancelled() -> None:
            if mode == "stream_deadline":
                with contextlib.suppress(grpc.aio.AioRpcError):
                    async for _ in stream(b"a", timeout=random.uniform(0, 0.01)):
                        pass
                return
            if mode in ("stream_stopped", "stream_complete"):
                name = os.urandom(8)
                reader = asyncio.ensure_future(_drain(stream(name, timeout=5)))
                if mode == "stream_stopped":
                    await asyncio.sleep(random.uniform(0, 0.01))
                    await stop(name, timeout=5)
                await reader
                return
            if mode == "stream_call_cancel":
                call = stream(b"a", timeout=5)
                reader = asyncio.ensure_future(_drain(call))
                await asyncio.sleep(random.uniform(0, 0.01))
                call.cancel()
                await reader
                return
            task = asyncio.ensure_future(one())
            await asyncio.sleep(random.uniform(0, 0.01))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await task

        async def rounds(n: int) -> None:
            for _ in range(n // 16):
                await asyncio.gather(*(cancelled() for _ in range(16)))
            await asyncio.sleep(1.0)  # let the shielded calls finish

        await rounds(500)  # warm-up
        client0, server0 = anonymous_mb(), anonymous_mb(server_pid)
        await rounds(calls)
        client1, server1 = anonymous_mb(), anonymous_mb(server_pid)
    per_call = 2**20 / calls
    return (f"{mode:15s} {calls} calls: client {(client1 - client0) * per_call:5.0f} B/call, "
            f"server {(server1 - server0) * per_call:5.0f} B/call")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        asyncio.run(serve(sys.argv[2]))
        return
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    print(f"grpcio {grpc.__version__}")
    for mode in sys.argv[2:] or MODES:
        port_file = Path(tempfile.mkdtemp()) / "port"
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)])
        try:
            deadline = time.monotonic() + 30
            while not (port_file.exists() and port_file.read_text()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the probe server did not start")
                time.sleep(0.05)
            print(asyncio.run(measure(mode, calls, int(port_file.read_text()), server.pid)), flush=True)
        finally:
            server.kill()
            server.wait()
            with contextlib.suppress(OSError):
                os.unlink(port_file)


if __name__ == "__main__":
    main()
