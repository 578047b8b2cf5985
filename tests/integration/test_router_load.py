"""Load against admission control (issue 11, acceptance 5): 1000 concurrent streams at a router whose
cap is 256, on a real cluster (tokenizer service, one worker, the router, as processes). The excess
is refused with RESOURCE_EXHAUSTED at once, every admitted stream finishes, and the router's RSS
stays bounded. Slow (about a minute on 2 cores): `pytest -m slow tests/integration/test_router_load.py -s`."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from router.client import AsyncRouterClient
from tests.integration.test_router import Proc, one_group_cluster

pytestmark = pytest.mark.slow

STREAMS, CAP = 1000, 256


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def router(model_factory, tmp_path_factory) -> Iterator[Proc]:
    worker_flags = ["--dtype", "float32", "--max-running-requests", "64", "--max-total-tokens", "16384",
                    "--context-length", "256"]
    with one_group_cluster(model_factory("tiny"), tmp_path_factory.mktemp("load"), worker_flags,
                           ["--max-concurrent-requests", str(CAP)]) as (_, _, router):
        yield router


def test_1000_streams_against_a_cap_of_256(router: Proc) -> None:
    peak = {"rss": _rss_mb(router.proc.pid)}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak["rss"] = max(peak["rss"], _rss_mb(router.proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    async def one(client: AsyncRouterClient, i: int) -> tuple[str, float]:
        start = time.monotonic()
        try:
            (c,) = await client.complete("Hello there", max_new_tokens=8, ignore_eos=True, request_id=f"load-{i}")
            return c.finish.reason, time.monotonic() - start
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, time.monotonic() - start

    async def scenario() -> list[tuple[str, float]]:
        # Ten connections, as many clients would open (one HTTP/2 connection serializes its streams'
        # setup in the client).
        clients = [AsyncRouterClient(router.address, timeout=120) for _ in range(10)]
        try:
            for c in clients:
                await c.wait_ready()
            return await asyncio.gather(*(one(clients[i % 10], i) for i in range(STREAMS)))
        finally:
            for c in clients:
                await c.close()

    start_rss = peak["rss"]
    results = asyncio.run(scenario())
    stop.set()
    sampler.join()
    refused = [s for code, s in results if code == "RESOURCE_EXHAUSTED"]
    finished = [s for code, s in results if code == "length"]
    other = [code for code, _ in results if code not in ("RESOURCE_EXHAUSTED", "length")]
    refused_ms = sorted(1e3 * s for s in refused)
    print(f"\n{len(finished)} finished, {len(refused)} refused, other {other}; refusal latency ms: "
          f"p50 {statistics.median(refused_ms):.0f} p99 {refused_ms[int(0.99 * (len(refused_ms) - 1))]:.0f} "
          f"max {refused_ms[-1]:.0f}; admitted e2e s: p50 {statistics.median(finished):.2f} max {max(finished):.2f}; "
          f"router RSS {start_rss:.0f} -> peak {peak['rss']:.0f} MB")
    assert not other
    assert len(finished) >= CAP and len(finished) + len(refused) == STREAMS and refused
    assert peak["rss"] < 300
    # Refusals are immediate: the median well under 100 ms (the client's own 1000 calls on 2 shared
    # cores are part of what is measured).
    assert statistics.median(refused_ms) < 100
