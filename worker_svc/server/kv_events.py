"""The worker's KV event stream (SglangScheduler.SubscribeKvEvents): the radix cache's events, batched
once per engine step, numbered, kept in a bounded replay history and fanned out to subscribers on the
server's event loop.

- Recording costs the engine nothing until the first subscriber: then the engine thread installs a
  recorder in the radix cache (``RadixCache.start_events``), whose first batch is a clear plus every
  block the tree holds; ``linger_s`` after the last subscriber leaves it is removed again (and the
  history dropped). The engine thread only collects plain event objects and, after a step that made
  some, hands the list over with one ``call_soon_threadsafe``; protos are built here.
- Sequence numbers rise by one per batch from a base taken from the clock at start (microseconds), so
  a cursor from an earlier process of the same worker is below the window, never inside it.
- ``start_sequence_number`` N > 0 is the last batch the subscriber applied: inside the history the
  batches after it come first, then live ones; below the history or beyond the newest batch it is
  OUT_OF_RANGE (the subscriber clears what it knows and subscribes from 0). N = 0: once anything was
  published, a snapshot of the live blocks (``KvSnapshotChunk``: chunk 0 starts with a clear, stores
  follow parents first, the chunks numbered consecutively up to the newest batch), then live batches.
- Every batch carries the engine's load (``EngineLoad``, GetLoads' numbers); while no batch flows a
  ``load_only`` batch repeating the stream's last sequence goes out when the load changed (checked
  every ``load_tick_s``) and as a heartbeat after ``heartbeat_s`` of silence (``heartbeat_idle_s``
  once two heartbeats in a row found nothing changed). Before its first batch a stream gets them
  (numbered 0) only if it asked (``load_records_before_first_batch``).
- A subscriber more than ``subscriber_queue`` batches behind is dropped with DATA_LOSS (resubscribe
  from 0 for a snapshot): a slow reader never holds the engine or the other streams back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import structlog
from smg_grpc_proto.generated import common_pb2 as cpb

from worker_svc.engine.engine_loop import EngineLoop, EngineUnavailable, LoadSnapshot, LoopState
from worker_svc.kvcache.kv_events import BlocksRemoved, CacheCleared, KvEvent, KvEventRecorder

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class KvEventsOptions:
    block_size: int = 16  # tokens per announced block (--kv-events-block-size); the pool's page stays 1
    history_batches: int = 1024  # batches kept for subscribers that resume from a cursor
    subscriber_queue: int = 1024  # batches a subscriber may fall behind before it is dropped
    max_blocks_per_batch: int = 2048  # bigger steps are split; also the blocks of one snapshot chunk
    linger_s: float = 30.0  # recording stays on this long after the last subscriber left
    load_tick_s: float = 0.1
    heartbeat_s: float = 1.0
    heartbeat_idle_s: float = 5.0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("--kv-events-block-size must be positive")
        for name in ("history_batches", "subscriber_queue", "max_blocks_per_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KV events: {name} must be positive")


class CursorOutOfRange(Exception):
    """The subscriber's cursor is not in the replay window (OUT_OF_RANGE)."""


class SubscriberDropped(Exception):
    """The subscriber fell too far behind (DATA_LOSS) or the worker stops (UNAVAILABLE)."""

    def __init__(self, message: str, data_loss: bool) -> None:
        super().__init__(message)
        self.data_loss = data_loss


@dataclass(eq=False)
class _Subscriber:
    last_seq: int  # the last sequence this stream was given (0: none yet)
    load_before_first: bool
    initial: Iterator[cpb.KvEventBatch]  # snapshot chunks or replayed batches, then live ones
    pending: deque[cpb.KvEventBatch] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: str | None = None
    sample: int = 0
    last_load: cpb.EngineLoad | None = None
    last_sent: float = 0.0  # monotonic
    quiet_heartbeats: int = 0  # heartbeats in a row that found the load unchanged


def _load_changed(last: cpb.EngineLoad, now: cpb.EngineLoad) -> bool:
    """A change worth a load-only batch (the gateway's own rule): any count, KV usage by half a
    percent, the rate by 5 % or 50 tokens/s."""
    if (last.running_requests, last.waiting_requests, last.waiting_uncached_tokens, last.max_running_requests) != (
            now.running_requests, now.waiting_requests, now.waiting_uncached_tokens, now.max_running_requests):
        return True
    if abs(last.token_usage - now.token_usage) > 0.005:
        return True
    delta = abs(last.gen_throughput - now.gen_throughput)
    return delta > 50.0 or delta > 0.05 * max(last.gen_throughput, now.gen_throughput)


class KvEventPublisher:
    """One per worker; every method but the engine-thread listener runs on the server's event loop."""

    def __init__(self, engine_loop: EngineLoop, options: KvEventsOptions) -> None:
        self.engine_loop = engine_loop
        self.options = options
        self.base = time.time_ns() // 1000
        self.seq = self.base  # the newest published batch (== base: none yet)
        self._history: deque[cpb.KvEventBatch] = deque(maxlen=options.history_batches)
        self._live: dict[int, tuple[int | None, list[int]]] = {}  # block hash -> (parent, tokens), parents first
        self._subscribers: set[_Subscriber] = set()
        self._recording = False
        self._linger: asyncio.TimerHandle | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._event_id = 0
        self._recorder: KvEventRecorder | None = None  # engine thread only
        engine_loop.add_step_listener(self._take_events)

    # ---- the engine thread -----------------------------------------------------------------------

    def _take_events(self) -> None:
        """After every step: hand the step's events (if any) to the event loop in one call."""
        recorder = self._recorder
        if recorder is None:
            return
        events = recorder.take()
        if events and self._aio is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody listens
                self._aio.call_soon_threadsafe(self._publish, events)

    def _start_recording(self) -> None:
        cache = self.engine_loop.scheduler.cache
        assert cache is not None
        self._recorder = cache.start_events(self.options.block_size)

    def _stop_recording(self) -> None:
        cache = self.engine_loop.scheduler.cache
        self._recorder = None
        if cache is not None:
            cache.stop_events()

    # ---- publishing ------------------------------------------------------------------------------

    def _publish(self, events: list[KvEvent]) -> None:
        if not self._recording:
            return  # recorded before recording was switched off: nobody holds a cursor into it
        for batch_events in self._split(events):
            self.seq += 1
            batch = cpb.KvEventBatch(sequence_number=self.seq, timestamp=time.time(), events=batch_events)
            self._history.append(batch)
            for sub in self._subscribers:
                self._offer(sub, batch)

    def _split(self, events: list[KvEvent]) -> Iterator[list[cpb.KvCacheEvent]]:
        """Protos of the step's events in batches of at most ``max_blocks_per_batch`` stored blocks
        (so a snapshot never needs more chunks than there are batches), folded into the live record."""
        limit, size = self.options.max_blocks_per_batch, self.options.block_size
        out: list[cpb.KvCacheEvent] = []
        blocks = 0
        for event in events:
            if isinstance(event, CacheCleared):
                self._live.clear()
                out.append(self._event(cleared=cpb.KvCacheCleared()))
            elif isinstance(event, BlocksRemoved):
                for h in event.hashes:
                    self._live.pop(h, None)
                out.append(self._event(removed=cpb.KvBlocksRemoved(block_hashes=event.hashes)))
            else:
                parent, start = event.parent, 0
                while start < len(event.hashes):
                    if blocks == limit:
                        yield out
                        out, blocks = [], 0
                    take = min(limit - blocks, len(event.hashes) - start)
                    hashes, tokens = event.hashes[start : start + take], event.tokens[start : start + take]
                    out.append(self._event(stored=_stored(parent, hashes, tokens, size)))
                    for h, toks in zip(hashes, tokens, strict=True):
                        self._live[h] = (parent, toks)
                        parent = h
                    blocks += take
                    start += take
        if out:
            yield out

    def _event(self, **data) -> cpb.KvCacheEvent:
        self._event_id += 1
        return cpb.KvCacheEvent(event_id=self._event_id, **data)

    def _offer(self, sub: _Subscriber, batch: cpb.KvEventBatch) -> None:
        if sub.dropped is not None:
            return
        if len(sub.pending) >= self.options.subscriber_queue:
            sub.dropped = f"KV event subscriber fell more than {self.options.subscriber_queue} batches behind"
            sub.pending.clear()
        else:
            sub.pending.append(batch)
        sub.wake.set()

    # ---- subscriptions ---------------------------------------------------------------------------

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(self, start: int, load_before_first: bool) -> _Subscriber:
        """Register a stream from cursor ``start`` (see the module doc); raises CursorOutOfRange or
        EngineUnavailable. Synchronous, so nothing is published between the cut and the registration."""
        self._aio = asyncio.get_running_loop()
        if start:
            first = self._history[0].sequence_number if self._history else self.seq + 1
            if not first - 1 <= start <= self.seq:
                window = f"{first}..{self.seq}" if self._history else f"none after {self.seq}"
                raise CursorOutOfRange(f"start_sequence_number {start} is not in the replay window ({window}); "
                                       "subscribe from 0 for a snapshot")
            replay = [b for b in self._history if b.sequence_number > start]
            initial: Iterator[cpb.KvEventBatch] = iter(replay)
            last = start
        elif self.seq > self.base:
            initial, last = self._snapshot(), self.seq
        else:
            initial, last = iter(()), 0
        if not self._recording:
            self.engine_loop.call_on_engine(self._start_recording).add_done_callback(_log_failure)  # may raise
            self._recording = True
        sub = _Subscriber(last_seq=last, load_before_first=load_before_first, initial=initial)
        self._subscribers.add(sub)
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        log.info("KV event subscriber joined", start_sequence_number=start, subscribers=len(self._subscribers),
                 at=self.seq, load_records_before_first_batch=load_before_first)
        return sub

    def unsubscribe(self, sub: _Subscriber) -> None:
        self._subscribers.discard(sub)
        sub.pending.clear()
        log.info("KV event subscriber left", subscribers=len(self._subscribers), reason=sub.dropped or "stream ended")
        if not self._subscribers and self._recording and self._linger is None:
            assert self._aio is not None
            self._linger = self._aio.call_later(self.options.linger_s, self._stop_if_unwatched)

    def _stop_if_unwatched(self) -> None:
        self._linger = None
        if self._subscribers or not self._recording:
            return
        self._recording = False
        self._history.clear()
        self._live.clear()
        with contextlib.suppress(EngineUnavailable):
            self.engine_loop.call_on_engine(self._stop_recording).add_done_callback(_log_failure)
        log.info("KV event recording stopped: no subscriber", linger_s=self.options.linger_s)

    def _snapshot(self) -> Iterator[cpb.KvEventBatch]:
        """The live blocks as of now, in chunks numbered up to the newest sequence. The record is
        copied now (the cut); the protos are built as the stream sends them."""
        items = list(self._live.items())
        limit, cut = self.options.max_blocks_per_batch, self.seq
        count = max(1, -(-len(items) // limit))
        assert count <= cut - self.base  # each batch stores at most `limit` blocks
        return self._chunks(items, count, cut)

    def _chunks(self, items: list[tuple[int, tuple[int | None, list[int]]]], count: int,
                cut: int) -> Iterator[cpb.KvEventBatch]:
        limit, size = self.options.max_blocks_per_batch, self.options.block_size
        for index in range(count):
            chunk = items[index * limit : (index + 1) * limit]
            events = [cpb.KvCacheEvent(cleared=cpb.KvCacheCleared())] if index == 0 else []
            run_parent: int | None = None
            hashes: list[int] = []
            tokens: list[list[int]] = []
            for h, (parent, toks) in chunk:  # runs of chained blocks become one store
                if hashes and parent != hashes[-1]:
                    events.append(cpb.KvCacheEvent(stored=_stored(run_parent, hashes, tokens, size)))
                    hashes, tokens = [], []
                if not hashes:
                    run_parent = parent
                hashes.append(h)
                tokens.append(toks)
            if hashes:
                events.append(cpb.KvCacheEvent(stored=_stored(run_parent, hashes, tokens, size)))
            yield cpb.KvEventBatch(
                sequence_number=cut - count + 1 + index, timestamp=time.time(), events=events,
                snapshot=cpb.KvSnapshotChunk(index=index, count=count, blocks=len(items), unknown_before=0),
            )

    # ---- one stream ------------------------------------------------------------------------------

    async def stream(self, sub: _Subscriber) -> AsyncIterator[cpb.KvEventBatch]:
        """The subscriber's batches with the load attached; raises SubscriberDropped to end it."""
        opts = self.options
        sent_any = False
        for batch in sub.initial:
            yield self._with_load(sub, batch, telemetry=not sent_any)
            sent_any = True
        if not sent_any and (sub.last_seq or sub.load_before_first):
            yield self._load_only(sub)
        while True:
            if sub.dropped is not None:
                raise SubscriberDropped(sub.dropped, data_loss=True)
            if self.engine_loop.state is not LoopState.RUNNING:
                state = self.engine_loop.state.value
                raise SubscriberDropped(f"worker is not serving: engine {state}", data_loss=False)
            if sub.pending:
                batch = sub.pending.popleft()
                yield self._with_load(sub, batch, telemetry=sub.last_load is None)
                continue
            sub.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(sub.wake.wait(), opts.load_tick_s)
            if sub.pending or sub.dropped is not None or not (sub.last_seq or sub.load_before_first):
                continue
            now, load = time.monotonic(), self._load(self.engine_loop.load())
            changed = sub.last_load is None or _load_changed(sub.last_load, load)
            interval = opts.heartbeat_idle_s if sub.quiet_heartbeats >= 2 else opts.heartbeat_s
            if changed:
                sub.quiet_heartbeats = 0
                yield self._load_only(sub)
            elif now - sub.last_sent >= interval:
                sub.quiet_heartbeats += 1
                yield self._load_only(sub)

    def _with_load(self, sub: _Subscriber, batch: cpb.KvEventBatch, telemetry: bool) -> cpb.KvEventBatch:
        out = cpb.KvEventBatch()
        out.CopyFrom(batch)
        out.load.CopyFrom(self._record(sub, load_only=False, telemetry=telemetry))
        sub.last_seq = batch.sequence_number
        sub.quiet_heartbeats = 0
        return out

    def _load_only(self, sub: _Subscriber) -> cpb.KvEventBatch:
        record = self._record(sub, load_only=True, telemetry=True)
        return cpb.KvEventBatch(sequence_number=sub.last_seq, timestamp=time.time(), load=record)

    def _record(self, sub: _Subscriber, load_only: bool, telemetry: bool) -> cpb.EngineLoad:
        snap = self.engine_loop.load()
        record = self._load(snap)
        sub.sample += 1
        record.sample, record.load_only = sub.sample, load_only
        if telemetry:  # the heartbeat cadence and a stream's first record
            record.cache_hit_rate = snap.cache_hit_rate
            record.num_used_tokens = snap.used_tokens
            record.max_total_num_tokens = snap.total_tokens
            record.queues.CopyFrom(cpb.EngineQueues(waiting=snap.waiting, retracted=snap.retracted_waiting))
        sub.last_load, sub.last_sent = record, time.monotonic()
        return record

    @staticmethod
    def _load(snap: LoadSnapshot) -> cpb.EngineLoad:
        """GetLoads' routing core. ``used_tokens`` already leaves out the cache's evictable part, so it
        is the active usage as well."""
        return cpb.EngineLoad(
            running_requests=snap.running,
            waiting_requests=snap.waiting,
            waiting_uncached_tokens=snap.waiting_prompt_tokens,
            token_usage=snap.token_usage,
            active_token_usage=snap.token_usage,
            gen_throughput=snap.gen_throughput,
            max_running_requests=snap.max_running_requests,
            age_ms=0,
        )


def _log_failure(future: Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("KV event recording could not be switched", error=repr(future.exception()))


def _stored(parent: int | None, hashes: list[int], tokens: list[list[int]], size: int) -> cpb.KvBlocksStored:
    stored = cpb.KvBlocksStored(
        blocks=[cpb.KvBlock(block_hash=h, token_ids=t, block_size=size) for h, t in zip(hashes, tokens, strict=True)],
        tier=cpb.KV_CACHE_TIER_DEVICE, locality=cpb.KV_CACHE_LOCALITY_LOCAL,
    )
    if parent is not None:
        stored.parent_block_hash = parent
    return stored
