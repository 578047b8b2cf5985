"""The shared-memory communicator (parallel/shm_communicator.py, kernels/csrc/shm_comm.cpp) against
gloo on the same inputs: ranks are threads of this process (tests/ranks.py), each with its own
mapping of one segment and its own gloo group on one store.

Sums: fp32 at 2 ranks equals gloo exactly; at 4 ranks (and for bf16 / fp16) they equal the fp32 sum
in rank order rounded once, which is what the kernels promise, and stay within rounding of gloo.
Every reduction ISA the host can run is tested (AVX2 always, AVX-512 where the CPU has it).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.ranks import gloo_groups, on_ranks, shm_communicators
from worker_svc.parallel import shm_communicator as shm

UNAVAILABLE = shm.available()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"shared-memory communicator: {UNAVAILABLE}")
SLOT = 1 << 20  # small slots: the 8 MB messages go in chunks
ISAS = ["avx2"] + (["avx512"] if UNAVAILABLE is None and shm._ops().shm_has_avx512() else [])
SIZES = [1, 3, 17, 1000, 1024, 16384, 65536 + 5, 2 * 1024 * 1024]  # elements: 4 B .. 8 MB at fp32


def _communicators(size: int, isa: str = "auto", timeout_s: float = 30.0,
                   two_shot_bytes: int = shm.TWO_SHOT_BYTES) -> list[shm.ShmCommunicator]:
    return shm_communicators(size, SLOT, timeout_s, isa=isa, two_shot_bytes=two_shot_bytes)


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def gloo(request) -> tuple[int, list[dist.ProcessGroup]]:
    return request.param, [group for _, group in gloo_groups(request.param, "shm_test")]


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + numel)
    return (torch.randn(numel, generator=gen) * 3).to(dtype)


def _rank_order_sum(size: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    acc = _input(0, numel, dtype).float()
    for r in range(1, size):
        acc = acc + _input(r, numel, dtype).float()
    return acc.to(dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_all_reduce_matches_gloo(gloo, isa: str, dtype: torch.dtype) -> None:
    size, groups = gloo
    comms = _communicators(size, isa)

    def run(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for numel in SIZES:
            mine, theirs = _input(rank, numel, dtype), _input(rank, numel, dtype)
            comms[rank].all_reduce(mine)
            dist.all_reduce(theirs, group=groups[rank])
            out.append((mine, theirs))
        return out

    results = on_ranks(size, run)
    for i, numel in enumerate(SIZES):
        expected = _rank_order_sum(size, numel, dtype)
        for rank in range(size):
            got, gloo_sum = results[rank][i]
            assert torch.equal(got, expected), (numel, rank)  # one rounding of the rank-order fp32 sum
            if dtype == torch.float32 and size == 2:
                assert torch.equal(got, gloo_sum), numel
            else:  # gloo rounds each partial sum to the dtype: an ulp of a partial apart at most
                atol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 0.25}[dtype]
                torch.testing.assert_close(got.float(), gloo_sum.float(), rtol=2e-2, atol=atol)


def test_one_shot_and_two_shot_agree() -> None:
    """The same sums whether reduced one-shot or by reduce-scatter + all-gather (odd sizes too)."""
    one = _communicators(2, two_shot_bytes=1 << 40)
    two = _communicators(2, two_shot_bytes=0)

    def run(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for numel in (1, 15, 17, 33, 4097, 100003):
            a, b = _input(rank, numel, torch.bfloat16), _input(rank, numel, torch.bfloat16)
            one[rank].all_reduce(a)
            two[rank].all_reduce(b)
            out.append((a, b))
        return out

    for per_rank in on_ranks(2, run):
        for a, b in per_rank:
            assert torch.equal(a, b)


def test_gather_broadcast_and_split_phase_back_to_back() -> None:
    size = 4
    comms = _communicators(size)

    def run(rank: int) -> dict[str, object]:
        c = comms[rank]
        out: dict[str, object] = {}
        for step in range(40):  # more collectives than phases, of every kind, interleaved
            shard = torch.full((2, 3 + step % 5), float(rank * 100 + step))
            parts = c.all_gather(shard)
            assert [float(p[0, 0]) for p in parts] == [float(r * 100 + step) for r in range(size)]
            header = torch.tensor([step, rank, 7, 9], dtype=torch.int64)
            c.broadcast(header, src=0)
            assert header.tolist() == [step, 0, 7, 9]
            # Two all-reduces in flight at once (what the overlap executor does), finished out of order.
            a = torch.full((5,), float(rank + step))
            b = torch.full((70000,), float(rank))
            work_a, work_b = c.all_reduce_start(a), c.all_reduce_start(b)
            work_b.wait()
            work_a.wait()
            assert torch.equal(a, torch.full((5,), float(sum(range(size)) + size * step)))
            assert torch.equal(b, torch.full((70000,), float(sum(range(size)))))
            # A third start while two are in flight finishes the oldest first instead of deadlocking.
            works = [c.all_reduce_start(torch.ones(3)) for _ in range(3)]
            for w in works:
                w.wait()
        big = torch.arange(3 * SLOT // 4, dtype=torch.float32)  # over the slot: in chunks
        c.all_reduce(big)
        out["big"] = big
        return out

    for result in on_ranks(size, run):
        assert torch.equal(result["big"], torch.arange(3 * SLOT // 4, dtype=torch.float32) * size)


def test_a_missing_peer_fails_within_the_timeout_and_poisons_the_segment() -> None:
    comms = _communicators(2, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(shm.CollectiveFailed, match="--tp-timeout"):
        comms[0].all_reduce(torch.ones(8))  # rank 1 never joins
    assert 0.45 < time.monotonic() - start < 3.0
    assert comms[1].poisoned  # the peer's next wait fails at once
    with pytest.raises(shm.CollectiveFailed, match="group failed"):
        comms[1].all_reduce(torch.ones(8))
    comms[1].close()
    comms[1].fault.set("late fault (test)")  # after close: nothing left to poison, and no error


def test_the_group_fault_ends_a_wait_at_once() -> None:
    """What the heartbeat does when a peer dies: the blocked rank raises within a slice, not at the
    collective timeout."""
    comms = _communicators(2, timeout_s=60.0)
    fault = comms[0].fault

    def fail_soon(rank: int) -> float:
        if rank == 1:
            time.sleep(0.3)
            fault.set("tp rank 1 died (test)")
            return 0.0
        start = time.monotonic()
        with pytest.raises(shm.CollectiveFailed, match="rank 1 died"):
            comms[0].broadcast(torch.zeros(4, dtype=torch.int64), src=1)
        return time.monotonic() - start

    waited = on_ranks(2, fail_soon)[0]
    assert 0.25 < waited < 1.5


def test_segments_are_private_and_unlinked() -> None:
    before = shm.segment_names()
    name, _ = shm.create_segment(2, SLOT)
    path = shm.SHM_DIR / name
    assert path.stat().st_mode & 0o777 == 0o600
    other, _ = shm.create_segment(2, SLOT)
    assert other != name  # per-launch random names: two groups on one host never collide
    shm.unlink_segment(name)
    shm.unlink_segment(other)
    assert shm.segment_names() == before
    with pytest.raises(ValueError, match="segment name"):
        shm.attach_segment("../../etc/passwd", 2, SLOT)


def test_two_groups_on_one_host_do_not_interfere() -> None:
    first, second = _communicators(2), _communicators(2)

    def run(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        group, r = (first, rank) if rank < 2 else (second, rank - 2)
        out = []
        for step in range(20):
            t = torch.full((1000,), float(rank + step))
            group[r].all_reduce(t)
            out.append(t)
        return out[-1], torch.tensor(float(rank))

    results = on_ranks(4, run)
    assert torch.equal(results[0][0], torch.full((1000,), 0.0 + 1.0 + 2 * 19))
    assert torch.equal(results[2][0], torch.full((1000,), 2.0 + 3.0 + 2 * 19))
