"""The router's mirror of a worker's prefix cache (router/kv_index.py) and the prefix policy's choice
over mirrors (router/workers.py): batches apply in sequence (stale ones skipped, a gap reported, a
snapshot resyncing), and a prompt goes to the group holding its longest prefix, to the least loaded
group on a tie or no match or when the holder is far busier, and by hashing while a stream is down."""

from __future__ import annotations

import asyncio

from smg_grpc_proto.generated import common_pb2 as cpb

from llmserve.kv_hash import prefix_block_hashes
from router.kv_index import KvMirror, matched_tokens
from router.workers import SERVING, PoolOptions, WorkerPool

B = 4


def _stored(tokens: list[int], first_block: int = 0) -> cpb.KvCacheEvent:
    hashes = prefix_block_hashes(tokens, B)[first_block:]
    blocks = [cpb.KvBlock(block_hash=h, token_ids=tokens[(first_block + i) * B:(first_block + i + 1) * B], block_size=B)
              for i, h in enumerate(hashes)]
    return cpb.KvCacheEvent(stored=cpb.KvBlocksStored(blocks=blocks))


def _batch(seq: int, *events: cpb.KvCacheEvent, **kw) -> cpb.KvEventBatch:
    return cpb.KvEventBatch(sequence_number=seq, events=events, **kw)


def test_mirror_applies_batches_in_sequence():
    a, b = list(range(12)), list(range(8)) + [90, 91, 92, 93]
    m = KvMirror()
    assert m.apply(_batch(0, load=cpb.EngineLoad(load_only=True))) and m.last_seq == 0  # a load record
    assert m.apply(_batch(10, cpb.KvCacheEvent(cleared=cpb.KvCacheCleared()), _stored(a)))
    assert m.block_size == B and m.blocks == set(prefix_block_hashes(a, B)) and m.last_seq == 10
    assert m.apply(_batch(11, _stored(b, first_block=2)))
    assert m.apply(_batch(11, cpb.KvCacheEvent(cleared=cpb.KvCacheCleared())))  # stale: skipped
    assert len(m.blocks) == 4
    removed = cpb.KvBlocksRemoved(block_hashes=prefix_block_hashes(b, B)[2:])
    assert not m.apply(_batch(13, cpb.KvCacheEvent(removed=removed)))  # 12 is missing: a gap
    assert m.last_seq == 11 and len(m.blocks) == 4
    assert m.apply(_batch(12, cpb.KvCacheEvent(removed=removed)))
    assert m.blocks == set(prefix_block_hashes(a, B))
    # A snapshot resyncs whatever the cursor: its first chunk clears.
    snap = cpb.KvSnapshotChunk(index=0, count=1, blocks=2)
    assert m.apply(_batch(12, cpb.KvCacheEvent(cleared=cpb.KvCacheCleared()), _stored(b[:8]), snapshot=snap))
    assert m.blocks == set(prefix_block_hashes(b[:8], B)) and m.last_seq == 12


def test_matched_tokens_counts_whole_leading_blocks():
    long, other = KvMirror(), KvMirror()
    prompt = list(range(100, 130))
    long.apply(_batch(1, _stored(prompt[:20])))
    other.apply(_batch(1, _stored(prompt[:8] + [1, 2, 3, 4])))
    assert matched_tokens(prompt, [long, other, KvMirror()]) == [20, 8, 0]
    assert matched_tokens([5] + prompt[1:], [long, other]) == [0, 0]  # a block names its whole prefix
    assert matched_tokens(prompt[:3], [long]) == [0]  # no full block


def test_prefix_policy_picks_by_cache_then_load_and_falls_back_to_hashing():
    async def scenario() -> None:
        pool = WorkerPool([f"127.0.0.1:{p}" for p in (1, 2, 3)], PoolOptions(policy="prefix", prefix_balance_abs=4))
        for g in pool.groups:
            g.health = SERVING
            assert g.kv is not None
            g.kv.live = True
        kv = [g.kv for g in pool.groups]
        prompt = list(range(200, 240))
        kv[1].apply(_batch(1, _stored(prompt[:24])))
        kv[2].apply(_batch(1, _stored(prompt[:12])))
        assert {pool.pick(prompt).index for _ in range(6)} == {1}  # the longest prefix
        kv[2].apply(_batch(2, _stored(prompt[:24], first_block=3)))
        pool.groups[1].in_flight, pool.groups[2].in_flight = 2, 1
        assert {pool.pick(prompt).index for _ in range(6)} == {2}  # a tie: the less loaded holder
        assert {pool.pick(list(range(5, 45))).index for _ in range(6)} == {0}  # no match: the least loaded
        pool.groups[1].in_flight, pool.groups[2].in_flight = 6, 7  # both holders far busier than group 0
        assert {pool.pick(prompt).index for _ in range(6)} == {0}
        pool.groups[2].in_flight = 3
        assert pool.pick(prompt).index == 2
        assert pool.pick(prompt, exclude={2}).index == 0  # group 1 holds it but is 6 busier
        pool.groups[1].in_flight = 4
        assert pool.pick(prompt, exclude={2}).index == 1
        # One stream down: rendezvous hashing of the prompt's head, the same group every time.
        kv[0].live = False
        picks = {pool.pick(prompt).index for _ in range(6)}
        assert len(picks) == 1
        await pool.close()

    asyncio.run(scenario())
