"""The router's prefix policy over two real workers (processes), routing by their KV events
(router/kv_index.py): a prompt cached on one worker behind the router's back goes to that worker,
and prompts sharing a long prefix follow the first of them to one worker, whose cache serves the
prefix (cached_tokens in usage)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as spb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as spb_grpc

from llmserve.kv_hash import prefix_block_hashes
from llmserve.v1 import router_pb2 as pb
from router.client import RouterClient, collect
from router.kv_index import KvMirror, follow
from tests.integration.test_router import SERVING, Proc, _health, engine_flags, spawn, wait_for

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def cluster(model_factory, tmp_path_factory) -> Iterator[tuple[list[Proc], Proc]]:
    model = model_factory("tiny")
    workdir = tmp_path_factory.mktemp("prefix-cluster")
    tokenizer = spawn("tokenizer", ["tokenizer", "--model", str(model)], workdir)
    workers = [spawn(f"worker{i}", ["worker", "--model", str(model), *engine_flags()], workdir) for i in range(2)]
    procs = [tokenizer, *workers]
    try:
        deadline = time.monotonic() + 120
        for p in procs:
            p.wait_port(deadline)
        router = spawn("router", ["router", "--tokenizer", tokenizer.address, "--policy", "prefix",
                                  "--workers", ",".join(w.address for w in workers), "--probe-interval", "0.3"],
                       workdir)
        procs.append(router)
        router.wait_port(deadline)
        wait_for(lambda: _health(router.address) == SERVING, 60, what="router SERVING")
        with RouterClient(router.address, timeout=5) as c:
            wait_for(lambda: all(g.health == pb.WORKER_HEALTH_SERVING for g in c.list_workers().groups), 60,
                     what="both worker groups SERVING")
        wait_for(lambda: sum(r.get("event") == "KV event stream up" for r in router.log_records()) >= 2, 30,
                 what="the router's KV event streams")
        yield workers, router
    finally:
        for p in reversed(procs):
            p.stop()


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


def _routed_to(router: Proc, request_id: str) -> int:
    (group,) = [r["group"] for r in router.log_records()
                if r.get("event") == "generate routed" and r.get("request_id") == request_id]
    return group


def test_prefix_policy_follows_the_workers_caches(cluster) -> None:
    workers, router = cluster
    with RouterClient(router.address, timeout=TIMEOUT) as client:
        def run(ids: list[int], rid: str) -> tuple[int, int]:
            (c,) = collect(list(client.generate(ids, request_id=rid, max_new_tokens=4, temperature=0,
                                                ignore_eos=True)))
            assert c.finish is not None and c.finish.completion_tokens == 4
            time.sleep(0.3)  # its KV events reach the router before the next request
            return _routed_to(router, rid), c.finish.cached_tokens

        # Cached on worker k by a Generate straight to it: only the worker's events tell the router.
        behind = [_ids(100, seed=k) for k in range(2)]
        for k, ids in enumerate(behind):
            request = spb.GenerateRequest(tokenized=spb.TokenizedInput(input_ids=ids),
                                          sampling_params=spb.SamplingParams(temperature=0.0, max_new_tokens=1))
            with grpc.insecure_channel(workers[k].address) as ch:
                list(spb_grpc.SglangSchedulerStub(ch).Generate(request, timeout=TIMEOUT))
        time.sleep(0.3)
        for k, ids in enumerate(behind):
            group, cached = run(ids + [1, 2, 3], f"behind-{k}")
            assert group == k and cached >= 96, (k, group, cached)

        # A new long prefix with four different endings: the first lands somewhere (no match: the
        # less loaded group), the rest follow it and find the prefix cached.
        prefix = _ids(120, seed=7)
        results = [run(prefix + _ids(10, seed=100 + i), f"shared-{i}") for i in range(4)]
        groups = {g for g, _ in results}
        assert len(groups) == 1, results
        assert results[0][1] == 0 and all(cached >= 112 for _, cached in results[1:]), results


def test_the_mirror_resyncs_when_a_worker_restarts_on_its_address(model_factory) -> None:
    """A worker restarted on the same address numbers its batches from a later base: the router's
    cursor is outside its window (OUT_OF_RANGE), so the mirror clears and takes a snapshot of the new
    process's cache instead of mixing the two."""
    from tests.integration.conftest import worker_engine_config
    from worker_svc.engine.engine import Engine
    from worker_svc.server.app import ServerThread, WorkerServer

    model = model_factory("tiny")

    def start(port: int) -> ServerThread:
        thread = ServerThread(WorkerServer(Engine(worker_engine_config(model)), port=port))
        thread.start()
        return thread

    def generate(address: str, ids: list[int]) -> None:
        request = spb.GenerateRequest(tokenized=spb.TokenizedInput(input_ids=ids),
                                      sampling_params=spb.SamplingParams(temperature=0.0, max_new_tokens=1))
        with grpc.insecure_channel(address) as ch:
            list(spb_grpc.SglangSchedulerStub(ch).Generate(request, timeout=TIMEOUT))

    async def until(predicate, what: str) -> None:
        deadline = time.monotonic() + 20
        while not predicate():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.02)

    async def scenario() -> None:
        first = start(0)
        port = first.server.port
        assert port is not None
        address = f"127.0.0.1:{port}"
        channel = grpc.aio.insecure_channel(address)
        mirror = KvMirror()
        up = [True]  # the follower waits while its group is down (the pool's probes say so)
        task = asyncio.ensure_future(follow(spb_grpc.SglangSchedulerStub(channel), mirror, "g", lambda: up[0]))
        old, new = _ids(32, seed=1), [_ids(32, seed=2 + i) for i in range(3)]
        try:
            await until(lambda: mirror.live, "stream up")
            await asyncio.to_thread(generate, address, old)
            await until(lambda: mirror.blocks == set(prefix_block_hashes(old, 16)), "the first worker's blocks")
            up[0] = False
            await asyncio.to_thread(first.stop, 0.5)
            await until(lambda: not mirror.live, "stream down")
            second = await asyncio.to_thread(start, port)
            other = KvMirror()  # another router, following the new process from its start
            other_task = asyncio.ensure_future(follow(spb_grpc.SglangSchedulerStub(channel), other, "h", lambda: True))
            try:
                await until(lambda: other.live, "the other stream up")
                # More batches than the old process published up to the router's cursor, so a
                # numbering that restarted would put that cursor inside the new process's window.
                for ids in new:
                    await asyncio.to_thread(generate, address, ids)
                want = {h for ids in new for h in prefix_block_hashes(ids, 16)}
                await until(lambda: other.blocks == want, "the other router's mirror")
                up[0] = True
                await until(lambda: mirror.live and mirror.blocks == want, "the new worker's blocks only")
            finally:
                other_task.cancel()
                await asyncio.to_thread(second.stop, 0.5)
        finally:
            task.cancel()
            await channel.close()

    asyncio.run(scenario())
