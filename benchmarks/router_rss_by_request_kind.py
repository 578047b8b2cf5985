"""Router native-memory growth by request kind (issue 11 soak): routers side by side in front of one
tiny-model worker, each driven with one kind of request, printing each router's anonymous RSS every
30 s. Kinds: plain streams, streams the client cancels 0-30 ms in or after the first token of 64,
Tokenize calls, and the soak's others: streams under a 20-300 ms client deadline, n = 3, 200-token id prompts.

    .venv/bin/python benchmarks/router_rss_by_request_kind.py MINUTES CONCURRENCY [KIND ...]   # from the repo root
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
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from llmserve.modelgen import make_model  # noqa: E402
from router.client import AsyncRouterClient  # noqa: E402
from tests.integration.test_router import Proc, engine_flags, spawn  # noqa: E402

KINDS = ("stream", "cancel", "cancel_mid", "unary", "deadline", "n3", "long")
PROMPT = "Once upon a time"


def anonymous_mb(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start_router(name: str, tokenizer: Proc, worker: Proc, work: Path, deadline: float,
                 source: Path | None = None) -> Proc:
    """A router process; `source`: run it from that checkout (another commit's worktree)."""
    port_file, log_path = work / f"{name}.port", work / f"{name}.log"
    cmd = [sys.executable, "-m", "llmserve.cli", "router", "--tokenizer", tokenizer.address,
           "--workers", worker.address, "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
           "--log-json", "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if source is not None:
        env["PYTHONPATH"] = str(source)
    with open(log_path, "wb") as log:  # `python -m` imports from its cwd first: the source tree's
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=source or work)
    router = Proc(name, proc, port_file, log_path)
    router.wait_port(deadline)
    return router


async def one(client: AsyncRouterClient, kind: str, rng: random.Random) -> None:
    async def consume(prompt: str | list[int] = PROMPT, timeout: float = 60.0, **args) -> None:
        async for _ in client.generate(prompt, max_new_tokens=16, ignore_eos=True, timeout=timeout, **args):
            pass

    if kind == "stream":
        await consume()
    elif kind == "deadline":
        with contextlib.suppress(grpc.aio.AioRpcError):
            await consume(timeout=rng.uniform(0.02, 0.3))
    elif kind == "n3":
        await consume(n=3, temperature=0.8)
    elif kind == "long":
        await consume([rng.randrange(500) for _ in range(200)])
    elif kind == "cancel":
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(rng.uniform(0, 0.03))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await task
    elif kind == "cancel_mid":  # cancelled while the worker generates: the router waits on a worker read
        stream = client.generate(PROMPT, max_new_tokens=64, ignore_eos=True, timeout=60.0)
        async for delta in stream:
            if delta.token_ids:
                break
        await stream.aclose()  # cancels the client's call, with no read of the client's in flight
    else:
        await client.tokenize(PROMPT + " there was")


async def drive(router: Proc, kind: str, concurrency: int, counts: dict[str, int], end: float) -> None:
    rng = random.Random(1)
    async with AsyncRouterClient(router.address) as client:
        await client.wait_ready()
        running: set[asyncio.Future[None]] = set()
        while time.monotonic() < end:
            while len(running) < concurrency:
                running.add(asyncio.ensure_future(one(client, kind, rng)))
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            counts[router.name] = counts.get(router.name, 0) + len(done)
        await asyncio.gather(*running, return_exceptions=True)


async def measure(routers: list[Proc], kinds: list[str], minutes: float, concurrency: int,
                  also: Sequence[Proc] = ()) -> None:
    """Drive router i with requests of kinds[i]; print every router's RSS (and that of the processes in
    `also`) every 30 s and at the end."""
    end = time.monotonic() + 60 * minutes
    counts: dict[str, int] = {}
    tasks = [asyncio.ensure_future(drive(router, kind, concurrency, counts, end))
             for router, kind in zip(routers, kinds, strict=True)]
    start = time.monotonic()
    while True:
        row = "  ".join(f"{r.name}: anon {anonymous_mb(r.proc.pid):.1f} MB n={counts.get(r.name, 0)}" for r in routers)
        row += "".join(f"  {p.name}: anon {anonymous_mb(p.proc.pid):.1f} MB" for p in also)
        print(f"{time.monotonic() - start:5.0f}s {row}", flush=True)
        if all(t.done() for t in tasks):
            break
        await asyncio.sleep(30)


def main() -> None:
    minutes, concurrency = float(sys.argv[1]), int(sys.argv[2])
    kinds = sys.argv[3:] or list(KINDS)
    work = Path(tempfile.mkdtemp())
    model = make_model(work / "m", arch="llama", preset="tiny", seed=0)
    tokenizer = spawn("tokenizer", ["tokenizer", "--model", str(model)], work)
    worker = spawn("worker", ["worker", "--model", str(model), *engine_flags()], work)
    procs = [tokenizer, worker]
    try:
        deadline = time.monotonic() + 120
        tokenizer.wait_port(deadline)
        worker.wait_port(deadline)
        routers = [start_router(kind, tokenizer, worker, work, deadline) for kind in kinds]
        procs += routers
        asyncio.run(measure(routers, kinds, minutes, concurrency))
    finally:
        for p in procs:
            p.proc.terminate()


if __name__ == "__main__":
    main()
