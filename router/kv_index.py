"""A worker group's prefix cache as its KV event stream (SglangScheduler.SubscribeKvEvents) tells it:
the set of block hashes the group holds, kept current by one streaming call per group; the prefix
policy (router/workers.py) scores a prompt by how many of its leading blocks a group holds.

Block hashes chain (llmserve/kv_hash.py): a block's hash names its whole prefix, and a cache holds a
block's prefix whenever it holds the block, so the prompt's blocks are looked up in order until the
first one no group holds. The block size is learned from the stored events.

The follower subscribes with ``load_records_before_first_batch`` (so a worker that has stored nothing
yet still shows the stream is up) and resumes from the last batch it applied; OUT_OF_RANGE (the
worker restarted, or its history no longer reaches back) and DATA_LOSS (this router fell behind)
clear the mirror and resubscribe from 0, which brings a snapshot. A worker that answers UNIMPLEMENTED
(its radix cache is off, or not ours) is asked again every ``retry_unsupported_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc
from smg_grpc_proto import sglang_scheduler_pb2_grpc as spb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from llmserve.kv_hash import iter_block_hashes
from llmserve.logging import get_logger

log = get_logger(__name__)


class KvMirror:
    """What one group has cached, as far as its event stream says; ``live`` while the stream is up."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.block_size: int | None = None
        self.last_seq = 0  # the last batch applied (0: none; resubscribe from 0)
        self.live = False
        self.unsupported = False

    def reset(self) -> None:
        self.blocks.clear()
        self.last_seq = 0

    def apply(self, batch: cpb.KvEventBatch) -> bool:
        """Apply one batch; False on a sequence gap (resubscribe from ``last_seq`` to replay it)."""
        if batch.load.load_only:
            return True
        seq = batch.sequence_number
        if not batch.HasField("snapshot") and self.last_seq:
            if seq <= self.last_seq:
                return True  # already applied (a replay overlapping what we had)
            if seq > self.last_seq + 1:
                return False
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                for block in event.stored.blocks:
                    self.blocks.add(block.block_hash)
                    if block.block_size > 0:
                        self.block_size = block.block_size
            elif kind == "removed":
                self.blocks.difference_update(event.removed.block_hashes)
            elif kind == "cleared":
                self.blocks.clear()
        self.last_seq = seq
        return True


def matched_tokens(prompt_ids: Sequence[int], mirrors: Sequence[KvMirror]) -> list[int]:
    """For each mirror, how many leading prompt tokens it holds (whole blocks). Hashes each block once
    per block size and stops at the first block no mirror of that size holds."""
    out = [0] * len(mirrors)
    by_size: dict[int, list[int]] = {}
    for i, m in enumerate(mirrors):
        if m.block_size is not None and m.blocks:
            by_size.setdefault(m.block_size, []).append(i)
    for size, members in by_size.items():
        still = members
        for n, block in enumerate(iter_block_hashes(prompt_ids, size), start=1):
            still = [i for i in still if block in mirrors[i].blocks]
            if not still:
                break
            for i in still:
                out[i] = n * size
    return out


async def follow(stub: spb_grpc.SglangSchedulerStub, mirror: KvMirror, name: str,
                 healthy: Callable[[], bool], retry_unsupported_s: float = 30.0) -> None:
    """Keep ``mirror`` current from the group's event stream until cancelled."""
    delay = 0.1
    while True:
        if not healthy():  # a group that is down is not worth a reconnect storm; its probe brings it back
            await asyncio.sleep(1.0)
            continue
        request = cpb.SubscribeKvEventsRequest(start_sequence_number=mirror.last_seq,
                                               load_records_before_first_batch=True)
        call = stub.SubscribeKvEvents(request)
        try:
            async for batch in call:
                if not mirror.live:
                    mirror.live, mirror.unsupported, delay = True, False, 0.1
                    log.info("KV event stream up", group=name, start_sequence_number=request.start_sequence_number)
                if not mirror.apply(batch):
                    log.warning("KV event sequence gap; resubscribing", group=name, last=mirror.last_seq,
                                received=batch.sequence_number)
                    call.cancel()
                    break
            else:
                log.info("KV event stream ended", group=name)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.DATA_LOSS):
                log.info("KV event stream needs a resync", group=name, code=code.name, details=exc.details())
                mirror.reset()
                continue
            if code == grpc.StatusCode.UNIMPLEMENTED:
                if not mirror.unsupported:
                    log.info("worker group publishes no KV events; prefix policy falls back to hashing",
                             group=name, details=exc.details())
                mirror.unsupported = True
                mirror.reset()
                await asyncio.sleep(retry_unsupported_s)
                continue
            log.info("KV event stream failed", group=name, code=code.name, retry_s=delay)
        finally:
            mirror.live = False
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)
