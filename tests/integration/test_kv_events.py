"""SubscribeKvEvents over real gRPC on 127.0.0.1 against a tiny-model worker (worker_svc/server/kv_events.py):
Stored events carry the prompt's blocks with sglang's chained hashes, FlushCache gives a Cleared, a
subscriber from 0 gets a snapshot, one with a cursor gets the batches after it (OUT_OF_RANGE outside
the window), idle streams get load-only heartbeats, recording stops after the last subscriber leaves,
and a subscriber that falls behind is dropped with DATA_LOSS while the others carry on."""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from llmserve.kv_hash import prefix_block_hashes
from tests.integration.conftest import worker_engine_config
from worker_svc.engine.engine import Engine
from worker_svc.engine.engine_loop import EngineLoop
from worker_svc.sampling import SamplingParams
from worker_svc.server.app import ServerThread, WorkerServer
from worker_svc.server.kv_events import KvEventPublisher, KvEventsOptions, SubscriberDropped
from worker_svc.server.servicer import WorkerOptions

B = 4  # block size of these tests' workers
TIMEOUT = 30
OPTIONS = KvEventsOptions(block_size=B, heartbeat_s=0.2, heartbeat_idle_s=0.4, linger_s=0.3)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


class Subscription:
    """A SubscribeKvEvents stream read by a background thread into a queue."""

    def __init__(self, address: str, start: int = 0, load_first: bool = False) -> None:
        self.channel = grpc.insecure_channel(address)
        request = cpb.SubscribeKvEventsRequest(start_sequence_number=start, load_records_before_first_batch=load_first)
        self.call = pb_grpc.SglangSchedulerStub(self.channel).SubscribeKvEvents(request)
        self.items: queue.Queue[cpb.KvEventBatch | grpc.RpcError] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.items.put(batch)
        except grpc.RpcError as exc:
            self.items.put(exc)

    def next(self, timeout: float = TIMEOUT) -> cpb.KvEventBatch:
        item = self.items.get(timeout=timeout)
        if isinstance(item, grpc.RpcError):
            raise item
        return item

    def next_events(self, timeout: float = TIMEOUT) -> cpb.KvEventBatch:
        """The next batch that is not load-only."""
        deadline = time.monotonic() + timeout
        while True:
            batch = self.next(max(0.01, deadline - time.monotonic()))
            if not batch.load.load_only:
                return batch

    def error(self, timeout: float = TIMEOUT) -> grpc.RpcError:
        deadline = time.monotonic() + timeout
        while True:
            item = self.items.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(item, grpc.RpcError):
                return item

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


@pytest.fixture(scope="module")
def server(worker_model):
    engine = Engine(worker_engine_config(worker_model))
    srv = WorkerServer(engine, options=WorkerOptions(served_model_name="tiny-kv", kv_events=OPTIONS))
    thread = ServerThread(srv)
    thread.start()
    yield srv
    thread.stop(grace=0.5)


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.SglangSchedulerStub(channel)


def _generate(stub, ids: list[int], max_new: int = 3) -> pb.GenerateComplete:
    request = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=max_new),
    )
    (done,) = [r.complete for r in stub.Generate(request, timeout=TIMEOUT) if r.WhichOneof("response") == "complete"]
    return done


def _blocks(batch: cpb.KvEventBatch) -> list[tuple[int, list[int]]]:
    return [(b.block_hash, list(b.token_ids)) for e in batch.events if e.HasField("stored") for b in e.stored.blocks]


def _wait(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_events_of_a_request_a_flush_a_snapshot_and_a_resume(server, stub):
    cache = server.loop.scheduler.cache
    prompt = _prompt(22, seed=1)
    _generate(stub, prompt)
    assert cache.events is None  # nobody listens: nothing is hashed or recorded
    assert stub.FlushCache(cpb.FlushCacheRequest(), timeout=TIMEOUT).success

    first = Subscription(server.address, load_first=True)
    # Before any batch: a load record numbered 0. Then the tree as it stands (empty): a clear.
    hello = first.next()
    assert hello.load.load_only and hello.sequence_number == 0 and hello.load.max_running_requests == 4
    start = first.next_events()
    assert [e.WhichOneof("data") for e in start.events] == ["cleared"] and start.sequence_number > 0
    assert not start.load.load_only and start.load.max_running_requests == 4
    seq = start.sequence_number

    done = _generate(stub, prompt, max_new=3)
    # After the prefill the prompt's 5 full blocks; when it finishes, the block its output completes.
    prefill = first.next_events()
    assert prefill.sequence_number == seq + 1
    (stored,) = [e.stored for e in prefill.events]
    assert not stored.HasField("parent_block_hash")
    assert [list(b.token_ids) for b in stored.blocks] == [prompt[i : i + B] for i in range(0, 20, B)]
    assert [b.block_hash for b in stored.blocks] == prefix_block_hashes(prompt, B)
    assert {b.block_size for b in stored.blocks} == {B}
    finish = first.next_events()
    assert finish.sequence_number == seq + 2
    full = prompt + list(done.output_ids)[:2]  # the last output token's KV is never computed
    (stored,) = [e.stored for e in finish.events]
    assert stored.parent_block_hash == prefix_block_hashes(prompt, B)[-1]
    assert _blocks(finish) == [(prefix_block_hashes(full, B)[5], full[20:24])]
    assert finish.load.running_requests == 0 and finish.load.sample > prefill.load.sample
    # Idle: load-only heartbeats that repeat the last sequence.
    beat = first.next(timeout=2)
    assert beat.load.load_only and beat.sequence_number == seq + 2 and not beat.events

    # A second subscriber from 0 gets a snapshot cut at the newest batch: a clear, then every block.
    second = Subscription(server.address)
    snap = second.next_events()
    assert snap.HasField("snapshot") and (snap.snapshot.index, snap.snapshot.count) == (0, 1)
    assert snap.sequence_number == seq + 2 and snap.snapshot.blocks == 6 and snap.snapshot.unknown_before == 0
    assert snap.events[0].HasField("cleared")
    assert _blocks(snap) == list(zip(prefix_block_hashes(full, B), [full[i : i + B] for i in range(0, 24, B)],
                                     strict=True))

    # A subscriber resuming from a cursor gets exactly the batches after it, then live ones.
    resumed = Subscription(server.address, start=seq)
    assert [_blocks(resumed.next_events()) for _ in range(2)] == [_blocks(prefill), _blocks(finish)]

    # FlushCache: every stream gets one batch with a clear.
    assert stub.FlushCache(cpb.FlushCacheRequest(), timeout=TIMEOUT).success
    for sub in (first, second, resumed):
        flushed = sub.next_events()
        assert flushed.sequence_number == seq + 3 and [e.WhichOneof("data") for e in flushed.events] == ["cleared"]

    # Cursors outside the window: before it (another process's, say) and beyond the newest batch.
    for cursor in (1, seq + 10):
        bad = Subscription(server.address, start=cursor)
        err = bad.error()
        assert err.code() == grpc.StatusCode.OUT_OF_RANGE and "start_sequence_number" in err.details()
        bad.close()

    # Cancelled streams free their subscriptions; after linger_s recording stops and the history goes.
    for sub in (first, second, resumed):
        sub.close()
    _wait(lambda: server.servicer.kv_events.subscribers == 0)
    _wait(lambda: cache.events is None)
    err = Subscription(server.address, start=seq).error()  # the history is gone
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE
    # Subscribing from the newest cursor is allowed: recording restarts with a clear and the tree.
    _generate(stub, prompt, max_new=1)  # not recorded: nobody listens
    again = Subscription(server.address, start=seq + 3)
    restart = again.next_events()
    assert restart.sequence_number == seq + 4 and restart.events[0].HasField("cleared")
    assert [h for h, _ in _blocks(restart)] == prefix_block_hashes(prompt, B)
    again.close()


def test_streams_end_when_the_worker_stops(worker_model):
    srv = WorkerServer(Engine(worker_engine_config(worker_model)), options=WorkerOptions(kv_events=OPTIONS))
    thread = ServerThread(srv)
    thread.start()
    sub = Subscription(srv.address, load_first=True)
    sub.next()
    started = time.monotonic()
    thread.stop(grace=5.0)
    assert time.monotonic() - started < 3  # the open stream did not hold the shutdown for its grace
    assert sub.error(timeout=5).code() == grpc.StatusCode.UNAVAILABLE
    sub.close()


def test_a_subscriber_that_falls_behind_is_dropped_with_data_loss(worker_model):
    """At the publisher (the gRPC transport buffers too much to make a reader lag on cue): a
    subscriber that reads nothing is cut off once ``subscriber_queue`` batches wait for it; one that
    keeps up gets every batch."""
    engine_loop = EngineLoop(Engine(worker_engine_config(worker_model)))
    engine_loop.start()

    async def scenario() -> None:
        publisher = KvEventPublisher(engine_loop, KvEventsOptions(block_size=B, subscriber_queue=2))
        slow, fast = publisher.subscribe(0, False), publisher.subscribe(0, False)
        got: list[int] = []

        async def read_fast() -> None:
            async for batch in publisher.stream(fast):
                if not batch.load.load_only:
                    got.append(batch.sequence_number)

        reader = asyncio.ensure_future(read_fast())
        aio = asyncio.get_running_loop()
        for i in range(4):  # each request stores blocks after its prefill: at least one batch each
            finished = asyncio.Event()
            engine_loop.submit(_prompt(12, seed=10 + i), SamplingParams(max_new_tokens=1, temperature=0.0),
                               f"r{i}", lambda out, e=finished: out.finished and aio.call_soon_threadsafe(e.set))
            await finished.wait()
        deadline = time.monotonic() + 10
        while len(got) < 5:  # the recording's first batch (a clear), then one per prefill
            # Seen once in a full run under load (got == [], cause not found): say how the reader ended.
            assert time.monotonic() < deadline, (got, reader.done() and reader.exception())
            await asyncio.sleep(0.01)
        assert got == list(range(publisher.base + 1, publisher.seq + 1))
        with pytest.raises(SubscriberDropped) as dropped:
            async for _ in publisher.stream(slow):
                pass
        assert dropped.value.data_loss and "behind" in str(dropped.value)
        reader.cancel()
        publisher.unsubscribe(slow)
        publisher.unsubscribe(fast)

    try:
        asyncio.run(scenario())
    finally:
        engine_loop.stop()


def test_a_snapshot_is_cut_when_the_subscriber_joins_and_chunked(worker_model):
    """Batches published between the subscription and its first read follow the snapshot, not
    into it; a step storing more than ``max_blocks_per_batch`` blocks is split, and so is the
    snapshot, into chunks numbered up to the cut."""
    engine_loop = EngineLoop(Engine(worker_engine_config(worker_model)))
    engine_loop.start()

    async def scenario() -> None:
        publisher = KvEventPublisher(engine_loop, KvEventsOptions(block_size=B, max_blocks_per_batch=2))
        aio = asyncio.get_running_loop()

        async def generate(ids: list[int], rid: str, until_seq: int) -> None:
            done = asyncio.Event()
            engine_loop.submit(ids, SamplingParams(max_new_tokens=1, temperature=0.0), rid,
                               lambda out: out.finished and aio.call_soon_threadsafe(done.set))
            await done.wait()
            deadline = time.monotonic() + 10
            while publisher.seq < until_seq:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)

        watcher = publisher.subscribe(0, False)  # recording on: its first batch is a clear
        a, b = _prompt(12, seed=20), _prompt(8, seed=21)
        await generate(a, "a", publisher.base + 3)  # a's three blocks: two batches of at most two
        joined = publisher.subscribe(0, False)
        cut = publisher.seq
        await generate(b, "b", cut + 1)
        got = []
        async for batch in publisher.stream(joined):
            got.append(batch)
            if batch.sequence_number == cut + 1:
                break
        assert [g.sequence_number for g in got] == [cut - 1, cut, cut + 1]
        assert [(g.snapshot.index, g.snapshot.count, g.snapshot.blocks) for g in got[:2]] == [(0, 2, 3), (1, 2, 3)]
        assert got[0].events[0].HasField("cleared") and not got[2].HasField("snapshot")
        hashes = prefix_block_hashes(a, B)
        assert [_blocks(g) for g in got[:2]] == [[(hashes[0], a[0:4]), (hashes[1], a[4:8])], [(hashes[2], a[8:12])]]
        assert got[1].events[0].stored.parent_block_hash == hashes[1]
        assert [h for h, _ in _blocks(got[2])] == prefix_block_hashes(b, B)
        publisher.unsubscribe(joined)
        publisher.unsubscribe(watcher)

    try:
        asyncio.run(scenario())
    finally:
        engine_loop.stop()
