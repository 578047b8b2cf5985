"""Soak (issue 11): mixed traffic through `llmserve serve` for LLMSERVE_SOAK_MINUTES (default 30):
streams, client cancels, short deadlines, n > 1 and long prompts, eight at a time. Asserts no
unexpected error, the KV pool back to idle, and router and worker RSS flat after warm-up (growth over
the last two thirds of the run at most 5%). Slow: `pytest -m slow tests/integration/test_soak.py -s`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as spb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as spb_grpc

from router.client import AsyncRouterClient, RouterClient
from tests.integration.test_cluster import serve  # noqa: F401 - the fixture
from tests.procfs import rss_mb

pytestmark = pytest.mark.slow

CONCURRENCY = 8



async def _one(client: AsyncRouterClient, rng: random.Random, counts: dict[str, int], errors: list[str]) -> None:
    kind = rng.choice(["stream", "stream", "cancel", "deadline", "n3", "long"])
    counts[kind] = counts.get(kind, 0) + 1
    prompt: str | list[int] = "Once upon a time"
    args: dict = {"max_new_tokens": 32, "ignore_eos": True, "temperature": 0.8, "seed": rng.randrange(1 << 30)}
    timeout = 60.0
    if kind == "n3":
        args["n"] = 3
    elif kind == "long":
        prompt = [rng.randrange(500) for _ in range(200)]
        args["max_new_tokens"] = 16
    elif kind == "deadline":
        timeout = rng.uniform(0.02, 0.3)
    async def consume() -> None:
        async for _ in client.generate(prompt, timeout=timeout, **args):
            pass

    try:
        if kind == "cancel":  # the client goes away 0-50 ms in
            task = asyncio.ensure_future(consume())
            await asyncio.sleep(rng.uniform(0, 0.05))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return
        await consume()
    except grpc.aio.AioRpcError as exc:
        if not (kind == "deadline" and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
            errors.append(f"{kind}: {exc.code().name}: {exc.details()}")


@pytest.mark.timeout(60 * float(os.environ.get("LLMSERVE_SOAK_MINUTES", "30")) + 600)
def test_soak(serve) -> None:  # noqa: F811
    minutes = float(os.environ.get("LLMSERVE_SOAK_MINUTES", "30"))
    s = serve("--dp", "2")
    s.wait_line("serving; Ctrl-C or SIGTERM stops the cluster")
    pids = s.pids()
    router = s.router
    samples: list[tuple[float, dict[str, float]]] = []
    counts: dict[str, int] = {}
    errors: list[str] = []

    async def traffic() -> None:
        rng = random.Random(0)
        end = time.monotonic() + 60 * minutes
        next_sample = time.monotonic()
        async with AsyncRouterClient(router) as client:
            await client.wait_ready()
            running: set[asyncio.Task] = set()
            while time.monotonic() < end:
                while len(running) < CONCURRENCY:
                    running.add(asyncio.ensure_future(_one(client, rng, counts, errors)))
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
                if time.monotonic() >= next_sample:
                    samples.append((time.monotonic(), {name: rss_mb(pid) for name, pid in pids.items()}))
                    next_sample += 30
            await asyncio.gather(*running)

    asyncio.run(traffic())
    samples.append((time.monotonic(), {name: rss_mb(pid) for name, pid in pids.items()}))
    time.sleep(2)  # aborts of the last cancels land
    with RouterClient(router, timeout=10) as client:
        addresses = [g.address for g in client.list_workers().groups]
    for address in addresses:
        with grpc.insecure_channel(address) as ch:
            load = spb_grpc.SglangSchedulerStub(ch).GetLoads(spb.GetLoadsRequest(), timeout=10).loads[0]
        assert (load.num_running_reqs, load.num_waiting_reqs, load.num_used_tokens) == (0, 0, 0), load
    warm = samples[len(samples) // 3][1]
    last = samples[-1][1]
    total = sum(counts.values())
    print(f"\nsoak {minutes:g} min: {total} requests {counts}; unexpected errors {len(errors)}")
    for name in pids:
        print(f"  {name}: RSS start {samples[0][1][name]:.0f} MB, at 1/3 {warm[name]:.0f} MB, end {last[name]:.0f} MB "
              f"({100 * (last[name] / warm[name] - 1):+.1f}% over the last 2/3)")
    assert not errors, errors[:10]
    for name in pids:
        assert last[name] <= 1.05 * warm[name], (name, warm[name], last[name])
