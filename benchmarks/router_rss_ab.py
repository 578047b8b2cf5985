"""Router native-memory growth per client cancel, two source trees side by side: a router from an
earlier commit (a git worktree, removed afterwards) and one from this tree, in front of one tiny-model
worker, both driven with streams the client cancels 0-30 ms in; prints each router's anonymous RSS
every 30 s (docs/reliability.md, "Soak").

    .venv/bin/python benchmarks/router_rss_ab.py BASE_REV MINUTES CONCURRENCY   # from the repo root
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.router_rss_by_request_kind import anonymous_mb, one  # noqa: E402
from llmserve.modelgen import make_model  # noqa: E402
from router.client import AsyncRouterClient  # noqa: E402
from tests.integration.test_router import Proc, engine_flags, spawn  # noqa: E402


def start_router(name: str, source: Path, tokenizer: Proc, worker: Proc, work: Path, deadline: float) -> Proc:
    port_file, log_path = work / f"{name}.port", work / f"{name}.log"
    cmd = [sys.executable, "-m", "llmserve.cli", "router", "--tokenizer", tokenizer.address,
           "--workers", worker.address, "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
           "--log-json", "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(source)}
    with open(log_path, "wb") as log:  # cwd = the source tree: `python -m` imports from there
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=source)
    router = Proc(name, proc, port_file, log_path)
    router.wait_port(deadline)
    return router


async def drive(router: Proc, concurrency: int, counts: dict[str, int], end: float) -> None:
    rng = random.Random(1)
    async with AsyncRouterClient(router.address) as client:
        await client.wait_ready()
        running: set[asyncio.Future[None]] = set()
        while time.monotonic() < end:
            while len(running) < concurrency:
                running.add(asyncio.ensure_future(one(client, "cancel", rng)))
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            counts[router.name] = counts.get(router.name, 0) + len(done)
        await asyncio.gather(*running, return_exceptions=True)


async def measure(routers: list[Proc], minutes: float, concurrency: int) -> None:
    end = time.monotonic() + 60 * minutes
    counts: dict[str, int] = {}
    tasks = [asyncio.ensure_future(drive(r, concurrency, counts, end)) for r in routers]
    start = time.monotonic()
    while True:
        row = "  ".join(f"{r.name}: anon {anonymous_mb(r.proc.pid):.1f} MB n={counts.get(r.name, 0)}" for r in routers)
        print(f"{time.monotonic() - start:5.0f}s {row}", flush=True)
        if all(t.done() for t in tasks):
            break
        await asyncio.sleep(30)


def main() -> None:
    base_rev, minutes, concurrency = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    work = Path(tempfile.mkdtemp())
    base = work / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), base_rev], check=True,
                   stdout=subprocess.DEVNULL)
    model = make_model(work / "m", arch="llama", preset="tiny", seed=0)
    tokenizer = spawn("tokenizer", ["tokenizer", "--model", str(model)], work)
    worker = spawn("worker", ["worker", "--model", str(model), *engine_flags()], work)
    procs = [tokenizer, worker]
    try:
        deadline = time.monotonic() + 120
        tokenizer.wait_port(deadline)
        worker.wait_port(deadline)
        routers = [start_router("base", base, tokenizer, worker, work, deadline),
                   start_router("this", ROOT, tokenizer, worker, work, deadline)]
        procs += routers
        asyncio.run(measure(routers, minutes, concurrency))
    finally:
        for p in procs:
            p.proc.terminate()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)


if __name__ == "__main__":
    main()
